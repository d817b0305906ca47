"""The module reads back its weights: ``state_dict()`` while the engine runs, and the module's
own parameters once it closes (see [Note: evicted parameters] in ``guard.py``).

Decided: no gather context. A read of a parameter anywhere fetches its unit (the guard), which is
what user code between steps needs; a state dict, which holds every parameter at once, is
built on the host from the master weights without bringing anything to the gpu, through
state-dict hooks on every module that holds parameters, so ``model.state_dict()``,
``submodule.state_dict()`` and Hugging Face's ``save_pretrained`` give the trained values.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.guard import Guard
from pagemem.errors import (CorruptPage, PageMemError, TierIOError, TornPage, WeightsNotGivenBack, one_line,
                            warn, weights_lost_message)
from pagemem.machine import host_memory_available

if TYPE_CHECKING:
    from pagemem.engine.calls import CallLock


def hook_state_dicts(model: nn.Module, bank: ParamBank, guard: Guard, before: Callable[[], None],
                     calls: "CallLock | None" = None) -> list:
    """Hooks that make ``state_dict()`` of any module holding parameters give their current
    values on the host: the guard lets the state dict's ``detach`` of an evicted parameter
    through, and the post-hooks put the values in (one tensor per parameter, so tied parameters
    stay one tensor). The outermost pre-hook takes every value the state dict will hold at once,
    as one call of the engine (``calls``: its call lock, and shielded from signals: [Note: calls
    from several threads]), after ``before()`` (writes to parameters are kept then): a step on
    another thread lands before or after, never between two modules, and no lock is held while
    the state dict's other hooks (the user's) run. A state dict that raised part-way leaves
    nothing behind: the next one starts afresh. Returns the hook handles."""
    index = {id(p): i for i, (_, p) in enumerate(bank.params)}
    local = threading.local()

    def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        stack = getattr(local, "quiet", None)
        if not stack or prefix == "":  # the outermost (a stack left by one that raised is dropped)
            for q in reversed(stack or []):
                q.__exit__(None, None, None)
            local.quiet, local.values = [], {}
            with calls.call("state_dict") if calls is not None else nullcontext():
                before()
                if not keep_vars:
                    for p in module.parameters():
                        i = index.get(id(p))
                        if i is not None and i not in local.values:
                            local.values[i] = bank.host_value(i, p.dtype)
        q = guard.passthrough()
        q.__enter__()
        local.quiet.append(q)

    def post(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for name, p in module._parameters.items():
            key = prefix + name
            i = index.get(id(p)) if p is not None else None
            if i is None or key not in state or isinstance(state[key], nn.Parameter):
                continue  # keep_vars: the Parameter itself
            if i not in local.values:
                local.values[i] = bank.host_value(i, p.dtype)
            state[key] = local.values[i]
        local.quiet.pop().__exit__(None, None, None)
        if not local.quiet:
            local.values = {}

    handles = []
    for module in model.modules():  # every module above a parameter: the outermost state dict takes the values
        if any(id(p) in index for p in module.parameters()):
            handles.append(module.register_state_dict_pre_hook(pre))
            handles.append(module.register_state_dict_post_hook(post))
    return handles


def give_weights_back(bank: ParamBank, guard: Guard) -> None:
    """The engine closes: each parameter gets its trained value (fp32 master weights in its
    original dtype) in host memory, and its plain class back, when host memory has room for them
    all; otherwise a warning, and every read of a parameter raises, naming why.

    [Note: weights given back one by one] A parameter whose master weights cannot be read (a
    corrupt page, a failed read) costs only itself: every other parameter still gets its value,
    the ones that failed stay guarded and refuse every read (never a placeholder's value), and
    then one error names them all (``WeightsNotGivenBack``, a ``CorruptPage``; a ``TierIOError``
    where every failure was a failed read) and says to load a checkpoint."""
    need = sum(r.param.numel() * r.original_dtype.itemsize for r in bank.records)
    free = host_memory_available()
    if free is not None and need > free * 0.9:
        why = (f"the engine is closed and the trained weights ({need} bytes) did not fit in host memory "
               f"({free} bytes available): save them with engine.save() before close() and load them from there")
        warn(f"pagemem: {why}")
        guard.release(None, why)
        return
    values: dict[int, torch.Tensor] = {}
    lost: dict[int, PageMemError] = {}
    for i in range(len(bank.params)):
        try:
            values[i] = bank.host_value(i, bank.original_dtype_of(i))
        except (CorruptPage, TornPage, TierIOError) as exc:
            lost[i] = exc
    refused = {i: (f"the engine is closed and its trained weights could not be read back ({one_line(str(e))}); "
                   f"load a checkpoint into a fresh model (pagemem.Engine.load)") for i, e in lost.items()}
    guard.release(values.pop, "the engine is closed", refused)
    if not lost:
        return
    named = {bank.params[i][0]: e for i, e in lost.items()}
    kept = len(bank.params) - len(lost)
    first = next(iter(lost.values()))
    if any(isinstance(e, (CorruptPage, TornPage)) for e in lost.values()):
        raise WeightsNotGivenBack(named, kept) from first
    err = TierIOError(weights_lost_message(named, kept), getattr(first, "errno", None))
    err.lost = named  # type: ignore[attr-defined]
    raise err from first
