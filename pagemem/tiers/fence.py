"""Slots released behind a fence: given back only once the work that still reads them is done.

A fence is anything with ``query()`` and ``synchronize()``, such as a ``torch.cuda.Event``
recorded on the stream whose kernels still read the slot. Fences are kept oldest first; those
on one stream complete in that order, so reclaiming usually only looks at the front.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class Fence(Protocol):
    """Work that must finish before something it uses may be reused."""

    def query(self) -> bool:
        """True once the work has finished (never blocks)."""

    def synchronize(self) -> None:
        """Block until the work has finished."""


class PendingSlots:
    """Released slots waiting for their fences, oldest release first. Not thread-safe."""

    __slots__ = ("_queue", "_slots")

    def __init__(self) -> None:
        self._queue: deque[tuple[Fence, list[int]]] = deque()
        self._slots: set[int] = set()

    def __len__(self) -> int:
        """How many slots are waiting."""
        return len(self._slots)

    def __contains__(self, slot: object) -> bool:
        return slot in self._slots

    def add(self, slots: list[int], fence: Fence) -> None:
        """Hold ``slots`` until ``fence`` completes. Raises ValueError (changing nothing) on a
        slot that is already waiting or given twice."""
        for s in slots:
            if s in self._slots:
                raise ValueError(f"slot {s} is already released (waiting on its fence)")
        if len(set(slots)) != len(slots):
            raise ValueError("a slot is released twice")
        if slots:
            self._queue.append((fence, list(slots)))
            self._slots.update(slots)

    def reclaim(self, give: Callable[[list[int]], None], need: int = 0) -> int:
        """Pass the slots of completed fences to ``give``; return how many were given.

        Takes completed releases from the front of the queue. If that gives fewer than ``need``
        slots, also those completed further back, then synchronizes the oldest fences until
        ``need`` slots (or every waiting slot) are back. A fence that raises leaves its slots
        waiting and everything already given given.
        """
        queue = self._queue
        given = 0
        while queue and queue[0][0].query():
            given += self._give(queue.popleft()[1], give)
        if given < need and len(queue) > 1:  # completed out of order (another stream)
            completed = [fence.query() for fence, _ in queue]
            if any(completed):
                ready = [slots for (_, slots), c in zip(queue, completed) if c]
                self._queue = queue = deque(e for e, c in zip(queue, completed) if not c)
                for slots in ready:
                    given += self._give(slots, give)
        while given < need and queue:
            queue[0][0].synchronize()
            given += self._give(queue.popleft()[1], give)
        return given

    def _give(self, slots: list[int], give: Callable[[list[int]], None]) -> int:
        self._slots.difference_update(slots)
        give(slots)
        return len(slots)
