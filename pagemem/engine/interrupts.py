"""Ctrl-C held while the engine's own bookkeeping runs.

[Note: Ctrl-C inside the engine]
Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, so a Ctrl-C
can land half-way through an eviction (some parameters placeholders, the unit still marked
bound, and the next check of writes to parameters takes the NaN placeholders for a user's
write), half-way through putting up the gradient handles, or inside a page operation's start.
The engine's records would stay torn. So while the engine runs its own code (``shielded``
methods and ``shield()`` blocks), a SIGINT is *held*: the handler notes it, and the outermost
shielded block raises ``KeyboardInterrupt`` as it ends, with the engine's state whole. The user's
code (the model's forward, the loss, hooks) is never shielded, and a second Ctrl-C while one is
held raises at once (a way out of anything that hangs). The handler is installed while an
engine is open, from the main thread, over Python's default handler only (a handler of the
user's or a framework's is left alone, and then nothing is held).
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_main = threading.main_thread()
_state = {"depth": 0, "held": False, "engines": 0}
_installed: list[Any] = []


def _handler(signum: int, frame: Any) -> None:
    if _state["depth"] and not _state["held"]:
        _state["held"] = True
        return
    _state["held"] = False
    raise KeyboardInterrupt


class shield:
    """``with shield():`` holds a Ctrl-C until the outermost block ends (see the Note)."""

    __slots__ = ("_on",)

    def __enter__(self) -> None:
        self._on = threading.current_thread() is _main
        if self._on:
            _state["depth"] += 1

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if not self._on:
            return
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["held"]:
            _state["held"] = False
            if exc is None:
                raise KeyboardInterrupt
            exc.add_note("pagemem: a Ctrl-C arrived meanwhile and was dropped for this error")


def shielded(fn: F) -> F:
    """A method whose body runs under ``shield()``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with shield():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def install() -> None:
    """An engine opens: hold Ctrl-C inside shielded code from now on (main thread only)."""
    if threading.current_thread() is not _main:
        return
    _state["engines"] += 1
    if _state["engines"] == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)
        _installed.append(True)


def uninstall() -> None:
    """An engine closed: the last one puts Python's default handler back."""
    if threading.current_thread() is not _main or not _state["engines"]:
        return
    _state["engines"] -= 1
    if not _state["engines"] and _installed:
        _installed.clear()
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
