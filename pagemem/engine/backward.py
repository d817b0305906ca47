"""The engine's backward: by ``engine.backward(loss)`` or by habit (``loss.backward()``), and what
a backward that fails part-way leaves ([Note: backward by habit], [Note: a step is a
transaction] in ``update.py``). A mixin of ``Engine``: its phase moves through ``self.phase``
([Note: engine phases], ``phase.py``)."""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from pagemem.engine.interrupts import shielded
from pagemem.engine.phase import EnginePhase, PhaseMachine
from pagemem.errors import InvalidRequest
from pagemem.process import require_owner

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank
    from pagemem.engine.config import EngineConfig
    from pagemem.engine.gradients.gradients import Gradients
    from pagemem.engine.units.guard import Guard
    from pagemem.engine.updates.lockfree import LockFreeUpdater
    from pagemem.engine.paging.pager import Pager
    from pagemem.engine.updates.update import Updater


class BackwardMixin:
    bank: "ParamBank"
    config: "EngineConfig"
    gradients: "Gradients"
    guard: "Guard"
    lockfree: "LockFreeUpdater | None"
    pager: "Pager"
    updater: "Updater"
    phase: PhaseMachine
    _phase_seconds: dict[str, float]
    failed_backwards: int
    owner_pid: int

    if TYPE_CHECKING:  # Engine's
        def _usable(self, what: str) -> None: ...

        def _saved_tensor_hooks(self) -> Any: ...

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
        self.guard.enter()  # exited once, by the move out of the backward (_end_backward, _abort_backward)
        self.phase.begin_backward(implicit)
        if implicit:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_implicit_backward)

    @shielded
    def _abort_backward(self, exc: BaseException | None, guard_held: bool = True) -> None:
        """A backward raised part-way (``exc``; None: a backward by habit found unfinished).
        Its gradients are discarded, so the next iteration is as if its batch had been skipped;
        see [Note: a step is a transaction]. ``guard_held``: the backward still holds the guard
        (``_end_backward`` exits it before its bookkeeping)."""
        if guard_held:
            self.guard.exit()
        self.failed_backwards += 1
        applied, held = 0, False
        broken: str | None = None
        try:
            try:
                self.bank.grads_landed()  # no copy still lands in pages once this returns
            finally:
                applied, held = self.gradients.abort_backward()
        finally:  # the phase leaves the backward whatever raised above
            if self.lockfree is not None and self.lockfree.has_fresh():
                broken = ("a backward failed after adding gradients to sums the lock-free updater shares with "
                          "earlier iterations: they cannot be taken back; load the last checkpoint")
            elif applied:
                broken = (f"a backward failed after {applied} parameters were updated from it during backward "
                          "(overlap_update): the model is part-way through a step, which can be neither "
                          "finished nor undone exactly; load the last checkpoint (Engine.load), and pass "
                          "overlap_update=False where a failed backward must be recoverable")
            earlier = self.phase.abort_backward(broken)
        if broken is not None:
            note = f"pagemem: {broken}"
        elif held:
            note = (f"pagemem: the failed backward's gradients were discarded, with those of the {earlier} "
                    "earlier backward(s) of this step (their sums held part of it): the step starts again")
        else:
            note = ("pagemem: the failed backward's gradients were discarded; the next backward starts the step "
                    "as if this batch had been skipped")
        if exc is not None:
            exc.add_note(note)
        else:
            warnings.warn(note + " (the last loss.backward() raised)", RuntimeWarning, stacklevel=4)

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
        except BaseException as exc:
            self._abort_backward(exc, guard_held=False)
            raise
        self.phase.end_backward()
        self.gradients.show()

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """A parameter's gradient is about to be accumulated: start a backward the engine did
        not start (see [Note: backward by habit])."""
        require_owner("loss.backward() through the engine's model", self.owner_pid)
        if self.phase.in_backward:
            return
        self._usable("loss.backward()")
        if self.updater.scaler.scale is not None:
            raise InvalidRequest("loss.backward(): this engine scales the loss (loss_scale); call "
                                 "engine.backward(loss) instead")
        self._begin_backward(implicit=True)

    def _end_implicit_backward(self) -> None:
        """Autograd's callback at the end of a backward by habit."""
        self._end_backward()
