"""Reading and writing tensor data, and lending it out as views and leases.

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
import weakref
from typing import Callable

import torch

from pagemem.errors import InvalidRequest, TornPage
from pagemem.store.lease import Lease
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


def source_bytes(t: PagedTensor, src: object) -> torch.Tensor:
    """``src`` as contiguous bytes for ``t``, with conjugate and negative bits resolved."""
    if not isinstance(src, torch.Tensor):
        raise InvalidRequest(f"copy_ needs a torch.Tensor, got {type(src).__name__}")
    if src.is_quantized or src.layout != torch.strided or src.device.type == "meta":
        raise InvalidRequest(f"copy_: the source must be a dense strided tensor with data, got "
                             f"{src.layout} {src.dtype} on {src.device}")
    if src.shape != t.shape or src.dtype != t.dtype:
        raise InvalidRequest(
            f"copy_: source is {tuple(src.shape)} {src.dtype}, tensor is {tuple(t.shape)} {t.dtype}")
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
        self.views = 0
        self.view_copies = 0
        self.closed = False

    def _exclusive(self, t: PagedTensor, fn):
        return self.queue.exclusive(t.page_refs, fn, lambda: self.check(t))

    # ------------------------------------------------------------------ reads

    def read(self, t: PagedTensor) -> torch.Tensor:
        def body() -> torch.Tensor:
            if t.nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            with self.queue.lock:
                self.check(t)
                _refuse_torn(t)
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

    def write(self, t: PagedTensor, src: object) -> None:
        self.check(t)
        data = source_bytes(t, src)

        def body() -> None:
            with self.queue.lock:
                self.check(t)
                disk, memory = [], []
                for page, lo, hi, pos in t.segments():
                    for tier, slot in page.copies().items():
                        (memory if tier.resident else disk).append((page, tier, slot, lo, hi, pos))
            commit = self._write_disk(disk, data) if disk else None
            for _page, tier, slot, lo, hi, pos in memory:
                tier.buffer(slot)[lo:hi].copy_(data[pos:pos + hi - lo])
            self._sync_cuda([m[1] for m in memory])
            with self.queue.lock:
                if commit:
                    commit()
                for page, lo, hi, _pos in t.segments():
                    page.written = True
                    page.mend(lo, hi)

        self._exclusive(t, body)

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

    # ------------------------------------------------------------------ views and leases

    def viewable(self, t: PagedTensor) -> bool:
        with self.queue.lock:
            self.check(t)
            return self._alias_tier(t, None) is not None and not any(p.intents for p in t.page_refs)

    def view(self, t: PagedTensor, tier_name: str | None = None) -> torch.Tensor:
        want = self._memory_tier(tier_name)

        def body() -> torch.Tensor:
            if t.nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            with self.queue.lock:
                self.check(t)
                tier = self._alias_tier(t, want)
                if tier is None:
                    raise InvalidRequest(
                        f"view(): the tensor's pages are not adjacent in one memory tier (tiers {_copy_tiers(t)}); "
                        "use to_torch() for a copy, lease() for a pinned copy, or move it to a memory tier first")
                _refuse_torn(t)
                alias = self._alias(t, tier, lifetime=True)
            return alias

        return self._exclusive(t, body)

    def lease_many(self, ts: list[PagedTensor], tier_name: str | None, write: bool) -> list[Lease]:
        """Leases of ``ts`` taken under one operation (one wait, one queue entry)."""
        want = self._memory_tier(tier_name)
        pages = {id(p): p for t in ts for p in t.page_refs}

        def check() -> None:
            for t in ts:
                self.check(t)

        def body() -> list[Lease]:
            leases: list[Lease] = []
            try:
                for t in ts:
                    leases.append(self._lease_held(t, want, write))
            except BaseException:
                for lease in leases:
                    lease.release()
                raise
            return leases

        return self.queue.exclusive(list(pages.values()), body, check)

    def _memory_tier(self, tier_name: str | None) -> Tier | None:
        want = self.tiers[tier_name] if tier_name is not None else None
        if want is not None and not want.resident:
            raise InvalidRequest(f"tier {tier_name!r} is not memory; views and leases are of 'gpu' or 'cpu'")
        return want

    def _lease_held(self, t: PagedTensor, want: Tier | None, write: bool) -> Lease:
        """A lease of ``t``, whose pages the caller holds (an exclusive operation)."""
        with self.queue.lock:
            self.check(t)
            _refuse_torn(t)
            tier = self._alias_tier(t, want) if t.nbytes else (want or self.tiers[t.home])
            if tier is not None:
                if t.nbytes:
                    tensor = self._alias(t, tier, lifetime=False)
                else:
                    tensor = torch.empty(t.shape, dtype=t.dtype)
                    self._pin(t)
                return Lease(t, tier.name, tensor, False, write, self._end_alias, lambda: self.closed)
            tier = self._full_copy_tier(t, want)
            segments = [(page.copy_on(tier), lo, hi, pos) for page, lo, hi, pos in t.segments()]
            self._pin(t)
            self.view_copies += 1
        merged = torch.empty(t.nbytes, dtype=torch.uint8, device=tier.device)
        for slot, lo, hi, pos in segments:
            merged[pos:pos + hi - lo].copy_(tier.buffer(slot)[lo:hi])
        tensor = merged.view(t.dtype).view(t.shape)
        return Lease(t, tier.name, tensor, True, write, self._end_copy, lambda: self.closed)

    def _memory_order(self, want: Tier | None) -> list[Tier]:
        """The memory tiers to lend from, nearest first (only ``want`` when one is asked for)."""
        return [want] if want is not None else [self.tiers.gpu, self.tiers.cpu]

    def _full_copy_tier(self, t: PagedTensor, want: Tier | None) -> Tier:
        order = self._memory_order(want)
        for tier in order:
            if all(p.copy_on(tier) is not None for p in t.page_refs):
                return tier
        raise InvalidRequest(f"lease: the tensor has no complete copy in {'/'.join(x.name for x in order)} "
                             f"(its pages are on {_copy_tiers(t)}); move or copy it there first")

    def _alias_tier(self, t: PagedTensor, want: Tier | None) -> Tier | None:
        """The memory tier where the tensor's pages sit on adjacent slots, nearest first."""
        pages = t.page_refs
        if not pages:
            return self.tiers[t.home] if self.tiers[t.home].resident else None
        for tier in self._memory_order(want):
            first = pages[0].copy_on(tier)
            if first is not None and all(p.copy_on(tier) == first + i for i, p in enumerate(pages)):
                return tier
        return None

    def _alias(self, t: PagedTensor, tier: Tier, lifetime: bool) -> torch.Tensor:
        """An alias of ``t``'s memory on ``tier``, its pages pinned (caller holds the lock): for
        the alias's lifetime, or (``lifetime=False``) until the caller unpins."""
        pages = t.page_refs
        raw = tier.span(pages[0].copy_on(tier), len(pages))[t.offset:t.offset + t.nbytes]
        storage, owner = _own_storage(raw)
        alias = storage.view(t.dtype).view(t.shape)
        self._pin(t)
        self.views += 1
        if lifetime:
            # [Note: pins follow the storage] every tensor derived from the alias, by slicing,
            # reshaping, reinterpreting its dtype or being saved by autograd, shares the alias's
            # own storage, which holds ``owner``: the pin goes when the last of them does
            weakref.finalize(owner, self._unpin, t)
        return alias

    def _end_alias(self, lease: Lease, tensor: torch.Tensor) -> None:
        t = lease.source
        try:
            if lease.write and not self.closed and self._replicated(t):
                self.write(t, tensor)  # bring the other copies up to date
        except BaseException:
            # the leased copy holds the new bytes, the others could not be updated: the copies
            # disagree, so the tensor's bytes refuse reads until written again
            with self.queue.lock:
                for page, lo, hi, _pos in t.segments():
                    page.tear_range(lo, hi)
            raise
        finally:
            self._unpin(t)

    def _replicated(self, t: PagedTensor) -> bool:
        with self.queue.lock:
            return any(p.replicas for p in t.page_refs)

    def _end_copy(self, lease: Lease, tensor: torch.Tensor) -> None:
        try:
            if lease.write and not self.closed:
                self.write(lease.source, tensor)
        finally:
            self._unpin(lease.source)

    def _pin(self, t: PagedTensor) -> None:
        t.pins += 1
        for p in t.page_refs:
            p.pins += 1

    def _unpin(self, t: PagedTensor) -> None:
        with self.queue.lock:
            t.pins -= 1
            for p in t.page_refs:
                p.pins -= 1

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


