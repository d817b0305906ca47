"""The interface all three tiers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.fence import Fence, PendingSlots
from pagemem.tiers.freelist import SlotFreeList

PageDone = Callable[[BaseException | None], None]
"""Completion of a page read or write: None, or the error that stopped it."""

TIER_NAMES = ("gpu", "cpu", "nvme")


class Tier(ABC):
    """A tier holds ``capacity`` page slots of ``page_bytes`` each.

    Slots come from a free list that keeps free slots as coalesced runs, so a request gets
    adjacent slots whenever a long enough run is free. A slot released behind a fence (work
    still reading it) waits until the fence completes. Page data moves in and out through
    ``start_read`` / ``start_write`` against host buffers, asynchronously. Memory tiers also
    expose each slot as a tensor (``buffer``); a host-addressable tier's slots are host buffers
    themselves. Not thread-safe: the caller serialises allocate and release.
    """

    name: str
    page_bytes: int
    host_addressable: bool = False
    """True when slots are plain host memory the I/O engines can read and write."""
    host_spans: bool = False
    """True when a run of adjacent slots moves to or from one host buffer in one call
    (``start_read_span`` / ``start_write_span``: the nvme tier)."""

    def __init__(self, name: str, capacity: int, page_bytes: int) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.slots = SlotFreeList(capacity)
        self.pending = PendingSlots()

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def free_pages(self) -> int:
        """Free slots, counting those waiting on a fence (they come back without anyone acting)."""
        return self.slots.free + len(self.pending)

    @property
    def used_pages(self) -> int:
        return self.capacity - self.free_pages

    @property
    def pending_pages(self) -> int:
        """Released slots still waiting for their fence."""
        return len(self.pending)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` slots (adjacent when a long enough free run exists).

        First takes back released slots whose fences have completed; when still short, waits on
        the oldest fences until enough are back. Raises ValueError (changing nothing) only when
        ``free_pages < n``.
        """
        free = self.free_pages
        if n > free or n < 0:
            raise ValueError(f"cannot allocate {n} slots: {free} free")
        if self.pending:
            self.pending.reclaim(self.slots.release, n - self.slots.free)
        return self.slots.allocate(n)

    def release(self, slots: list[int], fence: Fence | None = None) -> None:
        """Give ``slots`` back; with a ``fence``, only once ``fence.query()`` is True (until then
        they count as free but are not handed out). Raises ValueError (changing nothing) on a slot
        that is not allocated, already released, or listed twice."""
        if fence is None:
            for s in slots:
                if s in self.pending:
                    raise ValueError(f"slot {s} is already released (waiting on its fence)")
            self.slots.release(slots)
            return
        used = self.slots.is_used
        for s in slots:
            if not 0 <= s < self.capacity or not used(s):
                raise ValueError(f"slot {s} is not allocated")
        self.pending.add(slots, fence)

    def fence(self) -> Fence | None:
        """A fence after the work queued so far on the caller's stream that may still read this
        tier's slots, to pass to ``release``; None when every access is already complete."""
        return None

    @property
    def resident(self) -> bool:
        """True when slots are memory that tensors can view (gpu and cpu tiers)."""
        return False

    def buffer(self, slot: int) -> torch.Tensor:
        """The slot's bytes as a uint8 tensor (memory tiers only)."""
        raise TypeError(f"tier {self.name!r} is not addressable memory")

    def span(self, first_slot: int, count: int) -> torch.Tensor:
        """Adjacent slots ``first_slot .. first_slot+count-1`` as one uint8 tensor (memory tiers)."""
        raise TypeError(f"tier {self.name!r} is not addressable memory")

    def host_buffer(self, slot: int, count: int = 1) -> HostBuffer:
        """The slot (``count`` adjacent slots from it) as a host buffer (host-addressable tiers only)."""
        raise TypeError(f"tier {self.name!r} is not host-addressable")

    @abstractmethod
    def start_read(self, slot: int, into: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        """Copy the page in ``slot`` into the host buffer ``into``; call ``done`` when finished.
        ``after``: a fence the copy must wait for (memory tiers; the nvme tier ignores it)."""

    @abstractmethod
    def start_write(self, slot: int, src: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        """Copy the host buffer ``src`` into ``slot``; call ``done`` when finished.
        ``after``: a fence the copy must wait for (memory tiers; the nvme tier ignores it)."""

    def start_read_span(self, first: int, count: int, into: HostBuffer, done: PageDone) -> None:
        """Read ``count`` adjacent slots from ``first`` into the host buffer ``into`` in one call
        (tiers with ``host_spans``)."""
        raise TypeError(f"tier {self.name!r} does not move spans to host buffers")

    def start_write_span(self, first: int, count: int, src: HostBuffer, done: PageDone) -> None:
        """Write the host buffer ``src`` to ``count`` adjacent slots from ``first`` in one call
        (tiers with ``host_spans``)."""
        raise TypeError(f"tier {self.name!r} does not move spans to host buffers")

    @abstractmethod
    def describe(self) -> dict:
        """Backend facts for people and stats: what memory or files, which engines."""

    def close(self) -> None:
        """Release the tier's memory or files."""
