"""The engine's backward: by ``engine.backward(loss)`` or by habit (``loss.backward()``), the
gradient sums it leaves (``zero_grad``, clipping, their norm), and what a backward that fails
part-way leaves ([Note: backward by habit], [Note: a failed backward is
undone] in ``updates/backward_undo.py``). A mixin of ``Engine``: its phase moves through ``self.phase``
([Note: engine phases], ``phase.py``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from pagemem.engine.calls import CallLock, engine_call
from pagemem.engine.interrupts import shielded
from pagemem.engine.phase import EnginePhase, PhaseMachine
from pagemem.engine.ranks.average import average_gradients
from pagemem.engine.updates.lockfree import SHARED_SUMS
from pagemem.errors import InvalidRequest, RankFailed, warn
from pagemem.process import require_owner

if TYPE_CHECKING:
    from torch import nn

    from pagemem.engine.updates.adam import PagedOptimizer
    from pagemem.engine.units.bank import ParamBank
    from pagemem.engine.config import EngineConfig
    from pagemem.engine.gradients.gradients import Gradients
    from pagemem.engine.units.guard import Guard
    from pagemem.engine.updates.lockfree import LockFreeUpdater
    from pagemem.engine.paging.pager import Pager
    from pagemem.engine.updates.update import Updater
    from pagemem.engine.gradients.grad_ledger import GradLedger
    from pagemem.engine.ranks import Collectives
    from pagemem.engine.ranks.grad_scatter import GradScatter


class BackwardMixin:
    bank: "ParamBank"
    config: "EngineConfig"
    gradients: "Gradients"
    guard: "Guard"
    lockfree: "LockFreeUpdater | None"
    pager: "Pager"
    updater: "Updater"
    phase: PhaseMachine
    module: "nn.Module"
    optimizer: "PagedOptimizer"
    calls: CallLock
    _phase_seconds: dict[str, float]
    failed_backwards: int
    backwards: int
    global_step: int
    owner_pid: int
    collectives: "Collectives | None"
    ledger: "GradLedger"
    grad_scatter: "GradScatter"

    if TYPE_CHECKING:  # Engine's
        def _usable(self, what: str) -> None: ...

        def _saved_tensor_hooks(self) -> Any: ...

    @engine_call("backward", shielded=False)
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; gradients of successive calls add up until ``step()`` updates."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidRequest("backward: loss must be a one-element tensor")
        self._usable("backward")
        if self.phase.in_backward:
            raise InvalidRequest("backward: called while another backward through this engine runs")
        t0 = time.perf_counter()
        scale = self.updater.scaler.scale
        begun = False
        try:
            self._begin_backward()
            begun = True
            with self._saved_tensor_hooks():
                (loss * scale if scale is not None else loss).backward()
            self._end_backward()
        except BaseException as exc:
            if self.phase.now is EnginePhase.BACKWARD:  # it raised part-way (a Ctrl-C before the end's bookkeeping too)
                self._abort_backward(exc)
            elif begun and isinstance(exc, KeyboardInterrupt) and self.phase.now is EnginePhase.ACCUMULATED:
                # held until the bookkeeping was whole ([Note: Ctrl-C inside the engine])
                exc.add_note("pagemem: the backward had finished: its gradients are summed (step() updates with "
                             "them, engine.zero_grad() discards them)")
            raise
        self._phase_seconds["backward"] += time.perf_counter() - t0

    @shielded
    def _begin_backward(self, implicit: bool = False) -> None:
        """[Note: backward by habit] ``engine.backward(loss)`` and a plain ``loss.backward()`` start
        here: the first gradient hook of a backward the engine did not start calls this too (and
        queues ``_end_implicit_backward`` at the end of autograd's run), so both add gradients up
        the same way. Only loss scaling needs ``engine.backward`` (it scales the loss). A backward
        by habit that raises never runs that callback: the next call into the engine finds it
        (``Engine._usable``) and aborts it."""
        if self.updater.updated_during_backward():
            raise InvalidRequest("backward: the previous backward was the last of a step and already updated "
                                 f"parameters during backward (overlap_update, {self.phase.per_step} backward(s) per "
                                 "step): call step() first, set accumulation_steps to the backwards of one step, or "
                                 "pass overlap_update=False")
        if self.updater.overlap:  # updates may run during this backward: writes by hand reach the master first
            self.pager.residency.keep_writes()  # ([Note: writes to parameters])
        self.gradients.begin_backward()
        # [Note: which backward is the last of a step] engine.backward counts accumulation_steps;
        # a backward by habit learns it from the steps it saw (none yet: no update runs early)
        per_step = self.phase.per_step if self.phase.per_step is not None else (None if implicit else
                                                                                 self.config.accumulation_steps)
        try:
            self.updater.begin_backward(final=per_step is not None and self.phase.micro + 1 == per_step)
        except BaseException:  # refused: nothing began, and the handles taken down go back up
            self.gradients.show()
            raise
        if self.bank.gathered:  # [Note: sharded gradient sums]
            self.grad_scatter.begin_backward()
        self.guard.enter()  # exited once, by the move out of the backward (_end_backward, _abort_backward)
        self.phase.begin_backward(implicit)
        self.backwards += 1
        if implicit:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_implicit_backward)

    @shielded
    def _abort_backward(self, exc: BaseException | None, guard_held: bool = True) -> None:
        """A backward raised part-way (``exc``; None: a backward by habit found unfinished). It
        is undone: the engine is as if its batch had been skipped, the step's earlier backwards
        kept ([Note: a failed backward is undone] in ``updates/backward_undo.py``). Only an undo
        that itself fails breaks the engine. ``guard_held``: the backward still holds the guard
        (``_end_backward`` exits it before its bookkeeping)."""
        if guard_held:
            self.guard.exit()
        self.failed_backwards += 1
        undone = 0
        broken: str | None = None
        lost = exc if isinstance(exc, RankFailed) else self.collectives.failed if self.collectives else None
        if lost is not None:  # [Note: collectives]: the ranks are out of step for good
            broken = (f"a collective with the other ranks failed ({lost}); the ranks can no longer agree: exit and "
                      "restart every rank from the last checkpoint (torchrun --max-restarts does)")
        failed: BaseException | None = None
        try:
            try:
                self.bank.grads_landed()  # no copy still lands in pages once this returns
                if self.bank.gathered:  # nothing in flight writes shares once this returns
                    self.grad_scatter.abort()
            finally:
                undone, _ = self.gradients.abort_backward()
        except BaseException as err:  # the pages are neither the old values nor the new: nothing is certain
            failed = err
            broken = (f"a backward failed and undoing it failed too ({type(err).__name__}: {err}): the model's "
                      "states are neither those before it nor after it; load the last checkpoint (Engine.load)")
        finally:  # the phase leaves the backward whatever raised above
            earlier = self.phase.abort_backward(broken)
        if broken is not None:
            note = f"pagemem: {broken}"
        else:
            self.gradients.show()  # the earlier backwards' sums, as before this one
            note = "pagemem: the failed backward was undone, as if this batch had been skipped"
            kept = [f"the gradients of the {earlier} earlier backward(s) of this step are kept"] if earlier else []
            if undone:
                kept.append(f"the updates of {undone} parameter(s) made during it (overlap_update) were undone")
            if kept:
                note += f" ({'; '.join(kept)})"
        if exc is not None:
            exc.add_note(note)
        else:
            warn(note + " (the last loss.backward() raised)")
        if failed is not None and not isinstance(failed, Exception):
            raise failed  # a second Ctrl-C while undoing: raised at once, the engine broken

    @shielded
    def _end_backward(self) -> None:
        """The backward's autograd run is over: its bookkeeping, then the phase moves on. If the
        bookkeeping raises, the backward is aborted as one that failed part-way."""
        self.guard.exit()
        try:
            self.bank.grads_landed()  # every sum whole once backward returns ([Note: gradient copies])
            self.gradients.end_backward()
            self.pager.end_backward()
            self.updater.end_backward()
            if self.bank.gathered:  # [Note: sharded gradient sums]: every backward, per unit
                self.grad_scatter.end_backward((self.global_step, self.backwards))
            elif self.collectives is not None and self.phase.micro + 1 >= self.config.accumulation_steps:
                # [Note: data parallel over the process group]: the step's last backward
                average_gradients(self.bank, self.ledger, self.updater.zero_grad, self.collectives,
                                  (self.global_step, self.backwards))
        except BaseException as exc:
            self._abort_backward(exc, guard_held=False)
            raise
        self.phase.end_backward()
        self.gradients.show()

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """A parameter's gradient is about to be accumulated: start a backward the engine did
        not start (see [Note: backward by habit])."""
        require_owner("loss.backward() through the engine's model", self.owner_pid)
        if self.phase.in_backward:  # a hook of the backward that runs (it holds the engine: calls.py)
            return
        with self.calls.held("loss.backward()"):  # begun with no other call running
            if self.phase.in_backward:
                return
            self._usable("loss.backward()")
            if self.updater.scaler.scale is not None:
                raise InvalidRequest("loss.backward(): this engine scales the loss (loss_scale); call "
                                     "engine.backward(loss) instead")
            self._begin_backward(implicit=True)

    def _end_implicit_backward(self) -> None:
        """Autograd's callback at the end of a backward by habit."""
        with self.calls.held("loss.backward()"):
            self._end_backward()

    # ------------------------------------------------------------------ the gradients summed

    @engine_call("zero_grad")
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients summed so far (``set_to_none=False``: make them zero, still
        stepped), as ``engine.optimizer.zero_grad()`` and ``model.zero_grad()`` do."""
        self._usable("zero_grad")
        self.updater.refuse_if_unfinished("zero_grad")
        self.optimizer.zero_grad(set_to_none)

    @engine_call("optimizer.zero_grad")
    def _zero_grad(self) -> None:
        """``engine.optimizer.zero_grad()`` ran (it set the handles to None, or zeroed them):
        discard what it discarded (see [Note: gradient handles])."""
        self._usable("zero_grad")
        if self.lockfree is not None and self.lockfree.has_fresh():
            self.gradients.show()  # the handles it set to None go back up: nothing was discarded
            raise InvalidRequest(SHARED_SUMS)
        try:
            self.gradients.take_back()
        except InvalidRequest:  # refused (applied during backward): the handles go back up, as nothing was discarded
            self.gradients.show()
            raise
        if not self.gradients.show():
            self.phase.discard()

    @engine_call("get_global_grad_norm")
    def get_global_grad_norm(self) -> float:
        """The 2-norm of all gradient sums now (as ``clip_grad_norm_`` computes it), or of the
        last update's gradients once they are consumed; 0.0 before any."""
        return self.gradients.global_norm()

    @engine_call("clip_grad_norm_")
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient sums by their global ``norm_type``-norm, bit for bit as
        ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``; returns that norm (before
        clipping). The 2-norm is computed over the pages; another norm over the gradients
        materialised ([Note: gradient handles]). For every step, ``EngineConfig(max_grad_norm=)``
        clips by the 2-norm."""
        if self.collectives is not None:  # every rank clips, or the replicas part for good
            self.collectives.begin("clipping gradients")
        if norm_type in (2, 2.0):
            return self.gradients.clip(max_norm)
        self._usable("clip_grad_norm_")
        self.gradients.take_back()
        self.gradients.show()
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
