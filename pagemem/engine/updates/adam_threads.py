"""Worker threads for CPU optimizer work, each running torch with one intra-op thread.

Why one torch thread per worker: torch's fused CPU AdamW called once per 4 MiB page from one
thread with the default intra-op pool ran 3.4x slower than one call over the whole tensor on
this machine (an OpenMP fork/join per small call); with one torch thread in each of ``n``
workers, the page-by-page loop matched the single call (``/work/shared/notes/engine.md``).

``torch.set_num_threads`` is not per-thread alone: besides this thread's OpenMP setting it stores
a process-wide default that every thread which first uses torch afterwards picks up (measured on
torch 2.13: a worker's ``set_num_threads(1)`` left the main thread, and threads started later,
with one thread). So each worker first initialises its own torch threads, then sets one, and
the pool puts the process-wide default back once all workers are set.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

from pagemem.checks import check_int
from pagemem.errors import InvalidRequest, PageMemError

_STOP = object()


class WorkerDied(PageMemError, RuntimeError):
    """A worker thread ended without being asked to: its task, every queued task and every later
    submission fail with this error (the cause is chained)."""


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


class Workers:
    """``threads`` daemon threads taking callables from one FIFO queue; results come back as
    ``concurrent.futures.Future``. An ``Exception`` in a task fails only its future. Anything
    else that ends a worker (``SystemExit``, ``KeyboardInterrupt``, a bug in the loop) breaks the
    pool: the dying worker fails its task and every queued one with :class:`WorkerDied`, and later
    submissions raise it at once, so no caller waits on a future nobody will complete."""

    def __init__(self, threads: int | None = None, name: str = "pagemem-worker") -> None:
        self.threads = usable_cores() if threads is None else check_int("threads", threads, 1, 1024)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: WorkerDied | None = None
        self._closed = False
        default = torch.get_num_threads()  # initialises this thread's torch threads first
        ready = threading.Semaphore(0)
        self._workers = [threading.Thread(target=self._run, args=(ready,), name=f"{name}-{i}", daemon=True)
                         for i in range(self.threads)]
        for w in self._workers:
            w.start()
        for _ in self._workers:
            ready.acquire()
        torch.set_num_threads(default)  # the process-wide default the workers overwrote

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on a worker. Raises WorkerDied if the pool is broken and
        InvalidRequest once it is closed."""
        fut: Future = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._closed:
                raise InvalidRequest("the worker pool is closed")
            self._queue.put((fut, fn, args, kwargs))
        return fut

    @property
    def broken(self) -> WorkerDied | None:
        """The error that broke the pool, or None while every worker is alive."""
        return self._broken

    def close(self) -> None:
        """Run what is queued, then stop and join the workers. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._workers:
                    self._queue.put(_STOP)
        me = threading.current_thread()
        for w in self._workers:
            if w is not me:
                w.join()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the worker

    def _run(self, ready: threading.Semaphore) -> None:
        fut: Future | None = None
        try:
            try:
                torch.get_num_threads()  # initialise this thread's torch threads, then narrow them
                torch.set_num_threads(1)
            finally:
                ready.release()
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                fut, fn, args, kwargs = item
                if fut.set_running_or_notify_cancel():
                    try:
                        result = fn(*args, **kwargs)
                    except Exception as e:  # the task failed, the worker lives on
                        fut.set_exception(e)
                    else:
                        fut.set_result(result)
                # a finished task's arguments (views that pin pages) must not live on in this
                # frame until the next task arrives
                fut = item = fn = args = kwargs = result = None
        except BaseException as e:  # the worker itself ends: fail everything that waits on it
            self._die(e, fut)

    def _die(self, cause: BaseException, in_flight: Future | None) -> None:
        err = WorkerDied(f"{threading.current_thread().name} died: {cause!r}")
        err.__cause__ = cause
        with self._lock:
            if self._broken is None:
                self._broken = err
            stops = 0
            pending = [in_flight] if in_flight is not None else []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stops += 1
                else:
                    pending.append(item[0])
            for _ in range(stops):  # close() already asked the others to stop
                self._queue.put(_STOP)
        for f in pending:
            if not f.done():
                f.set_exception(err)
