"""The measured gpu peak, per paging mode: pages held plus non-model bytes at every op.

Per op the gpu holds the arena (sized from a plan; in warm-up and unplanned demand paging, which
run with the arena at the whole budget, only the pages in use count) plus the non-model bytes
(recorded by the tracer in warm-up, the trace's in a planned iteration, the reserve on demand).
See [Note: the gpu budget] in ``pager.py``.
"""

from __future__ import annotations

from typing import Any


class PeakMeter:
    def __init__(self, gpu_tier: Any, page_bytes: int, budget_pages: int) -> None:
        self._gpu = gpu_tier
        self._page_bytes = page_bytes
        self._budget_pages = budget_pages
        self.by_mode: dict[str, int] = {}
        """Per mode, the most gpu bytes at any op."""
        self.pages = 0
        """The most gpu pages in use at any op."""

    def op(self, mode: str, pages: int, non_model: int) -> None:
        """Called at every op: kept to a few attribute reads."""
        if pages > self.pages:
            self.pages = pages
        arena = self._gpu.capacity
        held = pages if arena == self._budget_pages else arena
        nbytes = held * self._page_bytes + non_model
        if nbytes > self.by_mode.get(mode, 0):
            self.by_mode[mode] = nbytes

    def stats(self) -> dict[str, Any]:
        return {"gpu_peak_bytes": max(self.by_mode.values(), default=0),
                "gpu_peak_bytes_by_mode": dict(self.by_mode),
                "gpu_peak_page_bytes": self.pages * self._page_bytes}
