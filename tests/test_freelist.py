import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagemem.tiers.freelist import SlotFreeList


def test_fresh_list_hands_out_adjacent_slots_in_order():
    fl = SlotFreeList(10)
    assert fl.allocate(3) == [0, 1, 2]
    assert fl.allocate(2) == [3, 4]
    assert (fl.used, fl.free) == (5, 5)
    assert fl.runs() == [(5, 5)] and fl.largest_run == 5


def test_released_run_comes_back_in_the_same_order():
    fl = SlotFreeList(10)
    a = fl.allocate(4)
    fl.allocate(2)
    fl.release(a)
    assert fl.allocate(4) == a


def test_churn_still_gives_adjacent_slots():
    """A LIFO stack would hand out 5, 3, 1 here; coalesced runs give three adjacent slots."""
    fl = SlotFreeList(8)
    singles = [fl.allocate(1) for _ in range(8)]
    for s in (1, 3, 5):
        fl.release(singles[s])
    fl.release(singles[4])
    fl.release(singles[2])
    assert fl.runs() == [(1, 5)]
    assert fl.allocate(3) == [1, 2, 3]


def test_released_slots_merge_with_both_neighbours():
    fl = SlotFreeList(9)
    a, b, c = fl.allocate(3), fl.allocate(3), fl.allocate(3)
    fl.release(a)
    fl.release(c)
    assert fl.runs() == [(0, 3), (6, 3)]
    fl.release(b)
    assert fl.runs() == [(0, 9)] and fl.largest_run == 9


def test_best_fit_takes_the_smallest_run_that_fits_lowest_address_first():
    fl = SlotFreeList(20)
    held = fl.allocate(20)
    # free runs: (0,4) (5,2) (8,3) (12,2) (15,5)
    fl.release(held[0:4] + held[5:7] + held[8:11] + held[12:14] + held[15:20])
    assert fl.allocate(2) == [5, 6]      # exact fit, lower of the two runs of 2
    assert fl.allocate(3) == [8, 9, 10]  # exact fit beats the longer runs before it
    assert fl.allocate(1) == [12]        # the shortest run that fits
    assert fl.allocate(5) == [15, 16, 17, 18, 19]
    assert fl.runs() == [(0, 4), (13, 1)]


def test_when_no_run_is_long_enough_the_fewest_pieces_are_used():
    fl = SlotFreeList(20)
    held = fl.allocate(20)
    # free runs: (0,2) (3,5) (9,1) (11,4) (16,3)
    fl.release(held[0:2] + held[3:8] + held[9:10] + held[11:15] + held[16:19])
    got = fl.allocate(8)
    # 5 + 3: the longest run, then the rest by best fit from the run of exactly 3
    assert got == [3, 4, 5, 6, 7, 16, 17, 18]
    assert fl.runs() == [(0, 2), (9, 1), (11, 4)]


def test_release_in_any_order_and_errors_change_nothing():
    fl = SlotFreeList(4)
    fl.allocate(3)
    with pytest.raises(ValueError):
        fl.allocate(2)
    with pytest.raises(ValueError):
        fl.allocate(-1)
    with pytest.raises(ValueError):
        fl.release([3])  # never allocated
    with pytest.raises(ValueError):
        fl.release([0, 0])
    with pytest.raises(ValueError):
        fl.release([1, 7])
    assert (fl.used, fl.free) == (3, 1)
    assert fl.runs() == [(3, 1)]
    fl.release([2, 0, 1])
    assert fl.runs() == [(0, 4)]
    assert fl.allocate(0) == []


def test_empty_list():
    fl = SlotFreeList(0)
    assert (fl.free, fl.used, fl.largest_run, fl.runs()) == (0, 0, 0, [])
    assert fl.allocate(0) == []
    with pytest.raises(ValueError):
        fl.allocate(1)
    with pytest.raises(ValueError):
        SlotFreeList(-1)


def test_long_churn_keeps_the_index_small():
    """Lazy deletion must not let stale heap entries pile up under churn."""
    fl = SlotFreeList(64)
    for i in range(5000):
        a = fl.allocate(1 + i % 3)
        b = fl.allocate(1)
        fl.release(a)
        fl.release(b)
    assert fl.runs() == [(0, 64)]
    assert sum(len(h) for h in fl._heaps.values()) <= 2 * len(fl.runs()) + 16


def model_runs(free: set[int]) -> list[tuple[int, int]]:
    runs, start, prev = [], None, -1
    for s in sorted(free):
        if start is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            runs.append((start, prev + 1 - start))
        start = prev = s
    if start is not None:
        runs.append((start, prev + 1 - start))
    return runs


CAPACITY = 24


class FreeListMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fl = SlotFreeList(CAPACITY)
        self.free = set(range(CAPACITY))  # the model
        self.held: list[list[int]] = []

    @rule(n=st.integers(0, 9))
    def allocate(self, n):
        if n > len(self.free):
            with pytest.raises(ValueError):
                self.fl.allocate(n)
            return
        runs = model_runs(self.free)
        got = self.fl.allocate(n)
        assert len(got) == n and set(got) <= self.free
        fitting = [(length, start) for start, length in runs if length >= n]
        if n and fitting:  # the contiguity promise, from the best-fitting run
            length, start = min(fitting)
            assert got == list(range(start, start + n))
        elif n:  # as few pieces as the longest runs allow
            pieces = len(model_runs(set(got)))
            lengths = sorted((length for _, length in runs), reverse=True)
            fewest = next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= n)
            assert pieces == fewest
        self.free -= set(got)
        self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), shuffle=st.randoms(use_true_random=False))
    def release(self, i, shuffle):
        slots = self.held.pop(i % len(self.held))
        shuffle.shuffle(slots)
        self.fl.release(slots)
        self.free |= set(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), k=st.integers(1, 5))
    def release_part(self, i, k):
        run = self.held[i % len(self.held)]
        part, run[:] = run[:k], run[k:]
        self.fl.release(part)
        self.free |= set(part)

    @precondition(lambda self: self.held and self.held[0])
    @rule()
    def double_free_is_refused(self):
        slots = self.held[0]
        self.fl.release(slots)
        with pytest.raises(ValueError):
            self.fl.release(slots[:1])
        self.free |= set(slots)
        self.held.pop(0)

    @rule(capacity=st.integers(0, 2 * CAPACITY))
    def resize(self, capacity):
        held = {s for run in self.held for s in run}
        if any(s >= capacity for s in held):
            before = (self.fl.capacity, self.fl.runs())
            with pytest.raises(ValueError, match="in use"):
                self.fl.resize(capacity)
            assert (self.fl.capacity, self.fl.runs()) == before  # a refusal changes nothing
            return
        self.fl.resize(capacity)
        self.free = set(range(capacity)) - held

    @invariant()
    def accounting(self):
        held = [s for run in self.held for s in run]
        assert len(held) == len(set(held))
        assert not self.free & set(held)
        assert self.fl.used == len(held)
        assert self.fl.free == len(self.free)
        assert self.fl.used + self.fl.free == self.fl.capacity
        assert self.free | set(held) == set(range(self.fl.capacity))
        assert all(self.fl.is_used(s) for s in held)
        assert not any(self.fl.is_used(s) for s in self.free)

    @invariant()
    def runs_are_coalesced(self):
        runs = self.fl.runs()
        assert runs == model_runs(self.free)  # the same slots, and maximal runs
        assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:]))
        assert self.fl.largest_run == max((n for _, n in runs), default=0)


TestFreeListMachine = FreeListMachine.TestCase
TestFreeListMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
