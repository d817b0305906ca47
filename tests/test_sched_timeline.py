"""The segment-tree memory timeline against a plain array, under random operations."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagemem.sched.timeline import NEG, ScanTimeline, SegmentTimeline

values = st.integers(-(10**12), 10**12)


class TimelineMachine(RuleBasedStateMachine):
    @initialize(init=st.lists(st.integers(0, 10**9), min_size=1, max_size=70))
    def setup(self, init):
        self.ref = list(init)
        self.seg = SegmentTimeline(init)
        self.scan = ScanTimeline(init)

    def _range(self, a, b):
        n = len(self.ref)
        lo, hi = sorted((a % (n + 1), b % (n + 1)))
        return lo, hi

    @rule(a=st.integers(0, 100), b=st.integers(0, 100), v=values)
    def add(self, a, b, v):
        lo, hi = self._range(a, b)
        for i in range(lo, hi):
            self.ref[i] += v
        self.seg.add(lo, hi, v)
        self.scan.add(lo, hi, v)

    @rule(a=st.integers(0, 100), b=st.integers(0, 100))
    def range_max(self, a, b):
        lo, hi = self._range(a, b)
        want = max(self.ref[lo:hi]) if lo < hi else NEG
        assert self.seg.max(lo, hi) == want
        assert self.scan.max(lo, hi) == want

    @rule(a=st.integers(0, 100), b=st.integers(0, 100), limit=values)
    def last_above(self, a, b, limit):
        lo, hi = self._range(a, b)
        want = max((i for i in range(lo, hi) if self.ref[i] > limit), default=-1)
        assert self.seg.last_above(lo, hi, limit) == want
        assert self.scan.last_above(lo, hi, limit) == want

    @invariant()
    def same_values(self):
        if hasattr(self, "ref"):
            assert list(self.seg.values()) == self.ref


TestTimelineMachine = TimelineMachine.TestCase
TestTimelineMachine.settings = settings(max_examples=200, stateful_step_count=40)


@given(st.integers(1, 3000))
def test_any_length(n):
    t = SegmentTimeline(np.arange(n))
    assert t.max(0, n) == n - 1
    t.add(0, n // 2, 10**6)
    assert t.last_above(0, n, 10**6 - 1) == n // 2 - 1  # -1 when nothing was raised
