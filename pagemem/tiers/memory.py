"""Memory tiers: ``gpu`` (device memory, or a host stand-in without CUDA) and ``cpu``."""

from __future__ import annotations

import torch

from pagemem.tiers.arena import CudaArena, HostArena, HostBuffer
from pagemem.tiers.base import PageDone, Tier


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

    def host_buffer(self, slot: int) -> HostBuffer:
        if not self.host_addressable:
            return super().host_buffer(slot)
        return self.arena.buffer(slot * self.page_bytes, self.page_bytes)  # type: ignore[union-attr]

    def start_read(self, slot: int, into: HostBuffer, done: PageDone) -> None:
        self.copier.copy(into.tensor, self.buffer(slot), done)

    def start_write(self, slot: int, src: HostBuffer, done: PageDone) -> None:
        self.copier.copy(self.buffer(slot), src.tensor, done)

    def describe(self) -> dict:
        return {"backend": self.backend, "device": str(self.device), "copies": self.copier.name}

    def close(self) -> None:
        self.arena.close()
