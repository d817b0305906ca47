"""PagedTensor: a tensor stored as a run of bytes over a list of pages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from pagemem.store.handle import MoveHandle
    from pagemem.store.pages import Page
    from pagemem.store.store import PageStore


class PagedTensor:
    """A tensor whose bytes live in store pages: it starts ``offset`` bytes into its first page
    and runs for ``nbytes`` across its pages. Pages are the unit of residence: tensors
    allocated in one group may share their boundary pages, and moving one tensor moves those
    shared pages (with the neighbour's bytes on them) too.
    """

    __slots__ = ("_store", "shape", "dtype", "nbytes", "_pages", "_offset", "_home", "_freed",
                 "__weakref__")

    def __init__(self, store: "PageStore", shape: torch.Size, dtype: torch.dtype,
                 pages: "tuple[Page, ...]", offset: int, home: str) -> None:
        self._store = store
        self.shape = shape
        self.dtype = dtype
        self.nbytes = shape.numel() * dtype.itemsize
        self._pages = pages
        self._offset = offset
        self._home = home  # tier of a tensor with no bytes (it has no pages to ask)
        self._freed = False

    @property
    def tier(self) -> str | None:
        """``"gpu"``, ``"cpu"`` or ``"nvme"``; None while a move is in flight or when the pages
        are spread over several tiers (the tensor is then not ready for computation)."""
        return self._store._tier_of(self)

    @property
    def pages(self) -> tuple[int, ...]:
        """Ids of the pages holding this tensor, in order."""
        return tuple(p.id for p in self._pages)

    @property
    def is_freed(self) -> bool:
        return self._freed

    def extents(self) -> list[tuple[int, int, int]]:
        """``(page_id, start, end)`` byte ranges within each page, in tensor order."""
        return [(p.id, lo, hi) for p, lo, hi, _ in self._segments()]

    def _segments(self) -> "Iterator[tuple[Page, int, int, int]]":
        """``(page, start_in_page, end_in_page, position_in_tensor)`` for each page."""
        page_bytes = self._store.page_bytes
        pos = 0
        lo = self._offset
        for page in self._pages:
            hi = min(page_bytes, lo + self.nbytes - pos)
            yield page, lo, hi, pos
            pos += hi - lo
            lo = 0

    def copy_(self, src: torch.Tensor) -> "PagedTensor":
        """Write ``src`` (same shape and dtype, any device) into the tensor, on whatever tier."""
        self._store._write(self, src)
        return self

    def to_torch(self) -> torch.Tensor:
        """A new torch tensor holding the data: on the GPU if every page is in a CUDA ``gpu``
        tier, else in host memory. Pages on NVMe are read and their checksums verified."""
        return self._store._read(self)

    def view(self) -> torch.Tensor:
        """A zero-copy torch view of the tensor's memory; needs its pages adjacent in one
        memory tier (see ``is_viewable``). Valid until the tensor moves or is freed."""
        return self._store._view(self)

    @property
    def is_viewable(self) -> bool:
        """True when ``view()`` can alias the tensor without a copy right now."""
        return self._store._viewable(self)

    def move(self, tier: str) -> "MoveHandle":
        """Start moving the tensor's pages to ``tier``; returns a handle to wait on."""
        return self._store.move([self], tier)

    def free(self) -> None:
        """Give the tensor's bytes back; pages no live tensor uses are released (after any move
        in flight on them finishes). Freeing twice is harmless."""
        self._store._free(self)

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"tier={self.tier}"
        return (f"PagedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {state}, "
                f"pages={len(self._pages)})")
