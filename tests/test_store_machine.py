"""A hypothesis state machine over the page store: random tensors (dtypes, shapes, groups)
allocated, written, moved (waited on or left in flight), freed and read across all three tiers
with tiny capacities and 4 KiB pages.

Invariants after every step: every live tensor reads back exactly what was written; used + free
pages = capacity in every tier; no two live tensors share a byte; an out-of-memory changes nothing.
"""

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

import pagemem

from conftest import ENGINES, DelayedCopier, DelayedEngine, Delayer, random_tensor, same_bytes

PAGE = 4096
TIERS = ("gpu", "cpu", "nvme")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]

dims = st.one_of(st.lists(st.integers(0, 12), max_size=3),  # small: share pages
                 st.lists(st.integers(300, 3 * PAGE), min_size=1, max_size=1))  # span pages
specs = st.tuples(dims, st.sampled_from(DTYPES)).filter(
    lambda s: torch.Size(s[0]).numel() * s[1].itemsize <= 3 * PAGE)
tiers = st.sampled_from(TIERS)
index = st.integers(0, 10_000)


class StoreMachine(RuleBasedStateMachine):
    engine = "threads"

    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.store = pagemem.PageStore(pagemem.StoreConfig(
            page_bytes=PAGE, gpu_bytes=6 * PAGE, cpu_bytes=10 * PAGE, nvme_bytes=14 * PAGE,
            nvme_path=self.dir.name, io_engine=self.engine, staging_pages=2, io_depth=4))
        # every transfer starts a little late, so moves are still in flight at later steps
        self.delayer = Delayer(max_delay=0.002)
        nvme = self.store.tier("nvme")
        nvme.engine = DelayedEngine(nvme.engine, self.delayer)
        for name in ("gpu", "cpu"):
            tier = self.store.tier(name)
            tier.copier = DelayedCopier(tier.copier, self.delayer)
        self.live: list[tuple[pagemem.PagedTensor, torch.Tensor | None]] = []
        self.seed = 0

    def teardown(self):
        self.store.close()
        self.delayer.close()
        self.dir.cleanup()

    # -- helpers
    def snapshot(self):
        s = self.store.stats()
        return ({n: (s[n].used_pages, s[n].free_pages, s[n].live_bytes) for n in TIERS},
                [(t.extents(), [self.store.location(p) for p in t.pages], t.tier) for t, _ in self.live])

    def expect_unchanged_after_oom(self, fn, settle: bool):
        if settle:
            self.store.synchronize()
        before = self.snapshot() if settle else None
        try:
            return fn()
        except pagemem.OutOfMemory as exc:
            assert exc.tier in TIERS and exc.requested_pages > exc.free_pages
            if settle:
                assert self.snapshot() == before
            return None

    # -- rules
    @rule(spec=specs, tier=tiers, settle=st.booleans())
    def allocate(self, spec, tier, settle):
        t = self.expect_unchanged_after_oom(lambda: self.store.allocate(spec[0], spec[1], tier=tier), settle)
        if t is not None:
            assert t.tier == tier and t.shape == torch.Size(spec[0])
            self.live.append((t, None))

    @rule(group=st.lists(specs, min_size=1, max_size=5), tier=tiers, settle=st.booleans())
    def allocate_group(self, group, tier, settle):
        ts = self.expect_unchanged_after_oom(lambda: self.store.allocate_group(group, tier=tier), settle)
        if ts is not None:
            self.live.extend((t, None) for t in ts)

    @precondition(lambda self: self.live)
    @rule(group=st.lists(specs, min_size=1, max_size=3), tier=tiers, i=index, settle=st.booleans())
    def allocate_group_after(self, group, tier, i, settle):
        after, _ = self.live[i % len(self.live)]
        ts = self.expect_unchanged_after_oom(
            lambda: self.store.allocate_group(group, tier=tier, after=after), settle)
        if ts is not None:
            self.live.extend((t, None) for t in ts)

    @precondition(lambda self: self.live)
    @rule(i=index, settle=st.booleans())
    def write(self, i, settle):
        i %= len(self.live)
        t, _ = self.live[i]
        self.seed += 1
        data = random_tensor(t.shape, t.dtype, self.seed)
        if self.expect_unchanged_after_oom(lambda: t.copy_(data), settle) is not None:
            self.live[i] = (t, data)

    @precondition(lambda self: self.live)
    @rule(i=index, tier=tiers, wait=st.booleans(), settle=st.booleans())
    def move(self, i, tier, wait, settle):
        t, _ = self.live[i % len(self.live)]
        h = self.expect_unchanged_after_oom(lambda: t.move(tier), settle)
        if h is not None and wait:
            h.wait(timeout=30)
            assert t.tier == tier

    @precondition(lambda self: len(self.live) >= 2)
    @rule(picks=st.lists(index, min_size=2, max_size=4), tier=tiers, settle=st.booleans())
    def move_several(self, picks, tier, settle):
        ts = list({id(t): t for t, _ in (self.live[p % len(self.live)] for p in picks)}.values())
        h = self.expect_unchanged_after_oom(lambda: self.store.move(ts, tier), settle)
        if h is not None:
            h.wait(timeout=30)
            assert all(t.tier == tier for t in ts)

    @precondition(lambda self: self.live)
    @rule(burst=st.lists(st.tuples(index, st.sampled_from(TIERS + ("write", "free"))), min_size=2, max_size=8))
    def burst(self, burst):
        """Several moves, writes and frees issued back to back without waiting for any."""
        for i, what in burst:
            if not self.live:
                return
            i %= len(self.live)
            t, _ = self.live[i]
            if what == "write":
                self.seed += 1
                data = random_tensor(t.shape, t.dtype, self.seed)
                if self.expect_unchanged_after_oom(lambda: t.copy_(data), settle=False) is not None:
                    self.live[i] = (t, data)
            elif what == "free":
                self.live.pop(i)
                t.free()
            else:
                self.expect_unchanged_after_oom(lambda: t.move(what), settle=False)

    @precondition(lambda self: self.live)
    @rule(i=index)
    def free(self, i):
        t, _ = self.live.pop(i % len(self.live))
        t.free()
        assert t.is_freed

    @rule()
    def synchronize(self):
        """Once nothing is in flight, every live page holds its own slot and the counts add up."""
        self.store.synchronize()
        for t, _ in self.live:
            assert t.tier is None or t.tier in TIERS
        pages = {p for t, _ in self.live for p in t.pages}
        locations = [self.store.location(p) for p in pages]
        assert len(set(locations)) == len(locations)
        s = self.store.stats()
        assert sum(s[n].used_pages for n in TIERS) == len(pages)
        assert sum(s[n].live_bytes for n in TIERS) == sum(t.nbytes for t, _ in self.live)

    # -- invariants
    @invariant()
    def every_live_tensor_reads_back_what_was_written(self):
        for t, expected in self.live:
            out = t.to_torch()
            assert out.shape == t.shape and out.dtype == t.dtype
            if expected is not None:
                assert same_bytes(out, expected)

    @invariant()
    def used_plus_free_is_capacity(self):
        s = self.store.stats()
        for n in TIERS:
            assert s[n].used_pages + s[n].free_pages == s[n].capacity_pages

    @invariant()
    def no_two_live_tensors_share_a_byte(self):
        ranges = sorted((page, lo, hi) for t, _ in self.live for page, lo, hi in t.extents())
        for (p1, _, hi1), (p2, lo2, _) in zip(ranges, ranges[1:]):
            assert p1 != p2 or hi1 <= lo2


machine_settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("engine", ENGINES)
def test_store_state_machine(engine):
    machine = type(f"StoreMachine_{engine}", (StoreMachine,), {"engine": engine})
    run_state_machine_as_test(machine, settings=machine_settings)
