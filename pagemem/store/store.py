"""PageStore: tensors in fixed-size pages across the gpu, cpu and nvme tiers."""

from __future__ import annotations

import threading
from collections import deque
from functools import partial
from typing import Iterable, Sequence

import torch

from pagemem.config import StoreConfig
from pagemem.errors import InvalidRequest, OutOfMemory
from pagemem.store import ordering
from pagemem.store.handle import MoveHandle
from pagemem.store.layout import pack
from pagemem.store.mover import Mover
from pagemem.store.ordering import Op
from pagemem.store.pages import Page, PageIds
from pagemem.store.stats import StoreStats, TierStats, TransferMeter
from pagemem.store.tensor import PagedTensor
from pagemem.tiers import Tier, build_tiers
from pagemem.tiers.arena import HostBuffer
from pagemem.units import format_bytes

TensorSpec = tuple[Sequence[int], torch.dtype]


class PageStore:
    """Fixed-size pages across three tiers, composed into tensors and moved asynchronously.

    Use as a context manager, or call ``close()``: closing waits for moves in flight, then
    releases the arenas and removes the NVMe page files. Safe to use from several threads.
    """

    def __init__(self, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise InvalidRequest(f"PageStore needs a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.page_bytes: int = config.page_bytes  # type: ignore[assignment]
        self._tiers = build_tiers(config)
        self._mover = Mover(self._tiers.staging)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._unfinished = 0
        self._closed = False
        self._ids = PageIds()
        self._pages: dict[int, Page] = {}
        self._meter = TransferMeter()
        self._local = threading.local()

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for operations in flight, then release memory and delete the page files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._unfinished:
                self._idle.wait()
        self._tiers.close()

    def synchronize(self) -> None:
        """Wait until every operation started so far has finished."""
        with self._lock:
            while self._unfinished:
                self._idle.wait()

    # ------------------------------------------------------------------ description

    def tier(self, name: str) -> Tier:
        """The tier object called ``name`` (``"gpu"``, ``"cpu"`` or ``"nvme"``)."""
        return self._tiers[name]

    @property
    def cuda(self) -> bool:
        """True when the ``gpu`` tier is real CUDA memory, False for the host stand-in."""
        return self._tiers.cuda

    def describe(self) -> str:
        """One line per tier: size and backend (says when ``gpu`` is a host stand-in)."""
        lines = [f"pagemem store, {format_bytes(self.page_bytes)} pages"]
        for t in self._tiers:
            info = t.describe()
            extra = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("backend", "files"))
            lines.append(f"  {t.name:<4} {t.capacity:>7} pages ({format_bytes(t.capacity * self.page_bytes)}): "
                         f"{info['backend']}" + (f"; {extra}" if extra else ""))
        return "\n".join(lines)

    def stats(self) -> StoreStats:
        """Capacity, used pages, live bytes and utilization per tier; bytes and time per move
        direction; backends in use."""
        with self._lock:
            live = {t.name: 0 for t in self._tiers}
            for page in self._pages.values():
                live[page.tier.name] += page.live
            tiers = {
                t.name: TierStats(t.name, self.page_bytes, t.capacity, t.used_pages, t.free_pages,
                                  live[t.name], t.describe())
                for t in self._tiers
            }
            moves = self._meter.snapshot()
        staging = self._tiers.staging
        return StoreStats(tiers, moves, staging.capacity, staging.free, self.cuda)

    def location(self, page_id: int) -> tuple[str, int]:
        """``(tier, slot)`` currently holding logical page ``page_id``."""
        with self._lock:
            page = self._pages.get(page_id)
            if page is None:
                raise InvalidRequest(f"page {page_id} is not allocated")
            return page.tier.name, page.slot

    # ------------------------------------------------------------------ allocation

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, tier: str = "cpu") -> PagedTensor:
        """A new tensor of ``shape`` and ``dtype`` in ``tier``. Its contents are unspecified until
        written (like ``torch.empty``). Raises OutOfMemory, changing nothing, if it does not fit."""
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
        dest = self._tiers[tier]
        shapes, dtypes = [], []
        for spec in specs:
            shape, dtype = _check_spec(spec)
            shapes.append(shape)
            dtypes.append(dtype)
        sizes = [s.numel() * d.itemsize for s, d in zip(shapes, dtypes)]
        pb = self.page_bytes
        with self._lock:
            self._check_open()
            shared = self._open_tail(after, dest) if after is not None else None
            layout = pack(sizes, pb, start=shared.fill if shared else 0)
            fresh = layout.pages - (1 if shared else 0)
            if fresh > dest.free_pages:
                raise OutOfMemory(tier, fresh, dest.free_pages, pb,
                                  f"{len(shapes)} tensor(s) of {format_bytes(layout.live_bytes)}")
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
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
                span = layout.page_span(i)
                offset = layout.starts[i] - span.start * pb if span else 0
                t = PagedTensor(self, shape, dtype, tuple(pages[j] for j in span), offset, tier)
                for page, lo, hi, _ in t._segments():
                    page.live += hi - lo
                tensors.append(t)
        return tensors

    def _open_tail(self, after: PagedTensor, dest: Tier) -> Page | None:
        """``after``'s last page if a new group may continue in it (see ``allocate_group``)."""
        self._check_live(after)
        if not after._pages:
            return None
        page = after._pages[-1]
        end = after._offset + after.nbytes - (len(after._pages) - 1) * self.page_bytes
        if page.tier is not dest or page.future_tier is not dest or page.fill != end or end >= self.page_bytes:
            return None
        return page

    # ------------------------------------------------------------------ moves

    def move(self, tensors: Iterable[PagedTensor], tier: str) -> MoveHandle:
        """Start moving the pages of ``tensors`` to ``tier``; returns a handle to wait on.

        Destination pages are reserved now: raises OutOfMemory, changing nothing, if they do
        not fit. Moves of different pages run concurrently; moves of one page keep their order.
        """
        dest = self._tiers[tier]
        tensors = list(tensors)
        with self._lock:
            self._check_open()
            pages: dict[int, Page] = {}
            for t in tensors:
                self._check_live(t)
                for page in t._pages:
                    pages.setdefault(page.id, page)
            need = [p for p in pages.values() if p.future_tier is not dest]
            if len(need) > dest.free_pages:
                raise OutOfMemory(tier, len(need), dest.free_pages, self.page_bytes,
                                  f"moving {len(tensors)} tensor(s)")
            reserved = dict(zip((p.id for p in need), dest.allocate(len(need))))
            op = Op(pages.values(), self._start_move)
            op.plan = [dest, [(p, reserved.get(p.id)) for p in pages.values()]]
            for page in pages.values():
                page.future_tier = dest
            for t in tensors:
                t._home = tier
            ready = self._enqueue(op)
        if ready:
            self._run([op])
        return MoveHandle([op])

    def _start_move(self, op: Op) -> None:
        dest, plan = op.plan
        work = []
        with self._lock:
            for page, slot in plan:
                if page.tier is dest:
                    if slot is not None:
                        dest.release([slot])
                    continue
                if slot is None:  # an earlier move of this page failed, so none was reserved
                    if not dest.free_pages:
                        op.errors.append(OutOfMemory(dest.name, 1, 0, self.page_bytes, f"page {page.id}"))
                        if page.last_op is op:
                            page.future_tier = page.tier
                        continue
                    slot = dest.allocate(1)[0]
                direction = f"{page.tier.name}->{dest.name}"
                self._meter.begin(direction)
                work.append((page, page.tier, page.slot, dest, slot, direction))
            op.remaining = len(work)
        if not work:
            self._complete(op)
            return
        for item in work:
            _, src, src_slot, dst, dst_slot, _ = item
            done = partial(self._page_moved, op, item)
            try:
                self._mover.transfer(src, src_slot, dst, dst_slot, done)
            except Exception as exc:  # refused before it started (e.g. an engine shutting down)
                done(exc)

    def _page_moved(self, op: Op, item: tuple, error: BaseException | None) -> None:
        page, src, src_slot, dest, dest_slot, direction = item
        with self._lock:
            try:
                if error is None:
                    page.tier, page.slot = dest, dest_slot
                    src.release([src_slot])
                    self._meter.end(direction, self.page_bytes)
                else:
                    dest.release([dest_slot])
                    self._meter.end(direction, 0)
                    op.errors.append(error)
                    if page.last_op is op:
                        page.future_tier = page.tier
            except Exception as exc:  # a broken invariant: report it rather than hang the waiters
                op.errors.append(exc)
            op.remaining -= 1
            last = op.remaining == 0
        if last:
            self._complete(op)

    # ------------------------------------------------------------------ free

    def _free(self, t: PagedTensor) -> None:
        with self._lock:
            if t._freed or self._closed:
                t._freed = True
                return
            t._freed = True
            dead = []
            for page, lo, hi, _ in t._segments():
                page.live -= hi - lo
                if page.live == 0:
                    dead.append(page)
            if not dead:
                return
            op = Op(dead, self._start_release)
            ready = self._enqueue(op)
        if ready:
            self._run([op])

    def _start_release(self, op: Op) -> None:
        with self._lock:
            for page in op.pages:
                page.tier.release([page.slot])
                del self._pages[page.id]
                self._ids.give(page.id)
        self._complete(op)

    # ------------------------------------------------------------------ reading and writing

    def _write(self, t: PagedTensor, src: torch.Tensor) -> None:
        if not isinstance(src, torch.Tensor):
            raise InvalidRequest(f"copy_ needs a torch.Tensor, got {type(src).__name__}")
        if src.shape != t.shape or src.dtype != t.dtype:
            raise InvalidRequest(
                f"copy_: source is {tuple(src.shape)} {src.dtype}, tensor is {tuple(t.shape)} {t.dtype}")
        data = src.detach().contiguous().reshape(-1).view(torch.uint8)

        def write() -> None:
            resident, on_disk = [], []
            for seg in t._segments():
                (resident if seg[0].tier.resident else on_disk).append(seg)
            # disk pages first, copy-on-write: if that fails (full, I/O error) nothing has changed
            commit = self._write_nvme(on_disk, data) if on_disk else None
            for page, lo, hi, pos in resident:
                page.tier.buffer(page.slot)[lo:hi].copy_(data[pos:pos + hi - lo])
            self._sync_cuda(t)
            if commit:
                commit()

        self._exclusive(t, write)

    def _write_nvme(self, segments: list, data: torch.Tensor):
        """Write the new contents of on-disk pages to fresh slots (copy-on-write) and return the
        function that swaps them in. Raises, changing nothing, if the slots or writes fail."""
        nvme = self._tiers.nvme
        with self._lock:
            if len(segments) > nvme.free_pages:
                raise OutOfMemory("nvme", len(segments), nvme.free_pages, self.page_bytes,
                                  "copy-on-write of the tensor's pages")
            new_slots = nvme.allocate(len(segments))
        nvme_read = partial(_run_io, nvme.start_read)
        nvme_write = partial(_run_io, nvme.start_write)

        def write_batch(i: int, batch: list, bufs: list[HostBuffer]) -> None:
            nvme_read([(s[0].slot, b) for s, b in zip(batch, bufs) if s[2] - s[1] < self.page_bytes])
            for (page, lo, hi, pos), buf in zip(batch, bufs):
                buf.tensor[lo:hi].copy_(data[pos:pos + hi - lo])
            nvme_write(list(zip(new_slots[i:i + len(batch)], bufs)))

        try:
            self._staged(segments, write_batch)
        except BaseException:
            with self._lock:
                nvme.release(new_slots)
            raise

        def commit() -> None:
            with self._lock:
                for (page, *_), slot in zip(segments, new_slots):
                    nvme.release([page.slot])
                    page.slot = slot

        return commit

    def _read(self, t: PagedTensor) -> torch.Tensor:
        def read() -> torch.Tensor:
            if t.nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            gpu = self._tiers.gpu
            device = gpu.device if self.cuda and all(p.tier is gpu for p in t._pages) else "cpu"
            out = torch.empty(t.nbytes, dtype=torch.uint8, device=device)
            on_disk = []
            for page, lo, hi, pos in t._segments():
                if page.tier.resident:
                    out[pos:pos + hi - lo].copy_(page.tier.buffer(page.slot)[lo:hi])
                else:
                    on_disk.append((page, lo, hi, pos))
            self._sync_cuda(t)
            nvme = self._tiers.nvme

            def read_batch(_i: int, batch: list, bufs: list[HostBuffer]) -> None:
                _run_io(nvme.start_read, [(s[0].slot, b) for s, b in zip(batch, bufs)])
                for (page, lo, hi, pos), buf in zip(batch, bufs):
                    out[pos:pos + hi - lo].copy_(buf.tensor[lo:hi])

            self._staged(on_disk, read_batch)
            return out.view(t.dtype).view(t.shape)

        return self._exclusive(t, read)

    def _staged(self, segments: list, body) -> None:
        """Call ``body(index, batch, staging buffers)`` over ``segments`` in staging-sized batches,
        giving the buffers back after each batch whatever happens."""
        staging = self._tiers.staging
        size = max(1, staging.capacity // 2)
        for i in range(0, len(segments), size):
            batch = segments[i:i + size]
            bufs = staging.acquire_blocking(len(batch))
            try:
                body(i, batch, bufs)
            finally:
                staging.release(bufs)

    def _viewable(self, t: PagedTensor) -> bool:
        with self._lock:
            return self._check_live(t) and _adjacent_resident(t)

    def _view(self, t: PagedTensor) -> torch.Tensor:
        def view() -> torch.Tensor:
            with self._lock:
                ok = _adjacent_resident(t)
            if not ok:
                where = sorted({p.tier.name for p in t._pages})
                raise InvalidRequest(
                    f"view(): the tensor's pages are not adjacent in one memory tier (tiers {where}); "
                    "use to_torch() for a copy, or move it to a memory tier first")
            if t.nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            first = t._pages[0]
            raw = first.tier.span(first.slot, len(t._pages))
            return raw[t._offset:t._offset + t.nbytes].view(t.dtype).view(t.shape)

        return self._exclusive(t, view)

    def _sync_cuda(self, t: PagedTensor) -> None:
        if self.cuda and any(p.tier is self._tiers.gpu for p in t._pages):
            torch.cuda.current_stream(self._tiers.gpu.device).synchronize()

    def _exclusive(self, t: PagedTensor, fn):
        """Run ``fn`` once operations queued earlier on ``t``'s pages are done, holding the pages."""
        ready = threading.Event()
        op = Op(t._pages, lambda _op: ready.set())
        with self._lock:
            self._check_open()
            self._check_live(t)
            start_now = self._enqueue(op)
        if start_now:
            self._run([op])
        ready.wait()
        try:
            return fn()
        finally:
            self._complete(op)

    # ------------------------------------------------------------------ queries

    def _tier_of(self, t: PagedTensor) -> str | None:
        with self._lock:
            if not t._pages:
                return t._home
            tiers = set()
            for page in t._pages:
                if page.future_tier is not page.tier:
                    return None
                tiers.add(page.tier)
            return tiers.pop().name if len(tiers) == 1 else None

    # ------------------------------------------------------------------ operation plumbing

    def _enqueue(self, op: Op) -> bool:
        self._unfinished += 1
        return ordering.enqueue(op)

    def _complete(self, op: Op) -> None:
        with self._lock:
            ready = ordering.finish(op)
            self._unfinished -= 1
            if not self._unfinished:
                self._idle.notify_all()
        op.done.set()
        if ready:
            self._run(ready)

    def _run(self, ops: list[Op]) -> None:
        """Start ``ops``; ops that become ready meanwhile on this thread are started by the
        outermost call, iteratively, so long chains do not recurse."""
        queue = getattr(self._local, "queue", None)
        if queue is not None:
            queue.extend(ops)
            return
        self._local.queue = queue = deque(ops)
        try:
            while queue:
                op = queue.popleft()
                op.start(op)
        finally:
            self._local.queue = None

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("the store is closed")

    def _check_live(self, t: PagedTensor) -> bool:
        if t._store is not self:
            raise InvalidRequest("the tensor belongs to another store")
        if t._freed:
            raise InvalidRequest("the tensor was freed")
        return True


def _adjacent_resident(t: PagedTensor) -> bool:
    pages = t._pages
    if not pages:
        return True
    first = pages[0]
    if not first.tier.resident or first.future_tier is not first.tier:
        return False
    return all(p.tier is first.tier and p.future_tier is p.tier and p.slot == first.slot + i
               for i, p in enumerate(pages))


def _check_spec(spec: object) -> tuple[torch.Size, torch.dtype]:
    try:
        shape, dtype = spec  # type: ignore[misc]
    except (TypeError, ValueError):
        raise InvalidRequest(f"a tensor spec is (shape, dtype), got {spec!r}") from None
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidRequest(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims) or any(int(d) != d for d in shape):
        raise InvalidRequest(f"shape must hold non-negative ints, got {shape!r}")
    return torch.Size(dims), dtype


def _run_io(start, requests: list[tuple[int, HostBuffer]]) -> None:
    """Run page reads or writes ``start(slot, buf, done)`` concurrently; raise the first error."""
    if not requests:
        return
    lock = threading.Lock()
    left = [len(requests)]
    errors: list[BaseException] = []
    finished = threading.Event()

    def done(error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0] == 0:
                finished.set()

    for slot, buf in requests:
        try:
            start(slot, buf, done)
        except Exception as exc:  # refused before it started: count it as that request's error
            done(exc)
    finished.wait()
    if errors:
        raise errors[0]
