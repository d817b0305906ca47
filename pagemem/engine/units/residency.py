"""Which paging units are on the gpu, and the parameters' ``.data`` while they are.

Two ways in; each unit's state lives on its ``Unit`` (see [Note: unit states]):

- **kept for good** (a unit the plan caches on the gpu): ``settle(unit)`` makes the gpu copy the
  only one (``KEPT``), so each update refreshes one copy; evicting it moves it home;
- **as the plan says** (``executor.py``): ``stage(unit, pages)`` starts copying a run of the
  unit's pages to the gpu at the op the plan's ``move_to_gpu`` names; ``bind(unit)`` at its
  ``compute`` waits for that unit's copies only (and copies what was not staged: a miss), then
  points the parameters at the gpu pages; ``release(unit)`` at the plan's ``release``;
- **on demand** (the warm-up iteration, and an iteration that left its plan): ``ensure(units)``
  binds, first evicting the least recently used units not in use until the pages fit, and the
  non-model bytes the caller reserves fit beside them; then it stages the unit the previous
  demand iteration used next, if that fits without evicting.

Where the compute copy is the master (``ParamBank.compute_is_master``) every unit is home on the
gpu (``PARKED``): binding points its parameters at the master pages (``KEPT``), releasing keeps
them bound (a unit has no pages to give back), nothing evicts them; only ``release_all`` unbinds
them, before the store resizes the arena or closes.

[Note: parameters are views over page memory]
While a unit is resident each of its ``nn.Parameter`` objects has ``.data`` set to a view of its
gpu replica (``PagedTensor.view``, which pins the pages for as long as that view or anything
derived from it lives, autograd's saved tensors included). Releasing a unit points ``.data`` at a
placeholder of the same shape and dtype (Hugging Face code reads ``.shape``) and drops the
replica; if a derived tensor still pins it, the replica stays (a *zombie*) until it dies and is
dropped later, so no tensor ever aliases a slot that was given to another unit. The Parameter
objects themselves never change, so optimizer and autograd references stay valid.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from pagemem.engine.interrupts import shielded
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.records import placeholder
from pagemem.engine.units.unit import Unit, UnitState
from pagemem.engine.units.guard import Guard, Unguarded
from pagemem.engine.units.writes import KeepsWrites, storage_ptr
from pagemem.errors import InvalidRequest, OutOfMemory


class Residency(KeepsWrites):
    def __init__(self, bank: ParamBank, guard: Guard | None = None,
                 wait_for_updates: Callable[[Iterable[int]], None] | None = None) -> None:
        """``wait_for_updates(params)``: the updates of ``params`` running behind backward
        (``overlap_update``) have landed once it returns: their master weights and compute copy
        agree again, which ``keep_writes`` compares (see [Note: writes to parameters])."""
        self.bank = bank
        self._wait_for_updates = wait_for_updates if wait_for_updates is not None else (lambda params: None)
        self.guard = guard if guard is not None else Unguarded()
        """Told of every bind and eviction (see [Note: evicted parameters])."""
        self.store = bank.store
        self._gpu = self.store.tier("gpu")
        self.page_bytes = self.store.page_bytes
        self.budget_bytes = self.store.config.pages("gpu") * self.page_bytes
        """The gpu budget: pages plus the non-model memory callers reserve beside them."""
        self.home_on_gpu = bank.compute_is_master
        """Every unit's compute copy is its master, kept on the gpu (see the module docs)."""
        self._units = bank.layers
        if self.home_on_gpu:
            for u in self._units:
                u.to(UnitState.PARKED)
        self._clock = 0
        """Ticks at every use of a unit (``Unit.last_used``: least recently used goes first)."""
        self._order: list[int] = []
        """Units in the order the previous demand iteration asked for them (what staging on
        demand follows)."""
        self._seen: list[int] = []
        self._cursor = 0
        self._by_ptr: dict[int, int] = {}
        self.fetches = 0
        """Units made resident on demand."""
        self.prefetches = 0
        """Units staged ahead of use (by the plan, or by the demand path's guess)."""
        self.evictions = 0
        self.misses = 0
        """Units a plan's compute found not fully staged (the executor copied the rest)."""
        self.host_stages = 0
        """Runs of compute pages staged from nvme to the cpu ahead of their move to the gpu."""
        self._data_taken: set[int] = set()
        self._parked: dict[int, int] = {}
        """Each evicted parameter's placeholder storage: one that moved was given other memory."""
        with torch._C.DisableTorchFunctionSubclass():
            for i, (_, p) in enumerate(bank.params):
                if p.numel():
                    self._parked[i] = storage_ptr(p)
        """Parameters whose ``.data`` was handed out since they were last checked."""
        self.written = 0
        """Parameters written in place whose new values were kept (see ``keep_writes``)."""
        self.deferred_releases = 0
        """Releases a plan asked for while a module scope still held the unit (it stays)."""
        self.wait_seconds = 0.0
        """Time the compute thread spent waiting for pages (the gpu idle, on the stand-in)."""

    @property
    def used_pages(self) -> int:
        return self._gpu.used_pages

    def param_at(self, ptr: int) -> int | None:
        """The resident parameter whose data starts at address ``ptr``, if any."""
        return self._by_ptr.get(ptr)

    def units_of(self, params: Iterable[int]) -> list[int]:
        return sorted({self.bank.layer_of[i] for i in params})

    def resident_units(self) -> list[int]:
        """Units bound (a replica or their only copy) or staging."""
        return [u.index for u in self._units if u.bound or u.state is UnitState.STAGING]

    def is_bound(self, li: int) -> bool:
        return self._units[li].bound

    def is_settled(self, li: int) -> bool:
        return self._units[li].settled

    def state_of(self, li: int) -> UnitState:
        return self._units[li].state

    # ------------------------------------------------------------------ as the plan says

    @shielded
    def stage(self, li: int, pages: range | None = None) -> None:
        """Start copying unit ``li``'s pages (all, or the run ``pages``) to the gpu. Reserves
        now: OutOfMemory, changing nothing, when they do not fit."""
        if self.home_on_gpu:
            return
        layer, u = self.bank.layers[li], self._units[li]
        if u.bound or u.settled:  # a parked unit's only copy is on the gpu already
            return
        if self.bank.gathered:  # [Note: gathered units]: the whole unit at its first staged run of pages
            if u.state is not UnitState.STAGING:
                self._stage_gather(layer)
            return
        handle = self.store.copy(layer.compute, "gpu", pages=pages)
        u.to(UnitState.STAGING)
        u.staged.append(handle)
        u.staged_pages += len(pages) if pages is not None else self.store.page_count(layer.compute)
        self.prefetches += 1

    @shielded
    def stage_host(self, li: int, pages: range | None = None) -> None:
        """Start copying unit ``li``'s pages (all, or the run ``pages``) from their home on nvme
        to the cpu, so that staging them to the gpu later reads memory ([Note: homes on nvme]).
        Nothing where the compute copy is not on nvme, or the unit is on the gpu; no cpu room
        leaves them to be read from nvme at their ``stage``."""
        layer, u = self.bank.layers[li], self._units[li]
        if self.home_on_gpu or self.bank.gathered or self.bank.home_tier != "nvme" or u.bound or u.settled:
            return
        try:
            self.store.copy(layer.compute, "cpu", pages=pages)
            self.host_stages += 1
        except OutOfMemory:
            pass

    @shielded
    def release_host(self, li: int) -> None:
        """Drop the cpu copy ``stage_host`` made of unit ``li``'s pages (its home stays on nvme).
        A page pinned or in flight keeps its copy until the next release."""
        if self.home_on_gpu or self.bank.gathered or self.bank.home_tier != "nvme":
            return
        layer = self.bank.layers[li]
        try:
            self.store.release(layer.compute, "cpu")
        except InvalidRequest:
            pass

    @shielded
    def bind(self, li: int) -> None:
        """Make unit ``li`` resident: wait for its staged copies, copy whatever was not staged
        (counted in ``misses``), point its parameters at the gpu pages."""
        layer, u = self.bank.layers[li], self._units[li]
        if u.bound:
            self._touch(u)
            return
        if self.home_on_gpu:
            self._bind_views(layer)
            return
        if not u.settled and u.staged_pages < self.bank.compute_pages(li):
            self.misses += 1
        self._fetch(layer, keep={li}, reserve=0)

    @shielded
    def settle(self, li: int) -> None:
        """Keep unit ``li`` on the gpu for good (a layer the plan caches there): its gpu copy
        becomes the only one, so the refresh after each update writes one copy, not two. Evicting
        it later moves it back to the cpu. No room on either side leaves it as it was."""
        layer, u = self.bank.layers[li], self._units[li]
        if self.bank.gathered or u.settled or (u.bound and u.held):  # a scope may read it: it stays as it is
            return  # (a gathered unit is evicted before each update: [Note: gathered units])
        if u.bound:
            self.evict(layer)  # its views pin the pages: settle between unbound pages only
            if u.state is UnitState.ZOMBIE:
                return
        try:
            self._fetch(layer, keep={li}, reserve=0, bind=False)
        except OutOfMemory:
            return  # bound at its compute (a miss)
        try:
            self.store.release(layer.compute, self.bank.home_tier).wait()
            u.to(UnitState.PARKED)
        except InvalidRequest:
            pass
        self._bind_views(layer)

    @shielded
    def release(self, li: int) -> None:
        """Unit ``li`` leaves the gpu (see the Note): parameters back to placeholders, pages given
        back (or kept as a zombie while a derived tensor pins them). Units home on the gpu stay
        bound."""
        if self.home_on_gpu:
            return
        layer, u = self.bank.layers[li], self._units[li]
        if u.state is UnitState.STAGING:
            self._drop_staged(layer)
            return
        if u.bound and u.held:
            self.deferred_releases += 1  # a scope may still read it (see scopes.py)
            return
        self.evict(layer)

    # ------------------------------------------------------------------ on demand

    def new_iteration(self) -> bool:
        """A demand iteration begins: the units asked for since the last one become the order
        to stage in. True when that order differs from the one before."""
        changed = bool(self._order) and bool(self._seen) and self._seen != self._order
        if self._seen:
            self._order, self._seen = self._seen, []
        self._cursor = 0
        return changed

    @shielded
    def ensure(self, units: list[int], reserve: int = 0, stage_next: bool = True) -> None:
        """Make every listed unit resident, evicting least recently used ones not listed while
        the pages plus ``reserve`` non-model bytes exceed the budget; then (``stage_next``) stage
        the unit the previous demand iteration used next, if it fits without evicting."""
        keep = set(units)
        for li in units:
            self._seen.append(li)
            layer = self.bank.layers[li]
            if self._units[li].bound:
                self._touch(self._units[li])
            elif self.home_on_gpu:
                self._bind_views(layer)
            else:
                self._fetch(layer, keep, reserve)
                self.fetches += 1
            if stage_next:
                self._stage_after(li, reserve)

    @shielded
    def make_room(self, keep: Iterable[int], reserve: int) -> None:
        """Evict units not in ``keep`` until the gpu pages in use plus ``reserve`` bytes fit the
        budget (or nothing more can go)."""
        keep = set(keep)
        while self.used_pages * self.page_bytes + reserve > self.budget_bytes:
            if not self._evict_one(keep):
                return

    def _stage_after(self, li: int, reserve: int) -> None:
        """[Note: demand staging] follows the previous demand iteration's order: one unit ahead,
        and only into free room (it never evicts), so fetches stay the only ones that make room."""
        order = self._order
        if self.home_on_gpu or self.bank.gathered:
            return
        try:
            pos = order.index(li, self._cursor)
        except ValueError:
            return
        self._cursor = pos + 1
        if self._cursor >= len(order):
            return
        nxt = self.bank.layers[order[self._cursor]]
        if self._units[nxt.index].state is not UnitState.HOME:
            return
        need = self.store.page_count(nxt.compute)
        if (self.used_pages + need) * self.page_bytes + reserve > self.budget_bytes:
            return
        try:  # reserves up front: no room means OutOfMemory, nothing changed
            self.stage(nxt.index)
        except OutOfMemory:
            return

    def _fetch(self, layer: Unit, keep: set[int], reserve: int, bind: bool = True) -> None:
        t0 = time.perf_counter()
        u = self._units[layer.index]
        need = max(0, self.bank.compute_pages(layer.index) - u.staged_pages)
        while (self.used_pages + need) * self.page_bytes + reserve > self.budget_bytes:
            if not self._evict_one(keep):
                break
        while True:
            try:
                if self.bank.gathered and not u.staged:
                    self._gather(layer)
                elif self.bank.gathered:
                    for handle in u.staged:
                        handle.wait()
                else:
                    for handle in u.staged:
                        handle.wait()
                    self.store.copy(layer.compute, "gpu").wait()
                break
            except OutOfMemory as exc:
                if not self._evict_one(keep):
                    # the units in use now and this one must fit together: a budget that holds them (and
                    # the reserve) is the least this op needs; a later op may need more
                    pb = exc.page_bytes
                    least = -(-((self.used_pages + exc.requested_pages) * pb + reserve) // pb) * pb
                    raise OutOfMemory("gpu", exc.requested_pages, exc.free_pages, pb,
                                      f"layer {layer.name!r}: every other resident layer is in use (a module "
                                      "running holds it, or tensors derived from its parameters are alive)",
                                      least_bytes=max(least, self.budget_bytes + pb), least_is_bound=True) from None
        u.staged.clear()
        u.staged_pages = 0
        if bind:
            self._bind_views(layer)
        self.wait_seconds += time.perf_counter() - t0

    def _gather(self, layer: Unit) -> None:
        """A gathered unit's whole compute copy made on the gpu and filled from every rank's
        share ([Note: gathered units]); OutOfMemory, nothing made, when it does not fit."""
        assert self.bank.gather_unit is not None, "a gathered bank needs the engine's gather"
        self.bank.make_compute(layer)  # a zombie's copy, still pinned, is set aside (an update may have passed)
        try:
            self.bank.gather_unit(layer)
        except BaseException:
            self.bank.drop_compute(layer)
            raise

    def _stage_gather(self, layer: Unit) -> None:
        """Start a gathered unit's fetch ahead of its bind ([Note: gathered units]): its compute
        copy made on the gpu (OutOfMemory, nothing made, when it does not fit), the gather under
        way."""
        assert self.bank.gather_unit is not None, "a gathered bank needs the engine's gather"
        u = self._units[layer.index]
        self.bank.make_compute(layer)
        try:
            handle = self.bank.gather_unit.start(layer)
        except BaseException:
            self.bank.drop_compute(layer)
            raise
        u.to(UnitState.STAGING)
        u.staged.append(handle)
        u.staged_pages = self.bank.compute_pages(layer.index)
        self.prefetches += 1

    def _bind_views(self, layer: Unit) -> None:
        params = self.bank.params
        u = self._units[layer.index]
        try:  # one store call for the unit (a view each costs a queue entry)
            views: list = self.store.view_many(layer.compute, "gpu")
        except InvalidRequest:  # some on scattered slots: those get a lease each, below
            views = [None] * len(layer.compute)
        for i, t, view in zip(layer.params, layer.compute, views):
            p = params[i][1]
            try:
                data = view if view is not None else t.view("gpu")
            except InvalidRequest:  # scattered slots: a merged copy of the gpu pages (stats().view_copies)
                if self.home_on_gpu:  # a copy would go stale: updates write the master pages
                    raise InvalidRequest(f"parameter {params[i][0]!r}: its master pages are not adjacent on the "
                                         "gpu, so the parameter cannot be a view of them") from None
                lease = t.lease("gpu", write=False)
                u.leases.append(lease)
                data = lease.tensor
            with torch._C.DisableTorchFunctionSubclass():  # the engine's own: not a user's assignment
                if p.numel() and self._parked.get(i) not in (None, storage_ptr(p)):
                    # given other memory while evicted (set_ moves no guard): keep its values
                    self.bank.write_parameter(i, p.data)
                    self.written += 1
                p.data = data
            self.guard.bound(i)
            if data.numel():
                ptr = storage_ptr(data)
                self._by_ptr[ptr] = i
                u.bound_ptrs[i] = ptr
        with torch._C.DisableTorchFunctionSubclass():
            u.versions = [params[i][1]._version for i in layer.params]
        u.to(UnitState.KEPT if u.settled else UnitState.BOUND)
        self._touch(u)

    def _touch(self, u: Unit) -> None:
        self._clock += 1
        u.last_used = self._clock

    def _evict_one(self, keep: set[int]) -> bool:
        """Give back the pages of one unit not in ``keep``: staged but unbound copies first,
        then zombies, then the least recently used resident unit. False when nothing could go
        (nothing can where units are home on the gpu)."""
        if self.home_on_gpu:
            return False
        for u in self._units:
            if u.state is UnitState.STAGING and u.index not in keep:
                self._drop_staged(u)
                return True
        for u in self._units:
            if u.state in (UnitState.ZOMBIE, UnitState.PARKED) and self._drop(u):
                return True
        by_use = sorted((u for u in self._units if u.bound), key=lambda u: u.last_used)
        for spare_backward in (True, False):  # units backward scopes hold go last
            for u in by_use:
                if u.index in keep or u.held or (spare_backward and u.soft_holds) or not u.bound:
                    continue
                self.evict(u)
                if not u.bound and u.state is not UnitState.ZOMBIE and u.state is not UnitState.PARKED:
                    return True
        return False

    @shielded
    def evict(self, layer: Unit) -> None:
        """Point the unit's parameters at placeholders and drop its gpu replica (see the Note)."""
        u = self._units[layer.index]
        if not u.bound:
            return
        self._keep_writes(layer)
        for i in layer.params:
            p = self.bank.params[i][1]
            with torch._C.DisableTorchFunctionSubclass():
                p.data = placeholder(p.shape, p.dtype, p.device)
                self._parked[i] = storage_ptr(p)
            self.guard.evicted(i)
        for lease in u.leases:
            lease.release()
        u.leases.clear()
        for ptr in u.bound_ptrs.values():
            self._by_ptr.pop(ptr, None)
        u.bound_ptrs.clear()
        self.evictions += not self.home_on_gpu
        if self.home_on_gpu:
            u.to(UnitState.PARKED)
        elif u.settled:  # its only copy goes home, or waits on the gpu for room there
            u.to(UnitState.HOME if self._give_back(layer) else UnitState.PARKED)
        else:
            u.to(UnitState.HOME if self._give_back(layer) else UnitState.ZOMBIE)

    def _give_back(self, layer: Unit) -> bool:
        """Give back the unit's gpu pages: drop the replica, or move a settled unit's only copy
        home. False while a tensor derived from an old view pins them (or no cpu room is left).
        Units home on the gpu have nothing to give back."""
        if self.home_on_gpu:
            return True
        if self.bank.gathered:
            return self.bank.drop_compute(layer)
        try:
            if layer.settled:
                self.store.move(layer.compute, self.bank.home_tier).wait()
            else:
                self.store.release(layer.compute, "gpu").wait()
        except (InvalidRequest, OutOfMemory):
            return False
        return True

    def _drop(self, layer: Unit) -> bool:
        """A zombie's replica, or a parked unit's only copy, goes back home if it can now
        (units home on the gpu stay parked)."""
        if self.home_on_gpu or not self._give_back(layer):
            return False
        layer.to(UnitState.HOME)
        return True

    def _drop_staged(self, layer: Unit) -> None:
        """Wait for a unit's staged copies and drop what they brought."""
        u = self._units[layer.index]
        for handle in u.staged:
            try:
                handle.wait()
            except Exception:  # a failed copy leaves whatever landed; dropped all the same
                pass
        u.staged.clear()
        u.staged_pages = 0
        u.to(UnitState.HOME if self._give_back(layer) else UnitState.ZOMBIE)

    @shielded
    def release_all(self) -> None:
        for layer, u in zip(self.bank.layers, self._units):
            if u.state is UnitState.STAGING:
                self._drop_staged(layer)
            self.evict(layer)
        for u in self._units:
            if u.state is UnitState.ZOMBIE or (u.state is UnitState.PARKED and not self.home_on_gpu):
                self._drop(u)

