"""Copy engines: asynchronous copies between a memory tier and host buffers.

With CUDA, host<->device copies run on two dedicated streams (one per direction) and complete
through CUDA events, so they overlap compute on other streams. Without CUDA, copies between
host-memory arenas run on a small thread pool (torch's copy releases the GIL), or inline on the
thread that issues them (``threads=0``: on a host stand-in with few cores a copy thread buys no
overlap, the copy and the compute share the same cores, and only adds contention). Either engine
can order a copy after a fence (``after``), and drops every reference to a request once its
callback has run.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from pagemem.errors import OperationFailed
from pagemem.tiers.completion import deliver
from pagemem.tiers.fence import Fence

CopyDone = Callable[[BaseException | None], None]


def _call(done: CopyDone, error: BaseException | None) -> None:
    deliver(done, error, "a copy's completion")  # never raises ([Note: no operation is lost])


class HostCopyEngine:
    """Copies between host tensors on ``threads`` worker threads (0: inline, done on return)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagemem-copy") if threads else None
        self.name = f"host threads ({threads})" if threads else "inline host copies"

    @property
    def inline(self) -> bool:
        """Copies run on the issuing thread."""
        return self._pool is None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, done: CopyDone, after: Fence | None = None) -> None:
        """Copy ``src`` into ``dst`` on a worker thread (or this one), after waiting for ``after``."""
        if self._pool is None:
            self._run(dst, src, done, after)
            return
        self._pool.submit(self._run, dst, src, done, after)

    @staticmethod
    def _run(dst: torch.Tensor, src: torch.Tensor, done: CopyDone, after: Fence | None) -> None:
        # the pool drops its work item (and so these arguments) as soon as this returns
        try:
            if after is not None:
                after.synchronize()
            dst.copy_(src)
        except BaseException as exc:  # reported to the waiter, not lost on a pool thread
            _call(done, exc)
            return
        _call(done, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _EventWaiter:
    """A thread that waits on CUDA events in submission order and runs their callbacks. If the
    thread dies, what it holds and every later push fail with that error at once."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.broken: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def push(self, event: torch.cuda.Event, done: CopyDone) -> None:
        with self._lock:
            broken = self.broken
            if broken is None:
                self._queue.put((event, done))
        if broken is not None:
            _call(done, broken)

    def _run(self) -> None:
        try:
            while self._wait_one():
                pass
        except BaseException as exc:  # the waiter dies: fail what it would have completed
            self._die(exc)

    def _wait_one(self) -> bool:
        """Complete the next request; False at close. Its references go when this returns, so
        an idle waiter keeps no callback (or whatever the callback holds) alive."""
        item = self._queue.get()
        if item is None:
            return False
        event, done = item
        try:
            event.synchronize()
        except BaseException as exc:
            _call(done, exc)
            return True
        _call(done, None)
        return True

    def _die(self, cause: BaseException) -> None:
        err = OperationFailed(f"{threading.current_thread().name}, the CUDA event waiter, died: {cause!r}; "
                              "copies queued on it and later copies fail")
        err.__cause__ = cause
        pending = []
        with self._lock:
            self.broken = err
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item[1])
        for done in pending:
            _call(done, err)

    def close(self) -> None:
        with self._lock:
            if self.broken is None:
                self._queue.put(None)
        self._thread.join()


class CudaCopyEngine:
    """Host<->device copies on an H2D stream and a D2H stream, completed by CUDA events.

    A copy into device memory (from host or device) runs on the H2D stream, one into host memory
    on the D2H stream. ``after`` (a ``torch.cuda.Event``) makes the copy stream wait for it, so a
    copy of memory a compute stream is still writing starts once that write is done. Tensors are
    never ``record_stream``-ed: the caller keeps ``dst`` and ``src`` alive until ``done``.
    """

    name = "cuda streams"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._waiters = {
            self.h2d: _EventWaiter("pagemem-h2d"),
            self.d2h: _EventWaiter("pagemem-d2h"),
        }
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, done: CopyDone,
             after: torch.cuda.Event | None = None) -> None:
        stream = self.h2d if dst.is_cuda else self.d2h
        try:
            if after is not None and not isinstance(after, torch.cuda.Event):
                raise TypeError(f"after: the CUDA copy engine needs a torch.cuda.Event, got {type(after).__name__}")
            with self._lock, torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # a host wait sleeps instead of spinning a core
                event.record(stream)
                # enqueue under the lock so events reach the waiter in stream order
                self._waiters[stream].push(event, done)
        except Exception as exc:
            _call(done, exc)

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.close()
