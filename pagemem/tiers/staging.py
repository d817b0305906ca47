"""Staging pages: a small pinned host pool that bounces gpu<->nvme moves and nvme reads/writes
done on behalf of callers. Requests are served first-come first-served, all-or-nothing, so a
caller never holds some buffers while waiting for more: no deadlock, no starvation."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from pagemem.tiers.arena import HostArena, HostBuffer


class StagingPool:
    """``pages`` host buffers of ``page_bytes`` each, pinned when CUDA is present."""

    def __init__(self, pages: int, page_bytes: int, pin: bool) -> None:
        self.page_bytes = page_bytes
        self.arena = HostArena(pages * page_bytes, pin)
        self.capacity = pages
        self._free = [self.arena.buffer(i * page_bytes, page_bytes) for i in range(pages)]
        self._waiters: deque[tuple[int, Callable[[list[HostBuffer]], None]]] = deque()
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, count: int, then: Callable[[list[HostBuffer]], None]) -> None:
        """Call ``then(buffers)`` once ``count`` buffers are free (now, or when they are released)."""
        if self._closed:
            raise RuntimeError("the staging pool is closed")
        if not 1 <= count <= self.capacity:
            raise ValueError(f"can take 1..{self.capacity} staging pages at once, asked for {count}")
        with self._lock:
            if self._waiters or len(self._free) < count:
                self._waiters.append((count, then))
                return
            bufs = self._take(count)
        then(bufs)

    def acquire_blocking(self, count: int) -> list[HostBuffer]:
        """Wait until ``count`` buffers are free and take them."""
        got: list[list[HostBuffer]] = []
        ready = threading.Event()

        def then(bufs: list[HostBuffer]) -> None:
            got.append(bufs)
            ready.set()

        self.acquire(count, then)
        ready.wait()
        return got[0]

    def release(self, bufs: list[HostBuffer]) -> None:
        """Give buffers back and serve waiters in order."""
        served = []
        with self._lock:
            if self._closed:
                return
            self._free.extend(bufs)
            while self._waiters and len(self._free) >= self._waiters[0][0]:
                count, then = self._waiters.popleft()
                served.append((then, self._take(count)))
        for then, got in served:  # one waiter's failure must not starve the others
            try:
                then(got)
            except BaseException:  # a waiter's ``then`` must complete its own operation
                logging.getLogger("pagemem").exception("a staging waiter's callback raised")

    def _take(self, count: int) -> list[HostBuffer]:
        bufs = self._free[-count:]
        del self._free[-count:]
        return bufs

    @property
    def free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Give the pool's memory back now (buffers still held read zeros). Idempotent."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._waiters.clear()
        self.arena.close()
