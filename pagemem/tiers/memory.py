"""Memory tiers: ``gpu`` (device memory, or a host stand-in without CUDA) and ``cpu``."""

from __future__ import annotations

import torch

from pagemem.tiers.arena import CudaArena, HostArena, HostBuffer
from pagemem.tiers.base import PageDone, Tier
from pagemem.tiers.fence import Fence


class MemoryTier(Tier):
    """Page slots carved out of one arena; copies go through a copy engine."""

    def __init__(self, name: str, arena: HostArena | CudaArena, page_bytes: int, copier,
                 backend: str, host_addressable: bool) -> None:
        super().__init__(name, arena.nbytes // page_bytes, page_bytes)
        self.arena = arena
        self.copier = copier
        self.backend = backend
        self.host_addressable = host_addressable
        self.device = arena.tensor.device

    @property
    def resident(self) -> bool:
        return True

    def buffer(self, slot: int) -> torch.Tensor:
        start = slot * self.page_bytes
        return self.arena.tensor[start:start + self.page_bytes]

    def span(self, first_slot: int, count: int) -> torch.Tensor:
        start = first_slot * self.page_bytes
        return self.arena.tensor[start:start + count * self.page_bytes]

    def host_buffer(self, slot: int, count: int = 1) -> HostBuffer:
        if not self.host_addressable:
            return super().host_buffer(slot, count)
        return self.arena.buffer(slot * self.page_bytes, count * self.page_bytes)  # type: ignore[union-attr]

    def fence(self) -> Fence | None:
        """On CUDA, an event recorded now on the current stream of this tier's device: call it on
        the thread that queued the kernels still reading the slot, when it frees the slot, and
        pass it to ``release``. None for host memory (host accesses are complete on return)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # a host wait sleeps instead of spinning a core
        event.record(torch.cuda.current_stream(self.device))
        return event

    def read_span(self, first_slot: int, count: int, into: torch.Tensor, done: PageDone,
                  after: Fence | None = None) -> None:
        """Copy the ``count`` adjacent slots from ``first_slot`` into the uint8 tensor ``into``
        (host or device, ``count * page_bytes`` elements) in one copy; ``done(error)`` after.
        ``after``: a fence (on CUDA, a ``torch.cuda.Event``) the copy waits for first. ``into``
        must stay alive and untouched until ``done`` is called."""
        self.copier.copy(into, self._span_for(first_slot, count, into, "into"), done, after=after)

    def write_span(self, first_slot: int, count: int, src: torch.Tensor, done: PageDone,
                   after: Fence | None = None) -> None:
        """Copy the uint8 tensor ``src`` (host or device, ``count * page_bytes`` elements) into the
        ``count`` adjacent slots from ``first_slot`` in one copy; ``done(error)`` after.
        ``after`` as in ``read_span``; ``src`` must stay alive and unchanged until ``done``."""
        self.copier.copy(self._span_for(first_slot, count, src, "src"), src, done, after=after)

    def start_read(self, slot: int, into: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        self.read_span(slot, 1, into.tensor, done, after)

    def start_write(self, slot: int, src: HostBuffer, done: PageDone, after: Fence | None = None) -> None:
        self.write_span(slot, 1, src.tensor, done, after)

    def _span_for(self, first_slot: int, count: int, other: torch.Tensor, what: str) -> torch.Tensor:
        if count < 1 or first_slot < 0 or first_slot + count > self.capacity:
            raise ValueError(f"{self.name}: slots {first_slot}..{first_slot + count - 1} are not in "
                             f"[0, {self.capacity - 1}]")
        nbytes = count * self.page_bytes
        if other.dtype != torch.uint8 or other.numel() != nbytes:
            raise ValueError(f"{self.name}: {what} must be a uint8 tensor of {nbytes} elements, "
                             f"got {other.dtype} with {other.numel()}")
        return self.span(first_slot, count).view(other.shape)

    def resize(self, pages: int) -> None:
        """Move onto a new arena of ``pages`` slots on the same device: the used slots' bytes are
        copied to the same slots there, then the old arena is given back. Slots waiting on a
        fence are taken back first (waiting for it). Raises ValueError, changing nothing, when a
        used slot lies at or above ``pages``; MemoryError, changing nothing, when the new arena
        cannot be had. The caller ensures nothing reads or writes the tier meanwhile (no
        transfer in flight, no view of its memory alive)."""
        if self.pending:
            self.pending.reclaim(self.slots.release, len(self.pending))
        top = self.slots.last_used()
        if top >= pages:
            raise ValueError(f"{self.name}: slot {top} is in use; cannot shrink to {pages} slots")
        old = self.arena
        keep = (top + 1) * self.page_bytes  # the bytes of every used slot
        if keep < pages * self.page_bytes // 2:
            # [Note: resizing a full device] holds the old arena and the used bytes, not two
            # arenas: the engine shrinks a whole-budget arena to its plan's with few pages in use
            # (a transient second arena was the largest peak of a run with everything on nvme)
            self._resize_parked(pages, keep)
            return
        try:
            new = self._new_arena(pages)
        except MemoryError:
            self._resize_parked(pages, keep)
            return
        try:
            if keep:
                new.tensor[:keep].copy_(old.tensor[:keep])
                if new.tensor.is_cuda:
                    torch.cuda.synchronize(new.tensor.device)
            self.slots.resize(pages)
        except BaseException:
            new.close()
            raise
        self.arena = new
        old.close()

    def _new_arena(self, pages: int) -> HostArena | CudaArena:
        old = self.arena
        nbytes = pages * self.page_bytes
        return CudaArena(nbytes, old.device) if isinstance(old, CudaArena) else HostArena(nbytes, pin=old.pinned)

    def _resize_parked(self, pages: int, keep: int) -> None:
        """[Note: resizing a full device] Old and new arena cannot both be held (an arena that
        takes most of a GPU, shrunk to its plan): the used slots' bytes wait in host memory while
        the old arena is given back and the new one taken. If the new one still cannot be had, an
        arena of the old size is taken again and the bytes put back (changing nothing), and the
        MemoryError is raised."""
        old = self.arena
        parked = old.tensor[:keep].to("cpu", copy=True)  # waits for the device
        old_pages = self.capacity
        old.close()
        try:
            new = self._new_arena(pages)
        except MemoryError:
            self.arena = self._new_arena(old_pages)
            self.arena.tensor[:keep].copy_(parked)
            raise
        new.tensor[:keep].copy_(parked)
        if new.tensor.is_cuda:
            torch.cuda.synchronize(new.tensor.device)
        self.slots.resize(pages)
        self.arena = new

    def describe(self) -> dict:
        return {"backend": self.backend, "device": str(self.device), "copies": self.copier.name}

    def close(self) -> None:
        self.arena.close()
