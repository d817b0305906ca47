"""PageStore: tensors in fixed-size pages across the gpu, cpu and nvme tiers.

The store is the facade over its parts: ``queue`` (the lock and the per-page operation order),
``placement`` (moves, copies, dropped copies), ``data`` (reads and writes), ``lending`` (views
and leases), ``transfer`` (the one path page bytes take between tiers) and ``specs`` (argument
checks). It owns the page table and the lifecycle: allocation, free, close. It belongs to the
process that made it: every public method first checks that it runs there ([Note: an engine
belongs to its process], ``pagemem/process.py``).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Iterable, Sequence

import torch

import pagemem.process as process
from pagemem.config import StoreConfig
from pagemem.errors import FirstError, InvalidRequest, OutOfMemory
from pagemem.store.export import export_page
from pagemem.store.data import DataPath
from pagemem.store.lending import Lender
from pagemem.store.handle import MoveHandle
from pagemem.store.layout import pack
from pagemem.store.specs import TensorSpec, check_spec, iterable, tensors_of
from pagemem.store.lease import Lease
from pagemem.store.ordering import Op
from pagemem.store.pages import IntentKind, Page, PageIds
from pagemem.store.placement import Placement
from pagemem.store.queue import OpQueue
from pagemem.store.stats import MoveSpan, StoreStats, TierStats, TransferMeter
from pagemem.store.tensor import PagedTensor
from pagemem.store.transfer import Mover
from pagemem.tiers import Tier, build_tiers
from pagemem.units import format_bytes



class PageStore:
    """Fixed-size pages across three tiers, composed into tensors and moved asynchronously.

    Use as a context manager, or call ``close()``: closing waits for operations in flight, then
    gives the arenas back and removes the NVMe page files (a store dropped without ``close()`` does
    the same when it is garbage collected). Safe to use from several threads, in the process that
    made it: in a forked child every method raises ``WrongProcess`` and garbage collection, exit and
    ``del`` release nothing ([Note: an engine belongs to its process]).
    """

    def __init__(self, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise InvalidRequest(f"PageStore needs a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.page_bytes: int = config.page_bytes  # type: ignore[assignment]
        self.owner_pid = process.current_pid()
        """The process that made the store, the only one that may use it."""
        self._tiers = build_tiers(config)
        self._finalizer = process.finalize(self, self._tiers.close)
        self._queue = OpQueue()
        self._meter = TransferMeter()
        mover = Mover(self._tiers.staging)
        self._placement = Placement(self._queue, mover, self._meter, self.page_bytes, self._tiers.gpu,
                                    self._tiers.cuda)
        # through a weak reference: the parts must not keep the store alive (its finalizer frees
        # the tiers when it is dropped without close())
        check = partial(_check_weak, weakref.ref(self))
        self._data = DataPath(self._queue, mover, self._tiers, self.page_bytes, check)
        self._lend = Lender(self._queue, self._tiers, self._data, check)
        self._closed = False
        self._ids = PageIds()
        self._pages: dict[int, Page] = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None and not process.is_owner(self.owner_pid):
            return  # a forked child leaving by an exception: it goes on, nothing is closed
        self.close()

    def close(self) -> None:
        """Wait for operations in flight, then give the memory back and delete the page files.
        Tensors, views and leases used afterwards raise ``InvalidRequest`` (stale raw views read
        zeros, never another tensor's data). Every file, fd and thread is released even if a part
        of closing raises; then the first error is raised ([Note: closing releases everything])."""
        self._owned("close")
        with self._queue.lock:
            if self._closed:
                return
            self._closed = True
            self._data.closed = True
        with FirstError() as step:
            step(self._queue.drain)
            step(self._finalizer)
            step(self._forget_pages)

    def _forget_pages(self) -> None:
        with self._queue.lock:
            self._pages.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def synchronize(self) -> None:
        """Wait until every operation started so far has finished."""
        self._owned("synchronize")
        self._queue.drain()

    def resize(self, tier: str, pages: int) -> None:
        """Give the memory tier ``tier`` (``"gpu"`` or ``"cpu"``) an arena of ``pages`` slots,
        from 0 up to its configured budget (``StoreConfig.pages``): a new arena is allocated,
        the pages there are copied to it at their slots, and the old one is given back. An
        engine sizes its gpu arena from its plan with it, leaving the rest of the budget to the
        non-model memory. Raises, changing nothing: ``InvalidRequest`` when a page with a copy
        on the tier is pinned (a view or a lease) or has an operation in flight, or a slot in
        use lies at or above ``pages``; ``OutOfMemory`` when the new arena cannot be had."""
        self._owned("resize")
        if tier not in ("gpu", "cpu"):
            raise InvalidRequest(f"resize: tier must be 'gpu' or 'cpu' (memory tiers), got {tier!r}")
        most = self.config.pages(tier)
        if isinstance(pages, bool) or not isinstance(pages, int) or not 0 <= pages <= most:
            raise InvalidRequest(f"resize: pages must be an int in [0, {most}] ({tier}_bytes / page_bytes), "
                                 f"got {pages!r}")
        t = self._tiers[tier]
        with self._queue.lock:
            self._check_open()
            for page in self._pages.values():
                there = page.copy_on(t) is not None or any(dest is t for _op, _kind, dest in page.intents)
                if there and page.pins:
                    raise InvalidRequest(f"resize({tier!r}): page {page.id} is pinned by an open lease or a "
                                         "live view; release it first")
                if there and page.pending:
                    raise InvalidRequest(f"resize({tier!r}): page {page.id} has an operation in flight; "
                                         "wait for it (synchronize()) first")
            try:
                t.resize(pages)  # type: ignore[attr-defined]
            except ValueError as exc:
                raise InvalidRequest(f"resize({tier!r}): {exc}") from None
            except MemoryError as exc:
                raise OutOfMemory(tier, pages, 0, self.page_bytes, f"a new arena: {exc}") from None

    # ------------------------------------------------------------------ description

    def tier(self, name: str) -> Tier:
        """The tier object called ``name`` (``"gpu"``, ``"cpu"`` or ``"nvme"``)."""
        self._owned("tier")
        return self._tiers[name]

    @property
    def cuda(self) -> bool:
        """True when the ``gpu`` tier is real CUDA memory, False for the host stand-in."""
        return self._tiers.cuda

    def describe(self) -> str:
        """One line per tier: size and backend (says when ``gpu`` is a host stand-in)."""
        self._owned("describe")
        lines = [f"pagemem store, {format_bytes(self.page_bytes)} pages"]
        for t in self._tiers:
            info = t.describe()
            extra = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("backend", "files"))
            lines.append(f"  {t.name:<4} {t.capacity:>7} pages ({format_bytes(t.capacity * self.page_bytes)}): "
                         f"{info['backend']}" + (f"; {extra}" if extra else ""))
        return "\n".join(lines)

    def stats(self) -> StoreStats:
        """Capacity, used pages, live bytes and utilization per tier; bytes and time per move
        direction; backends in use; views served zero-copy and those that needed a copy."""
        self._owned("stats")
        with self._queue.lock:
            live = {t.name: 0 for t in self._tiers}
            pinned = 0
            for page in self._pages.values():
                live[page.tier.name] += page.live
                pinned += page.pins > 0
            tiers = {
                t.name: TierStats(t.name, self.page_bytes, t.capacity, t.used_pages, t.free_pages,
                                  live[t.name], t.describe())
                for t in self._tiers
            }
            moves = self._meter.snapshot()
            views, copies = self._lend.views, self._lend.view_copies
        staging = self._tiers.staging
        return StoreStats(tiers, moves, staging.capacity, staging.free, self.cuda, views, copies, pinned)

    def move_spans(self, since: float = 0.0) -> list[MoveSpan]:
        """The periods each move direction had a transfer in flight that ended after ``since``
        (``time.perf_counter`` seconds), oldest first, with the bytes moved in each: the
        measured timeline's moves (the newest ``SPANS_KEPT`` are kept)."""
        self._owned("move_spans")
        with self._queue.lock:
            return self._meter.spans(since)

    def location(self, page_id: int) -> tuple[str, int]:
        """``(tier, slot)`` of the home copy of logical page ``page_id``."""
        self._owned("location")
        with self._queue.lock:
            page = self._pages.get(page_id)
            if page is None:
                raise InvalidRequest(f"page {page_id} is not allocated")
            return page.tier.name, page.slot

    def copies(self, page_id: int) -> dict[str, int]:
        """Every copy of logical page ``page_id``: tier -> slot, home first."""
        self._owned("copies")
        with self._queue.lock:
            page = self._pages.get(page_id)
            if page is None:
                raise InvalidRequest(f"page {page_id} is not allocated")
            return {t.name: s for t, s in page.copies().items()}

    def export_page(self, page_id: int, fd: int, offset: int, name: str = "") -> int:
        """Write logical page ``page_id``'s bytes at ``offset`` of the open file ``fd`` (a
        checkpoint's, called ``name`` in errors), verified by reading them back; return their
        XXH3-64 checksum. CorruptPage / TierIOError on failure. Synchronize first
        (``store/export.py``)."""
        self._owned("export_page")
        self._check_open()
        return export_page(self, page_id, fd, offset, name)

    # ------------------------------------------------------------------ allocation

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, tier: str = "cpu") -> PagedTensor:
        """A new tensor of ``shape`` and ``dtype`` in ``tier``. Its contents are unspecified until
        written (like ``torch.empty``). Raises OutOfMemory, changing nothing, if it does not fit."""
        self._owned("allocate")
        return self.allocate_group([(shape, dtype)], tier)[0]

    def allocate_group(self, specs: Iterable[TensorSpec], tier: str = "cpu",
                       after: PagedTensor | None = None) -> list[PagedTensor]:
        """Several tensors laid back to back, so small ones share pages (e.g. a layer's
        parameters). All or nothing: raises OutOfMemory, changing nothing, if they do not fit.

        ``after``: continue in the partly filled last page of that tensor (as ANGEL-PTM lets a
        tensor begin on a partly filled page), so consecutive groups waste no page tails. Only
        when that page is in ``tier``, not moving, and nothing was placed after the tensor yet;
        otherwise the group starts on fresh pages. The groups then share that page.
        """
        self._owned("allocate_group")
        dest = self._tiers[tier]
        if after is not None and not isinstance(after, PagedTensor):
            raise InvalidRequest(f"after: must be a PagedTensor or None, got {type(after).__name__}")
        checked = [check_spec(spec) for spec in iterable(specs, "specs")]
        sizes = [nbytes for _, _, nbytes in checked]
        pb = self.page_bytes
        with self._queue.lock:
            self._check_open()
            shared = self._open_tail(after, dest) if after is not None else None
            layout = pack(sizes, pb, start=shared.fill if shared else 0)
            fresh = layout.pages - (1 if shared else 0)
            if fresh > dest.free_pages:
                raise OutOfMemory(tier, fresh, dest.free_pages, pb,
                                  f"{len(checked)} tensor(s) of {format_bytes(layout.live_bytes)}")
            pages = [shared] if shared else []
            for slot in dest.allocate(fresh):
                page = Page(self._ids.take(), dest, slot)
                self._pages[page.id] = page
                pages.append(page)
            if pages:
                pages[-1].fill = layout.end - (layout.pages - 1) * pb
                for page in pages[:-1]:
                    page.fill = pb
            tensors = []
            for i, (shape, dtype, nbytes) in enumerate(checked):
                span = layout.page_span(i)
                offset = layout.starts[i] - span.start * pb if span else 0
                t = PagedTensor(self, shape, dtype, nbytes, tuple(pages[j] for j in span), offset, tier)
                for page, lo, hi, _ in t.segments():
                    page.live += hi - lo
                tensors.append(t)
        return tensors

    def _open_tail(self, after: PagedTensor, dest: Tier) -> Page | None:
        """``after``'s last page if a new group may continue in it (see ``allocate_group``)."""
        self._check(after)
        if not after.page_refs:
            return None
        page = after.page_refs[-1]
        end = after.offset + after.nbytes - (len(after.page_refs) - 1) * self.page_bytes
        if page.tier is not dest or page.intents or page.fill != end or end >= self.page_bytes:
            return None
        return page

    # ------------------------------------------------------------------ placement

    def move(self, tensors: PagedTensor | Iterable[PagedTensor], tier: str) -> MoveHandle:
        """Start moving the home copies of the pages of ``tensors`` to ``tier``; returns a handle.

        Destination pages are reserved now: raises OutOfMemory, changing nothing, if they do not
        fit, and InvalidRequest if a page is pinned (a lease or a live view). Operations on
        different pages run concurrently; operations on one page keep their order.
        """
        self._owned("move")
        return self._place("move", tensors, tier)

    def copy(self, tensors: PagedTensor | Iterable[PagedTensor], tier: str, *,
             pages: range | None = None) -> MoveHandle:
        """Start copying the pages of ``tensors`` to ``tier``, keeping every existing copy valid
        (a replica: what the scheduler's ``move_to_gpu`` makes). Reserves like ``move``; pages
        already there cost nothing. ``pages``: only these of the tensors' distinct pages, counted
        in order from 0 (the scheduler moves a layer page by page)."""
        self._owned("copy")
        return self._place("copy", tensors, tier, pages)

    def release(self, tensors: PagedTensor | Iterable[PagedTensor], tier: str, *,
                pages: range | None = None) -> MoveHandle:
        """Drop the copies of the pages of ``tensors`` on ``tier`` (another copy must remain;
        dropping the home copy makes the remaining copy furthest from the GPU the home).
        ``pages`` as for ``copy``."""
        self._owned("release")
        return self._place("drop", tensors, tier, pages)

    def page_count(self, tensors: PagedTensor | Iterable[PagedTensor]) -> int:
        """How many distinct pages ``tensors`` occupy (what ``pages=`` ranges index)."""
        self._owned("page_count")
        with self._queue.lock:
            return len({page.id for t in tensors_of(tensors, "page_count") for page in t.page_refs})

    def _place(self, kind: IntentKind, tensors, tier: str, select: range | None = None) -> MoveHandle:
        dest = self._tiers[tier]
        tensors = tensors_of(tensors, kind)
        if select is not None and not isinstance(select, range):
            raise InvalidRequest(f"pages: expected a range of page positions, got {type(select).__name__}")
        with self._queue.lock:
            self._check_open()
            pages: dict[int, Page] = {}
            for t in tensors:
                self._check(t)
                for page in t.page_refs:
                    pages.setdefault(page.id, page)
            chosen = list(pages.values())
            if select is not None:
                if select.step != 1 or select.start < 0 or select.stop > len(chosen):
                    raise InvalidRequest(f"pages: {select} is not a run within the {len(chosen)} pages "
                                         f"of these tensors")
                chosen = chosen[select.start:select.stop]
            what = f"{'moving' if kind == 'move' else 'copying'} {len(tensors)} tensor(s)"
            op = self._placement.issue(kind, chosen, dest, what)
            if kind == "move":
                for t in tensors:
                    t.home = tier
            ready = self._queue.submit(op)
        if ready:
            self._queue.run([op])
        return MoveHandle([op])

    # ------------------------------------------------------------------ free

    def free(self, t: PagedTensor) -> None:
        """Give ``t``'s bytes back (``PagedTensor.free``)."""
        self._owned("free")
        if not isinstance(t, PagedTensor) or t.store is not self:
            raise InvalidRequest("free: the tensor belongs to another store")
        with self._queue.lock:
            if t.freed or self._closed:
                t.freed = True
                return
            if t.pins:
                raise InvalidRequest(f"free: the tensor is pinned by {t.pins} open lease(s) or live view(s); "
                                     "release the lease or drop the view first")
            dying = [p for p, lo, hi, _ in t.segments() if p.live == hi - lo]
            t.freed = True
            for page, lo, hi, _ in t.segments():
                page.live -= hi - lo
            if not dying:
                return
            gpu = self._tiers.gpu
            fence = gpu.fence() if self.cuda and any(p.copy_on(gpu) is not None for p in dying) else None
            op = Op(dying, partial(self._release_pages, fence))
            ready = self._queue.submit(op)
        if ready:
            self._queue.run([op])

    def _release_pages(self, fence, op: Op) -> None:
        with self._queue.lock:
            by_tier: dict[Tier, list[int]] = {}
            for page in op.pages:
                for tier, slot in page.copies().items():
                    by_tier.setdefault(tier, []).append(slot)
                self._pages.pop(page.id, None)
                self._ids.give(page.id)
            for tier, slots in by_tier.items():  # one call per tier: runs go back whole
                self._placement.give_back(tier, slots, fence)
        self._queue.complete(op)

    # ------------------------------------------------------------------ data (PagedTensor's calls)

    def read(self, t: PagedTensor) -> torch.Tensor:
        """``t``'s data as a new torch tensor (``PagedTensor.to_torch``)."""
        self._owned("read")
        return self._data.read(t)

    def write(self, t: PagedTensor, src: torch.Tensor, start: int | None = None) -> None:
        """Write ``src`` into every copy of ``t`` (``PagedTensor.copy_``); with ``start``, only
        into its flat elements ``start .. start + src.numel()`` (``src`` of any shape, ``t``'s
        dtype)."""
        self._owned("write")
        self._data.write(t, src, start)

    def write_many(self, items: "Iterable[tuple]") -> None:
        """``write`` of several tensors under one wait for the operations queued on their pages:
        no copy of those pages starts between two of the writes. Each item is ``(t, src)`` or
        ``(t, src, start)`` (``write``'s arguments)."""
        self._owned("write_many")
        self._data.write_many(list(items))

    def write_packed(self, tensors: "Iterable[PagedTensor]", src: torch.Tensor) -> None:
        """``src``'s elements, in order, into ``tensors`` (their dtype, their total size), every
        copy, as ``write_many`` does: one copy per run of adjacent bytes in each memory tier
        ([Note: a packed write] in ``data.py``)."""
        self._owned("write_packed")
        self._data.write_packed(tensors_of(tensors, "write_packed"), src)

    def view(self, t: PagedTensor, tier: str | None = None) -> torch.Tensor:
        """A zero-copy view pinning ``t``'s pages for its lifetime (``PagedTensor.view``)."""
        self._owned("view")
        return self.view_many([t], tier)[0]

    def view_many(self, tensors: Iterable[PagedTensor], tier: str | None = None) -> list[torch.Tensor]:
        """``view`` of several tensors at once (a layer's parameters, say): one wait for the
        operations queued on their pages instead of one per tensor. All or none: raises
        ``InvalidRequest``, pinning nothing, if any of them cannot be viewed."""
        self._owned("view_many")
        return self._lend.view_many(tensors_of(tensors, "view_many"), tier)

    def viewable(self, t: PagedTensor) -> bool:
        self._owned("viewable")
        return self._lend.viewable(t)

    def lease(self, t: PagedTensor, tier: str | None = None, write: bool = True) -> Lease:
        """Pin ``t``'s pages and lend its memory on ``tier`` (default: gpu if it has a complete
        copy there, else cpu) until the lease is released: an alias when the pages are adjacent
        there, else a merged copy, written back at release when ``write``. See ``store/lease.py``."""
        self._owned("lease")
        return self.lease_many([t], tier, write)[0]

    def lease_many(self, tensors: Iterable[PagedTensor], tier: str | None = None,
                   write: bool = True, *, split: bool = False) -> list[Lease]:
        """``lease`` of several tensors at once: one wait for the operations queued on their
        pages instead of one per tensor (a layer's states, say). ``split``: lend a tensor whose
        pages are not adjacent as ``Lease.pieces`` (one alias per run) instead of a merged copy."""
        self._owned("lease_many")
        for name, flag in (("write", write), ("split", split)):
            if not isinstance(flag, bool):
                raise InvalidRequest(f"lease: {name} must be True or False, got {flag!r}")
        return self._lend.lease_many(tensors_of(tensors, "lease_many"), tier, write, split)

    def tier_of(self, t: PagedTensor) -> str | None:
        """``PagedTensor.tier``: the home tier, None while in flight or split over tiers."""
        self._owned("tier_of")
        with self._queue.lock:
            self._check(t)
            if not t.page_refs:
                return t.home
            tiers = set()
            for page in t.page_refs:
                if page.intents:
                    return None
                tiers.add(page.tier)
            return tiers.pop().name if len(tiers) == 1 else None

    def tiers_of(self, t: PagedTensor) -> frozenset[str]:
        """``PagedTensor.tiers``: tiers holding a complete copy of ``t``."""
        self._owned("tiers_of")
        with self._queue.lock:
            self._check(t)
            if not t.page_refs:
                return frozenset([t.home])
            common = None
            for page in t.page_refs:
                names = {tier.name for tier in page.copies()}
                common = names if common is None else common & names
            return frozenset(common or ())

    # ------------------------------------------------------------------ checks

    def _owned(self, what: str) -> None:
        """Refuse a call from a process forked from the owner, before any lock is taken (one may
        have been copied held): [Note: an engine belongs to its process]."""
        process.require_owner(f"PageStore.{what}()", self.owner_pid)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("the store is closed")

    def _check(self, t: PagedTensor) -> None:
        if not isinstance(t, PagedTensor) or t.store is not self:
            raise InvalidRequest("the tensor belongs to another store")
        self._check_open()
        if t.freed:
            raise InvalidRequest("the tensor was freed")


def _check_weak(store_ref: "weakref.ref[PageStore]", t: PagedTensor) -> None:
    store = store_ref()
    if store is None:
        raise InvalidRequest("the store is gone")
    store._check(t)
