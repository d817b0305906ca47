"""First values from safetensors files: ``pagemem.Engine(model, config, values=PATH)``.

[Note: values from safetensors]
``FromSafetensors`` is a ValueSource ([Note: first values], ``values.py``) over a ``.safetensors``
file or Hugging Face's layout (``safetensors_layout.py``). It reads every file's header when
made (shapes, dtypes, keys: no tensor data) and refuses, before the engine allocates a page,
what could not load: a missing or unreadable file, a tensor the model lacks, a key of
``model.state_dict()`` the files lack, a shape that differs. Then the bank asks it for one
module's parameters at a time, each read with ``safe_open`` (a memory map) and cast to the
parameter's dtype (as ``load_state_dict`` casts), so host memory holds one module's tensors
beyond the map.

Decided, as ``load_state_dict(strict=True)`` decides: the files must hold exactly the keys
``model.state_dict()`` has. A tensor of the files the model does not have is refused, naming
it (a model of another architecture, or keys under another prefix, would otherwise train from
partly fresh values without a word); a non-persistent buffer the model has is accepted too.
Tied tensors are stored once (``safetensors.torch.save_model`` and ``save_pretrained`` keep
either alias, ``Engine.save_weights`` the first in ``model.state_dict()``): any alias in the
files gives the tensor its value, and two aliases both there must hold equal values.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagemem.engine.checkpoints.ckpt_state import persistent_buffers
from pagemem.engine.checkpoints.safetensors_layout import find_weights
from pagemem.errors import ConfigError

_SHOWN = 5
"""How many keys an error lists."""


@dataclass(frozen=True)
class _Stored:
    file: str
    shape: tuple[int, ...]


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _aliases(named: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor reached under several names -> all its names, in order."""
    groups: dict[int, list[str]] = {}
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    return {name: tuple(names) for names in groups.values() for name in names}


class FromSafetensors:
    """The values stored in safetensors files (see [Note: values from safetensors]). Made over
    the model, before the engine takes its parameters; ``close()`` once the bank is built."""

    meta = True

    def __init__(self, path: str | os.PathLike, model: nn.Module) -> None:
        self.weights = find_weights(path)
        self.where = self.weights.path
        self._open = ExitStack()
        self._handles: dict[str, Any] = {}
        self.stored = self._headers()
        params = _aliases(list(model.named_parameters(remove_duplicate=False)))
        buffers = _aliases([(n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None])
        unexpected = [k for k in self.stored if k not in params and k not in buffers]
        if unexpected:
            raise ConfigError(f"values: {self.where} holds {len(unexpected)} tensor(s) the model does not have: "
                              f"{_listed(unexpected)} (keys must be as model.state_dict() names them)")
        saved = {key for key, _m, _b in persistent_buffers(model)}  # a non-persistent buffer may be absent
        self.key_of: dict[str, str] = {}
        """Each parameter's and buffer's name (every alias) -> the key the files hold it under."""
        self.also: dict[str, list[str]] = {}
        """A key -> the other aliases of its tensor the files hold too (their values must be equal)."""
        missing = []
        groups = [(a, True) for a in dict.fromkeys(params.values())]
        groups += [(a, any(n in saved for n in a)) for a in dict.fromkeys(buffers.values())]
        for aliases, required in groups:
            present = [a for a in aliases if a in self.stored]
            if present:
                self.key_of.update({a: present[0] for a in aliases})
                if len(present) > 1:
                    self.also[present[0]] = present[1:]
            elif required:
                missing.append(aliases[0])
        if missing:
            raise ConfigError(f"values: {self.where} has no tensor for {len(missing)} of the model's key(s): "
                              f"{_listed(missing)}")
        shapes = {**{n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)},
                  **{n: tuple(b.shape) for n, b in model.named_buffers(remove_duplicate=False) if b is not None}}
        for name, key in self.key_of.items():
            got = self.stored[key].shape
            if got != shapes[name]:
                raise ConfigError(f"values: {self.stored[key].file}: {key!r} has shape {got}, the model's "
                                  f"{name!r} has {shapes[name]}")

    def _headers(self) -> dict[str, _Stored]:
        """Every tensor's file and shape, from the headers (no tensor is read)."""
        stored: dict[str, _Stored] = {}
        for file in self.weights.files:
            with _reading(file):
                with safe_open(file, framework="pt") as f:
                    keys = list(f.keys())
                    shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
            wanted = keys if self.weights.weight_map is None else [
                k for k, v in self.weights.weight_map.items() if v == file]
            for key in wanted:
                if key not in shapes:
                    raise ConfigError(f"values: {self.weights.index} puts {key!r} in {os.path.basename(file)}, "
                                      "which does not hold it")
                stored[key] = _Stored(file, shapes[key])
        return stored

    def _tensor(self, key: str) -> torch.Tensor:
        file = self.stored[key].file
        with _reading(file):
            if file not in self._handles:
                self._handles[file] = self._open.enter_context(safe_open(file, framework="pt"))
            return self._handles[file].get_tensor(key)

    def _value(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The value of the parameter or buffer ``name``, cast to ``dtype``: from its key, checked
        equal to any other alias's the files hold too."""
        key = self.key_of[name]
        value = self._tensor(key)
        for other in self.also.get(key, []):
            if not torch.equal(self._tensor(other), value):
                raise ConfigError(f"values: {self.where} holds tied tensors {key!r} and {other!r} with different "
                                  "values")
        return value.to(dtype)

    def values(self, mname: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        return [self._value(name, p.dtype) for name, p in params]

    def set_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Buffers the files hold take their values (on ``device``, in the buffer's dtype); a
        buffer reached under several names stays one tensor."""
        done: dict[int, torch.Tensor] = {}
        for mname, module in model.named_modules(remove_duplicate=False):
            for bname, b in list(module._buffers.items()):
                key = f"{mname}.{bname}" if mname else bname
                if b is None or key not in self.key_of:
                    continue
                if id(b) not in done:
                    done[id(b)] = self._value(key, b.dtype).to(device)
                module._buffers[bname] = done[id(b)]

    def close(self) -> None:
        """Let go of the files' maps."""
        self._handles.clear()
        self._open.close()


@contextmanager
def _reading(file: str) -> Iterator[None]:
    """Around a read of ``file``: safetensors' and the OS's errors become a ConfigError naming it."""
    try:
        yield
    except SafetensorError as exc:
        raise ConfigError(f"values: {file}: not a readable safetensors file ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"values: {file}: cannot be read ({exc.strerror or exc})") from None
