"""Where a bank's optimizer states and gradient sums go between tiers, as a part of ``ParamBank``:
staged to the cpu ahead of their update, brought there by the streamed update ([Note: homes on
nvme] in ``homes.py``), kept on the gpu for a unit the plan caches there ([Note: states a plan
keeps on the gpu])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from pagemem.engine.units.records import grad_tier_beside, streamed_pages
from pagemem.errors import InvalidRequest, OutOfMemory
from pagemem.store import PagedTensor
from pagemem.store.layout import pack

if TYPE_CHECKING:
    from pagemem.engine.units.unit import Unit


class StatesMoved:
    """``ParamBank``'s moves of optimizer states and gradient sums (a mixin: the bank's fields)."""

    layers: list["Unit"]
    store: object
    optimizer_tier: str
    home_tier: str
    states_apart: bool
    compute_is_master: bool

    def stage_states(self, li: int) -> None:
        """Start copying unit ``li``'s optimizer states to the cpu ahead of their update (the
        plan's ``move_to_cpu optim``), where the cpu has room for all of them beside twice what its
        streamed update holds at once (``stream_pages``); else they are read at the update."""
        layer = self.layers[li]
        if self.layers[li].state_tier != "nvme" or self.states_apart:  # the lock-free updater fetches its own
            return
        states = layer.states()
        # whole units only, and only beside room for the streamed update's own batches: a partial
        # copy, or one that leaves the update no room, is dropped by it and read again (measured:
        # 3x the disk traffic and 2x the step time on a GPT with states on nvme)
        need = self.store.page_count(states)
        if self.store.tier("cpu").free_pages < need + 2 * (self.stream_pages(li) or 0):
            return
        try:
            self.store.copy(states, "cpu")
        except OutOfMemory:
            pass

    def stream_pages(self, li: int) -> int | None:
        """The most cpu pages unit ``li``'s update holds at once where it is streamed
        ([Note: homes on nvme] in ``homes.py``): its largest parameter's optimizer states and
        gradient sums that rest on nvme when the unit is not kept on the gpu, counted as the
        engine's least budget counts them (``records.streamed_pages``). None where nothing of it
        rests on nvme, or it has nothing to update."""
        kinds = 3 if self.optimizer_tier == "nvme" else 0
        kinds += grad_tier_beside(self.optimizer_tier, self.home_tier) == "nvme"
        sizes = [self.params[i][1].numel() for i in self.layers[li].params if self.records[i].trainable]
        if not kinds or not sizes:
            return None
        return max(streamed_pages(n, kinds, self.store.page_bytes) for n in sizes)

    def drop_cpu_copies(self) -> None:
        """Give back the cpu copies staged of what lives on nvme: optimizer states
        (``stage_states``) and compute copies (``Residency.stage_host``); the update needs their
        room for what it streams through the cpu ([Note: homes on nvme])."""
        for layer in self.layers:
            kinds = [layer.states()] if layer.state_tier == "nvme" else []
            if self.home_tier == "nvme" and not self.compute_is_master:
                kinds.append(layer.compute)
            for tensors in kinds:  # pages without a cpu copy are skipped by the store
                if tensors:
                    try:
                        self.store.release(tensors, "cpu").wait()
                    except InvalidRequest:
                        pass  # pinned, or its only copy on the cpu: it stays

    def on_disk(self, params: Iterable[int]) -> list[PagedTensor]:
        """The optimizer states and gradient sums of ``params`` that live on nvme (what their
        update brings to the cpu first: [Note: homes on nvme])."""
        out: list[PagedTensor] = []
        for i in params:
            layer, k = self.where(i)
            kinds = ("master", "exp_avg", "exp_avg_sq") if layer.state_tier == "nvme" else ()
            if self.grad_tier_of(layer.index) == "nvme":
                kinds += ("grad",)
            for kind in kinds:
                t = getattr(layer, kind)[k]
                if t is not None and (kind != "master" or not self.compute_is_master):
                    out.append(t)
        return out

    # ------------------------------------------------------------------ states kept on the gpu

    def gpu_state_pages(self, li: int) -> int:
        """Gpu pages unit ``li``'s optimizer states and gradient sums take when ``place_states``
        keeps them there (each kind on fresh pages); none where they are on the gpu at rest
        (``optimizer_tier="gpu"``: counted with the pages at rest, not the plan's)."""
        if self.optimizer_tier == "gpu":
            return 0
        sizes = [self.params[i][1].numel() * 4 for i in self.layers[li].params if self.records[i].trainable]
        return 4 * pack(sizes, self.store.page_bytes).pages if sizes else 0

    def place_states(self, li: int, tier: str | None) -> bool:
        """[Note: states a plan keeps on the gpu] Put unit ``li``'s optimizer states and gradient
        sums on ``tier`` (``"gpu"`` for a unit the plan caches there, so that its update runs on
        the gpu, as the plan's ``update`` task says; None: back on ``optimizer_tier``). The
        states are copied into fresh pages there (each unit's on pages of its own: states of
        neighbouring units share pages where they were allocated together, so moving pages
        would split a neighbour) and the old ones freed. False, changing nothing, when the new
        pages cannot be had. Call between updates (gradient sums are carried over too)."""
        tier = tier or self.optimizer_tier
        if self.layers[li].state_tier == tier:
            return True
        if self.states_apart:  # the lock-free updater owns the states: they stay on their tier
            return False
        layer = self.layers[li]
        kinds = ("master", "exp_avg", "exp_avg_sq", "grad")
        self.grads_landed(layer.params)
        grad_tier = grad_tier_beside(tier, self.home_tier)
        new: dict[str, list[PagedTensor]] = {}
        try:
            for kind in kinds:
                present = [t for t in getattr(layer, kind) if t is not None]
                new[kind] = self.store.allocate_group([(t.shape, torch.float32) for t in present],
                                                      tier=grad_tier if kind == "grad" else tier) if present else []
        except OutOfMemory:
            for group in new.values():
                for t in group:
                    t.free()
            return False
        self._lasting = {key: v for key, v in self._lasting.items() if self.layer_of[key[1]] != li}
        for kind in kinds:
            fresh = iter(new[kind])
            moved: list[PagedTensor | None] = []
            for src in getattr(layer, kind):
                if src is None:
                    moved.append(None)
                    continue
                dst = next(fresh)
                dst.copy_(src.to_torch())
                src.free()
                moved.append(dst)
            setattr(layer, kind, moved)
        layer.state_tier = tier
        return True
