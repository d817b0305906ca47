"""Each parameter's fp32 gradient sum, read and changed in place: its norm, scaled, zeroed, set
from a tensor assigned to ``p.grad``, taken as a copy (each shielded from signals: sums on nvme
are store I/O that a Ctrl-C must not cut short). What ``p.grad`` handles and clipping do
([Note: gradient handles] in ``gradients/grads.py``); the ledger says which sums are readable
([Note: gradient states]): one whose update ran during backward is not."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.interrupts import shielded
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.updates.state_pieces import norm_of_pieces
from pagemem.errors import InvalidRequest
from pagemem.store import PageStore

_UPDATING, _APPLIED, _SUMMED = GradState.UPDATING, GradState.APPLIED, GradState.SUMMED


class GradSpread(Protocol):
    """Reads of gradient sums spread over the ranks ([Note: sharded gradient sums] in
    ``ranks/grad_scatter.py``): each a collective every rank makes."""

    def norms(self, params: list[int]) -> list[torch.Tensor]: ...

    def whole(self, i: int) -> torch.Tensor: ...

    def all_finite(self, params: list[int]) -> bool: ...


class GradSums:
    def __init__(self, bank: ParamBank, store: PageStore, ledger: GradLedger) -> None:
        self.bank = bank
        self.store = store
        self.ledger = ledger
        self.spread: GradSpread | None = None
        """Where each rank holds a share of the sums only: how they are read whole (set by the
        engine)."""

    @shielded
    def take(self, i: int) -> torch.Tensor:
        """A flat copy of parameter ``i``'s gradient sum (the lock-free updater takes it)."""
        if self.spread is not None:
            self._grad_view(i, lambda views: None)  # readable?
            return self.spread.whole(i)
        return self._grad_view(i, lambda views: torch.cat(views) if len(views) > 1 else views[0].clone())

    def _grad_view(self, i: int, fn: Callable[[list[torch.Tensor]], Any], applied_ok: bool = False) -> Any:
        """``fn`` of parameter ``i``'s gradient sum as flat fp32 views of its pages, in order (one,
        or one per run of adjacent pages). ``applied_ok``: also for a gradient a step already
        applied (its pages are there, their values are not the gradient: ``fn`` overwrites them)."""
        state = self.ledger.state(i)
        if state is _UPDATING or (state is _APPLIED and not applied_ok):
            raise InvalidRequest(f"parameter {self.bank.params[i][0]!r}: its gradient was applied during backward "
                                 "(overlap_update); pass overlap_update=False to read or clip gradients")
        self.bank.grads_landed([i])
        if self.bank.is_sharded(i, "grad") and not self.bank.owned_numel(i):
            return fn([])  # none of its elements is this rank's
        with self.bank.grad_pieces(i) as pieces:
            return fn([v for _, v in pieces])

    @shielded
    def norm(self, i: int) -> torch.Tensor:
        """The 2-norm of parameter ``i``'s gradient sum, as ``torch.linalg.vector_norm`` of it."""
        if self.spread is not None:
            return self.norms([i])[0]
        return self._grad_view(i, norm_of_pieces)

    @shielded
    def norms(self, params: list[int]) -> list[torch.Tensor]:
        """``norm`` of each of ``params`` (with the sums spread over ranks: one collective)."""
        if self.spread is None:
            return [self.norm(i) for i in params]
        for i in params:
            self._grad_view(i, lambda views: None)  # readable?
        return self.spread.norms(params)

    @shielded
    def scale(self, i: int, coef: float, divide: bool = False) -> None:
        """Multiply (``divide``: divide) parameter ``i``'s gradient sum by ``coef`` in place."""
        def scale_views(views: list[torch.Tensor]) -> None:
            with torch.no_grad():
                for v in views:
                    v.div_(coef) if divide else v.mul_(coef)
        self._grad_view(i, scale_views)

    @shielded
    def set(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient sum becomes ``grad`` (a gradient assigned to ``p.grad``)."""
        name = self.bank.params[i][0]
        if self.ledger.state(i) is _UPDATING:
            raise InvalidRequest(f"parameter {name!r}: p.grad was assigned after its gradient was applied during "
                                 "backward (overlap_update); pass overlap_update=False")
        if not self.bank.is_trainable(i):
            raise InvalidRequest(f"parameter {name!r}: p.grad was assigned to a parameter that does not require a "
                                 "gradient")
        if tuple(grad.shape) != tuple(self.bank.params[i][1].shape):
            raise InvalidRequest(f"parameter {name!r}: p.grad was assigned a tensor of shape {tuple(grad.shape)}")
        self.bank.set_grad(i, grad)
        self.ledger.move(i, _SUMMED)

    @shielded
    def zero(self, i: int) -> None:
        """Parameter ``i``'s gradient becomes zero (``p.grad.zero_()``): it is still updated. One
        a step already applied (``zero_grad(set_to_none=False)`` after ``optimizer.step()``) is a
        zero sum again, as torch's zeroed ``p.grad`` is."""
        def zero_views(views: list[torch.Tensor]) -> None:
            with torch.no_grad():
                for v in views:
                    v.zero_()
        self._grad_view(i, zero_views, applied_ok=True)
        self.ledger.move(i, _SUMMED)
