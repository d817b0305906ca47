"""Gradients between autograd and the update: the hand-off hook, ``p.grad`` handles, norms and
clipping (see [Note: the gradient hand-off] and [Note: gradient handles])."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from pagemem.checks import check_rate
from pagemem.engine.bank import ParamBank
from pagemem.engine.grads import GradHandles
from pagemem.engine.handoff import GradHandoff
from pagemem.engine.lockfree import SHARED_SUMS
from pagemem.engine.update import Updater
from pagemem.errors import InvalidRequest


class Gradients:
    def __init__(self, bank: ParamBank, updater: Updater) -> None:
        self.bank = bank
        self.updater = updater
        self.handles = GradHandles(bank.params, updater.grad_norm, updater.scale_grad, updater.zero_grad,
                                   updater.take_sum, updater.set_grad)
        self.handoff = GradHandoff(bank.layer_of)
        """Units whose gradients are final, as backward hands them off."""
        self.sink = updater.grad_ready
        """Where each handed-off gradient goes: the updater, or the lock-free updater's buffers."""
        self.pending = updater.pending
        """The parameters with a gradient ``p.grad`` shows a handle for."""
        self.assign = updater.set_grad
        """Takes a gradient assigned to ``p.grad`` by hand."""
        self.discard = updater.discard
        """Forgets the gradients of parameters whose ``p.grad`` was set to None."""
        self._to_drop: list[nn.Parameter] = []
        self.last_norm = 0.0
        """The global norm last computed (``global_norm``, ``clip``)."""

    def hand_off(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s post-accumulate hook: autograd's gradient goes to the updater;
        ``p.grad`` is dropped at once, unless hooks of the user's run after this one (they see
        it until the end of the backward)."""
        if p.grad is None:
            return
        self.sink(i, p.grad)
        self.handoff.handed(i)
        hooks = p._post_accumulate_grad_hooks
        if hooks is not None and len(hooks) > 2 and any(not _engine_hook(h) for h in hooks.values()):
            self._to_drop.append(p)
        else:
            p.grad = None

    def begin_backward(self) -> None:
        self.take_back()
        self.handoff.begin()

    def end_backward(self) -> None:
        for p in self._to_drop:
            p.grad = None
        self._to_drop.clear()
        self.handoff.end()

    def hand_to_lock_free(self, sink: Any, pending: Any) -> None:
        """Gradients go to the lock-free updater's buffers (``sink``); their handles show
        ``pending()`` and refuse every op: the sums are the updating thread's."""
        def refuse(*_args: Any) -> None:
            raise InvalidRequest("p.grad: with lock_free the gradients belong to the updating thread; reading, "
                                 "clipping or assigning them is refused (EngineConfig.lock_free)")
        def discard(params: list[int]) -> None:
            if params and pending():
                raise InvalidRequest(SHARED_SUMS)
        self.sink, self.pending, self.discard = sink, pending, discard
        self.handles = GradHandles(self.bank.params, refuse, refuse, refuse, refuse, refuse)
        self.assign = refuse

    def abort_backward(self) -> None:
        """A backward failed part-way: ``p.grad`` kept for the user's hooks goes, and the
        hand-off forgets it (its counts are not a backward's)."""
        for p in self._to_drop:
            p.grad = None
        self._to_drop.clear()
        self.handoff.abort()

    def take_back(self) -> None:
        """Take the handles down; what code did with ``p.grad`` meanwhile (set it to None,
        assigned a tensor) takes effect on the gradient sums."""
        dropped, assigned = self.handles.take_down()
        if dropped:
            self.discard(dropped)
        for i, g in assigned.items():
            self.assign(i, g)

    def show(self) -> list[int]:
        """Put the handles up for every parameter with a gradient; returns those."""
        pending = self.pending()
        self.handles.show(pending)
        return pending

    def global_norm(self) -> float:
        """The 2-norm of all gradient sums now, or the last one computed when there are none."""
        self.take_back()
        pending = self.show()
        return float(self._total_norm(pending)) if pending else self.last_norm

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the sums by their global 2-norm as ``clip_grad_norm_`` does; returns the norm."""
        check_rate("max_norm", max_norm)
        self.take_back()
        pending = self.show()
        if not pending:
            return torch.zeros(())
        total = self._total_norm(pending)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for i in pending:
            self.updater.scale_grad(i, float(coef))
        return total

    def _total_norm(self, pending: list[int]) -> torch.Tensor:
        norms = [self.updater.grad_norm(i) for i in pending]
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
        self.last_norm = float(total)
        return total

    def hooks(self, trainable: list[bool], group_of: list[int | None], before: Any) -> list:
        """For each trainable parameter in a group: ``before`` ahead of autograd's accumulation
        (a backward by habit starts there) and the hand-off after it. Returns the handles."""
        return [h for i, (_, p) in enumerate(self.bank.params) if trainable[i] and group_of[i] is not None
                for h in (p.register_hook(before), p.register_post_accumulate_grad_hook(partial(self.hand_off, i)))]


def _engine_hook(hook: Any) -> bool:
    """A post-accumulate hook the engine or its op clock registered (not the user's)."""
    if isinstance(hook, partial):
        return getattr(hook.func, "__name__", "") == "hand_off"
    return getattr(hook, "__qualname__", "").startswith("OpClock.")
