"""The engine's optimizer state dict: the Adam states in pages, as ``torch.optim.AdamW`` numbers them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagemem.errors import InvalidRequest

if TYPE_CHECKING:
    from pagemem.engine.engine import Engine


class OptimizerStates:
    """``engine.optimizer.state_dict()`` / ``load_state_dict()`` read and write the Adam states in
    the pages, numbered as torch numbers the optimizer's parameters (group by group), so
    optimizer checkpoints move between the engine and ``torch.optim.AdamW`` (and frameworks
    that save ``optimizer.state_dict()`` resume exactly). fp32 master weights are not in it, as
    torch keeps none: they are the model's values (``model.state_dict()``)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def _numbered(self) -> list[int]:
        """Bank index of each parameter, in torch's numbering."""
        index = {id(p): i for i, (_, p) in enumerate(self.engine.bank.params)}
        return [index[id(p)] for g in self.engine.optimizer.param_groups for p in g["params"]]

    def read(self) -> dict[int, dict[str, torch.Tensor]]:
        engine = self.engine
        engine.updater.flush()
        out = {}
        for n, i in enumerate(self._numbered()):
            steps = engine.bank.records[i].steps
            if not steps or not engine.bank.is_trainable(i):
                continue
            out[n] = {"step": torch.tensor(float(steps)),
                      **{kind: engine.bank.host_state(i, kind) for kind in ("exp_avg", "exp_avg_sq")}}
        return out

    def write(self, state: dict[Any, dict[str, Any]]) -> None:
        engine = self.engine
        numbered = self._numbered()
        for key, s in state.items():
            n = int(key)
            if not 0 <= n < len(numbered):
                raise InvalidRequest(f"optimizer.load_state_dict: state for parameter {n}, the optimizer has "
                                     f"{len(numbered)}")
            i = numbered[n]
            if not engine.bank.is_trainable(i):
                engine.bank.make_trainable(i)
            for kind in ("exp_avg", "exp_avg_sq"):
                v = s.get(kind)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(engine.bank.params[i][1].shape):
                    raise InvalidRequest(f"optimizer.load_state_dict: parameter {engine.bank.params[i][0]!r} has no "
                                         f"{kind} of its shape")
                engine.bank.set_state(i, kind, v.detach().float().cpu())
            engine.bank.set_step_count(i, int(float(s.get("step", 0))))
