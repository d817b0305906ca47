"""Reading and writing tensor data (views and leases of it: ``pagemem.store.lending``).

Reads take each page from its nearest copy (gpu, then cpu, then nvme). Writes update every copy
of every page. Disk pages are written first, copy-on-write into fresh slots, and swapped in only
once every write has landed, so a failed disk write changes nothing. Two cases need no
copy-on-write: a page that never held data (nothing to lose), and a tier with no room for fresh
slots, where the pages are written in place; if such a write fails, the bytes on those pages are
*torn*: reads of them raise ``TornPage`` until they are written again (torn data is never
returned).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from pagemem.errors import InvalidRequest, TornPage
from pagemem.store.pages import Page, fastest
from pagemem.store.queue import OpQueue
from pagemem.store.tensor import PagedTensor
from pagemem.store.transfer import Mover
from pagemem.tiers import Tier, TierSet
from pagemem.tiers.arena import HostBuffer

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype in _QUANTIZED:
        raise InvalidRequest(f"dtype {dtype} is quantized (scale and zero point live outside the "
                             "bytes); store its int_repr() and the quantization parameters instead")
    return dtype


def source_bytes(t: PagedTensor, src: object, start: int | None = None) -> torch.Tensor:
    """``src`` as contiguous bytes for ``t`` (with ``start``: for its flat elements ``start ..``;
    ``src`` of any shape then), with conjugate and negative bits resolved."""
    if not isinstance(src, torch.Tensor):
        raise InvalidRequest(f"copy_ needs a torch.Tensor, got {type(src).__name__}")
    if src.is_quantized or src.layout != torch.strided or src.device.type == "meta":
        raise InvalidRequest(f"copy_: the source must be a dense strided tensor with data, got "
                             f"{src.layout} {src.dtype} on {src.device}")
    if start is None and (src.shape != t.shape or src.dtype != t.dtype):
        raise InvalidRequest(
            f"copy_: source is {tuple(src.shape)} {src.dtype}, tensor is {tuple(t.shape)} {t.dtype}")
    if start is not None:
        if src.dtype != t.dtype:
            raise InvalidRequest(f"write: source dtype {src.dtype} differs from the tensor's {t.dtype}")
        room = t.nbytes // t.dtype.itemsize - src.numel()
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= room:
            raise InvalidRequest(f"write: start must be an integer in [0, {room}] for {src.numel()} elements "
                                 f"into {t.nbytes // t.dtype.itemsize}, got {start!r}")
    src = src.detach().resolve_conj().resolve_neg().contiguous()
    return src.reshape(-1).view(torch.uint8) if src.numel() else torch.empty(0, dtype=torch.uint8)


class DataPath:
    def __init__(self, queue: OpQueue, mover: Mover, tiers: TierSet, page_bytes: int,
                 check: Callable[[PagedTensor], None]) -> None:
        self.queue = queue
        self.mover = mover
        self.tiers = tiers
        self.page_bytes = page_bytes
        self.check = check
        """Raises InvalidRequest for a freed tensor, another store's tensor, or a closed store."""
        self.closed = False
        self._followers: dict[int, dict[int, tuple[torch.Tensor, Tier]]] = {}
        """Read-only merged copies lent out, per tensor (see ``follow``)."""

    def follow(self, t: PagedTensor, key: int, merged: torch.Tensor, tier: Tier) -> None:
        """[Note: read-only merged copies follow writes] A read-only lease of a tensor whose
        pages are not adjacent lends a merged copy (``merged``: its bytes, uint8). An alias would
        see every later write to the tensor, so the copy does too: each write updates it as it
        updates the pages, until ``unfollow``. (A writable lease's copy is the writer's own: it
        is written back at release, and nothing writes into it meanwhile.) Caller holds the lock."""
        self._followers.setdefault(id(t), {})[key] = (merged, tier)

    def unfollow(self, t: PagedTensor, key: int) -> None:
        with self.queue.lock:
            mine = self._followers.get(id(t))
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self._followers[id(t)]

    def _exclusive(self, t: PagedTensor, fn):
        return self.queue.exclusive(t.page_refs, fn, lambda: self.check(t))

    # ------------------------------------------------------------------ reads

    def read(self, t: PagedTensor) -> torch.Tensor:
        def body() -> torch.Tensor:
            if t.nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            with self.queue.lock:
                self.check(t)
                refuse_torn(t)
                where = [(_nearest(page), lo, hi, pos) for page, lo, hi, pos in t.segments()]
            gpu = self.tiers.gpu
            on_device = self.tiers.cuda and all(w[0][0] is gpu for w in where)
            out = torch.empty(t.nbytes, dtype=torch.uint8, device=gpu.device if on_device else "cpu")
            disk = []
            for (tier, slot), lo, hi, pos in where:
                if tier.resident:
                    out[pos:pos + hi - lo].copy_(tier.buffer(slot)[lo:hi])
                else:
                    disk.append((slot, lo, hi, pos))
            self._sync_cuda([w[0][0] for w in where])

            def read_batch(_i: int, batch: list, bufs: list[HostBuffer]) -> None:
                self._io([(self.mover.fetch, self.tiers.nvme, slot, buf) for (slot, *_), buf in zip(batch, bufs)])
                for (_, lo, hi, pos), buf in zip(batch, bufs):
                    out[pos:pos + hi - lo].copy_(buf.tensor[lo:hi])

            self._staged(disk, read_batch)
            return out.view(t.dtype).view(t.shape)

        return self._exclusive(t, body)

    # ------------------------------------------------------------------ writes

    def write(self, t: PagedTensor, src: object, start: int | None = None) -> None:
        """``src`` into every copy of ``t``; with ``start``, into elements ``start ..`` of its
        flat elements only (``src`` of any shape, ``t``'s dtype)."""
        self.check(t)
        data = source_bytes(t, src, start)
        offset = (start or 0) * t.dtype.itemsize
        self.write_bytes(t, data, None if start is None else (offset, offset + data.numel()))

    def write_many(self, items: list[tuple]) -> None:
        """Each ``(t, src)``: ``src`` into every copy of ``t`` (``(t, src, start)``: into its flat
        elements from ``start`` on, as ``write``), all under one wait for the operations queued
        on their pages (a unit's parameters in one go: no copy of those pages starts in between)."""
        for t, *_ in items:
            self.check(t)
        writes = []
        for t, src, *rest in items:
            start = rest[0] if rest else None
            data = source_bytes(t, src, start)
            offset = (start or 0) * t.dtype.itemsize
            writes.append((t, data, None if start is None else (offset, offset + data.numel())))
        pages = list(dict.fromkeys(p for t, *_ in items for p in t.page_refs))

        def check() -> None:
            for t, *_ in items:
                self.check(t)

        def body() -> None:
            for t, data, span in writes:
                self._write_now([(t, span, 0)], data)

        self.queue.exclusive(pages, body, check)

    def write_packed(self, tensors: list[PagedTensor], src: torch.Tensor) -> None:
        """[Note: a packed write] ``src``'s elements, in order, into ``tensors`` (each its
        ``numel``, its dtype ``src``'s), every copy, under one wait for the operations queued on
        their pages, as ``write_many``. One source for all: where the tensors' bytes are
        adjacent in a memory tier's slots (a unit's parameters, allocated as a group, are), one
        copy per run of adjacent bytes instead of one per page and tensor; the per-page rules
        (disk copy-on-write, followers, mended tears) are ``write_many``'s."""
        for t in tensors:
            self.check(t)
        if not isinstance(src, torch.Tensor) or src.layout != torch.strided or src.is_quantized:
            raise InvalidRequest(f"write_packed: the source must be a dense strided tensor, got {type(src).__name__}")
        wrong = [t for t in tensors if t.dtype != src.dtype]
        if wrong or sum(t.nbytes for t in tensors) != src.numel() * src.element_size():
            raise InvalidRequest(f"write_packed: {src.numel()} {src.dtype} elements for tensors of "
                                 f"{sorted({str(t.dtype) for t in tensors})} holding "
                                 f"{sum(t.nbytes for t in tensors)} bytes")
        data = src.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        parts, base = [], 0
        for t in tensors:
            parts.append((t, None, base))
            base += t.nbytes
        pages = list(dict.fromkeys(p for t in tensors for p in t.page_refs))

        def check() -> None:
            for t in tensors:
                self.check(t)

        self.queue.exclusive(pages, lambda: self._write_now(parts, data), check)

    def write_bytes(self, t: PagedTensor, data, span: tuple[int, int] | None = None) -> None:
        """Write ``data`` (sliced by byte positions: a uint8 tensor, or ``lending.PieceBytes``) over the
        bytes ``span`` of ``t`` (all of them when None) in every copy."""
        self._exclusive(t, lambda: self._write_now([(t, span, 0)], data))

    def _write_now(self, parts: list[tuple[PagedTensor, tuple[int, int] | None, int]], data) -> None:
        """The writes' work, their pages held: each ``(t, span, base)`` writes ``data[base:]``
        over the bytes ``span`` of ``t`` (all of them when None)."""
        whole = isinstance(data, torch.Tensor)  # lending.PieceBytes is sliced within a page only
        with self.queue.lock:
            on_disk = len(parts) > 1 and any(not tier.resident for t, _s, _b in parts
                                             for page in t.page_refs for tier in page.copies())
        if on_disk:  # a disk page is written whole (copy-on-write): parts sharing one go one after the other
            for part in parts:
                self._write_now([part], data)
            return
        with self.queue.lock:
            segments, followers = [], []
            for t, span, base in parts:
                self.check(t)
                clipped = _clipped(t, span)
                segments += [(page, lo, hi, base + pos) for page, lo, hi, pos in clipped]
                first, last = span if span is not None else (0, t.nbytes)
                spans = [(0, last - first)] if whole else [(pos, pos + hi - lo) for _p, lo, hi, pos in clipped]
                followers += [(merged, tier, first, base, spans) for merged, tier in self._followers.get(id(t), {}).values()]
            disk, memory = [], []
            for page, lo, hi, pos in segments:
                for tier, slot in page.copies().items():
                    (memory if tier.resident else disk).append((page, tier, slot, lo, hi, pos))
        commit = self._write_disk(disk, data) if disk else None
        pb = self.page_bytes
        for tier, a, b, pos in _memory_runs(memory, pb, whole):
            first = a // pb
            tier.span(first, -(-b // pb) - first)[a - first * pb:b - first * pb].copy_(data[pos:pos + b - a])
        for merged, _tier, first, base, spans in followers:  # [Note: read-only merged copies follow writes]
            for x, y in spans:
                merged[first + x:first + y].copy_(data[base + x:base + y])
        self._sync_cuda([m[1] for m in memory] + [f[1] for f in followers])
        with self.queue.lock:
            if commit:
                commit()
            for page, lo, hi, _pos in segments:
                page.written = True
                page.mend(lo, hi)

    def _write_disk(self, segments: list, data: torch.Tensor) -> Callable[[], None]:
        """Write the disk pages of ``segments``: copy-on-write where it matters and there is room
        (raises, changing nothing, on failure), else in place (tearing the pages on failure).
        Returns what swaps the fresh slots in; call it under the lock."""
        nvme = self.tiers.nvme
        pb = self.page_bytes
        with self.queue.lock:
            protect = [s for s in segments if s[0].written]
            if len(protect) <= nvme.free_pages:
                fresh = nvme.allocate(len(protect))
                target = dict(zip((id(s) for s in protect), fresh))
            else:  # no room to protect them: write in place (see the module docs)
                fresh, target = [], {}
        issued_in_place: list[Page] = []

        def write_batch(_i: int, batch: list, bufs: list[HostBuffer]) -> None:
            reads = []  # a partial page keeps the rest of its bytes: read it first
            for (_page, _t, slot, lo, hi, _p), buf in zip(batch, bufs):
                if hi - lo == pb:
                    continue
                if nvme.is_torn(slot):
                    buf.tensor.zero_()  # the rest of a torn page is unknown: its ranges stay torn
                else:
                    reads.append((self.mover.fetch, nvme, slot, buf))
            self._io(reads)
            for (_page, _t, _slot, lo, hi, pos), buf in zip(batch, bufs):
                buf.tensor[lo:hi].copy_(data[pos:pos + hi - lo])
            writes = []
            for seg, buf in zip(batch, bufs):
                slot = target.get(id(seg), seg[2])
                if id(seg) not in target:
                    issued_in_place.append(seg[0])
                writes.append((self.mover.put, nvme, slot, buf))
            self._io(writes)

        try:
            self._staged(segments, write_batch)
        except BaseException:
            with self.queue.lock:
                nvme.release(fresh)
                for page in issued_in_place:
                    page.tear(pb)
            raise

        def commit() -> None:
            for seg in protect:
                if id(seg) not in target:  # written in place
                    continue
                page, old = seg[0], seg[2]
                new = target[id(seg)]
                nvme.release([old])
                if page.tier is nvme:
                    page.slot = new
                else:
                    page.replicas[nvme] = new

        return commit

    # ------------------------------------------------------------------ helpers

    def _staged(self, segments: list, body) -> None:
        """Call ``body(index, batch, staging buffers)`` over ``segments`` in staging-sized batches,
        giving the buffers back after each batch whatever happens."""
        staging = self.tiers.staging
        size = max(1, staging.capacity // 2)
        for i in range(0, len(segments), size):
            batch = segments[i:i + size]
            bufs = staging.acquire_blocking(len(batch))
            try:
                body(i, batch, bufs)
            finally:
                staging.release(bufs)

    @staticmethod
    def _io(calls: list) -> None:
        """Run page transfers ``fn(tier, slot, buf, done)`` concurrently; raise the first error."""
        if not calls:
            return
        lock = threading.Lock()
        left = [len(calls)]
        errors: list[BaseException] = []
        finished = threading.Event()

        def done(error: BaseException | None) -> None:
            with lock:
                if error is not None:
                    errors.append(error)
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        for fn, tier, slot, buf in calls:
            try:
                fn(tier, slot, buf, done)
            except Exception as exc:  # refused before it started: that request's error
                done(exc)
        finished.wait()
        if errors:
            raise errors[0]

    def _sync_cuda(self, tiers: list[Tier]) -> None:
        gpu = self.tiers.gpu
        if self.tiers.cuda and any(t is gpu for t in tiers):
            torch.cuda.current_stream(gpu.device).synchronize()


def _memory_runs(memory: list, page_bytes: int, merge: bool = True) -> list[tuple[Tier, int, int, int]]:
    """``(tier, first byte, end byte, position in the data)`` for the memory copies' segments,
    with ``merge`` adjacent ones (in the tier and in the data) merged: one copy each ([Note: a
    packed write])."""
    runs: list[list] = []
    last: dict[Tier, list] = {}
    for _page, tier, slot, lo, hi, pos in memory:
        a = slot * page_bytes + lo
        run = last.get(tier)
        if merge and run is not None and run[2] == a and run[3] + run[2] - run[1] == pos:
            run[2] = a + hi - lo
            continue
        last[tier] = run = [tier, a, a + hi - lo, pos]
        runs.append(run)
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _clipped(t: PagedTensor, span: tuple[int, int] | None) -> list[tuple[Page, int, int, int]]:
    """``t.segments()`` cut to the bytes ``span`` of ``t``, positions counted from its start."""
    if span is None:
        return list(t.segments())
    a, b = span
    out = []
    for page, lo, hi, pos in t.segments():
        first, last = max(pos, a), min(pos + hi - lo, b)
        if first < last:
            out.append((page, lo + first - pos, lo + last - pos, first - a))
    return out


def _nearest(page: Page) -> tuple[Tier, int]:
    """The copy to read: memory before disk, gpu before cpu."""
    copies = page.copies()
    tier = fastest(copies)
    return tier, copies[tier]


def copy_tiers(t: PagedTensor) -> list[str]:
    """Names of the tiers holding copies of ``t``'s pages (for error messages)."""
    return sorted({c.name for p in t.page_refs for c in p.copies()})


def refuse_torn(t: PagedTensor) -> None:
    for page, lo, hi, _pos in t.segments():
        if page.is_torn(lo, hi):
            raise TornPage(
                f"page {page.id} of this tensor lost its bytes when an in-place disk write failed "
                "(there was no room for copy-on-write); write the tensor again with copy_() before reading it")

