"""The ``nvme`` tier: page slots at fixed offsets in preallocated files, read and written by an
I/O engine, every page checksummed on write and verified on read."""

from __future__ import annotations

import errno
import threading

from pagemem.errors import ConfigError, CorruptPage, PageMemError, TierIOError
from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.base import PageDone, Tier
from pagemem.tiers.checksum import NAME as CHECKSUM_NAME
from pagemem.tiers.checksum import page_checksum
from pagemem.tiers.fence import Fence
from pagemem.tiers.freelist import SlotFreeList
from pagemem.tiers.io.base import Done, EngineUnavailable, Request, make_engine
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


MAX_REQUEST_BYTES = 4 << 20
"""The most one I/O request of a run carries: big enough that the submitting thread's Python is
per run for small pages, small enough that a run's pages land in several requests the disk
serves in parallel; at the default 4 MiB page, one page per request, as before."""


class _Gather:
    """Calls ``done`` once every one of ``pieces`` requests has completed: with the first error,
    or None. A piece that completes again (a second delivery, [Note: no operation is lost]) is
    ignored."""

    __slots__ = ("_left", "_seen", "_error", "_done", "_lock")

    def __init__(self, pieces: int, done: PageDone) -> None:
        self._left, self._seen, self._error, self._done = pieces, bytearray(pieces), None, done
        self._lock = threading.Lock()

    def has(self, k: int) -> bool:
        return bool(self._seen[k])

    def piece(self, k: int, error: BaseException | None) -> None:
        with self._lock:
            if self._seen[k]:
                return
            self._seen[k] = 1
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            done, self._done = self._done, None
            done(self._error)


