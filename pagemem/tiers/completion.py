"""Completions that always arrive: callbacks run at most once, and a failure is delivered.

[Note: no operation is lost]
Page operations finish on threads nobody waits on (an I/O engine's reaper or pool, a copy
thread, a CUDA event waiter), through a chain of callbacks: engine -> tier -> store. An exception
raised on such a thread has no caller to reach, so if it is only logged, the operation it
belonged to never completes and every waiter (``MoveHandle.wait``, ``close()``) blocks forever.
So, at every hop:

- a thread's own work (a syscall, a checksum, a copy, its loop) is wrapped: its exception is
  delivered to the request's callback as the request's error (the tier turns it into a
  ``TierIOError`` for the disk, an ``OperationFailed`` otherwise, the cause chained);
- a callback that raises is called once more with its own exception (``deliver``): the request
  completes with that error; only if that raises too is it logged;
- the store wraps every callback it hands down in ``Once``: it runs at most once (so a second
  delivery is harmless), and if it raises its ``fallback`` completes the operation with the
  error;
- a thread that dies (its loop raised) marks its engine broken: everything queued on it and
  every later request fails with that error at once, so a dead thread never makes later
  operations hang.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from pagemem.errors import OperationFailed, PageMemError

_log = logging.getLogger("pagemem")


def as_pagemem_error(exc: BaseException, what: str) -> PageMemError:
    """``exc`` itself when it is a PageMemError, else an OperationFailed naming ``what`` with
    ``exc`` chained."""
    if isinstance(exc, PageMemError):
        return exc
    err = OperationFailed(f"{what} failed: {exc!r}")
    err.__cause__ = exc
    return err


def deliver(done: Callable[[Any], None], result: Any, what: str) -> None:
    """Call ``done(result)``; if it raises, call ``done`` once more with that exception (as an
    OperationFailed naming ``what``) so its operation completes with it; if that raises too,
    log it. Never raises: it runs on threads nobody waits on."""
    try:
        done(result)
        return
    except BaseException as exc:
        failure = as_pagemem_error(exc, what)
    try:
        done(failure)
    except BaseException:
        _log.exception("%s: its completion callback failed twice; the error was: %r", what, failure)


class Once:
    """A callback that runs at most once. If it raises, ``fallback(exc)`` runs (it must complete
    the operation with that error); later calls do nothing."""

    __slots__ = ("_fn", "_fallback", "_lock", "_called")

    def __init__(self, fn: Callable[[Any], None], fallback: Callable[[BaseException], None]) -> None:
        self._fn = fn
        self._fallback = fallback
        self._lock = threading.Lock()
        self._called = False

    def __call__(self, result: Any) -> None:
        with self._lock:
            if self._called:
                return
            self._called = True
        fn, fallback = self._fn, self._fallback
        self._fn = self._fallback = None  # drop what the request referenced once it completed
        try:
            fn(result)
        except BaseException as exc:
            try:
                fallback(exc)
            except BaseException:
                _log.exception("a completion's fallback failed; the callback had raised %r", exc)

    @property
    def called(self) -> bool:
        return self._called
