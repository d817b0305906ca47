"""Logical pages: stable ids that tensors hold, mapped to a (tier, slot) that moves change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagemem.store.ordering import Op
    from pagemem.tiers import Tier


class Page:
    """One logical page. Guarded by the store's lock."""

    __slots__ = ("id", "tier", "slot", "live", "fill", "last_op", "pending", "future_tier")

    def __init__(self, page_id: int, tier: "Tier", slot: int) -> None:
        self.id = page_id
        self.tier = tier
        self.slot = slot
        self.live = 0
        """Bytes of live tensors on this page; the page is released when it drops to 0."""
        self.fill = 0
        """Bytes from the page's start that have been handed out; a later group may continue
        after them (``allocate_group(..., after=)``)."""
        self.last_op: Op | None = None
        """The newest unfinished operation on this page (later ones wait for it)."""
        self.pending = 0
        """Unfinished operations on this page."""
        self.future_tier = tier
        """Where the page will be once its queued moves finish (a hint for reservations)."""

    def __repr__(self) -> str:
        return f"Page({self.id}, {self.tier.name}:{self.slot}, live={self.live})"


class PageIds:
    """Recycles logical page ids (O(1))."""

    __slots__ = ("_next", "_free")

    def __init__(self) -> None:
        self._next = 0
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def give(self, page_id: int) -> None:
        self._free.append(page_id)
