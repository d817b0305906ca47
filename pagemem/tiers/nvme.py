"""The ``nvme`` tier: page slots at fixed offsets in preallocated files, read and written by an
I/O engine, every page checksummed on write and verified on read."""

from __future__ import annotations

import errno
import mmap
import os
import uuid
import weakref

from pagemem.errors import ConfigError, CorruptPage, PageMemError, TierIOError
from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.base import PageDone, Tier
from pagemem.tiers.checksum import NAME as CHECKSUM_NAME
from pagemem.tiers.checksum import page_checksum
from pagemem.tiers.fence import Fence
from pagemem.tiers.freelist import SlotFreeList
from pagemem.tiers.io.base import EngineUnavailable, make_engine
from pagemem.machine import disk_free
from pagemem.units import format_bytes

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _errname(code: int) -> str:
    return f"{errno.errorcode.get(code, 'E?')} ({os.strerror(code)})"


class TornSlot(CorruptPage):
    """A page whose last write failed: the bytes on disk may be partial, so they are never
    returned. ``expected`` and ``actual`` are None (nothing was read or compared)."""

    def __init__(self, tier: str, slot: int, where: str = "") -> None:
        self.tier = tier
        self.slot = slot
        self.expected = None
        self.actual = None
        loc = f" ({where})" if where else ""
        PageMemError.__init__(
            self,
            f"corrupt page in tier {tier!r} slot {slot}{loc}: the last write to this slot failed, "
            "so its bytes on disk may be partial; the data was not returned")


class PageFile:
    """One preallocated file of ``nbytes``, mode 0600, opened with O_DIRECT when supported."""

    def __init__(self, directory: str, nbytes: int, direct: bool) -> None:
        self.path = os.path.join(directory, f"pagemem-{os.getpid()}-{uuid.uuid4().hex[:12]}.pages")
        self.nbytes = nbytes
        available, _fs = disk_free(directory)
        if nbytes > available:
            raise TierIOError(
                f"nvme: cannot preallocate {format_bytes(nbytes)} in {directory}: only "
                f"{format_bytes(available)} free ({_errname(errno.ENOSPC)})", errno.ENOSPC)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fds = [fd]
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fds)
        try:
            _preallocate(fd, nbytes, self.path)
        except BaseException:
            self.close()
            raise
        self.direct = False
        self.fd = fd
        if direct and _O_DIRECT:
            dfd = _open_direct(self.path)
            if dfd is not None:
                self._fds.append(dfd)
                self.fd = dfd
                self.direct = True

    def close(self) -> None:
        """Close and delete the file (also done at garbage collection and interpreter exit)."""
        self._finalizer()


def _remove(path: str, fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, nbytes)  # filesystem without fallocate: a sparse file
            return
        raise TierIOError(
            f"nvme: cannot preallocate {format_bytes(nbytes)} for {path}: {_errname(exc.errno or errno.EIO)}",
            exc.errno) from exc


