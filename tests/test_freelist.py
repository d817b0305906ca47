import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagemem.tiers.freelist import SlotFreeList


def test_fresh_list_hands_out_adjacent_slots_in_order():
    fl = SlotFreeList(10)
    assert fl.allocate(3) == [0, 1, 2]
    assert fl.allocate(2) == [3, 4]
    assert (fl.used, fl.free) == (5, 5)


def test_released_run_comes_back_in_the_same_order():
    fl = SlotFreeList(10)
    a = fl.allocate(4)
    fl.allocate(2)
    fl.release(a)
    assert fl.allocate(4) == a


def test_errors_change_nothing():
    fl = SlotFreeList(4)
    fl.allocate(3)
    with pytest.raises(ValueError):
        fl.allocate(2)
    with pytest.raises(ValueError):
        fl.release([3])  # never allocated
    with pytest.raises(ValueError):
        fl.release([0, 0])
    assert (fl.used, fl.free) == (3, 1)
    assert fl.allocate(1) == [3]


class FreeListMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fl = SlotFreeList(16)
        self.held: list[list[int]] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if n > self.fl.free:
            with pytest.raises(ValueError):
                self.fl.allocate(n)
        else:
            self.held.append(self.fl.allocate(n))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.fl.release(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held and self.held[0])
    @rule()
    def double_free_is_refused(self):
        slots = self.held[0]
        self.fl.release(slots)
        with pytest.raises(ValueError):
            self.fl.release(slots[:1])
        self.held[0] = self.fl.allocate(len(slots))

    @invariant()
    def accounting(self):
        held = [s for run in self.held for s in run]
        assert len(held) == len(set(held))
        assert self.fl.used == len(held)
        assert self.fl.used + self.fl.free == self.fl.capacity
        assert all(self.fl.is_used(s) for s in held)


TestFreeListMachine = FreeListMachine.TestCase
