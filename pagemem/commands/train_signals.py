"""SIGTERM in ``pagemem train``: what schedulers and ``kill`` send before they stop a job.

[Note: SIGTERM as Ctrl-C] While ``pagemem train`` runs, SIGTERM raises :class:`Preempted`, a
``KeyboardInterrupt``, so it takes Ctrl-C's path ([Note: Ctrl-C in pagemem train]): held by
the engine until the step is whole, then a checkpoint, the plots, timelines and summary, and
exit 143 (128 + SIGTERM, as a process the signal ended). During start-up it ends the start: a
new run's directory (its page files with it) is removed, and the engines made so far close.
A second SIGTERM during the save lands at once, as a second Ctrl-C does. The handler before
is put back when the command returns.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Any, Iterator

PREEMPTED = 128 + signal.SIGTERM


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived (``exit_status``: what the command exits with)."""

    exit_status = PREEMPTED


def _raise(signum: int, frame: Any) -> None:
    raise Preempted()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Preempted` inside (the main thread only: elsewhere, nothing)."""
    try:
        before = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: signals are not ours to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
