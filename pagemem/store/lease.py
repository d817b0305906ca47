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
``write=True``; or, asked for with ``split=True``, no copy at all: ``lease.pieces``, one alias
per run of adjacent pages (an elementwise update, such as Adam's, runs over each piece). ``close()`` gives the memory back even while aliases exist: stale host views
then read zeros, never another tensor's data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

import pagemem.process as process
from pagemem.errors import InvalidRequest

if TYPE_CHECKING:
    from pagemem.store.tensor import PagedTensor


Piece = tuple[int, torch.Tensor]
"""``(first element, flat alias)``: one run of a tensor's adjacent pages."""


class Lease:
    """An open lease on a tensor; ``tensor`` is its memory (an alias, or a merged copy), or for a
    split lease ``pieces`` are (one alias per run of adjacent pages)."""

    __slots__ = ("source", "tier", "copied", "write", "_tensor", "_pieces", "_end", "_closed", "_owner")

    def __init__(self, source: "PagedTensor", tier: str, tensor: torch.Tensor | None, copied: bool,
                 write: bool, end: Callable[["Lease", "torch.Tensor | list[Piece]"], None],
                 closed: Callable[[], bool], pieces: list[Piece] | None = None) -> None:
        self.source = source
        self.tier = tier
        """The tier whose copy is lent."""
        self.copied = copied
        """True when ``tensor`` is a merged copy rather than an alias of page memory."""
        self.write = write
        self._tensor: torch.Tensor | None = tensor
        self._pieces: list[Piece] | None = pieces
        self._end = end
        self._closed = closed
        self._owner = process.current_pid()

    def _check_active(self) -> None:
        if self._tensor is None and self._pieces is None:
            raise InvalidRequest("the lease was released; take a new one")
        if self._closed():
            raise InvalidRequest("the store is closed")

    @property
    def tensor(self) -> torch.Tensor:
        self._check_active()
        if self._tensor is None:
            raise InvalidRequest(f"the lease is split in {len(self._pieces or ())} pieces (its pages are not "
                                 "adjacent): use lease.pieces")
        return self._tensor

    @property
    def pieces(self) -> list[Piece]:
        """``(first element, flat alias)`` per run of adjacent pages, in order; a whole lease is
        one piece."""
        self._check_active()
        if self._pieces is not None:
            return list(self._pieces)
        return [(0, self._tensor.reshape(-1))]  # type: ignore[union-attr]

    @property
    def split(self) -> bool:
        """True when the memory is lent as several pieces (``tensor`` then raises)."""
        return self._pieces is not None and len(self._pieces) > 1

    @property
    def in_pieces(self) -> bool:
        """True for a lease taken with ``split=True`` (``with`` gives its ``pieces``)."""
        return self._pieces is not None

    @property
    def active(self) -> bool:
        return self._tensor is not None or self._pieces is not None

    def release(self) -> None:
        """End the lease (writing a merged copy back if ``write``). Releasing twice is harmless.
        In a process forked from the store's owner it raises ``WrongProcess`` (``process.py``)."""
        process.require_owner("Lease.release()", self._owner)
        if not self.active:
            return
        try:
            self._end(self, self._tensor if self._tensor is not None else self._pieces)  # type: ignore[arg-type]
        finally:
            self._tensor = self._pieces = None

    def __enter__(self) -> "torch.Tensor | list[Piece]":
        """``pieces`` for a lease taken with ``split=True``, else ``tensor``."""
        return self.pieces if self._pieces is not None else self.tensor

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None and not process.is_owner(self._owner):
            return  # a forked child leaving by an exception: it goes on, nothing is released
        self.release()

    def __repr__(self) -> str:
        state = "open" if self.active else "released"
        kind = "copy" if self.copied else f"{len(self._pieces)} pieces" if self._pieces else "alias"
        return f"<Lease {state} {kind} on {self.tier} of {self.source!r}>"