class NvmeTier(Tier):
    """Page slots striped over one file per directory in ``paths``.

    [Note: runs of pages in one request]
    A move of adjacent slots between the cpu tier and this one is one call
    (``start_read_span`` / ``start_write_span``, ``Mover.transfer``): the slots adjacent in one
    file go in one request of up to ``MAX_REQUEST_BYTES`` (with one file, a whole run), all the
    run's requests in one ``submit_many`` (aio: one ``io_submit``), each page still checksummed
    alone. Per page, the submitting thread did the Python of a request, a completion and the
    store's bookkeeping while holding the GIL, which the compute thread needs too (issue 33: most
    of the updating thread's GIL time). A request that fails fails its whole run: a write marks
    its slots torn and the store keeps every page of the run at its source (still valid); a read
    leaves every page of the run where it was.
    """

    host_spans = True

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
        """Write ``src`` to ``slot``: ``start_write_span`` of one slot. ``after`` is ignored:
        ``src`` is host memory."""
        self.start_write_span(slot, 1, src, done)

    def start_read(self, slot: int, into: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        """Read ``slot`` into ``into``: ``start_read_span`` of one slot. ``after`` is ignored."""
        self.start_read_span(slot, 1, into, done)

    def start_write_span(self, first: int, count: int, src: HostBuffer, done: PageDone) -> None:
        """Write the host buffer ``src`` (``count`` pages) to the adjacent slots from ``first``,
        each page checksummed ([Note: runs of pages in one request]). A request that fails
        (error or short) marks its slots torn until a later write succeeds or they are released;
        ``done`` gets the first error. Any exception while writing or completing is ``done``'s
        error ([Note: no operation is lost])."""
        pb = self.page_bytes
        try:
            digests = [page_checksum(src.view[i * pb:(i + 1) * pb]) for i in range(count)] if self.checksums \
                else [0] * count
        except BaseException as exc:  # nothing was written: the slots are unchanged, not torn
            f, offset = self.locate(first)
            done(self._raised("write", first, f, offset, "computing its checksum", exc))
            return
        pieces = self._pieces(first, count, [True] * count)
        gather = _Gather(len(pieces), done)

        def complete_for(k: int, s0: int, n: int, f: PageFile, offset: int) -> Done:
            def complete(res: int | BaseException) -> None:
                if gather.has(k):
                    return
                if res == n * pb:
                    for s in range(s0, s0 + n):
                        self._digest[s] = digests[s - first]
                        self._torn[s] = 0
                    gather.piece(k, None)
                else:
                    for s in range(s0, s0 + n):
                        self._torn[s] = 1
                    gather.piece(k, self._error("write", s0, f, offset, res, n))
            return complete

        self._submit(True, gather, [Request(f.fd, offset, src.view[(s0 - first) * pb:(s0 - first + n) * pb],
                                            complete_for(k, s0, n, f, offset))
                                    for k, (s0, n, f, offset) in enumerate(pieces)])

    def start_read_span(self, first: int, count: int, into: HostBuffer, done: PageDone) -> None:
        """Read the adjacent slots from ``first`` into the host buffer ``into`` (``count`` pages),
        verifying each page's checksum ([Note: runs of pages in one request]). A torn slot (its
        last write failed) reports TornSlot, a CorruptPage, without touching ``into``; a slot
        never written reads as zeros without touching the disk. ``done`` gets the first error.
        Any exception while reading or verifying is ``done``'s error ([Note: no operation is lost])."""
        pb = self.page_bytes
        for s in range(first, first + count):
            if self._torn[s]:
                f, offset = self.locate(s)
                done(TornSlot("nvme", s, f"{f.path} at offset {offset}"))
                return
        expected = self._digest[first:first + count]
        written = [e is not None for e in expected]
        for i in range(count):
            if not written[i]:
                into.tensor[i * pb:(i + 1) * pb].zero_()
        pieces = self._pieces(first, count, written)
        if not pieces:
            done(None)
            return
        gather = _Gather(len(pieces), done)

        def complete_for(k: int, s0: int, n: int, f: PageFile, offset: int) -> Done:
            def complete(res: int | BaseException) -> None:
                if gather.has(k):
                    return
                if res != n * pb:
                    gather.piece(k, self._error("read", s0, f, offset, res, n))
                    return
                if self.checksums:
                    for s in range(s0, s0 + n):
                        i = s - first
                        try:
                            actual = page_checksum(into.view[i * pb:(i + 1) * pb])
                        except BaseException as exc:
                            gather.piece(k, self._raised("read", s, *self.locate(s), "verifying its checksum", exc))
                            return
                        if actual != expected[i]:
                            f_s, off_s = self.locate(s)
                            gather.piece(k, CorruptPage("nvme", s, expected[i], actual, f"{f_s.path} at offset {off_s}"))
                            return
                gather.piece(k, None)
            return complete

        self._submit(False, gather, [Request(f.fd, offset, into.view[(s0 - first) * pb:(s0 - first + n) * pb],
                                             complete_for(k, s0, n, f, offset))
                                     for k, (s0, n, f, offset) in enumerate(pieces)])

    def _submit(self, write: bool, gather: "_Gather", requests: list[Request]) -> None:
        """Hand a span's requests to the engine. Where it refuses them all (it raises only when
        none started: ``IOEngine.submit_many``), the span completes with that error; pieces a
        wrapper already completed keep their outcome, and nothing was written or read."""
        try:
            self.engine.submit_many(write, requests)
        except Exception as exc:
            for k in range(len(requests)):
                gather.piece(k, exc)

    def _pieces(self, first: int, count: int, wanted: list[bool]) -> list[tuple[int, int, PageFile, int]]:
        """The requests for the ``wanted`` slots of ``first .. first + count - 1``: ``(first slot,
        slots, file, offset)``, each a run adjacent in one file of at most ``MAX_REQUEST_BYTES``."""
        most = max(1, MAX_REQUEST_BYTES // self.page_bytes)
        out: list[tuple[int, int, PageFile, int]] = []
        for s in range(first, first + count):
            if not wanted[s - first]:
                continue
            f, offset = self.locate(s)
            if out:
                s0, n, f0, off0 = out[-1]
                if f0 is f and s0 + n == s and off0 + n * self.page_bytes == offset and n < most:
                    out[-1] = (s0, n + 1, f0, off0)
                    continue
            out.append((s, 1, f, offset))
        return out

    def _raised(self, op: str, slot: int, f: PageFile, offset: int, step: str,
                exc: BaseException) -> TierIOError:
        """The TierIOError of a request whose ``step`` raised ``exc`` (chained)."""
        keep = "the source copy is unchanged and still readable" if op == "write" else \
            "the page stays where it was"
        err = TierIOError(f"nvme {op} of slot {slot} ({f.path} at offset {offset}) failed: {step} "
                          f"raised {exc!r}; {keep}", errno.EIO)
        err.__cause__ = exc
        return err

    def _error(self, op: str, slot: int, f: PageFile, offset: int, n: int | BaseException,
               slots: int = 1) -> TierIOError:
        what = f"nvme {op} of slot {slot} ({f.path} at offset {offset})" if slots == 1 else \
            f"nvme {op} of slots {slot}-{slot + slots - 1} ({f.path} at offset {offset}, {slots} pages)"
        if isinstance(n, BaseException):  # the engine's code raised, or its thread died
            return self._raised(op, slot, f, offset, "the I/O engine", n)  # (names the run's first slot)
        if n < 0:
            reason = _errname(-n)
            code = -n
        else:
            reason = f"short {op}: {n} of {slots * self.page_bytes} bytes"
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
