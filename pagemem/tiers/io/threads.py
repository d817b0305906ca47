"""Thread-pool engine: ``os.preadv`` / ``os.pwritev`` (which release the GIL) on ``depth`` threads."""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

from pagemem.tiers.completion import deliver
from pagemem.tiers.io.base import Done, IOEngine


class ThreadEngine(IOEngine):
    """Portable fallback: works with or without O_DIRECT, on any POSIX filesystem."""

    name = "threads"

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="pagemem-io")

    def submit(self, write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        self._pool.submit(self._run, write, fd, offset, buf, done)

    @staticmethod
    def _run(write: bool, fd: int, offset: int, buf: memoryview, done: Done) -> None:
        # the pool drops its work item (and so ``buf`` and ``done``) as soon as this returns;
        # nothing may escape: the pool would keep it in a future nobody reads ([Note: no
        # operation is lost])
        n: int | BaseException
        try:
            n = os.pwritev(fd, [buf], offset) if write else os.preadv(fd, [buf], offset)
        except OSError as exc:
            n = -(exc.errno or errno.EIO)
        except BaseException as exc:  # not the disk's error (a MemoryError, a bad buffer)
            n = exc
        deliver(done, n, "a threads-engine request's completion")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
