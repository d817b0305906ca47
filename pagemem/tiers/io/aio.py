"""Linux AIO engine through the ``libaio`` package (which needs the system ``libaio.so.1``).

Traps handled here: importing ``libaio`` without the system library raises OSError, not
ImportError; buffers are measured in items, so only uint8 memoryviews are passed; errors come
back as negative result codes, not exceptions; an ``AIOContext`` destroys itself when garbage
collected (``__del__``), also in a forked child, which the kernel gave no such context: ours does
nothing outside the process that made it ([Note: an engine belongs to its process]).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from typing import Sequence

from pagemem.errors import OperationFailed
from pagemem.tiers.completion import deliver
from pagemem.tiers.io.base import Done, EngineUnavailable, IOEngine, Request


def _load_libaio():
    try:
        import libaio
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(f"cannot load libaio: {exc}") from exc
    return libaio


_contexts: dict = {}


def _context_class(libaio):
    """``libaio.AIOContext`` whose ``close`` (``io_destroy``, also run by its ``__del__``) does
    nothing in a process other than the one that made it: a forked child has no such context,
    and the owner's must not be touched."""
    cls = _contexts.get(libaio)
    if cls is None:
        class OwnedContext(libaio.AIOContext):
            def __init__(self, *args, **kwargs) -> None:
                self._owner_pid = os.getpid()
                super().__init__(*args, **kwargs)

            def close(self) -> None:
                if os.getpid() == self._owner_pid:
                    super().close()

        cls = _contexts[libaio] = OwnedContext
    return cls


def _run_callback(done: Done, res: "int | BaseException") -> None:
    deliver(done, res, "an aio request's completion")  # never raises: the reaper lives on


_REAP_WAIT = 0.05
"""Seconds the reaper blocks in io_getevents before re-checking what is in flight."""


class AioEngine(IOEngine):
    """Submits ``io_submit`` requests directly; one reaper thread collects completions."""

    name = "aio"

    def __init__(self, depth: int) -> None:
        self._libaio = libaio = _load_libaio()
        try:
            self._ctx = _context_class(libaio)(depth)
        except OSError as exc:
            raise EngineUnavailable(f"io_setup({depth}) failed: {exc}") from exc
        self.depth = depth
        self._cv = threading.Condition(threading.Lock())
        self._inflight = 0
        self._backlog: deque = deque()
        self._callbacks: dict[object, Done] = {}
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="pagemem-aio", daemon=True)
        self._reaper.start()

    def submit(self, write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        self.submit_many(write, [Request(fd, offset, buf, done)])

    def submit_many(self, write: bool, requests: Sequence[Request]) -> None:
        """One ``io_submit`` for every request the depth admits now (the rest wait in the
        backlog, submitted as completions free the depth), not one system call per request."""
        lib = self._libaio
        mode = lib.AIOBLOCK_MODE_WRITE if write else lib.AIOBLOCK_MODE_READ
        blocks = [(lib.AIOBlock(mode, r.fd, [r.buf], r.offset), r.done) for r in requests]
        with self._cv:
            if self._closed:
                raise RuntimeError("I/O engine is closed")
            broken = self.broken
            if broken is None:
                now = []
                for block, done in blocks:
                    self._callbacks[block] = done
                    if self._inflight < self.depth:
                        self._inflight += 1
                        now.append(block)
                    else:
                        self._backlog.append(block)
                if now:
                    self._cv.notify()
        if broken is not None:  # the reaper died: nothing would ever complete these requests
            for _, done in blocks:
                _run_callback(done, broken)
            return
        if now:
            self._io_submit(now)

    def _io_submit(self, blocks: list) -> None:
        """Hand ``blocks`` (already counted in flight) to the kernel; fail what it refuses."""
        submitted = 0
        error: int | BaseException = -errno.EIO
        try:
            submitted = self._ctx.submit(blocks)
        except OSError as exc:
            error = -(exc.errno or errno.EIO)
        except BaseException as exc:  # not the kernel's refusal: the request's error all the same
            error = exc
        if submitted == len(blocks):
            return
        refused = blocks[submitted:]
        with self._cv:
            self._inflight -= len(refused)
            callbacks = [self._callbacks.pop(b) for b in refused if b in self._callbacks]
            self._cv.notify_all()
        for done in callbacks:
            _run_callback(done, error)

    def _reap(self) -> None:
        try:
            while self._reap_once():
                pass
        except BaseException as exc:  # the reaper dies: fail what it would have completed
            self._die(exc)

    def _die(self, cause: BaseException) -> None:
        """Mark the engine broken and complete every request it holds with that error
        ([Note: no operation is lost]); later submissions fail with it at once."""
        err = OperationFailed(f"the aio reaper thread died: {cause!r}; requests in flight and later "
                              "requests on this engine fail")
        err.__cause__ = cause
        with self._cv:
            self.broken = err
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
            self._backlog.clear()
            self._inflight = 0
            self._cv.notify_all()
        for done in callbacks:
            _run_callback(done, err)

    def _reap_once(self) -> bool:
        """Collect one batch of completions and run their callbacks; False once closed and idle.

        Everything a batch references (blocks, buffers, callbacks) lives in this frame only, so
        it is dropped when the call returns: an idle reaper keeps no callback alive.
        """
        with self._cv:
            while self._inflight == 0 and not self._closed:
                self._cv.wait()
            if self._inflight == 0:
                return False
        # bounded wait: a request the kernel refused after we counted it never completes,
        # so the reaper must come back to re-read the count (and to notice close())
        try:
            events = self._ctx.getEvents(min_nr=1, nr=self.depth, timeout=_REAP_WAIT)
        except InterruptedError:  # a signal (a profiler's, ptrace) cut io_getevents short: nothing was
            return True           # consumed, so wait again (it used to kill the reaper: every request failed)
        with self._cv:
            self._inflight -= len(events)
            refill = []
            while self._backlog and self._inflight < self.depth:
                refill.append(self._backlog.popleft())
                self._inflight += 1
            callbacks = [(self._callbacks.pop(block), res) for block, res, _ in events
                         if block in self._callbacks]
            self._cv.notify_all()
        if refill:
            self._io_submit(refill)
        for done, res in callbacks:
            _run_callback(done, res)
        return True

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            while self._inflight or self._backlog:
                self._cv.wait()
            self._closed = True
            self._cv.notify_all()
        try:
            self._reaper.join()
        finally:
            self._ctx.close()  # io_destroy: waits for what the kernel still holds
