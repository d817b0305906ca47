"""PagedTensor: a tensor stored as a run of bytes over a list of pages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from pagemem.store.handle import MoveHandle
    from pagemem.store.lease import Lease
    from pagemem.store.pages import Page
    from pagemem.store.store import PageStore


class PagedTensor:
    """A tensor whose bytes live in store pages: it starts ``offset`` bytes into its first page
    and runs for ``nbytes`` across its pages. Pages are the unit of residence: tensors
    allocated in one group may share their boundary pages, and moving one tensor moves those
    shared pages (with the neighbour's bytes on them) too.

    A record the store owns: every operation is a call to the store's public methods.
    """

    __slots__ = ("store", "shape", "dtype", "nbytes", "page_refs", "offset", "home", "freed",
                 "pins", "__weakref__")

    def __init__(self, store: "PageStore", shape: torch.Size, dtype: torch.dtype, nbytes: int,
                 pages: "tuple[Page, ...]", offset: int, home: str) -> None:
        self.store = store
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.page_refs = pages
        """The store's page records, in order (read by the store, never changed after allocation)."""
        self.offset = offset
        """Bytes from the start of the first page to the tensor's first byte."""
        self.home = home
        """Tier of a tensor with no bytes (it has no pages to ask)."""
        self.freed = False
        """Set by the store when the tensor is freed."""
        self.pins = 0
        """Open leases and live views of this tensor (kept by the store)."""

    @property
    def tier(self) -> str | None:
        """Tier of the home copy: ``"gpu"``, ``"cpu"`` or ``"nvme"``; None while a move or copy is
        in flight or when the pages' home copies are spread over several tiers (the tensor is then
        not ready for computation)."""
        return self.store.tier_of(self)

    @property
    def tiers(self) -> frozenset[str]:
        """Tiers holding a complete copy of the tensor (home and replicas), none in flight."""
        return self.store.tiers_of(self)

    @property
    def pages(self) -> tuple[int, ...]:
        """Ids of the pages holding this tensor, in order."""
        return tuple(p.id for p in self.page_refs)

    @property
    def is_freed(self) -> bool:
        return self.freed

    def extents(self) -> list[tuple[int, int, int]]:
        """``(page_id, start, end)`` byte ranges within each page, in tensor order."""
        return [(p.id, lo, hi) for p, lo, hi, _ in self.segments()]

    def segments(self) -> "Iterator[tuple[Page, int, int, int]]":
        """``(page, start_in_page, end_in_page, position_in_tensor)`` for each page."""
        page_bytes = self.store.page_bytes
        pos = 0
        lo = self.offset
        for page in self.page_refs:
            hi = min(page_bytes, lo + self.nbytes - pos)
            yield page, lo, hi, pos
            pos += hi - lo
            lo = 0

    def copy_(self, src: torch.Tensor) -> "PagedTensor":
        """Write ``src`` (same shape and dtype, any device) into every copy of the tensor."""
        self.store.write(self, src)
        return self

    def to_torch(self) -> torch.Tensor:
        """A new torch tensor holding the data: on the GPU if every page has a copy in a CUDA
        ``gpu`` tier, else in host memory. Pages read from NVMe are checksum-verified."""
        return self.store.read(self)

    def view(self, tier: str | None = None) -> torch.Tensor:
        """A zero-copy torch view of the tensor's memory; needs its pages adjacent in one memory
        tier (see ``is_viewable``): ``tier``'s copy, or the nearest such (gpu before cpu). The view *pins* the pages: while it, or any tensor derived
        from it, is alive, the pages cannot move or be freed (see ``PageStore.lease``)."""
        return self.store.view(self, tier)

    def lease(self, tier: str | None = None, write: bool = True) -> "Lease":
        """Pin the tensor in a memory tier and get its memory as a torch tensor (see
        ``PageStore.lease``); use as a context manager."""
        return self.store.lease(self, tier, write)

    @property
    def is_viewable(self) -> bool:
        """True when ``view()`` can alias the tensor without a copy right now."""
        return self.store.viewable(self)

    def move(self, tier: str) -> "MoveHandle":
        """Start moving the tensor's pages (their home copies) to ``tier``; returns a handle."""
        return self.store.move([self], tier)

    def copy(self, tier: str) -> "MoveHandle":
        """Start copying the tensor's pages to ``tier``, keeping the source; returns a handle."""
        return self.store.copy([self], tier)

    def release(self, tier: str) -> "MoveHandle":
        """Drop the tensor's copy on ``tier`` (another copy must remain)."""
        return self.store.release([self], tier)

    def free(self) -> None:
        """Give the tensor's bytes back; pages no live tensor uses are released (after any
        operation in flight on them finishes). Freeing twice is harmless."""
        self.store.free(self)

    def __repr__(self) -> str:
        try:
            state = "freed" if self.freed else f"tier={self.tier}"
        except Exception:
            state = "store closed"
        return (f"PagedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {state}, "
                f"pages={len(self.page_refs)})")
