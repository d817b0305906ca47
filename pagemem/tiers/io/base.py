"""The interface every NVMe I/O engine implements, and the choice between them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple, Sequence

from pagemem.tiers.completion import deliver

Done = Callable[["int | BaseException"], None]
"""Completion callback: bytes transferred, a negative errno, or the exception that stopped the
request (the engine's own code raised, or its thread died). Runs on an engine thread."""


class Request(NamedTuple):
    """One positional read or write of a whole host buffer (``submit``'s arguments)."""

    fd: int
    offset: int
    buf: memoryview
    done: Done


class EngineUnavailable(RuntimeError):
    """An I/O engine cannot run here; the message says why."""


class IOEngine(ABC):
    """Asynchronous positional reads and writes of whole buffers.

    ``submit`` never blocks on the disk: requests beyond ``depth`` in flight wait in a queue.
    ``done`` is called exactly once per request, from an engine thread (or from ``submit``'s
    caller when the request fails before reaching the disk); a ``done`` that raises is called
    once more with that exception (``tiers/completion.py``, [Note: no operation is lost]). An
    engine whose thread died is ``broken``: its queued and later requests complete with that
    error at once.
    """

    name: str
    depth: int
    broken: BaseException | None = None
    """The error that killed an engine thread, or None while the engine works."""

    @abstractmethod
    def submit(self, write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        """Start reading ``len(buf)`` bytes at ``offset`` into ``buf`` (or writing them from it)."""

    def submit_many(self, write: bool, requests: Sequence[Request]) -> None:
        """``submit`` each request, in order; each completes on its own ``done`` as ``submit``'s.
        Raises only when no request was started (as ``submit`` does, e.g. on a closed engine);
        once one has started, a request that cannot start completes on its ``done`` with the
        error, so a caller waiting for all of them is never left waiting. An engine that can hand
        the kernel several requests at once overrides it (aio: one ``io_submit``); this default
        submits them one by one."""
        for k, r in enumerate(requests):
            try:
                self.submit(write, r.fd, r.offset, r.buf, r.done)
            except Exception as exc:
                if k == 0:
                    raise
                for rest in requests[k:]:
                    deliver(rest.done, exc, "a request refused by its engine")
                return

    @abstractmethod
    def close(self) -> None:
        """Wait for requests in flight, then stop the engine's threads."""


def make_engine(name: str, depth: int, direct: bool) -> tuple[IOEngine, str]:
    """Build the engine ``name`` ("auto", "aio" or "threads"); return it and why it was chosen.

    "auto" takes Linux AIO when libaio loads and the files are opened with O_DIRECT (without
    O_DIRECT the kernel runs AIO synchronously inside io_submit), else the thread pool.
    Raises EngineUnavailable when "aio" is asked for and cannot run.
    """
    from pagemem.tiers.io.aio import AioEngine
    from pagemem.tiers.io.threads import ThreadEngine

    if name == "threads":
        return ThreadEngine(depth), "asked for"
    if not direct:
        if name == "aio":
            raise EngineUnavailable(
                "io_engine='aio' needs O_DIRECT (direct_io=True on a filesystem that supports it); "
                "without it Linux runs AIO synchronously"
            )
        return ThreadEngine(depth), "no O_DIRECT, so no asynchronous kernel AIO"
    try:
        return AioEngine(depth), "asked for" if name == "aio" else "libaio and O_DIRECT available"
    except EngineUnavailable as exc:
        if name == "aio":
            raise
        return ThreadEngine(depth), f"libaio unavailable ({exc})"
