"""O(1) free list of slot ids, the allocator under every tier."""

from __future__ import annotations


class SlotFreeList:
    """Integer slots ``0..capacity-1`` handed out from a LIFO stack.

    Allocating or freeing costs O(1) per slot. A run of slots freed together comes back in
    the same order on the next allocation, so a tensor evicted and brought back lands on
    adjacent slots again. Not thread-safe: the owning store serialises calls.
    """

    __slots__ = ("capacity", "_stack", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._stack = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def free(self) -> int:
        return len(self._stack)

    @property
    def used(self) -> int:
        return self.capacity - len(self._stack)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` slots. Raises ValueError (changing nothing) if fewer than ``n`` are free."""
        stack = self._stack
        if n > len(stack) or n < 0:
            raise ValueError(f"cannot allocate {n} slots: {len(stack)} free")
        if n == 0:
            return []
        slots = stack[-n:]
        del stack[-n:]
        slots.reverse()
        used = self._used
        for s in slots:
            used[s] = 1
        return slots

    def release(self, slots: list[int]) -> None:
        """Return ``slots``. Raises ValueError (changing nothing) on a slot that is not in use."""
        used = self._used
        for s in slots:
            if not 0 <= s < self.capacity or not used[s]:
                raise ValueError(f"slot {s} is not allocated")
        if len(set(slots)) != len(slots):
            raise ValueError("a slot is released twice")
        for s in slots:
            used[s] = 0
        self._stack.extend(reversed(slots))

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])
