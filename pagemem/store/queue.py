"""The store's operation queue: the lock, ordered submission, completion, and draining.

Operations are ordered per page (``ordering``). ``submit`` queues an operation under the lock;
``run`` starts ready operations outside it. Operations that become ready while this thread is
already starting operations are started by the outermost ``run``, iteratively, so long chains of
completions never recurse.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable, TypeVar

from pagemem.store import ordering
from pagemem.store.ordering import Op
from pagemem.errors import OperationFailed
from pagemem.store.pages import Page

T = TypeVar("T")


class OpQueue:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        """Guards every page and the tiers' free lists. Re-entrant, because a view's pin is
        dropped by a finalizer that may run (at garbage collection) while this thread holds it."""
        self._idle = threading.Condition(self.lock)
        self._unfinished = 0
        self._local = threading.local()

    def submit(self, op: Op) -> bool:
        """Queue ``op`` (caller holds the lock). True if it may start now: call ``run([op])``
        once the lock is released."""
        self._unfinished += 1
        return ordering.enqueue(op)

    def submit_and_run(self, op: Op) -> Op:
        """``submit`` then ``run`` (caller does not hold the lock)."""
        with self.lock:
            ready = self.submit(op)
        if ready:
            self.run([op])
        return op

    def complete(self, op: Op) -> None:
        """Mark ``op`` finished and start what was waiting for it. Idempotent: a fallback may
        complete an operation again ([Note: no operation is lost])."""
        with self.lock:
            if op.finished:
                return
            ready = ordering.finish(op)
            self._unfinished -= 1
            if not self._unfinished:
                self._idle.notify_all()
        op.done.set()
        if ready:
            self.run(ready)

    def run(self, ops: Iterable[Op]) -> None:
        queue = getattr(self._local, "queue", None)
        if queue is not None:
            queue.extend(ops)
            return
        self._local.queue = queue = deque(ops)
        interrupted: BaseException | None = None
        try:
            while queue:
                op = queue.popleft()
                try:
                    op.start(op)
                except BaseException as exc:  # a start that broke must not hang its waiters
                    if not isinstance(exc, Exception):  # Ctrl-C: raised once, here, after the queue ran;
                        interrupted = interrupted or exc  # waiters get an error of their own, not it again
                        exc = OperationFailed(f"{type(exc).__name__} while starting a page operation")
                    op.errors.append(exc)
                    if not op.finished:
                        self.complete(op)
        finally:
            self._local.queue = None
        if interrupted is not None:
            raise interrupted

    def exclusive(self, pages: Iterable[Page], fn: Callable[[], T], check: Callable[[], None]) -> T:
        """Run ``fn`` once the operations queued earlier on ``pages`` are done, holding the pages
        until it returns. ``check`` runs under the lock first (it raises to refuse)."""
        ready = threading.Event()
        op = Op(pages, lambda _op: ready.set())
        with self.lock:
            check()
            start_now = self.submit(op)
        if start_now:
            self.run([op])
        ready.wait()
        try:
            return fn()
        finally:
            self.complete(op)

    def drain(self) -> None:
        """Wait until every operation submitted so far has finished."""
        with self.lock:
            while self._unfinished:
                self._idle.wait()
