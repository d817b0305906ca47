"""Handles on asynchronous moves."""

from __future__ import annotations

import time

import pagemem.process as process
from pagemem.store.ordering import Op


class MoveHandle:
    """Completion of an asynchronous move. ``wait()`` returns once every page has landed, or
    raises the first error (TierIOError, CorruptPage, OutOfMemory) if a page could not move;
    pages that failed stay where they were, with their data intact."""

    __slots__ = ("_ops", "_owner")

    def __init__(self, ops: list[Op]) -> None:
        self._ops = tuple(ops)
        self._owner = process.current_pid()

    def done(self) -> bool:
        """True once the move has finished, successfully or not."""
        return all(op.done.is_set() for op in self._ops)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the move finishes; raise its first error. TimeoutError after ``timeout`` s.
        In a process forked from the store's owner, ``WrongProcess`` at once (nothing there would
        ever finish it: ``process.py``)."""
        process.require_owner("MoveHandle.wait()", self._owner)
        deadline = None if timeout is None else time.monotonic() + timeout
        for op in self._ops:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not op.done.wait(left):
                raise TimeoutError(f"move not finished after {timeout} s")
        errors = self.errors
        if errors:
            first = errors[0]
            if len(errors) > 1 and not getattr(first, "__notes__", None):
                first.add_note(f"{len(errors) - 1} more page(s) of this move failed too")
            raise first

    @property
    def errors(self) -> list[BaseException]:
        """Errors of the pages that failed to move (empty while running or on success)."""
        return [e for op in self._ops if op.done.is_set() for e in op.errors]

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<MoveHandle {state}, {len(self.errors)} errors>"
