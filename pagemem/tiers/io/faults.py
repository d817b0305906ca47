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
from typing import Literal

from pagemem.tiers.io.base import Done, IOEngine

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
        op = "write" if write else "read"
        kind = None
        with self._lock:
            for i, (fop, fkind) in enumerate(self._faults):
                if fop == op:
                    kind = fkind
                    del self._faults[i]
                    self.injected += 1
                    break
        if kind is None:
            self.inner.submit(write, fd, offset, buf, done)
        elif kind == "short":
            half = (len(buf) // 2) // 4096 * 4096
            if half:
                self.inner.submit(write, fd, offset, buf[:half], done)
            else:
                done(0)
        else:
            done(-_ERRNO[kind])

    def close(self) -> None:
        self.inner.close()
