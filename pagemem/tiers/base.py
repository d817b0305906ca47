"""The interface all three tiers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.freelist import SlotFreeList

PageDone = Callable[[BaseException | None], None]
"""Completion of a page read or write: None, or the error that stopped it."""

TIER_NAMES = ("gpu", "cpu", "nvme")


class Tier(ABC):
    """A tier holds ``capacity`` page slots of ``page_bytes`` each.

    Slots come from an O(1) free list. Page data moves in and out through ``start_read`` /
    ``start_write`` against host buffers, asynchronously. Memory tiers also expose each slot
    as a tensor (``buffer``); a host-addressable tier's slots are host buffers themselves.
    """

    name: str
    page_bytes: int
    host_addressable: bool = False
    """True when slots are plain host memory the I/O engines can read and write."""

    def __init__(self, name: str, capacity: int, page_bytes: int) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.slots = SlotFreeList(capacity)

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def free_pages(self) -> int:
        return self.slots.free

    @property
    def used_pages(self) -> int:
        return self.slots.used

    def allocate(self, n: int) -> list[int]:
        return self.slots.allocate(n)

    def release(self, slots: list[int]) -> None:
        self.slots.release(slots)

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

    def host_buffer(self, slot: int) -> HostBuffer:
        """The slot as a host buffer (host-addressable tiers only)."""
        raise TypeError(f"tier {self.name!r} is not host-addressable")

    @abstractmethod
    def start_read(self, slot: int, into: HostBuffer, done: PageDone) -> None:
        """Copy the page in ``slot`` into the host buffer ``into``; call ``done`` when finished."""

    @abstractmethod
    def start_write(self, slot: int, src: HostBuffer, done: PageDone) -> None:
        """Copy the host buffer ``src`` into ``slot``; call ``done`` when finished."""

    @abstractmethod
    def describe(self) -> dict:
        """Backend facts for people and stats: what memory or files, which engines."""

    def close(self) -> None:
        """Release the tier's memory or files."""
