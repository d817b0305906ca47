"""The optimizer step over the model's pages: gradients in, AdamW out.

``Updater`` receives each parameter's gradient as autograd completes it, sums it into the bank's
fp32 gradient pages, and updates the fp32 master weights and Adam moments with torch's fused
AdamW kernel on CPU workers (or on the gpu, for states kept there), then refreshes the compute
copy. Loss scaling follows ``torch.amp.GradScaler``; clipping follows ``clip_grad_norm_``. Where
it is exact, a parameter is updated during backward (see the Note in ``in_backward.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from pagemem.engine.updates.adam import AdamW, CpuAdam, fused_steps, join_all, total_sumsq, wait_all
from pagemem.engine.updates.backward_undo import BackwardUndo
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.updates.grad_sums import GradSums
from pagemem.engine.updates.in_backward import UpdatesInBackward
from pagemem.engine.updates.streamed import StreamedUpdate, retryable
from pagemem.engine.updates.loss_scale import LossScaler
from pagemem.engine.updates.state_pieces import StatePiece, lend, norm_of_pieces, with_grad
from pagemem.engine.config import EngineConfig
from pagemem.errors import InvalidRequest, StepFailed, warn
from pagemem.store import PageStore


_NONE, _ACCUMULATING, _SUMMED = GradState.NONE, GradState.ACCUMULATING, GradState.SUMMED
_UPDATING, _APPLIED = GradState.UPDATING, GradState.APPLIED

@dataclasses.dataclass
class UnfinishedUpdate:
    """One step's update while not every parameter in it has landed ([Note: a step is a
    transaction]): what it updates and with what, and how far it got."""

    params: list[int]
    hps: list[AdamW]
    scale: float | None
    coef: float | None = None
    checked: bool = False
    """The loss scale's verdict taken and the clipping coefficient computed (first attempt)."""
    stepped: set[int] = dataclasses.field(default_factory=set)
    """Master weights and moments updated and the step counted."""
    done: set[int] = dataclasses.field(default_factory=set)
    """And the compute copy refreshed."""

    def remaining(self) -> list[int]:
        return [i for i in self.params if i not in self.done]


