"""Ordering of operations on pages.

Every operation (a move, a read, a write, a release) names the pages it touches. It starts
only when the operations queued earlier on any of those pages have finished; operations on
disjoint pages run concurrently. Dependencies point only to earlier operations, so there are
no cycles and no deadlock. All functions here run under the store's lock.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from pagemem.store.pages import Page


class Op:
    """An operation on a set of pages; ``start`` runs (outside the lock) once it may begin."""

    __slots__ = ("pages", "start", "waiting", "successors", "finished", "done", "errors",
                 "remaining", "__weakref__")

    def __init__(self, pages: Iterable[Page], start: Callable[["Op"], None]) -> None:
        self.pages = tuple(pages)
        self.start = start
        self.waiting = 0
        self.successors: list[Op] = []
        self.finished = False
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.remaining = 0
        """Transfers of this operation still in flight."""


def enqueue(op: Op) -> bool:
    """Queue ``op`` behind the unfinished operations on its pages. True if it may start now."""
    before = {}
    for page in op.pages:
        prev = page.last_op
        if prev is not None and not prev.finished:
            before[id(prev)] = prev
        page.last_op = op
        page.pending += 1
    for prev in before.values():
        prev.successors.append(op)
    op.waiting = len(before)
    return op.waiting == 0


def finish(op: Op) -> list[Op]:
    """Mark ``op`` finished; return the operations that may start now."""
    op.finished = True
    for page in op.pages:
        page.pending -= 1
        if page.last_op is op:
            page.last_op = None
    ready = []
    for succ in op.successors:
        succ.waiting -= 1
        if succ.waiting == 0:
            ready.append(succ)
    op.successors = []
    return ready