class _CudaMemory:
    """Device memory presented through ``__cuda_array_interface__``, so a tensor made from it
    gets a storage of its own that keeps this object (and ``base``) alive."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.__cuda_array_interface__ = {"shape": (base.numel(),), "typestr": "|u1",
                                         "data": (base.data_ptr(), False), "version": 2}


def _own_storage(raw: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A uint8 tensor over the same memory as ``raw`` but with a storage of its own, and the
    object that storage keeps alive (weak-referenceable)."""
    if raw.is_cuda:
        owner = _CudaMemory(raw)
        return torch.as_tensor(owner, device=raw.device), owner
    owner = raw.numpy()
    return torch.from_numpy(owner), owner


def _nearest(page: Page) -> tuple[Tier, int]:
    """The copy to read: memory before disk, gpu before cpu."""
    copies = page.copies()
    tier = fastest(copies)
    return tier, copies[tier]


def _copy_tiers(t: PagedTensor) -> list[str]:
    """Names of the tiers holding copies of ``t``'s pages (for error messages)."""
    return sorted({c.name for p in t.page_refs for c in p.copies()})


def _refuse_torn(t: PagedTensor) -> None:
    for page, lo, hi, _pos in t.segments():
        if page.is_torn(lo, hi):
            raise TornPage(
                f"page {page.id} of this tensor lost its bytes when an in-place disk write failed "
                "(there was no room for copy-on-write); write the tensor again with copy_() before reading it")