def _open_direct(path: str) -> int | None:
    """Open ``path`` with O_DIRECT and prove an aligned read works; None if unsupported."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return None
    probe = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [probe], 0)
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.close()
    return fd


def slots_per_file(capacity: int, files: int) -> int:
    """Slots in each page file when ``capacity`` slots are striped over ``files`` files."""
    return -(-capacity // files) if files else 0


class NvmeTier(Tier):
    """Page slots striped over one file per directory in ``paths``."""

    HOST_BYTES_PER_SLOT = SlotFreeList.HOST_BYTES_PER_SLOT + 8 + 1
    """Host memory per slot: the free list's, a checksum reference and a torn flag."""

    def __init__(self, paths: tuple[str, ...], capacity: int, page_bytes: int, *,
                 engine: str, io_depth: int, direct: bool, checksums: bool) -> None:
        super().__init__("nvme", capacity, page_bytes)
        per_file = slots_per_file(capacity, len(paths))
        self.files: list[PageFile] = []
        try:
            for directory in paths:
                self.files.append(PageFile(directory, per_file * page_bytes, direct))
        except BaseException:
            for f in self.files:
                f.close()
            raise
        self.direct = bool(self.files) and all(f.direct for f in self.files)
        try:
            self.engine, self.engine_reason = make_engine(engine, io_depth, self.direct or not self.files)
        except EngineUnavailable as exc:
            for f in self.files:
                f.close()
            raise ConfigError(f"io_engine: {exc}") from exc
        self.checksums = checksums
        self._digest: list[int | None] = [None] * capacity
        """Checksum of what each slot holds; None for a slot never written (it reads as zeros)."""
        self._torn = bytearray(capacity)
        """1 for a slot whose last write failed: its bytes on disk may be partial."""

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def locate(self, slot: int) -> tuple[PageFile, int]:
        """The file and byte offset holding ``slot``."""
        n = len(self.files)
        return self.files[slot % n], (slot // n) * self.page_bytes

    def release(self, slots: list[int], fence: Fence | None = None) -> None:
        super().release(slots, fence)
        for s in slots:
            self._digest[s] = None
            self._torn[s] = 0

    def digest(self, slot: int) -> int | None:
        """The XXH3-64 checksum of what ``slot`` holds (None: never written, or checksums off)."""
        return self._digest[slot] if self.checksums else None

    def is_torn(self, slot: int) -> bool:
        """True when the last write to ``slot`` failed, so reading it reports CorruptPage."""
        return bool(self._torn[slot])

    def start_write(self, slot: int, src: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        """Write ``src`` to ``slot``. If the write fails (error or short), the slot is marked torn
        until a later write succeeds or it is released. ``after`` is ignored: ``src`` is host memory."""
        digest = page_checksum(src.view) if self.checksums else 0
        f, offset = self.locate(slot)

        def complete(n: int) -> None:
            if n == self.page_bytes:
                self._digest[slot] = digest
                self._torn[slot] = 0
                done(None)
            else:
                self._torn[slot] = 1
                done(self._error("write", slot, f, offset, n))

        self.engine.submit(True, f.fd, offset, src.view, complete)

    def start_read(self, slot: int, into: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        """Read ``slot`` into ``into``, verifying its checksum. A torn slot (last write failed)
        reports TornSlot, a CorruptPage, without touching ``into``. ``after`` is ignored."""
        if self._torn[slot]:
            f, offset = self.locate(slot)
            done(TornSlot("nvme", slot, f"{f.path} at offset {offset}"))
            return
        expected = self._digest[slot]
        if expected is None:  # never written: reads as zeros without touching the disk
            into.tensor.zero_()
            done(None)
            return
        f, offset = self.locate(slot)

        def complete(n: int) -> None:
            if n != self.page_bytes:
                done(self._error("read", slot, f, offset, n))
                return
            if self.checksums:
                actual = page_checksum(into.view)
                if actual != expected:
                    done(CorruptPage("nvme", slot, expected, actual, f"{f.path} at offset {offset}"))
                    return
            done(None)

        self.engine.submit(False, f.fd, offset, into.view, complete)

    def _error(self, op: str, slot: int, f: PageFile, offset: int, n: int) -> TierIOError:
        what = f"nvme {op} of slot {slot} ({f.path} at offset {offset})"
        if n < 0:
            reason = _errname(-n)
            code = -n
        else:
            reason = f"short {op}: {n} of {self.page_bytes} bytes"
            code = errno.EIO
        keep = "the source copy is unchanged and still readable" if op == "write" else \
            "the page stays where it was"
        return TierIOError(f"{what} failed: {reason}; {keep}", code)

    def describe(self) -> dict:
        return {
            "backend": "files",
            "files": self.paths,
            "io_engine": self.engine.name,
            "io_engine_reason": self.engine_reason,
            "io_depth": self.engine.depth,
            "o_direct": self.direct,
            "checksum": CHECKSUM_NAME if self.checksums else None,
        }

    def close(self) -> None:
        self.engine.close()
        for f in self.files:
            f.close()
