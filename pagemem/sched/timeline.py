"""Memory over logical time: range add, range max and "last op over a limit" queries.

``SegmentTimeline`` answers each in O(log n) (a bottom-up segment tree with lazy adds, after
Al.Cash's "Efficient and easy segment trees"); ``ScanTimeline`` rescans a numpy array per query
and serves as a cross-check and as the benchmark's anchor. Ranges are half-open ``[lo, hi)``.
"""

from __future__ import annotations

import numpy as np

NEG = -(1 << 62)


class SegmentTimeline:
    """Values ``v[0..n)`` (ints) with O(log n) range add, range max and ``last_above``."""

    def __init__(self, initial: "np.ndarray | list[int]") -> None:
        values = [int(x) for x in initial]
        self.n = n = len(values)
        size = 1
        while size < max(n, 1):
            size *= 2
        self.size = size
        self.h = size.bit_length() - 1
        t = [NEG] * (2 * size)
        t[size:size + n] = values
        for i in range(size - 1, 0, -1):
            t[i] = max(t[2 * i], t[2 * i + 1])
        self.t = t
        self.d = [0] * size

    def _build(self, i: int) -> None:
        t, d = self.t, self.d
        i >>= 1
        while i:
            a, b = t[2 * i], t[2 * i + 1]
            t[i] = (a if a > b else b) + d[i]
            i >>= 1

    def _push(self, p: int) -> None:
        t, d, size = self.t, self.d, self.size
        for s in range(self.h, 0, -1):
            i = p >> s
            v = d[i]
            if v:
                c = 2 * i
                t[c] += v
                t[c + 1] += v
                if c < size:
                    d[c] += v
                    d[c + 1] += v
                d[i] = 0

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add ``v`` to every value in ``[lo, hi)``."""
        if lo >= hi or v == 0:
            return
        t, d, size = self.t, self.d, self.size
        lo += size
        hi += size
        l0, r0 = lo, hi - 1
        while lo < hi:
            if lo & 1:
                t[lo] += v
                if lo < size:
                    d[lo] += v
                lo += 1
            if hi & 1:
                hi -= 1
                t[hi] += v
                if hi < size:
                    d[hi] += v
            lo >>= 1
            hi >>= 1
        self._build(l0)
        self._build(r0)

    def max(self, lo: int, hi: int) -> int:
        """Largest value in ``[lo, hi)`` (NEG for an empty range)."""
        if lo >= hi:
            return NEG
        lo += self.size
        hi += self.size
        self._push(lo)
        self._push(hi - 1)
        t = self.t
        res = NEG
        while lo < hi:
            if lo & 1:
                if t[lo] > res:
                    res = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > res:
                    res = t[hi]
            lo >>= 1
            hi >>= 1
        return res

    def last_above(self, lo: int, hi: int, limit: int) -> int:
        """The largest index in ``[lo, hi)`` whose value exceeds ``limit``; -1 if none."""
        if lo >= hi:
            return -1
        t, d, size = self.t, self.d, self.size
        # iterative descent: (node, node_lo, node_hi, sum of ancestors' pending adds)
        stack = [(1, 0, size, 0)]
        while stack:
            node, nl, nr, acc = stack.pop()
            if nr <= lo or nl >= hi or t[node] + acc <= limit:
                continue
            if node >= size:
                return nl
            mid = (nl + nr) // 2
            acc2 = acc + d[node]
            stack.append((2 * node, nl, mid, acc2))      # visited second
            stack.append((2 * node + 1, mid, nr, acc2))  # right child first
        return -1

    def values(self) -> np.ndarray:
        """All values, as a numpy array."""
        out = np.empty(self.n, dtype=np.int64)
        for i in range(self.n):
            out[i] = self.max(i, i + 1)
        return out


class ScanTimeline:
    """Same interface, one numpy array, every query a rescan."""

    def __init__(self, initial: "np.ndarray | list[int]") -> None:
        self.v = np.array(initial, dtype=np.int64)
        self.n = len(self.v)

    def add(self, lo: int, hi: int, v: int) -> None:
        if lo < hi:
            self.v[lo:hi] += v

    def max(self, lo: int, hi: int) -> int:
        return int(self.v[lo:hi].max()) if lo < hi else NEG

    def last_above(self, lo: int, hi: int, limit: int) -> int:
        if lo >= hi:
            return -1
        idx = np.nonzero(self.v[lo:hi] > limit)[0]
        return int(lo + idx[-1]) if len(idx) else -1

    def values(self) -> np.ndarray:
        return self.v.copy()


TIMELINES = {"segment": SegmentTimeline, "scan": ScanTimeline}
