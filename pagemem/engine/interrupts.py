"""Signals held while the engine's own bookkeeping runs.

[Note: Ctrl-C inside the engine]
Python runs a signal's handler between any two bytecodes of the main thread, and a handler may
raise: Ctrl-C raises ``KeyboardInterrupt``, and a SIGTERM handler that calls ``sys.exit`` raises
``SystemExit``. Landing half-way through an eviction (some parameters placeholders, the unit
still marked bound), half-way through putting up the gradient handles, between a lease taken
and its release, or inside a page operation's start, that exception would leave the engine's
records torn, and what the cleanup then raised ("page pinned by an open lease") would replace
it. So while the engine runs its own code (``shielded`` methods and ``shield()`` blocks) every
signal whose handler is Python code is *held*: the engine's handler notes it, and the
outermost shielded block runs the user's handler as it ends, with the engine's state whole
(its exception then propagates as itself; one raised meanwhile is its ``__context__``). The
user's code (the model's forward, the loss, hooks) is never shielded, and a second signal of
the same kind while one is held runs its handler at once (a way out of anything that hangs).

Which signals: SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2, whichever have a Python
handler (Python's default Ctrl-C handler included; a default or ignored disposition is the
kernel's and untouched). Not SIGALRM: a watchdog's timer must fire inside a hang. The engine's
handler wraps the user's (``signal.getsignal`` shows the wrapper, whose ``inner`` is theirs):
wrapped while an engine is open, at the start of each outermost shielded block (a handler set
after the engine opened is wrapped then), unwrapped when the last engine closes. Only the main
thread runs handlers; a shield on another thread holds nothing and needs nothing held.
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_main = threading.main_thread()
HELD_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))
"""The signals held inside the engine (see the Note)."""

try:  # the C function: signal.getsignal converts its answer to an enum, a cost at every engine call
    from _signal import getsignal as _getsignal
except ImportError:  # pragma: no cover - not CPython
    _getsignal = signal.getsignal

_state = {"depth": 0, "engines": 0}
_pending: dict[int, tuple[Callable[..., Any], Any]] = {}
"""Held signals, in arrival order: signal number -> (the user's handler, the frame it got)."""


class HeldHandler:
    """The engine's handler over a user's (``inner``): runs it at once outside the engine, and
    when the outermost shielded block ends inside it (see the Note)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, signum: int, frame: Any) -> Any:
        if _state["depth"]:
            if signum not in _pending:
                _pending[signum] = (self.inner, frame)
                return None
            del _pending[signum]  # the second while one is held: at once
        return self.inner(signum, frame)

    def __repr__(self) -> str:
        return f"HeldHandler({self.inner!r})"


def _wrap_handlers() -> None:
    for s in HELD_SIGNALS:
        h = _getsignal(s)
        if callable(h) and not isinstance(h, HeldHandler):
            signal.signal(s, HeldHandler(h))


def _run_held() -> None:
    """The outermost block ended: run each held handler, in arrival order (the first that raises
    ends it; the rest stay held for the next block's end)."""
    while _pending:
        signum = next(iter(_pending))
        inner, frame = _pending.pop(signum)
        inner(signum, frame)


class shield:
    """``with shield():`` holds signals until the outermost block ends (see the Note)."""

    __slots__ = ("_on",)

    def __enter__(self) -> None:
        self._on = threading.current_thread() is _main
        if self._on:
            if _state["depth"] == 0 and _state["engines"]:
                _wrap_handlers()
            _state["depth"] += 1

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if not self._on:
            return
        _state["depth"] -= 1
        if _state["depth"] == 0 and _pending:
            _run_held()


def signal_held() -> bool:
    """A signal arrived inside the engine and waits for the outermost shielded block to end (a
    long wait may give up early for it: ``ranks/collectives.py``)."""
    return bool(_pending)


def shielded(fn: F) -> F:
    """A method whose body runs under ``shield()``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with shield():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def install() -> None:
    """An engine opens: hold signals inside shielded code from now on (main thread only)."""
    if threading.current_thread() is not _main:
        return
    _state["engines"] += 1
    _wrap_handlers()


def uninstall() -> None:
    """An engine closed: the last one gives each signal its user's handler back."""
    if threading.current_thread() is not _main or not _state["engines"]:
        return
    _state["engines"] -= 1
    if not _state["engines"]:
        for s in HELD_SIGNALS:
            h = signal.getsignal(s)
            if isinstance(h, HeldHandler):
                signal.signal(s, h.inner)
