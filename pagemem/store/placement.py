"""Where page copies live: moves, copies that keep the source, and dropping a copy.

- **move** to a tier: the home copy goes there; the old home slot is given back once the data
  has landed. If the page already has a replica there, the replica becomes the home (no copy).
- **copy** to a tier: a replica is made there from the nearest copy (the cpu one when there is
  one); the source stays valid.
- **drop** a tier's copy: the replica there is given back (dropping the home copy promotes the
  replica furthest from the GPU). The last copy of a page cannot be dropped.

Destination slots are reserved when the operation is issued (so an out-of-memory is raised by
the call, changing nothing). Pages that are pinned (a lease or a live view) cannot be moved or
have a copy dropped. On CUDA, a fence recorded on the caller's stream at issue orders the
device-to-host copies after the kernels that produced the data, and holds back the reuse of gpu
slots given back until the kernels queued before the call have finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from pagemem.errors import InvalidRequest, OutOfMemory
from pagemem.store.ordering import Op
from pagemem.store.pages import Page, IntentKind, slowest
from pagemem.store.queue import OpQueue
from pagemem.store.stats import TransferMeter
from pagemem.store.transfer import Mover, Run, runs_of
from pagemem.tiers import Tier
from pagemem.tiers.completion import Once, as_pagemem_error


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """What one move, copy or drop does, fixed when it is issued."""

    kind: IntentKind
    dest: Tier
    pages: tuple[Page, ...]
    reserved: dict[int, int]
    """Page id -> destination slot reserved at issue."""
    fence: object | None
    """CUDA event recorded on the caller's stream at issue (None without CUDA)."""


@dataclass(slots=True)
class _Batch:
    """Pages travelling in one run of a plan."""

    src: Tier
    run: Run
    pages: list[tuple[Page, int, int]]  # (page, source slot, destination slot)
    counted: bool = False
    """Its landing was counted in ``op.remaining`` (a fallback must not count it again)."""


