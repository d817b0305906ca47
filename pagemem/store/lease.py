"""Leases: a tensor's memory lent out as a torch tensor, with its pages pinned meanwhile.

[Note: the view rule]
A torch tensor that aliases page memory is valid only while the pages stay where they are. So
every alias pins its pages: while pinned, a page cannot be moved, freed or have any of its copies
dropped, the aliased one or another (pins count per page, not per copy; those calls raise
``InvalidRequest`` naming the page); writes and copies to other tiers are still allowed. Two ways to hold an alias:

- ``PagedTensor.view()`` pins for the lifetime of the returned tensor: the pin goes when that
  tensor and everything derived from it (slices, reshapes, tensors autograd saved) are garbage.
- ``PagedTensor.lease()`` pins until ``release()`` (or the end of a ``with`` block), whatever
  references remain; after that ``lease.tensor`` raises. Do not keep tensors derived from it.

A lease of a tensor whose pages are not adjacent gets a merged copy instead (counted in
``stats().view_copies``), written back to every copy of the tensor at release when
``write=True``. ``close()`` gives the memory back even while aliases exist: stale host views
then read zeros, never another tensor's data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagemem.errors import InvalidRequest

if TYPE_CHECKING:
    from pagemem.store.tensor import PagedTensor


class Lease:
    """An open lease on a tensor; ``tensor`` is its memory (an alias, or a merged copy)."""

    __slots__ = ("source", "tier", "copied", "write", "_tensor", "_end", "_closed")

    def __init__(self, source: "PagedTensor", tier: str, tensor: torch.Tensor, copied: bool,
                 write: bool, end: Callable[["Lease", torch.Tensor], None], closed: Callable[[], bool]) -> None:
        self.source = source
        self.tier = tier
        """The tier whose copy is lent."""
        self.copied = copied
        """True when ``tensor`` is a merged copy rather than an alias of page memory."""
        self.write = write
        self._tensor: torch.Tensor | None = tensor
        self._end = end
        self._closed = closed

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise InvalidRequest("the lease was released; take a new one")
        if self._closed():
            raise InvalidRequest("the store is closed")
        return self._tensor

    @property
    def active(self) -> bool:
        return self._tensor is not None

    def release(self) -> None:
        """End the lease (writing a merged copy back if ``write``). Releasing twice is harmless."""
        if self._tensor is None:
            return
        try:
            self._end(self, self._tensor)
        finally:
            self._tensor = None

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "open" if self._tensor is not None else "released"
        kind = "copy" if self.copied else "alias"
        return f"<Lease {state} {kind} on {self.tier} of {self.source!r}>"
