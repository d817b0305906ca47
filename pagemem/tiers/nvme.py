"""The ``nvme`` tier: page slots at fixed offsets in preallocated files, read and written by an
I/O engine, every page checksummed on write and verified on read."""

from __future__ import annotations

import errno

from pagemem.errors import ConfigError, CorruptPage, PageMemError, TierIOError
from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.base import PageDone, Tier
from pagemem.tiers.checksum import NAME as CHECKSUM_NAME
from pagemem.tiers.checksum import page_checksum
from pagemem.tiers.fence import Fence
from pagemem.tiers.freelist import SlotFreeList
from pagemem.tiers.io.base import EngineUnavailable, make_engine
from pagemem.tiers.io.throttle import ThrottledEngine
from pagemem.tiers.pagefile import PageFile, errname as _errname

__all__ = ["NvmeTier", "PageFile", "TornSlot"]


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


def slots_per_file(capacity: int, files: int) -> int:
    """Slots in each page file when ``capacity`` slots are striped over ``files`` files."""
    return -(-capacity // files) if files else 0


class NvmeTier(Tier):
    """Page slots striped over one file per directory in ``paths``."""

    HOST_BYTES_PER_SLOT = SlotFreeList.HOST_BYTES_PER_SLOT + 8 + 1
    """Host memory per slot: the free list's, a checksum reference and a torn flag."""

    def __init__(self, paths: tuple[str, ...], capacity: int, page_bytes: int, *,
                 engine: str, io_depth: int, direct: bool, checksums: bool,
                 bandwidth: int | None = None) -> None:
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
            if bandwidth is not None:
                self.engine = ThrottledEngine(self.engine, bandwidth)
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
        until a later write succeeds or it is released. ``after`` is ignored: ``src`` is host memory.
        Any exception while writing or completing is ``done``'s error ([Note: no operation is lost])."""
        f, offset = self.locate(slot)
        try:
            digest = page_checksum(src.view) if self.checksums else 0
        except BaseException as exc:  # nothing was written: the slot is unchanged, not torn
            done(self._raised("write", slot, f, offset, "computing its checksum", exc))
            return

        def complete(n: int | BaseException) -> None:
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
        reports TornSlot, a CorruptPage, without touching ``into``. ``after`` is ignored. Any
        exception while reading or verifying is ``done``'s error ([Note: no operation is lost])."""
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

        def complete(n: int | BaseException) -> None:
            if n != self.page_bytes:
                done(self._error("read", slot, f, offset, n))
                return
            if self.checksums:
                try:
                    actual = page_checksum(into.view)
                except BaseException as exc:
                    done(self._raised("read", slot, f, offset, "verifying its checksum", exc))
                    return
                if actual != expected:
                    done(CorruptPage("nvme", slot, expected, actual, f"{f.path} at offset {offset}"))
                    return
            done(None)

        self.engine.submit(False, f.fd, offset, into.view, complete)

    def _raised(self, op: str, slot: int, f: PageFile, offset: int, step: str,
                exc: BaseException) -> TierIOError:
        """The TierIOError of a request whose ``step`` raised ``exc`` (chained)."""
        keep = "the source copy is unchanged and still readable" if op == "write" else \
            "the page stays where it was"
        err = TierIOError(f"nvme {op} of slot {slot} ({f.path} at offset {offset}) failed: {step} "
                          f"raised {exc!r}; {keep}", errno.EIO)
        err.__cause__ = exc
        return err

    def _error(self, op: str, slot: int, f: PageFile, offset: int, n: int | BaseException) -> TierIOError:
        what = f"nvme {op} of slot {slot} ({f.path} at offset {offset})"
        if isinstance(n, BaseException):  # the engine's code raised, or its thread died
            return self._raised(op, slot, f, offset, "the I/O engine", n)
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
            "direct_io": self.direct,
            "checksum": CHECKSUM_NAME if self.checksums else None,
        }

    def close(self) -> None:
        """Stop the I/O engine and delete the page files, the files even if stopping raised."""
        try:
            self.engine.close()
        finally:
            for f in self.files:
                f.close()
