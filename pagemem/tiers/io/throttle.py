"""A bandwidth cap on an I/O engine: a testing knob that makes a fast disk behave like a slower SSD.

``StoreConfig(nvme_bandwidth=...)`` wraps the nvme tier's engine in ``ThrottledEngine``: every
request really goes to the disk at once, but its completion is delivered no earlier than a
device of that bandwidth (reads and writes sharing it, one after another) would have finished
it. Benchmarks use it to put the SSD where a paper's server has it relative to the other links
(ANGEL-PTM's A100 server: about 10x slower than PCIe); see ``benchmarks/bench_lockfree.py``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Sequence

from pagemem.tiers.completion import deliver
from pagemem.tiers.io.base import Done, IOEngine, Request


class ThrottledEngine(IOEngine):
    """Delivers ``inner``'s completions at ``bytes_per_s`` (see the module docs)."""

    def __init__(self, inner: IOEngine, bytes_per_s: int) -> None:
        self.inner = inner
        self.name = f"{inner.name}+{bytes_per_s >> 20}MiB/s"
        self.depth = inner.depth
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self._due: list[tuple[float, int, Done, Any]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pagemem-io-throttle", daemon=True)
        self._thread.start()

    def submit(self, write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        self.submit_many(write, [Request(fd, offset, buf, done)])

    def submit_many(self, write: bool, requests: Sequence[Request]) -> None:
        """Each request due after the ones before it, at the bandwidth; all handed on at once."""
        with self._cond:
            dues = []
            for r in requests:
                start = max(time.monotonic(), self._free_at)
                self._free_at = due = start + len(r.buf) / self.bytes_per_s
                dues.append(due)
        self.inner.submit_many(write, [r._replace(done=self._landed(due, r.done)) for r, due in zip(requests, dues)])

    def _landed(self, due: float, done: Done) -> Done:
        """A completion held until ``due``."""
        def landed(result: Any) -> None:
            with self._cond:
                heapq.heappush(self._due, (due, next(self._order), done, result))
                self._cond.notify()
        return landed

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._due and (self._closing or self._due[0][0] <= time.monotonic()):
                        _, _, done, result = heapq.heappop(self._due)
                        break
                    if self._closing and not self._due:
                        return
                    self._cond.wait(None if not self._due else max(0.0, self._due[0][0] - time.monotonic()))
            deliver(done, result, "a throttled nvme request")

    def close(self) -> None:
        """Close the disk engine (its completions arrive), then deliver what is held at once."""
        try:
            self.inner.close()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify()
            self._thread.join()
