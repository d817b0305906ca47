"""Fault injection for the NVMe tier: wrap a real engine and make chosen requests fail.

For tests and for people checking how a training job survives a failing disk::

    nvme = store.tier("nvme")
    faults = FaultyEngine(nvme.engine); nvme.engine = faults
    faults.fail_next("write", "enospc")     # the next write reports ENOSPC
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from typing import Literal, Sequence

from pagemem.tiers.io.base import Done, IOEngine, Request

FaultKind = Literal["enospc", "eio", "short"]
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}


class FaultyEngine(IOEngine):
    """Passes requests to ``inner`` except those matching a queued fault.

    ``enospc`` and ``eio`` fail without touching the disk; ``short`` really transfers the first
    half of the buffer (rounded down to 4 KiB) and reports that count, as a short write would.
    """

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.name = f"{inner.name}+faults"
        self.depth = inner.depth
        self._faults: deque[tuple[str, str]] = deque()
        self._lock = threading.Lock()
        self.injected = 0

    def fail_next(self, op: Literal["read", "write"], kind: FaultKind, count: int = 1) -> None:
        """Make the next ``count`` requests of type ``op`` fail with ``kind``."""
        if op not in ("read", "write") or kind not in ("enospc", "eio", "short"):
            raise ValueError(f"unknown fault {op!r}/{kind!r}")
        with self._lock:
            self._faults.extend([(op, kind)] * count)

    def submit(self, write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        self.submit_many(write, [Request(fd, offset, buf, done)])

    def submit_many(self, write: bool, requests: Sequence[Request]) -> None:
        """A queued fault takes the next request of its kind (a run of pages is one request: the
        whole run fails); the others go on to ``inner`` together."""
        op = "write" if write else "read"
        passed: list[Request] = []
        for r in requests:
            kind = None
            with self._lock:
                for i, (fop, fkind) in enumerate(self._faults):
                    if fop == op:
                        kind = fkind
                        del self._faults[i]
                        self.injected += 1
                        break
            if kind is None:
                passed.append(r)
            elif kind == "short":
                half = (len(r.buf) // 2) // 4096 * 4096
                if half:
                    passed.append(r._replace(buf=r.buf[:half]))
                else:
                    r.done(0)
            else:
                r.done(-_ERRNO[kind])
        if passed:
            self.inner.submit_many(write, passed)

    def close(self) -> None:
        self.inner.close()