class Placement:
    def __init__(self, queue: OpQueue, mover: Mover, meter: TransferMeter, page_bytes: int,
                 gpu: Tier, cuda: bool) -> None:
        self.queue = queue
        self.mover = mover
        self.meter = meter
        self.page_bytes = page_bytes
        self.gpu = gpu
        self.cuda = cuda

    # ------------------------------------------------------------------ issue (under the lock)

    def issue(self, kind: IntentKind, pages: list[Page], dest: Tier, what: str) -> Op:
        """Check, reserve and queue one operation; the caller holds the lock and calls
        ``queue.run([op])`` when this returns an op that is ready (``op.waiting == 0``)."""
        need = []
        touches_gpu = False
        for page in pages:
            if page.pins and kind != "copy":
                raise InvalidRequest(
                    f"{kind} to {dest.name}: page {page.id} is pinned by an open lease or a live view "
                    f"({page.pins}); release the lease or drop the view first")
            _home, have = page.future()
            touches_gpu = touches_gpu or self.gpu in have
            if kind == "drop":
                if dest in have and len(have) == 1:
                    raise InvalidRequest(
                        f"release({dest.name!r}): page {page.id} has no other copy; free the tensor instead")
            elif dest not in have:
                need.append(page)
        if len(need) > dest.free_pages:
            raise OutOfMemory(dest.name, len(need), dest.free_pages, self.page_bytes, what)
        slots = dest.allocate(len(need))
        fence = self.gpu.fence() if self.cuda and touches_gpu else None
        plan = PlacementPlan(kind, dest, tuple(pages), dict(zip((p.id for p in need), slots)), fence)
        op = Op(pages, partial(self._start, plan))
        for page in pages:
            page.intents.append((op, kind, dest))
        return op

    # ------------------------------------------------------------------ start (lock not held)

    def _start(self, plan: PlacementPlan, op: Op) -> None:
        batches = []
        with self.queue.lock:
            by_source: dict[Tier, list[tuple[Page, int, int]]] = {}
            for page in plan.pages:
                slot = plan.reserved.get(page.id)
                if plan.kind == "drop":
                    self._drop(page, plan)
                    continue
                present = page.copy_on(plan.dest)
                if present is not None:  # already there (or an earlier op put it there)
                    if slot is not None:
                        plan.dest.release([slot])
                    if plan.kind == "move" and page.tier is not plan.dest:
                        self._promote(page, plan.dest, plan.fence)
                    continue
                if slot is None:  # an earlier operation on the page failed: reserve now
                    if not plan.dest.free_pages:
                        op.errors.append(OutOfMemory(plan.dest.name, 1, 0, self.page_bytes, f"page {page.id}"))
                        continue
                    slot = plan.dest.allocate(1)[0]
                src, src_slot = self._source(page, plan)
                by_source.setdefault(src, []).append((page, src_slot, slot))
            for src, items in by_source.items():
                items.sort(key=lambda i: i[1])
                coalesce = self.mover.coalesces(src, plan.dest)
                runs = runs_of([(s, d) for _, s, d in items], coalesce)
                i = 0
                for run in runs:
                    batches.append(_Batch(src, run, items[i:i + run.count]))
                    i += run.count
                self.meter.begin(f"{src.name}->{plan.dest.name}", len(runs))
            op.remaining = len(batches)
        if not batches:
            self._finish(op)
            return
        for batch in batches:
            # [Note: no operation is lost] whatever raises while this batch completes, on
            # whichever thread, completes it with that error (``_lost``), at most once
            done = Once(partial(self._landed, op, plan, batch), partial(self._lost, op, plan, batch))
            try:
                self.mover.transfer(batch.src, plan.dest, batch.run, done,
                                    after=plan.fence if batch.src is self.gpu else None)
            except Exception as exc:  # refused before it started (e.g. an engine shutting down)
                done(exc)

    def _source(self, page: Page, plan: PlacementPlan) -> tuple[Tier, int]:
        if plan.kind == "move":
            return page.tier, page.slot
        copies = page.copies()
        for tier, slot in copies.items():  # host memory is the cheapest source for any tier
            if tier.host_addressable:
                return tier, slot
        for tier, slot in copies.items():
            if tier.resident:
                return tier, slot
        return page.tier, page.slot

    def _landed(self, op: Op, plan: PlacementPlan, batch: _Batch, error: BaseException | None) -> None:
        with self.queue.lock:
            direction = f"{batch.src.name}->{plan.dest.name}"
            try:
                if error is None:
                    if plan.kind == "move":  # every page of a batch leaves the same source tier
                        old_slots = []
                        for page, src_slot, dst_slot in batch.pages:
                            old_slots.append(page.slot)
                            page.tier, page.slot = plan.dest, dst_slot
                        batch.src.release(old_slots)
                    else:
                        for page, _src_slot, dst_slot in batch.pages:
                            page.replicas[plan.dest] = dst_slot
                    self.meter.end(direction, batch.run.count * self.page_bytes, batch.run.count)
                else:
                    plan.dest.release([d for _, _, d in batch.pages])
                    self.meter.end(direction, 0, 0)
                    op.errors.append(as_pagemem_error(error, f"{plan.kind} of pages {direction}"))
            except Exception as exc:  # a broken invariant: report it rather than hang the waiters
                op.errors.append(as_pagemem_error(exc, f"{plan.kind} of pages {direction}"))
            batch.counted = True
            op.remaining -= 1
            last = op.remaining == 0
        if last:
            self._finish(op)

    def _lost(self, op: Op, plan: PlacementPlan, batch: _Batch, exc: BaseException) -> None:
        """``_landed`` raised: complete the batch with that error. Destination slots the pages
        do not hold are given back; a batch already counted only has its operation finished."""
        with self.queue.lock:
            op.errors.append(as_pagemem_error(
                exc, f"completing a {plan.kind} of pages {batch.src.name}->{plan.dest.name}"))
            last = op.remaining == 0
            if not batch.counted:
                held = [d for page, _, d in batch.pages if page.copy_on(plan.dest) == d]
                plan.dest.release([d for _, _, d in batch.pages if d not in held])
                batch.counted = True
                op.remaining -= 1
                last = op.remaining == 0
        if last:
            self._finish(op)

    def _finish(self, op: Op) -> None:
        with self.queue.lock:
            for page in op.pages:
                page.forget(op)
        self.queue.complete(op)

    # ------------------------------------------------------------------ copies given back

    def _promote(self, page: Page, tier: Tier, fence) -> None:
        """Make the replica on ``tier`` the home copy; give the old home slot back."""
        old, old_slot = page.tier, page.slot
        page.tier, page.slot = tier, page.replicas.pop(tier)
        self.give_back(old, [old_slot], fence)

    def _drop(self, page: Page, plan: PlacementPlan) -> None:
        tier = plan.dest
        if tier is page.tier:
            if not page.replicas:  # the other copy never arrived (an earlier copy failed)
                return
            self._promote(page, slowest(page.replicas), plan.fence)
            return
        slot = page.replicas.pop(tier, None)
        if slot is not None:
            self.give_back(tier, [slot], plan.fence)

    def give_back(self, tier: Tier, slots: list[int], fence) -> None:
        """Return slots to ``tier``; gpu slots wait for ``fence`` (the consumers' kernels)."""
        tier.release(slots, fence=fence if tier is self.gpu else None)
