"""Where parameters' and buffers' first values come from: one path, from a source.

[Note: first values]
The bank makes every unit's pages, then asks a *source* for the values of each module's own
parameters, one module at a time, and puts them in (fp32 master weights, the compute copy, zero
moments) before it asks for the next: host memory never needs more than one module's values
beyond what the source itself holds. The sources:

- ``FromModule``: the values the module's parameters hold (an ordinary model);
- ``FromInit(init)``: a model built on ``meta``; ``init(name, module)`` sets the values of one
  module's own parameters, given cpu memory for them (``pagemem.models.gpt.init_module``);
- ``FromStateDict(state)``: a state dict keyed as ``model.state_dict()`` (buffers in it are set
  too), for a model built on ``meta`` or not;
- ``FromSafetensors(path, model)``: safetensors files, one or Hugging Face's shards (buffers in
  them too), read a module at a time ([Note: values from safetensors], ``safetensors_values.py``);
- ``FromCheckpoint``: nothing yet: the pages start as zeros and ``Engine.load`` writes the
  checkpoint's states over them.

A parameter on ``meta`` first becomes a one-element shell on the gpu tier's device
(``materialize_meta``), so the module has real Parameters whose identity never changes after.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from pagemem.engine.units.safetensors_values import FromSafetensors
from pagemem.errors import ConfigError, InvalidRequest

ModuleInit = Callable[[str, nn.Module], None]
"""Sets the values of one module's own parameters in place: ``init(name, module)``."""


class ValueSource(Protocol):
    meta: bool
    """Whether the model's parameters may be (must be, for ``FromInit``) on ``meta``."""

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        """The first values of ``params`` (``module``'s own, named as in the model), on the host."""
        ...


class FromModule:
    """The values the model's parameters hold."""

    meta = False

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        return [p.detach().to("cpu") for _, p in params]


class FromCheckpoint:
    """Zeros: a checkpoint's states are written over them (``Engine.load``)."""

    meta = True

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        return [torch.zeros(p.shape) for _, p in params]


class FromInit:
    """``init(name, module)`` sets one module's own parameters at a time (a model on ``meta``)."""

    meta = True

    def __init__(self, init: ModuleInit) -> None:
        self.init = init

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        dtypes = [p.dtype for _, p in params]
        for (_, p), dtype in zip(params, dtypes):
            p.data = torch.empty(p.shape, dtype=dtype)
        self.init(mname, module)
        after = list(module.parameters(recurse=False))
        out = []
        for (name, p), dtype in zip(params, dtypes):
            if not any(q is p for q in after) or p.device.type != "cpu" or p.dtype != dtype:
                raise InvalidRequest(f"init: {name} must be set in place (same Parameter, on the cpu, {dtype}); "
                                     f"init({mname!r}, ...) replaced it")
            out.append(p.detach())
        return out


class FromStateDict:
    """A state dict keyed as ``model.state_dict()``: every parameter must be in it, with its
    shape; buffers in it are set too."""

    meta = True

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"values: must be a state dict (a mapping of names to tensors) or the path of "
                              f"safetensors weights, got {type(state).__name__}")
        self.state = state

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        out = []
        for name, p in params:
            v = self.state.get(name)
            if not isinstance(v, torch.Tensor):
                raise ConfigError(f"values: the state dict has no tensor for parameter {name!r}")
            if tuple(v.shape) != tuple(p.shape):
                raise ConfigError(f"values[{name!r}]: shape {tuple(v.shape)}, the parameter's is {tuple(p.shape)}")
            out.append(v.detach().to("cpu"))
        return out

    def set_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Buffers named in the state dict take its values (on ``device``)."""
        for mname, module in model.named_modules():
            for bname, b in list(module._buffers.items()):
                key = f"{mname}.{bname}" if mname else bname
                v = self.state.get(key)
                if b is None or not isinstance(v, torch.Tensor):
                    continue
                if tuple(v.shape) != tuple(b.shape):
                    raise ConfigError(f"values[{key!r}]: shape {tuple(v.shape)}, the buffer's is {tuple(b.shape)}")
                module._buffers[bname] = v.detach().to(device=device, dtype=b.dtype)


def source_of(model: nn.Module, init: ModuleInit | None, values: Any, from_module: bool) -> ValueSource:
    """The source ``Engine(init=, values=)`` asks for: ``init``, else ``values`` (a state dict,
    or a path: a ``.safetensors`` file, an index JSON or a directory in Hugging Face's layout),
    else the module's own values (``from_module``), else a checkpoint's (``Engine.load``)."""
    if init is not None:
        return FromInit(init)
    if isinstance(values, (str, os.PathLike)):
        return FromSafetensors(values, model)
    if values is not None:
        return FromStateDict(values)
    return FromModule() if from_module else FromCheckpoint()


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Replace every parameter on the ``meta`` device by a Parameter of the same shape, dtype
    and ``requires_grad`` on ``device`` (one element of memory), in every module that holds it
    (tied ones stay tied). Its values come from the source. What code hung on the old one comes
    along: its gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``: the
    same dicts, so their handles still remove them) and its Python attributes."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                shell = torch.zeros((), dtype=p.dtype, device=device)
                q = nn.Parameter(shell.expand(p.shape) if p.dim() else shell, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                if p._backward_hooks:
                    q._backward_hooks = p._backward_hooks
                if p._post_accumulate_grad_hooks:
                    q._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
                new[id(p)] = q
            module._parameters[name] = new[id(p)]


def check_source(source: ValueSource, model: nn.Module) -> None:
    """Refuse a source that cannot give this model its values."""
    meta = any(p.is_meta for p in model.parameters())
    if isinstance(source, FromInit) and not meta:
        raise InvalidRequest("init: initializes a model built on 'meta'; this model's parameters already have values")
    if meta and not source.meta:
        raise InvalidRequest("the model's parameters are on 'meta' (no values): pass init= or values= to the "
                             "Engine, or load them with pagemem.Engine.load(checkpoint, model)")
