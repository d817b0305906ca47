"""Slots released behind a fence come back only once the fence completes (fake fences, no GPU)."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagemem.tiers.arena import HostArena
from pagemem.tiers.fence import Fence, PendingSlots
from pagemem.tiers.memory import MemoryTier

PAGE = 64


class FakeFence:
    """Completes only when told to; ``synchronize`` completes it (as waiting on the GPU would)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@pytest.fixture
def tier():
    t = MemoryTier("gpu", HostArena(8 * PAGE, pin=False), PAGE, copier=None,
                   backend="test", host_addressable=False)
    yield t
    t.close()


def test_fake_fence_and_cuda_event_are_fences():
    assert isinstance(FakeFence(), Fence)
    assert hasattr(torch.cuda.Event, "query") and hasattr(torch.cuda.Event, "synchronize")


def test_host_tiers_need_no_fence(tier):
    assert tier.fence() is None


def test_pending_slots_count_as_free_but_are_not_handed_out(tier):
    a = tier.allocate(4)
    fence = FakeFence()
    tier.release(a, fence)
    assert (tier.free_pages, tier.used_pages, tier.pending_pages) == (8, 0, 4)
    assert tier.allocate(4) == [4, 5, 6, 7]  # enough free without waiting: no sync
    assert fence.waited == 0 and tier.pending_pages == 4
    fence.done = True
    assert tier.allocate(2) == [0, 1]  # completed: reclaimed, and the run is whole again
    assert tier.pending_pages == 0 and fence.waited == 0


def test_allocate_waits_on_the_oldest_fences_only_as_needed(tier):
    a, b, c = tier.allocate(2), tier.allocate(2), tier.allocate(2)
    fa, fb, fc = FakeFence(), FakeFence(), FakeFence()
    tier.release(a, fa)
    tier.release(b, fb)
    tier.release(c, fc)
    assert tier.free_pages == 8
    got = tier.allocate(4)  # 2 free, 2 more needed: wait on the oldest fence only
    assert (fa.waited, fb.waited, fc.waited) == (1, 0, 0)
    assert sorted(got) == [0, 1, 6, 7]
    assert tier.pending_pages == 4


def test_a_fence_completed_out_of_order_is_used_before_waiting(tier):
    a, b = tier.allocate(4), tier.allocate(4)
    fa, fb = FakeFence(), FakeFence()
    tier.release(a, fa)
    tier.release(b, fb)
    fb.done = True  # another stream finished first
    assert tier.allocate(4) == [4, 5, 6, 7]
    assert fa.waited == 0 and tier.pending_pages == 4


def test_release_errors_change_nothing(tier):
    a = tier.allocate(3)
    fence = FakeFence()
    with pytest.raises(ValueError):
        tier.release([a[0], 7], fence)  # 7 was never allocated
    with pytest.raises(ValueError):
        tier.release([a[0], a[0]], fence)
    assert tier.pending_pages == 0 and tier.used_pages == 3
    tier.release(a[:1], fence)
    with pytest.raises(ValueError, match="waiting on its fence"):
        tier.release(a[:1], FakeFence())
    with pytest.raises(ValueError, match="waiting on its fence"):
        tier.release(a[:1])
    with pytest.raises(ValueError):
        tier.allocate(9)
    assert (tier.free_pages, tier.pending_pages) == (6, 1)


def test_a_failing_fence_leaves_its_slots_waiting():
    class Broken(FakeFence):
        def query(self):
            raise RuntimeError("device lost")

        synchronize = query

    pending = PendingSlots()
    given = []
    pending.add([1, 2], FakeFence())
    pending.add([3], Broken())
    pending._queue[0][0].done = True
    with pytest.raises(RuntimeError):
        pending.reclaim(given.extend, need=3)
    assert given == [1, 2]  # what was reclaimed before the error stays reclaimed
    assert len(pending) == 1 and 3 in pending


class FenceMachine(RuleBasedStateMachine):
    """Allocate, release with and without fences, complete fences: a slot whose fence has not
    completed is never handed out, and the counts always add up."""

    def __init__(self):
        super().__init__()
        self.tier = MemoryTier("gpu", HostArena(12 * PAGE, pin=False), PAGE, copier=None,
                               backend="test", host_addressable=False)
        self.held: list[list[int]] = []
        self.fences: list[FakeFence] = []
        self.behind: dict[int, FakeFence] = {}  # released slot -> its fence

    def teardown(self):
        self.tier.close()

    @rule(n=st.integers(0, 7))
    def allocate(self, n):
        if n > self.tier.free_pages:
            with pytest.raises(ValueError):
                self.tier.allocate(n)
            return
        got = self.tier.allocate(n)  # never raises while free_pages >= n
        assert len(got) == n == len(set(got))
        for s in got:
            fence = self.behind.pop(s, None)
            assert fence is None or fence.done, f"slot {s} handed out before its fence completed"
        self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), fenced=st.booleans(), new_fence=st.booleans())
    def release(self, i, fenced, new_fence):
        slots = self.held.pop(i % len(self.held))
        if not fenced:
            self.tier.release(slots)
            return
        if new_fence or not self.fences:
            self.fences.append(FakeFence())
        fence = self.fences[-1]
        self.tier.release(slots, fence)
        for s in slots:
            self.behind[s] = fence

    @precondition(lambda self: self.fences)
    @rule(i=st.integers(0, 100))
    def complete(self, i):
        self.fences[i % len(self.fences)].done = True

    @invariant()
    def accounting(self):
        t = self.tier
        held = [s for run in self.held for s in run]
        assert t.used_pages == len(held)
        assert t.free_pages + t.used_pages == t.capacity
        waiting = {s for s, f in self.behind.items() if s in t.pending}
        assert t.pending_pages == len(waiting)
        assert not waiting & set(held)
        assert all(t.slots.is_used(s) for s in waiting)  # pending slots are not in the free list


TestFenceMachine = FenceMachine.TestCase
TestFenceMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
