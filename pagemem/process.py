"""Which process an engine, a store and their parts belong to.

[Note: an engine belongs to its process]
``os.fork()`` copies a process's memory but only the thread that called it: a forked child gets
the engine's and the store's objects, but not the threads that drive them (the I/O reaper, the
copy and update workers, the lock-free updater), nor the Linux AIO context (the kernel does not
copy it), nor CUDA; a lock another thread held at the fork stays held in the child forever. And
it gets every ``weakref.finalize`` of the parent, which runs at the child's exit, at its garbage
collection, at ``del engine``: closing the store there would join threads that do not exist,
take locks copied held, destroy an AIO context that is not the child's, unpin memory, and delete
the page files the parent is still training on.

So an engine and its store belong to the process that made them (``owner_pid``):

- every public call into an ``Engine`` or ``PageStore`` (and a ``MoveHandle``'s ``wait``, a
  ``Lease``'s ``release``, a read of a guarded parameter or gradient handle, a backward through
  the engine's graph) starts with :func:`require_owner`, which in any other process raises
  :class:`pagemem.errors.WrongProcess` at once, before any lock is taken (a lock may have been
  copied held), saying to make a new engine or store in this process;
- every finalizer in pagemem is :func:`finalize`'s, which runs its function only in the process
  that registered it: in a child, exit, atexit, ``del`` and ``gc.collect()`` release nothing of
  the parent's (its files, fds, AIO context, pinned memory, threads);
- a child closes at once its copies of the parent's page files' descriptors (``pagefile.py``), so
  the parent's files live and die with the parent (the sweeper of dead owners' files then finds
  them unlocked), and the child never holds them open;
- the op clock's hooks fall silent in a child (``tracer/clock.py``), and the errors come from the
  engine's checks.

Leaving a ``with`` block of an engine, store or lease by an exception in a child (a ``SystemExit``
from ``sys.exit`` in a child forked inside the block) does nothing: the exception goes on. A new
engine or store made in the child is the child's own and works as any other.

The owner is recorded as the process id at construction; :func:`current_pid` is this process's
id, kept by an ``os.register_at_fork`` hook (``os.fork``, ``multiprocessing``'s fork and
forkserver contexts and DataLoader workers all run it), so a check is a comparison, not a system
call. The finalizers compare with ``os.getpid()`` itself.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

from pagemem.errors import WrongProcess

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """This process's id (what an object made now records as its owner)."""
    return _pid


def is_owner(owner_pid: int) -> bool:
    """True in the process whose id is ``owner_pid``."""
    return owner_pid == _pid


def require_owner(what: str, owner_pid: int) -> None:
    """Raise :class:`WrongProcess` for ``what`` (the call) unless this is process ``owner_pid``
    (see the Note). Takes no lock."""
    if owner_pid != _pid:
        raise WrongProcess(what, owner_pid, _pid)


def finalize(obj: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> weakref.finalize:
    """``weakref.finalize(obj, fn, *args, **kwargs)`` whose ``fn`` runs only in this process:
    called in a forked child (at its exit, its garbage collection, or by hand) it does nothing."""
    return weakref.finalize(obj, _in_owner, os.getpid(), fn, *args, **kwargs)


def _in_owner(pid: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    if os.getpid() != pid:
        return None
    return fn(*args, **kwargs)
