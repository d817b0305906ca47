"""Store statistics: per-tier occupancy and per-direction transfer totals."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagemem.units import format_bytes


@dataclass(frozen=True)
class TierStats:
    name: str
    page_bytes: int
    capacity_pages: int
    used_pages: int
    free_pages: int
    live_bytes: int
    """Bytes of live tensors whose pages sit in this tier."""
    backend: dict

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def utilization(self) -> float:
        """Live bytes / bytes of used pages (1.0 when no page is used)."""
        return self.live_bytes / self.used_bytes if self.used_pages else 1.0


@dataclass(frozen=True)
class MoveStats:
    pages: int
    bytes: int
    seconds: float
    """Time at least one transfer in this direction was in flight."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(frozen=True)
class MoveSpan:
    """A period in which at least one transfer of ``direction`` (``"cpu->gpu"``) was in flight
    (``time.perf_counter`` seconds), and the bytes the transfers that ended in it moved."""

    direction: str
    start: float
    end: float
    bytes: int


SPANS_KEPT = 65536
"""Move spans a store keeps (the newest) for :meth:`PageStore.move_spans`."""


@dataclass(frozen=True)
class StoreStats:
    tiers: dict[str, TierStats]
    moves: dict[str, MoveStats]
    """Keyed ``"cpu->nvme"`` etc."""
    staging_pages: int
    staging_free: int
    """Pinned bounce pages, and how many are free right now."""
    cuda: bool
    views: int = 0
    """Views and leases served zero-copy (aliasing page memory)."""
    view_copies: int = 0
    """Leases that needed a merged copy because the pages were not adjacent."""
    pinned_pages: int = 0
    """Pages pinned right now by open leases or live views."""

    @property
    def view_copy_share(self) -> float:
        """Share of leases and views that needed a copy (0.0 when there were none)."""
        total = self.views + self.view_copies
        return self.view_copies / total if total else 0.0

    def __getitem__(self, tier: str) -> TierStats:
        return self.tiers[tier]

    def table(self) -> str:
        """The statistics as a plain-text table."""
        lines = [f"{'tier':<5} {'capacity':>11} {'used':>6} {'free':>6} {'live':>11} {'util':>7}  backend"]
        for t in self.tiers.values():
            backend = t.backend.get("backend", "")
            if t.name == "nvme":
                backend = f"{t.backend.get('io_engine')} engine, " + \
                    ("O_DIRECT" if t.backend.get("direct_io") else "buffered") + \
                    f", checksum {t.backend.get('checksum')}"
            lines.append(
                f"{t.name:<5} {format_bytes(t.capacity_bytes):>11} {t.used_pages:>6} {t.free_pages:>6} "
                f"{format_bytes(t.live_bytes):>11} {t.utilization:>7.2%}  {backend}")
        if self.moves:
            lines.append("")
            lines.append(f"{'move':<11} {'pages':>7} {'bytes':>11} {'seconds':>9} {'GB/s':>7}")
            for key, m in sorted(self.moves.items()):
                lines.append(f"{key:<11} {m.pages:>7} {format_bytes(m.bytes):>11} {m.seconds:>9.3f} {m.gbps:>7.2f}")
        if self.views or self.view_copies:
            lines.append("")
            lines.append(f"views: {self.views} zero-copy, {self.view_copies} needed a copy "
                         f"({self.view_copy_share:.1%}); {self.pinned_pages} pages pinned now")
        return "\n".join(lines)


@dataclass
class TransferMeter:
    """Accumulates bytes and busy time per direction. Called under the store's lock."""

    _active: dict[str, int] = field(default_factory=dict)
    _since: dict[str, float] = field(default_factory=dict)
    _busy: dict[str, float] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    _pages: dict[str, int] = field(default_factory=dict)
    _span_bytes: dict[str, int] = field(default_factory=dict)
    _spans: deque = field(default_factory=lambda: deque(maxlen=SPANS_KEPT))

    def begin(self, direction: str, transfers: int = 1) -> None:
        n = self._active.get(direction, 0)
        if n == 0:
            self._since[direction] = time.perf_counter()
            self._span_bytes[direction] = 0
        self._active[direction] = n + transfers

    def end(self, direction: str, nbytes: int, pages: int = 1) -> None:
        """One transfer begun with ``begin`` finished, having moved ``pages`` pages (0 if it failed)."""
        n = self._active[direction] - 1
        self._active[direction] = n
        self._span_bytes[direction] += nbytes
        if n == 0:
            now = time.perf_counter()
            self._busy[direction] = self._busy.get(direction, 0.0) + now - self._since[direction]
            self._spans.append(MoveSpan(direction, self._since[direction], now, self._span_bytes[direction]))
        if nbytes:
            self._bytes[direction] = self._bytes.get(direction, 0) + nbytes
            self._pages[direction] = self._pages.get(direction, 0) + pages

    def spans(self, since: float) -> list[MoveSpan]:
        """The kept spans that ended after ``since``, oldest first."""
        out = []
        for span in reversed(self._spans):
            if span.end <= since:
                break
            out.append(span)
        return out[::-1]

    def snapshot(self) -> dict[str, MoveStats]:
        now = time.perf_counter()
        out = {}
        for d in set(self._busy) | set(self._active):
            busy = self._busy.get(d, 0.0)
            if self._active.get(d):
                busy += now - self._since[d]
            if self._pages.get(d) or busy:
                out[d] = MoveStats(self._pages.get(d, 0), self._bytes.get(d, 0), busy)
        return out
