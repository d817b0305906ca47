"""The engine's optimizer state dict: the Adam states in pages, as ``torch.optim.AdamW`` numbers them."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
import xxhash

from pagemem.engine.units.bank import ParamBank
from pagemem.errors import InvalidRequest


class OptimizerStates:
    """``engine.optimizer.state_dict()`` / ``load_state_dict()`` read and write the Adam states in
    the pages, numbered as torch numbers the optimizer's parameters (group by group), so
    optimizer checkpoints move between the engine and ``torch.optim.AdamW`` (and frameworks
    that save ``optimizer.state_dict()`` resume exactly). fp32 master weights are not in it, as
    torch keeps none: they are the model's values (``model.state_dict()``)."""

    def __init__(self, bank: ParamBank, param_groups: Callable[[], Sequence[dict[str, Any]]],
                 flush: Callable[[], None],
                 serialised: Callable[[str], ContextManager[Any]] = lambda what: nullcontext()) -> None:
        """``param_groups()``: the optimizer's groups now; ``flush()``: every update submitted has
        landed in the pages; ``serialised(what)``: held while the states are read or written
        (the engine's call lock: a step on another thread lands before or after, never inside)."""
        self.bank = bank
        self.whole_moments: Callable[[list[int]], dict[int, dict[str, torch.Tensor]]] | None = None
        """With sharded moments: every rank's shares of the given parameters' moments, gathered
        (``ranks/gather.py``; a collective), set by the engine."""
        self.same_on_every_rank: Callable[[int], None] | None = None
        """With several ranks: raises on every rank unless every rank passed the same digest of
        the state dict being loaded (set by the engine)."""
        self._groups = param_groups
        self._flush = flush
        self._serialised = serialised

    def _numbered(self) -> list[int]:
        """Bank index of each parameter, in torch's numbering."""
        index = {id(p): i for i, (_, p) in enumerate(self.bank.params)}
        return [index[id(p)] for g in self._groups() for p in g["params"]]

    def read(self) -> dict[int, dict[str, torch.Tensor]]:
        with self._serialised("optimizer.state_dict"):
            return self._read()

    def write(self, state: dict[Any, dict[str, Any]]) -> None:
        with self._serialised("optimizer.load_state_dict"):
            self._write(state)

    def check_same(self, state_dict: dict[str, Any]) -> None:
        """With several ranks, before anything is loaded: every rank loads the same state dict
        (one rank alone, or ranks loading different ones, would leave the shares of different
        states, or replicas that part: every rank raises instead)."""
        if self.same_on_every_rank is not None:
            self.same_on_every_rank(state_digest(state_dict))

    def _read(self) -> dict[int, dict[str, torch.Tensor]]:
        bank = self.bank
        self._flush()
        numbered = [(n, i) for n, i in enumerate(self._numbered()) if bank.records[i].steps and bank.is_trainable(i)]
        if self.whole_moments is not None:  # [Note: sharded moments]
            whole = self.whole_moments([i for _, i in numbered])
        else:
            whole = {i: {kind: bank.host_state(i, kind) for kind in ("exp_avg", "exp_avg_sq")} for _, i in numbered}
        return {n: {"step": torch.tensor(float(bank.records[i].steps)), **whole[i]} for n, i in numbered}

    def _write(self, state: dict[Any, dict[str, Any]]) -> None:
        bank = self.bank
        numbered = self._numbered()
        for key, s in state.items():
            n = int(key)
            if not 0 <= n < len(numbered):
                raise InvalidRequest(f"optimizer.load_state_dict: state for parameter {n}, the optimizer has "
                                     f"{len(numbered)}")
            i = numbered[n]
            if not bank.is_trainable(i):
                bank.make_trainable(i)
            for kind in ("exp_avg", "exp_avg_sq"):
                v = s.get(kind)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(bank.params[i][1].shape):
                    raise InvalidRequest(f"optimizer.load_state_dict: parameter {bank.params[i][0]!r} has no "
                                         f"{kind} of its shape")
                bank.set_state(i, kind, v.detach().float().cpu())
            bank.set_step_count(i, int(float(s.get("step", 0))))


def state_digest(state_dict: dict[str, Any]) -> int:
    """A digest of an optimizer state dict's groups (without their parameters) and per-parameter
    states (tensors by their bytes), as an int64."""
    h = xxhash.xxh3_64()
    for group in state_dict.get("param_groups", []):
        h.update(repr(sorted((k, v) for k, v in group.items() if k != "params")).encode())
    for key in sorted(state_dict.get("state", {}), key=str):
        h.update(repr(key).encode())
        for name, v in sorted(state_dict["state"][key].items()):
            h.update(name.encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.intdigest() >> 1