class Updater(UpdatesInBackward, StreamedUpdate):
    """Gradients to updates: the sums, the step as a transaction, loss scaling and clipping; what
    runs during backward is ``UpdatesInBackward``'s (``in_backward.py``)."""

    def __init__(self, bank: ParamBank, store: PageStore, config: EngineConfig,
                 hyper: Callable[[int], AdamW], ledger: GradLedger | None = None,
                 data_parallel: bool = False) -> None:
        """``ledger``: each parameter's gradient state ([Note: gradient states]), which this
        moves as gradients arrive, are updated, assigned and discarded. ``data_parallel``: the
        gradients are averaged over ranks at the end of backward, so no update runs during it
        ([Note: data parallel over the process group])."""
        self.data_parallel = data_parallel
        self.bank = bank
        self.ledger = ledger if ledger is not None else GradLedger([n for n, _ in bank.params], bank.layer_of)
        self.store = store
        self.config = config
        self.hyper = hyper
        """``hyper(g)``: parameter group ``g``'s hyperparameters now (after any lr scheduler)."""
        self._writeback = None
        self.sums = GradSums(bank, store, self.ledger)
        """Each parameter's gradient sum read, scaled, zeroed or set in place (``grad_sums.py``)."""
        self.adam = CpuAdam(config.adam_threads)
        self.scaler = LossScaler(config.effective_loss_scale)
        self.skipped_steps = 0
        self.overlapped_updates = 0
        self._fires_prev: dict[int, int] = {}
        self._fires_now: dict[int, int] = {}
        self._early: dict[int, Any] = {}
        """The future of each update started during backward (``UPDATING``) that no step joined yet."""
        self._early_hp: dict[int, AdamW] = {}
        self._early_stepped: set[int] = set()
        """Parameters whose update during backward counted its step (before refreshing)."""
        self._final = False
        self.unfinished: UnfinishedUpdate | None = None
        """A step that failed part-way, until ``step()`` finishes it ([Note: a step is a transaction])."""
        self.undo = BackwardUndo(bank, store)
        """What the running backward overwrote ([Note: a failed backward is undone]); the
        lock-free updater keeps its sums in it too."""
        self._early_error: BaseException | None = None
        self._early_taken = False
        self.overlap = self._overlap_exact()
        self.gather_masters: Callable[[list[int]], None] | None = None
        """With sharded moments: gathers every rank's updated share of the given parameters'
        master weights ([Note: sharded moments]; ``ranks/gather.py``), set by the engine."""
        """Updates may run during backward (fixed by the configuration: see the Note)."""

    # ------------------------------------------------------------------ the step

    def refuse_if_unfinished(self, what: str) -> None:
        """Raise ``StepFailed`` while a step that failed part-way is not finished."""
        u = self.unfinished
        if u is not None:
            raise StepFailed(f"{what}: the last step failed after {len(u.done)} of {len(u.params)} parameters were "
                             "updated; call step() again to finish it exactly (its gradients are kept), or load "
                             "a checkpoint")

    def _update_one(self, i: int, hp: AdamW, grad: torch.Tensor | None = None) -> None:
        """Parameter ``i``'s AdamW update and compute-copy refresh (on a CPU worker, or in the
        hook), from its gradient pages or from ``grad``."""
        [(_, pieces)], leases = self._chunks([i])
        try:
            self.undo.keep_states(i, pieces)  # [Note: a failed backward is undone]
            if grad is not None:
                flat = grad.detach().reshape(-1)
                pieces = with_grad(pieces, flat)
            fused_steps([c for _, c in pieces], self.bank.records[i].steps + 1, hp, None)
            self.bank.count_step(i)
            self._early_stepped.add(i)
            for start, c in pieces:
                self.bank.refresh_compute(i, c.param, start)
        finally:
            for lease in leases:
                lease.release()

    def _update_params(self, group: list[tuple[int, list[StatePiece]]], u: UnfinishedUpdate) -> None:
        """Each parameter's update (one fused call over its pieces; its step counted at once),
        then its compute copy written from the new master weights, on the same worker (the
        refresh runs on every worker, not after them on one thread). What landed is marked in
        ``u``, so a retry does the rest only."""
        for i, pieces in group:
            if i not in u.stepped:
                fused_steps([c for _, c in pieces], self.bank.records[i].steps + 1, u.hps[self.bank.group_of(i)], u.scale,
                            clip_coef=u.coef)
                self.bank.count_step(i)
                u.stepped.add(i)
            for start, c in pieces:
                self.bank.refresh_compute(i, c.param, start)
            u.done.add(i)

    def step(self, consume: bool = True) -> bool:
        """Update every parameter that got a gradient since the last step (waiting for those
        already updated during backward). False when an fp16 overflow skipped it. ``consume``:
        the next backward starts new sums; else they are kept (a torch optimizer's ``step()``
        leaves ``p.grad`` for ``zero_grad()``)."""
        taken = self._step()  # raises with the gradients kept (see the Note)
        if consume:
            self.ledger.move_all((_ACCUMULATING, _SUMMED, _UPDATING), _NONE)
        else:  # applied during backward: shown until zero_grad, but no sum is left (those of an earlier step go)
            self.ledger.move_all(_APPLIED, _NONE)
            self.ledger.move_all(_UPDATING, _APPLIED)
        return taken

    # ------------------------------------------------------------------ gradients by habit

    def discard(self, params: list[int]) -> None:
        """Forget the gradient sums of ``params`` (``zero_grad``); refused for one already applied
        during backward. Once no sum is left, gradients applied by a step that kept them go too."""
        self.refuse_if_unfinished("zero_grad")
        applied = [self.bank.params[i][0] for i in params if self.ledger.state(i) is _UPDATING]
        if applied:
            raise InvalidRequest(f"zero_grad: the gradients of {applied[:3]}{'...' if len(applied) > 3 else ''} were "
                                 "already applied during backward (overlap_update); call step() first, or pass "
                                 "overlap_update=False")
        for i in params:
            if self.ledger.state(i) is not _NONE:
                self.ledger.move(i, _NONE)
        if not self.ledger.count(_ACCUMULATING, _SUMMED):
            self.ledger.move_all(_APPLIED, _NONE)

    def chunks(self, params: list[int], grads: bool = True) -> tuple[list[tuple[int, list[StatePiece]]], list]:
        """``params``' states as pieces of page memory, and the leases to release after
        (``grads=False``: the caller gives the gradients, see ``state_pieces.lend``)."""
        return lend(self.bank, self.store, params, grads)

    # what p.grad handles and clipping do to the sums ([Note: gradient handles]): GradSums does it
    def take_sum(self, i: int) -> torch.Tensor:
        """A flat copy of parameter ``i``'s gradient sum (the lock-free updater takes it)."""
        return self.sums.take(i)

    def grad_norm(self, i: int) -> torch.Tensor:
        return self.sums.norm(i)

    def grad_norms(self, params: list[int]) -> list[torch.Tensor]:
        return self.sums.norms(params)

    def scale_grad(self, i: int, coef: float, divide: bool = False) -> None:
        self.sums.scale(i, coef, divide)

    def set_grad(self, i: int, grad: torch.Tensor) -> None:
        self.sums.set(i, grad)

    def zero_grad(self, i: int) -> None:
        self.sums.zero(i)

    def _step(self) -> bool:
        """[Note: a step is a transaction] An update lands whole or the engine says what did
        not. Every task is joined before anything it writes is released (an error or Ctrl-C
        waits for the others). A task that fails leaves the update *unfinished*: the
        parameters it updated are marked (their step counted the moment their master and
        moments changed, their compute copy refreshed after), the gradient sums are kept, and
        ``StepFailed`` says so; ``step()`` again updates the rest with the same
        hyperparameters, loss scale and clipping coefficient, which gives the bits an
        uninterrupted step gives. Until then backward and ``zero_grad`` are refused. An error
        before any task ran (fetching states from nvme, say) leaves the gradients for a retry
        and nothing changed. The loss scale moves only when the whole update landed."""
        u = self.unfinished
        if u is None:
            u = self._begin_update()
            if u is None:
                return self._early_taken
            self.unfinished = u
        remaining = u.remaining()
        if not remaining:  # every task had landed when Ctrl-C reached the waiting caller
            self.unfinished = None
            self.scaler.update(overflow=False)
            return True
        with retryable("writing the last update's optimizer states back to nvme",
                        "the last update landed: its states are intact on the cpu and are written back again after "
                        "this one", u):
            self.flush()
        sharded = self.bank.shards is not None
        if not self.bank.on_disk(remaining) and not sharded:
            if not self._update_batch(remaining, u, check=True):  # all in memory: one batch, checked in it
                return False
        else:  # [Note: homes on nvme] the units pass through the cpu a batch at a time
            if not u.checked and not self._check_streamed(u, remaining):  # from whole gradients, sharded too
                return False
            u.checked = True
            if sharded:  # [Note: sharded moments]: this rank updates its share; the rest is counted
                self._count_unowned(u)
            for batch in self._batches(u.remaining()):
                self._update_batch(batch, u, check=False)
            if sharded and not self.bank.gathered:  # gathered units: no copy at rest to refresh
                self.flush()  # the gather reads and writes master weights the write-back moves
                assert self.gather_masters is not None
                self.gather_masters(u.params)
        self.unfinished = None
        self.scaler.update(overflow=False)
        return True

    def _update_batch(self, params: list[int], u: UnfinishedUpdate, check: bool) -> bool:
        """Update ``params`` (their units' states and gradient sums on nvme brought to the cpu
        first, written back behind what follows); ``check``: take the loss scale's verdict and the
        clipping coefficient from these gradients first (False: skipped for an overflow)."""
        disk = self.bank.on_disk(params)
        if disk:  # whole pages in and out: each page read once and written once
            self._bring(disk, u)
        leases = []
        try:
            chunks, leases = self._chunks(params)
            if check and not u.checked:  # the first attempt: the scale's verdict and the clip coefficient
                if u.scale is not None:  # only finiteness counts here: per piece is enough
                    total = total_sumsq(wait_all([self.adam.sumsq(c.grad) for _, ps in chunks for _, c in ps]))
                    if not math.isfinite(total):
                        self._skip()
                        return False
                if self.config.max_grad_norm is not None:
                    norms = wait_all([self.adam.submit(norm_of_pieces, [c.grad for _, c in ps]) for _, ps in chunks])
                    u.coef = self._clip_coefficient(norms, u.scale)
                u.checked = True
            # one task per unit: its parameters share pages, so their refreshes would queue for
            # each other on different workers; the largest units go first (the workers even out)
            by_unit: dict[int, list[tuple[int, list[StatePiece]]]] = {}
            for i, ps in chunks:
                by_unit.setdefault(self.bank.layer_of[i], []).append((i, ps))
            groups = sorted(by_unit.values(), key=lambda g: -sum(c.param.numel() for _, ps in g for _, c in ps))
            futures = []
            try:
                for g in groups:
                    futures.append(self.adam.submit(self._update_params, g, u))
            finally:  # a refused submit (a dead worker) still joins what was queued before it
                error = join_all(futures)
            if error is None and self._early_error is not None:
                error, self._early_error = self._early_error, None
            if error is not None:
                raise StepFailed(f"step: the update failed after {len(u.done)} of {len(u.params)} parameters were "
                                 f"updated ({type(error).__name__}: {error}); their gradients are kept: call step() "
                                 "again to finish it exactly, or load a checkpoint") from error
        finally:
            for lease in leases:
                lease.release()
            if disk:
                self._writeback = self.store.move(disk, "nvme")
        return True

    def _count_unowned(self, u: UnfinishedUpdate) -> None:
        """The parameters of ``u`` this rank holds no moments of: their steps counted (they are
        updated by the ranks that hold them, and gathered)."""
        for i in u.remaining():
            if not self.bank.owned_numel(i):
                if i not in u.stepped:
                    self.bank.count_step(i)
                    u.stepped.add(i)
                u.done.add(i)

    def _skip(self) -> None:
        """An fp16 overflow: the step is skipped and the loss scale backs off."""
        self.unfinished = None
        self.scaler.update(overflow=True)
        self.skipped_steps += 1

    def _begin_update(self) -> UnfinishedUpdate | None:
        """A new step: wait for the updates made during backward (those that failed join this
        update), and what the rest is updated with; None when nothing is left to update."""
        hps = [self.hyper(g) for g in range(self.bank.group_count())]
        early = self._early
        if early and any(hps[g] != hp for g, hp in self._early_hp.items()):
            warn("pagemem: param_groups changed between backward and step(); the updates made during "
                          "backward used the values before the change (pass overlap_update=False to read them "
                          "in step())")
        self._early_error = join_all(list(early.values()))
        self._early = {}  # joined (a Ctrl-C while joining leaves them for the next step() to join)
        failed = {i for i, f in early.items() if f.exception() is not None}
        self.overlapped_updates += len(early) - len(failed)
        stepped = failed & self._early_stepped
        self._early_stepped.clear()
        touched = sorted(set(self.ledger.holding(_ACCUMULATING, _SUMMED)) | failed)
        self._early_taken = bool(early)
        if not touched:
            return None
        u = UnfinishedUpdate(touched, hps, self.scaler.scale, stepped=stepped)
        return u

    def flush(self) -> None:
        """Wait for the last write-back of optimizer states to nvme; raise its error if it failed
        (the states are then still valid on the cpu, where the failed pages stay)."""
        handle, self._writeback = self._writeback, None
        if handle is not None:
            handle.wait()

    def _clip_coefficient(self, norms: list[torch.Tensor], scale: float | None) -> float:
        """``clip_grad_norm_``'s coefficient from each parameter's fp32 gradient norm, computed as
        it does (a norm of per-parameter fp32 norms, then ``max_norm / (norm + 1e-6)`` clamped to
        1), so clipping is bit-identical to plain PyTorch. [Note: fidelity over accuracy]
        ``CpuAdam``'s chunked norm is about 1e4 times more accurate on 1M-element tensors, but
        would not reproduce torch's updates; so a gradient lent in pieces is joined for its norm
        (``norm_of_pieces``: torch's reduction order is over the whole tensor)."""
        device = norms[0].device  # units whose states are kept on the gpu have their norms there
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
        if scale is not None:
            total = total / scale
        coef = torch.clamp(self.config.max_grad_norm / (total + 1e-6), max=1.0)
        return float(coef)

    # ------------------------------------------------------------------ helpers

    def _chunks(self, params: list[int]) -> tuple[list[tuple[int, list[StatePiece]]], list]:
        """Flat fp32 master weights, gradient and moments of each parameter as views of page
        memory, and the leases to release after (``state_pieces.lend``)."""
        return lend(self.bank, self.store, params)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {"steps": [r.steps for r in self.bank.records], "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale, "good_steps": self.scaler.good_steps}

    def restore(self, state: dict[str, Any]) -> None:
        if len(state["steps"]) != len(self.bank.records):
            raise InvalidRequest("the checkpoint's optimizer state does not fit this model")
        for i, steps in enumerate(state["steps"]):
            self.bank.set_step_count(i, steps)
        self.skipped_steps = state["skipped_steps"]
        self.scaler.scale = state["loss_scale"]
        self.scaler.good_steps = state["good_steps"]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.adam.close()
