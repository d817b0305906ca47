"""Laying tensors out in pages.

Tensors allocated together are placed back to back (each start aligned to ``TENSOR_ALIGN``
bytes), so a tensor may start on a partly filled page, span full pages and end on a partly
filled one, and small tensors share pages instead of each wasting most of one.
"""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_ALIGN = 256
"""Byte alignment of every tensor's start (what CUDA allocations guarantee)."""


@dataclass(frozen=True)
class GroupLayout:
    """Where each tensor of a group starts in the group's byte range, and the pages it needs."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    pages: int
    page_bytes: int
    end: int
    """Byte just past the last tensor (counting from the first page's start)."""

    @property
    def live_bytes(self) -> int:
        return sum(self.sizes)

    def page_span(self, i: int) -> range:
        """Indices (within the group) of the pages tensor ``i`` touches; empty for 0 bytes."""
        if self.sizes[i] == 0:
            return range(0)
        first = self.starts[i] // self.page_bytes
        last = (self.starts[i] + self.sizes[i] - 1) // self.page_bytes
        return range(first, last + 1)


def pack(sizes: list[int] | tuple[int, ...], page_bytes: int, align: int = TENSOR_ALIGN,
         start: int = 0) -> GroupLayout:
    """Lay out tensors of ``sizes`` bytes back to back in pages of ``page_bytes``, the first one
    ``start`` bytes into the first page (when continuing a partly filled page)."""
    if not 0 <= start < page_bytes:
        raise ValueError(f"start must be in [0, {page_bytes}), got {start}")
    starts = []
    end = start
    for size in sizes:
        if size < 0:
            raise ValueError(f"tensor size must be >= 0, got {size}")
        start = -(-end // align) * align if size else end
        starts.append(start)
        end = start + size
    return GroupLayout(tuple(starts), tuple(sizes), -(-end // page_bytes), page_bytes, end)
