"""Free list of slot ids that keeps free slots as coalesced runs, the allocator under every tier."""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heappop, heappush


class SlotFreeList:
    """Integer slots ``0..capacity-1``, the free ones kept as maximal runs of adjacent slots.

    ``allocate(n)`` returns ``n`` adjacent ascending slots whenever a free run of ``n`` or more
    exists, so a tensor's pages can be viewed without a copy. It takes the start of the
    *best-fitting* run (the shortest run that fits, the lowest address among equals): long runs
    stay whole for the long requests that need them and an exact fit leaves no sliver, while
    address order packs allocations towards low slots, so frees tend to re-merge into long runs
    (best fit and address-ordered fit are the low-fragmentation policies in Wilson et al.'s
    allocator survey). Only when no run is long enough does a request get several runs: the
    longest first, so as few pieces as possible, the last piece again by best fit.

    Released slots merge with their free neighbours at once (boundary tags: run length by first
    slot, first slot by last slot). Runs are indexed by length: a sorted list of the distinct
    lengths present (bisect; at most sqrt(2 * capacity) of them) and, per length, a min-heap of
    run starts with lazy deletion. Each call costs O(log n) per run it touches, plus O(1) per
    slot handed out or given back. Not thread-safe: the owning tier's caller serialises calls.
    """

    HOST_BYTES_PER_SLOT = 1
    """Host memory this list takes per slot (the in-use flags), however many are free."""

    __slots__ = ("capacity", "_used", "_free", "_len_at", "_start_at", "_lengths", "_count", "_heaps")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._used = bytearray(capacity)
        self._free = capacity
        self._len_at: dict[int, int] = {}
        """First slot of each free run -> its length."""
        self._start_at: dict[int, int] = {}
        """Last slot of each free run -> its first slot."""
        self._lengths: list[int] = []
        """Distinct run lengths present, ascending."""
        self._count: dict[int, int] = {}
        """Run length -> how many free runs have it."""
        self._heaps: dict[int, list[int]] = {}
        """Run length -> min-heap of starts; entries whose run is gone are skipped lazily."""
        if capacity:
            self._add(0, capacity)

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    @property
    def largest_run(self) -> int:
        """Length of the longest free run (0 when nothing is free)."""
        return self._lengths[-1] if self._lengths else 0

    def runs(self) -> list[tuple[int, int]]:
        """The free runs as ``(start, length)``, by address (O(runs log runs); for tests and stats)."""
        return sorted(self._len_at.items())

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])

    def last_used(self) -> int:
        """The highest slot in use, or -1 when none is."""
        return self._used.rfind(1)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` slots: one adjacent ascending run when some free run is long enough, else
        as few runs as possible. Raises ValueError (changing nothing) if fewer than ``n`` are free."""
        if n > self._free or n < 0:
            raise ValueError(f"cannot allocate {n} slots: {self._free} free")
        if not n:
            return []
        lengths = self._lengths
        if lengths[-1] >= n:  # one run: the common case
            length = lengths[bisect_left(lengths, n)]
            start = self._take(length, n)
            self._free -= n
            self._used[start:start + n] = b"\x01" * n
            return list(range(start, start + n))
        pieces: list[tuple[int, int]] = []
        left = n
        while left:
            if lengths[-1] >= left:
                length = lengths[bisect_left(lengths, left)]
                take = left
            else:
                length = take = lengths[-1]
            pieces.append((self._take(length, take), take))
            left -= take
        self._free -= n
        pieces.sort()
        slots: list[int] = []
        used = self._used
        for start, take in pieces:
            used[start:start + take] = b"\x01" * take
            slots.extend(range(start, start + take))
        return slots

    def release(self, slots: list[int]) -> None:
        """Return ``slots``. Raises ValueError (changing nothing) on a slot that is not in use."""
        used = self._used
        capacity = self.capacity
        for s in slots:
            if not 0 <= s < capacity or not used[s]:
                raise ValueError(f"slot {s} is not allocated")
        if len(slots) < 2:
            if slots:
                self._give_back(slots[0], 1)
                self._free += 1
            return
        if len(set(slots)) != len(slots):
            raise ValueError("a slot is released twice")
        ordered = slots if all(a + 1 == b for a, b in zip(slots, slots[1:])) else sorted(slots)
        start = prev = ordered[0]
        for s in ordered[1:]:
            if s != prev + 1:
                self._give_back(start, prev + 1 - start)
                start = s
            prev = s
        self._give_back(start, prev + 1 - start)
        self._free += len(slots)

    def resize(self, capacity: int) -> None:
        """Grow to ``capacity`` slots (the new ones free, merged with a free run before them), or
        shrink to it (the slots cut off must be free). Raises ValueError, changing nothing, on a
        negative capacity or a slot in use at or above it."""
        old = self.capacity
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if capacity < old:
            used = self._used.find(1, capacity)
            if used >= 0:
                raise ValueError(f"slot {used} is in use; cannot shrink to {capacity} slots")
            top = self._start_at[old - 1]  # the free run that ends at the last slot
            self._remove(top, old - top)
            if top < capacity:
                self._add(top, capacity - top)
            del self._used[capacity:]
            self._free -= old - capacity
        elif capacity > old:
            start, length = old, capacity - old
            left = self._start_at.get(old - 1)
            if left is not None:
                left_len = self._len_at[left]
                self._remove(left, left_len)
                start, length = left, length + left_len
            self._used.extend(bytes(capacity - old))
            self._free += capacity - old
            self._add(start, length)
        self.capacity = capacity

    # ------------------------------------------------------------------ runs

    def _give_back(self, start: int, length: int) -> None:
        """Free the used slots ``start..start+length-1``, merged with the free runs beside them."""
        self._used[start:start + length] = bytes(length)
        end = start + length
        right = self._len_at.get(end)
        if right is not None:
            self._remove(end, right)
            length += right
        left_start = self._start_at.get(start - 1)
        if left_start is not None:
            left_len = self._len_at[left_start]
            self._remove(left_start, left_len)
            start, length = left_start, length + left_len
        self._add(start, length)

    def _add(self, start: int, length: int) -> None:
        self._len_at[start] = length
        self._start_at[start + length - 1] = start
        count = self._count.get(length, 0)
        self._count[length] = count + 1
        if not count:
            insort(self._lengths, length)
        heap = self._heaps.get(length)
        if heap is None:
            self._heaps[length] = [start]
            return
        heappush(heap, start)
        if len(heap) > 2 * count + 16:  # mostly stale entries: rebuild (amortised O(1) per push)
            len_at = self._len_at
            self._heaps[length] = sorted({s for s in heap if len_at.get(s) == length})

    def _remove(self, start: int, length: int) -> None:
        del self._len_at[start]
        del self._start_at[start + length - 1]
        count = self._count[length] - 1
        if count:
            self._count[length] = count
        else:  # the last run of this length: its heap holds only stale entries now
            del self._count[length]
            del self._heaps[length]
            del self._lengths[bisect_left(self._lengths, length)]

    def _take(self, length: int, n: int) -> int:
        """Take the first ``n`` slots of the lowest free run of exactly ``length``; its start."""
        heap = self._heaps[length]
        len_at = self._len_at
        while len_at.get(heap[0]) != length:
            heappop(heap)
        start = heap[0]
        self._remove(start, length)
        if n < length:
            self._add(start + n, length - n)
        return start
