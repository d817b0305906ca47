"""One call into an engine at a time, from any thread.

[Note: calls from several threads]
An engine's public calls are *serialised*: each holds the engine's call lock from its start to
its end, so a call from a second thread waits for the running one to end and then runs whole.
``state_dict()``, ``save()`` or ``close()`` from a checkpointing thread during ``step()``
therefore see every parameter before the update or every parameter after it, never a mix, and
two threads calling ``step()`` update once each, one after the other. The lock is re-entrant
for its thread (``step()`` calls ``optimizer.step()``, a state-dict hook reads weights inside
``state_dict()``); a forward holds it while the model's forward runs, since that is one call.

A step part-way is the exception: a backward that updated parameters as their gradients
became final (``overlap_update``) leaves the step half done until ``step()``; a state dict then
would mix the two, so a call from another thread is refused until that ``step()`` (the loop's
own thread may read the half-done step, as torch's optimizer-in-backward shows it).

A backward is the other exception. ``engine.backward(loss)`` is one call like the others, but its
gradient hooks may run on autograd's threads (one per device with CUDA) while the calling
thread waits, so hooks never take the lock (they belong to the backward that holds it). A
backward by habit (``loss.backward()``) is no call of the engine's: it holds the lock only to
begin and to end, and between the two the phase says a backward runs. A call from another
thread then is *refused* (``InvalidRequest`` naming the thread that runs the backward) rather
than left waiting: if that backward raised, only its own thread's next call finds it ([Note:
backward by habit]), so a wait could last for ever. A call from the thread that ran the forward
(or from any thread when no forward ran) finds a backward that raised, as before.

A state dict taken through the module's hooks (``model.state_dict()``) is one call too: its
outermost pre-hook takes every value at once under the lock, then lets go, so no lock is held
while other hooks (a user's, which may raise) run. A call made on the thread that runs a
backward, from inside it (a hook, autograd's end callback, a signal's handler run there), is
never taken for a backward that raised; reading weights there is refused only where that
backward may have updated some (``overlap_update``).

A signal's handler that calls into the engine (a SIGTERM handler calling ``save()``) runs on
the main thread when no shielded block runs there ([Note: Ctrl-C inside the engine]); if the
main thread is inside a call then, the lock is its own and the call goes in; if another thread
holds it, the handler waits for that call to end.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch

from pagemem.engine.interrupts import shield
from pagemem.errors import InvalidRequest
from pagemem.process import current_pid, require_owner

F = TypeVar("F", bound=Callable[..., Any])


class CallLock:
    """The engine's call lock: re-entrant per thread, knowing which call holds it (a hook of
    ``engine.backward`` on autograd's thread goes in without it)."""

    __slots__ = ("_lock", "_owner", "_depth", "_what", "loop_thread", "closed", "owner_pid")

    def __init__(self, owner_pid: int | None = None) -> None:
        """``owner_pid``: the process the engine belongs to; in any other (a forked child) every
        acquire raises ``WrongProcess`` before touching the lock, which a parent's thread may have
        held at the fork ([Note: an engine belongs to its process], ``pagemem/process.py``)."""
        self.owner_pid = current_pid() if owner_pid is None else owner_pid
        self._lock = threading.RLock()
        self._owner: threading.Thread | None = None
        self._depth = 0
        self._what: str | None = None
        self.loop_thread: threading.Thread | None = None
        """The thread that ran the last forward: the training loop's (see the Note)."""
        self.closed = False
        """Set once the engine closed: a hook still on its way in (``with lock``) is refused."""

    def __enter__(self) -> None:
        """``with lock``: the op clock's hooks, the guard's fetches and autograd's unpacking of
        saved parameters run under the call lock too, so a call from another thread lands
        between two of them, never inside one (see the Note)."""
        taken = self.acquire("a hook")
        if self.closed:
            if taken:
                self.release()
            raise InvalidRequest("this engine is closed (close() ran on another thread)")

    def __exit__(self, *exc: object) -> None:
        if self._owner is threading.current_thread():  # taken (a hook let in without it finds another owner)
            self.release()

    @contextmanager
    def held(self, what: str) -> Iterator[None]:
        """Hold the lock for the call ``what`` (waiting for another thread's call to end)."""
        taken = self.acquire(what)
        try:
            yield
        finally:
            if taken:
                self.release()

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """One public call ``what``: the lock held, the body shielded from signals ([Note: Ctrl-C
        inside the engine])."""
        with self.held(what), shield():
            yield

    def acquire(self, what: str) -> bool:
        """Hold the lock until :meth:`release` (a state dict taken by hooks: its pre-hook
        acquires, its post-hook releases). A call made inside a backward's autograd node (a hook
        on autograd's thread) while another thread's ``engine.backward`` holds the lock belongs to
        that backward: it goes in without the lock (False: nothing to release)."""
        require_owner(f"Engine: {what}", self.owner_pid)
        if not self._lock.acquire(blocking=False):
            if self._what == "backward" and torch._C._current_autograd_node() is not None:
                return False
            self._lock.acquire()
        if self._depth == 0:
            self._owner, self._what = threading.current_thread(), what
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = self._what = None
        self._lock.release()


def engine_call(what: str, *, shielded: bool = True) -> Callable[[F], F]:
    """A public method of the engine: one call at a time (the engine's ``calls`` lock), its body
    shielded from signals ([Note: Ctrl-C inside the engine]) unless ``shielded=False`` (a call
    that runs user code in between, shielding its own bookkeeping)."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not shielded:
                with self.calls.held(what):
                    return fn(self, *args, **kwargs)
            with self.calls.call(what):
                return fn(self, *args, **kwargs)
        return call  # type: ignore[return-value]
    return decorate
