"""Gradients between autograd and the update: the hand-off hook, where gradients go, ``p.grad``
handles, norms and clipping (see [Note: the gradient hand-off], [Note: gradient handles] and
[Note: gradient states])."""

from __future__ import annotations

from functools import partial
from typing import Any, NoReturn, Protocol

import torch
from torch import nn

from pagemem.checks import check_rate
from pagemem.engine.interrupts import shielded
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.gradients.grad_ledger import GradLedger
from pagemem.engine.gradients.grads import GradHandles
from pagemem.engine.gradients.handoff import GradHandoff
from pagemem.engine.updates.lockfree import SHARED_SUMS, LockFreeUpdater
from pagemem.engine.updates.update import Updater
from pagemem.errors import InvalidRequest


class GradDestination(Protocol):
    """Where handed-off gradients go, chosen once when the engine is made (``Engine._build``):
    :class:`SyncDestination` (the updater's sums, updated by ``step()``) or
    :class:`LockFreeDestination` (the lock-free updater's buffers, ``lock_free=True``)."""

    def accept(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient of this backward (autograd's, from the hand-off hook)."""

    def unit_final(self, u: int) -> None:
        """Unit ``u`` has all its gradients of this backward (the hand-off's count)."""

    def end_backward(self) -> None:
        """The backward ended: what it handed off is summed."""

    def abort_backward(self) -> tuple[int, int]:
        """The backward failed part-way and none of its writes still runs: undo it ([Note: a
        failed backward is undone]); returns how many parameters' updates during it were undone
        and how many gradient sums were restored. Raises if it cannot be undone."""

    def discard(self, params: list[int]) -> None:
        """Forget the gradients of ``params`` (their ``p.grad`` was set to None)."""

    def assign(self, i: int, grad: torch.Tensor) -> None:
        """``grad`` was assigned to ``p.grad`` by hand: it becomes the gradient."""

    # what the gradient handles do (see [Note: gradient handles])
    def grad_norm(self, i: int) -> torch.Tensor: ...

    def scale_grad(self, i: int, coef: float, divide: bool = False) -> None: ...

    def zero_grad(self, i: int) -> None: ...

    def read_grad(self, i: int) -> torch.Tensor: ...


class SyncDestination:
    """Gradients are summed into pages by the :class:`Updater`, which ``step()`` updates from."""

    def __init__(self, updater: Updater) -> None:
        self.updater = updater
        self.accept = updater.grad_ready
        self.unit_final = updater.unit_final
        self.end_backward = updater.summed
        self.abort_backward = updater.abort_backward
        self.discard = updater.discard
        self.assign = updater.set_grad
        self.grad_norm = updater.grad_norm
        self.grad_norms = updater.grad_norms
        self.scale_grad = updater.scale_grad
        self.zero_grad = updater.zero_grad
        self.read_grad = updater.take_sum


class LockFreeDestination:
    """Gradients go to the :class:`LockFreeUpdater`'s buffers (``lock_free=True``); their handles
    show the iteration's gradients and refuse every op: the sums are the updating thread's."""

    def __init__(self, lockfree: LockFreeUpdater) -> None:
        self.lockfree = lockfree
        self.accept = lockfree.accumulate
        self.unit_final = lockfree.unit_final
        self.end_backward = lockfree.end_backward

    def abort_backward(self) -> tuple[int, int]:
        return self.lockfree.abort_backward()

    def discard(self, params: list[int]) -> None:
        if params and self.lockfree.has_fresh():
            raise InvalidRequest(SHARED_SUMS)

    def assign(self, i: int, grad: torch.Tensor) -> None:
        _refuse()

    def grad_norm(self, i: int) -> torch.Tensor:
        _refuse()

    def scale_grad(self, i: int, coef: float, divide: bool = False) -> None:
        _refuse()

    def zero_grad(self, i: int) -> None:
        _refuse()

    def read_grad(self, i: int) -> torch.Tensor:
        _refuse()


def _refuse() -> NoReturn:
    raise InvalidRequest("p.grad: with lock_free the gradients belong to the updating thread; reading, "
                         "clipping or assigning them is refused (EngineConfig.lock_free)")


class Gradients:
    def __init__(self, bank: ParamBank, updater: Updater, ledger: GradLedger, destination: GradDestination) -> None:
        """``destination``: where handed-off gradients go (fixed for the engine's life);
        ``ledger``: each parameter's gradient state, which says what ``p.grad`` shows."""
        self.bank = bank
        self.updater = updater
        self.ledger = ledger
        self.destination = destination
        self.handles = GradHandles(bank.params, destination.grad_norm, destination.scale_grad, destination.zero_grad,
                                   destination.read_grad, destination.assign, getattr(destination, "grad_norms", None))
        self.handoff = GradHandoff(bank.layers, bank.layer_of)
        """Units whose gradients are final, as backward hands them off."""
        self.handoff.subscribe(destination.unit_final)
        self._to_drop: list[nn.Parameter] = []
        self.last_norm = 0.0
        """The global norm last computed (``global_norm``, ``clip``)."""

    @shielded
    def hand_off(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s post-accumulate hook: autograd's gradient goes to the updater;
        ``p.grad`` is dropped at once, unless hooks of the user's run after this one (they see
        it until the end of the backward). Shielded: a Ctrl-C lands between two hand-offs, never
        inside one (a gradient written through to nvme is store I/O that must not be cut short:
        [Note: Ctrl-C inside the engine])."""
        if p.grad is None:
            return
        self.destination.accept(i, p.grad)
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
        self.destination.end_backward()

    def abort_backward(self) -> tuple[int, int]:
        """A backward failed part-way: the destination undoes what it handed off ([Note: a
        failed backward is undone]), the hand-off forgets it (its counts are not a backward's),
        and every ``p.grad`` autograd left goes (kept for the user's hooks, or accumulated
        before a hook raised ahead of the hand-off; after a failed ``loss.backward()``, a tensor
        assigned before the next call into the engine found it goes too: it cannot be told from
        autograd's). Returns the destination's ``abort_backward``; raises what it raises
        (nothing could be undone)."""
        try:
            return self.destination.abort_backward()
        finally:
            self._to_drop.clear()
            with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads and sets
                for i, (_, p) in enumerate(self.bank.params):
                    if self.bank.records[i].hooked and p.grad is not None:
                        p.grad = None  # the handles are down during a backward: none is one of them
            self.handoff.abort()

    def take_back(self) -> None:
        """Take the handles down; what code did with ``p.grad`` meanwhile (set it to None,
        assigned a tensor) takes effect on the gradient sums."""
        dropped, assigned = self.handles.take_down()
        if dropped:
            self.destination.discard(dropped)
        for i, g in assigned.items():
            self.destination.assign(i, g)

    def drop_handles(self) -> None:
        """At ``close()``: every ``p.grad`` goes back to None (a handle reads pages the engine is
        about to give back; a gradient assigned by hand meanwhile is dropped with them)."""
        try:
            self.handles.take_down()
        except InvalidRequest:  # a handle of another engine's parameter: clear what is left
            with torch._C.DisableTorchFunctionSubclass():
                for p in self.handles.params:
                    p.grad = None

    def show(self) -> list[int]:
        """Put the handles up for every parameter with a gradient (the ledger's ``pending``);
        returns those."""
        pending = self.ledger.pending()
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
        norms = self.updater.grad_norms(pending)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
        self.last_norm = float(total)
        return total

    def hooks(self, before: Any) -> list:
        """For each parameter hooked (``ParamRecord.hooked``: it requires a gradient and is in a
        group): ``before`` ahead of autograd's accumulation
        (a backward by habit starts there) and the hand-off after it. Returns the handles."""
        return [h for i, (_, p) in enumerate(self.bank.params) if self.bank.records[i].hooked
                for h in (p.register_hook(before), p.register_post_accumulate_grad_hook(partial(self.hand_off, i)))]


def _engine_hook(hook: Any) -> bool:
    """A post-accumulate hook the engine or its op clock registered (not the user's)."""
    if isinstance(hook, partial):
        return getattr(hook.func, "__name__", "") == "hand_off"
    return getattr(hook, "__qualname__", "").startswith("OpClock.")
