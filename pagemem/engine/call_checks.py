"""Checks every public call of the engine makes first: not closed, not broken, no backward by
habit left unfinished, no call from another thread while the training loop is part-way through a
step ([Note: calls from several threads], ``calls.py``). A mixin of ``Engine``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from pagemem.engine.phase import EnginePhase, PhaseMachine
from pagemem.errors import InvalidRequest

if TYPE_CHECKING:
    from pagemem.engine.calls import CallLock
    from pagemem.engine.updates.update import Updater


class CallChecks:
    phase: PhaseMachine
    updater: "Updater"
    calls: "CallLock"

    if TYPE_CHECKING:  # BackwardMixin's
        def _abort_backward(self, exc: BaseException | None, guard_held: bool = True) -> None: ...

    def _usable(self, what: str) -> None:
        """Refuse use after ``close()`` or once broken; finish off a backward by habit that
        raised (autograd never ran its end callback): see [Note: a failed backward is undone].
        (A process forked from the owner was refused before the call lock: ``calls.py``.)"""
        self._find_failed_backward(what)
        self.phase.require_usable(what)

    def _find_failed_backward(self, what: str) -> None:
        """A backward by habit that raised, unfound, is undone now ([Note: backward by habit])."""
        if self._refuse_beside_backward(what):
            self._abort_backward(None)

    def _refuse_beside_backward(self, what: str) -> bool:
        """Refuse a call from a thread other than the training loop's while that loop is part-way
        through a step: a backward by habit runs, or updates ran during its last backward
        (``overlap_update``) and its ``step()`` has not come. From the loop's thread, True: a
        backward by habit is on and no autograd node runs, so it raised, unfound ([Note: calls
        from several threads], ``calls.py``)."""
        if torch._C._current_graph_task_id() != -1:  # inside a backward on this thread: a hook, its end, a
            return False  # signal's handler run there; not one that raised

        habit = self.phase.now is EnginePhase.BACKWARD_BY_HABIT
        if not habit and not self.updater.updated_during_backward():
            return False
        loop = self.calls.loop_thread
        if loop is not None and loop is not threading.current_thread() and loop.is_alive():
            running = ("a backward (loss.backward()) runs through this engine" if habit else
                       "a step is part-way (parameters were updated during its last backward, overlap_update)")
            raise InvalidRequest(f"{what}: refused: {running} on thread {loop.name!r}; call it from that thread, "
                                 "or once that step has ended")
        return habit
