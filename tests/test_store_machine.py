"""A hypothesis state machine over the page store: random tensors (dtypes, shapes, groups)
allocated, written, moved, copied to other tiers and released there (waited on or left in flight),
leased (a lease held across steps pins its pages), freed and read across all three tiers with tiny
capacities and 4 KiB pages, while injected disk faults (EIO, ENOSPC, short transfers) hit reads,
writes, moves and copies.

Invariants after every step: every live tensor reads back exactly what was written (or, after a
failed in-place write, raises TornPage until rewritten); used + free pages = capacity in every
tier; no two live tensors share a byte; an out-of-memory changes nothing; a pinned page is never
moved or freed.
"""

import itertools
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

import pagemem
from pagemem.tiers.io import FaultyEngine

from conftest import ENGINES, DelayedCopier, DelayedEngine, Delayer, random_tensor, same_bytes

PAGE = 4096
TIERS = ("gpu", "cpu", "nvme")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
TORN = "torn"

dims = st.one_of(st.lists(st.integers(0, 12), max_size=3),  # small: share pages
                 st.lists(st.integers(300, 3 * PAGE), min_size=1, max_size=1))  # span pages
specs = st.tuples(dims, st.sampled_from(DTYPES)).filter(
    lambda s: torch.Size(s[0]).numel() * s[1].itemsize <= 3 * PAGE)
tiers = st.sampled_from(TIERS)
index = st.integers(0, 10_000)
faults = st.tuples(st.sampled_from(("read", "write")), st.sampled_from(("eio", "enospc", "short")))


class StoreMachine(RuleBasedStateMachine):
    engine = "threads"
    copy_threads = 2
    """0: memory copies inline (done when issued); else on threads, each started late."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.store = pagemem.PageStore(pagemem.StoreConfig(
            page_bytes=PAGE, gpu_bytes=6 * PAGE, cpu_bytes=10 * PAGE, nvme_bytes=14 * PAGE,
            nvme_path=self.dir.name, io_engine=self.engine, staging_pages=2, io_depth=4,
            copy_threads=self.copy_threads))
        # every transfer starts a little late, so operations are still in flight at later steps
        self.delayer = Delayer(max_delay=0.002)
        nvme = self.store.tier("nvme")
        self.faults = FaultyEngine(DelayedEngine(nvme.engine, self.delayer))
        nvme.engine = self.faults
        for name in ("gpu", "cpu") if self.copy_threads else ():
            tier = self.store.tier(name)
            tier.copier = DelayedCopier(tier.copier, self.delayer)
        self.live: list[tuple[pagemem.PagedTensor, object]] = []  # (tensor, data | None | TORN)
        self.leases: list[tuple[pagemem.PagedTensor, pagemem.Lease]] = []
        self.seed = 0
        self.torn_pages: set[int] = set()  # pages a failed in-place write tore (over-approximated)

    def teardown(self):
        for _, lease in self.leases:
            lease.release()
        self.store.close()
        self.delayer.close()
        self.dir.cleanup()

    # -- helpers
    def snapshot(self):
        s = self.store.stats()
        return ({n: (s[n].used_pages, s[n].free_pages, s[n].live_bytes) for n in TIERS},
                [(t.extents(), [self.store.copies(p) for p in t.pages], t.tier) for t, _ in self.live])

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

    def pinned_pages(self) -> set[int]:
        return {p for t, _ in self.leases for p in t.pages}

    def index_of(self, t) -> int:
        return next(k for k, (u, _) in enumerate(self.live) if u is t)

    def sharing(self, t) -> list[int]:
        """Indices of live tensors with bytes on a page of ``t`` (``t`` included)."""
        pages = set(t.pages)
        return [k for k, (u, _) in enumerate(self.live) if pages & set(u.pages)]

    def try_write(self, i: int, settle: bool) -> None:
        t, _ = self.live[i]
        self.seed += 1
        data = random_tensor(t.shape, t.dtype, self.seed)
        try:
            if self.expect_unchanged_after_oom(lambda: t.copy_(data), settle) is not None:
                self.live[i] = (t, data)
        except pagemem.TierIOError:
            self.after_failed_write(i)

    def after_failed_write(self, i: int) -> None:
        """Copy-on-write kept the old data, or an in-place write tore the pages it touched:
        tensors sharing those pages now read their data or TornPage."""
        t, _ = self.live[i]
        for k in self.sharing(t):
            u, expected = self.live[k]
            for _attempt in range(12):  # an injected read fault fails one read, never the data
                try:
                    out = u.to_torch()
                    assert k == i or not isinstance(expected, torch.Tensor) or same_bytes(out, expected)
                except pagemem.TornPage:
                    self.live[k] = (u, TORN)
                    self.torn_pages |= set(u.pages)
                except pagemem.TierIOError:
                    continue
                break

    def add(self, ts) -> None:
        """New tensors: those on a torn page refuse reads until written (their bytes were torn too)."""
        for t in ts:
            expected = None
            if set(t.pages) & self.torn_pages:
                try:
                    t.to_torch()
                except pagemem.TornPage:
                    expected = TORN
                except pagemem.TierIOError:
                    pass
            self.live.append((t, expected))

    def expect_pin_refusal(self, fn, pages: set[int], also: str = ""):
        """``fn`` touches ``pages``: refused with InvalidRequest exactly when one is pinned (or,
        for a release, possibly first for another page's ``also`` reason)."""
        pinned = pages & self.pinned_pages()
        if pinned:
            with pytest.raises(pagemem.InvalidRequest, match="pinned" + (f"|{also}" if also else "")):
                fn()
            return None
        return fn()

    # -- rules
    @rule(spec=specs, tier=tiers, settle=st.booleans())
    def allocate(self, spec, tier, settle):
        t = self.expect_unchanged_after_oom(lambda: self.store.allocate(spec[0], spec[1], tier=tier), settle)
        if t is not None:
            assert t.tier == tier and t.shape == torch.Size(spec[0])
            self.add([t])

    @rule(group=st.lists(specs, min_size=1, max_size=5), tier=tiers, settle=st.booleans())
    def allocate_group(self, group, tier, settle):
        ts = self.expect_unchanged_after_oom(lambda: self.store.allocate_group(group, tier=tier), settle)
        if ts is not None:
            self.add(ts)

    @precondition(lambda self: self.live)
    @rule(group=st.lists(specs, min_size=1, max_size=3), tier=tiers, i=index, settle=st.booleans())
    def allocate_group_after(self, group, tier, i, settle):
        after, _ = self.live[i % len(self.live)]
        ts = self.expect_unchanged_after_oom(
            lambda: self.store.allocate_group(group, tier=tier, after=after), settle)
        if ts is not None:
            self.add(ts)

    @precondition(lambda self: self.live)
    @rule(i=index, settle=st.booleans())
    def write(self, i, settle):
        self.try_write(i % len(self.live), settle)

    @precondition(lambda self: self.live)
    @rule(i=index, tier=tiers, kind=st.sampled_from(("move", "copy", "release")), wait=st.booleans(),
          settle=st.booleans())
    def place(self, i, tier, kind, wait, settle):
        t, _ = self.live[i % len(self.live)]
        call = {"move": t.move, "copy": t.copy, "release": t.release}[kind]
        pages = set(t.pages) if kind != "copy" else set()
        try:
            h = self.expect_pin_refusal(lambda: self.expect_unchanged_after_oom(lambda: call(tier), settle), pages,
                                        also="no other copy" if kind == "release" else "")
        except pagemem.InvalidRequest as exc:
            assert kind == "release" and "no other copy" in str(exc)
            return
        if h is not None and wait:
            try:
                h.wait(timeout=30)
            except (pagemem.TierIOError, pagemem.CorruptPage):
                return  # an injected fault: the source copies stay valid (checked by the invariant)
            except pagemem.OutOfMemory:
                return  # an earlier failed operation left this one without a reserved slot
            if kind == "move":
                assert t.tier == tier
            elif kind == "copy" and t.pages:
                assert tier in t.tiers
            elif t.pages:
                assert tier not in t.tiers or t.tiers == {tier}

    @precondition(lambda self: len(self.live) >= 2)
    @rule(picks=st.lists(index, min_size=2, max_size=4), tier=tiers, settle=st.booleans())
    def move_several(self, picks, tier, settle):
        ts = list({id(t): t for t, _ in (self.live[p % len(self.live)] for p in picks)}.values())
        pages = {p for t in ts for p in t.pages}
        h = self.expect_pin_refusal(lambda: self.expect_unchanged_after_oom(lambda: self.store.move(ts, tier), settle),
                                    pages)
        if h is not None:
            try:
                h.wait(timeout=30)
            except (pagemem.TierIOError, pagemem.CorruptPage, pagemem.OutOfMemory):
                return  # an injected fault, or a torn page that cannot be read off the disk
            assert all(t.tier == tier for t in ts)

    @precondition(lambda self: self.live)
    @rule(burst=st.lists(st.tuples(index, st.sampled_from(TIERS + ("write", "free", "copy"))),
                         min_size=2, max_size=8))
    def burst(self, burst):
        """Several moves, copies, writes and frees issued back to back without waiting for any."""
        for i, what in burst:
            if not self.live:
                return
            i %= len(self.live)
            t, _ = self.live[i]
            if what == "write":
                self.try_write(i, settle=False)
            elif what == "free":
                self.free(i)
            elif what == "copy":
                self.expect_unchanged_after_oom(lambda: t.copy("gpu"), settle=False)
            else:
                self.expect_pin_refusal(lambda: self.expect_unchanged_after_oom(lambda: t.move(what), settle=False),
                                        set(t.pages))

    @precondition(lambda self: self.live)
    @rule(i=index)
    def free(self, i):
        i %= len(self.live)
        t, _ = self.live[i]
        if any(u is t for u, _ in self.leases):
            with pytest.raises(pagemem.InvalidRequest, match="pinned"):
                t.free()
            return
        self.live.pop(i)
        t.free()
        assert t.is_freed
        alive = {p for u, _ in self.live for p in u.pages}
        self.torn_pages &= alive

    @precondition(lambda self: self.live)
    @rule(i=index, tier=st.sampled_from((None, "gpu", "cpu")), split=st.booleans())
    def lease_and_write(self, i, tier, split):
        """A lease (alias, merged copy, or with ``split`` one alias per run of adjacent pages)
        written through and released in one step."""
        i %= len(self.live)
        t, expected = self.live[i]
        self.seed += 1
        data = random_tensor(t.shape, t.dtype, self.seed)
        flat = data.reshape(-1)
        try:
            [lease] = self.store.lease_many([t], tier, split=split)
            with lease as lent:
                pieces = lease.pieces
                assert lease.in_pieces == split
                if split:
                    assert [(a, x.data_ptr(), x.numel()) for a, x in lent] == [(a, x.data_ptr(), x.numel()) for a, x in pieces]
                else:
                    assert lent is lease.tensor
                # in order, back to back, covering the tensor; never a copy when split
                assert [start for start, _ in pieces] == list(itertools.accumulate(
                    [0] + [x.numel() for _, x in pieces[:-1]]))
                assert sum(x.numel() for _, x in pieces) == flat.numel()
                assert not (split and lease.copied)
                assert lease.split == (len(pieces) > 1)
                for start, x in pieces:
                    if isinstance(expected, torch.Tensor):
                        assert same_bytes(x, expected.reshape(-1)[start:start + x.numel()])
                    if x.numel():  # byte for byte (a bool copy_ would canonicalise random bytes)
                        x.view(torch.uint8).copy_(flat[start:start + x.numel()].view(torch.uint8))
        except pagemem.InvalidRequest as exc:
            assert "no complete copy" in str(exc) or "not memory" in str(exc)
            return
        except pagemem.TornPage:
            assert expected is TORN
            return
        except pagemem.TierIOError:  # writing the lease back to every copy met an injected fault
            self.live[i] = (t, None)
            self.after_failed_write(i)
            return
        self.live[i] = (t, data)

    @precondition(lambda self: any(isinstance(e, torch.Tensor) and e.numel() for _, e in self.live))
    @rule(i=index, a=st.integers(0, 10_000), b=st.integers(0, 10_000), settle=st.booleans())
    def write_range(self, i, a, b, settle):
        """``write(t, src, start)``: elements ``start ..`` of a tensor; the rest keep their bytes."""
        known = [k for k, (_, e) in enumerate(self.live) if isinstance(e, torch.Tensor) and e.numel()]
        i = known[i % len(known)]
        t, expected = self.live[i]
        n = expected.numel()
        start, stop = sorted((a % (n + 1), b % (n + 1)))
        self.seed += 1
        part = random_tensor((stop - start,), t.dtype, self.seed)
        want = expected.reshape(-1).view(torch.uint8).clone()  # bytes: a bool clone would canonicalise them
        want[start * t.dtype.itemsize:stop * t.dtype.itemsize].copy_(part.view(torch.uint8))
        want = want.view(t.dtype)
        try:
            self.expect_unchanged_after_oom(lambda: self.store.write(t, part, start), settle)
        except pagemem.TierIOError:
            self.after_failed_write(i)
            return
        self.live[i] = (t, want.view(t.shape))

    @precondition(lambda self: self.live and len(self.leases) < 3)
    @rule(i=index)
    def hold_lease(self, i):
        t, expected = self.live[i % len(self.live)]
        try:
            lease = t.lease(write=False)
        except (pagemem.InvalidRequest, pagemem.TornPage):
            return
        if isinstance(expected, torch.Tensor):
            assert same_bytes(lease.tensor, expected)
        self.leases.append((t, lease))

    @precondition(lambda self: self.leases)
    @rule(i=index)
    def end_lease(self, i):
        _, lease = self.leases.pop(i % len(self.leases))
        lease.release()

    @rule(tier=st.sampled_from(("gpu", "cpu")), pages=st.integers(0, 10), settle=st.booleans())
    def resize(self, tier, pages, settle):
        """A memory tier's arena grows or shrinks with every page's bytes kept (the read-back
        invariant checks them); a refusal names its reason and changes nothing."""
        pages = min(pages, self.store.config.pages(tier))
        if settle:
            self.store.synchronize()
        before = self.snapshot() if settle else None
        try:
            self.store.resize(tier, pages)
        except pagemem.InvalidRequest as exc:
            assert any(why in str(exc) for why in ("pinned", "in flight", "is in use")), exc
            if settle:
                assert "in flight" not in str(exc)
                assert self.snapshot() == before
            return
        assert self.store.tier(tier).capacity == pages

    @rule(op_kind=faults)
    def inject_fault(self, op_kind):
        self.faults.fail_next(*op_kind)

    @rule()
    def synchronize(self):
        """Once nothing is in flight, every copy of every live page holds its own slot and the
        counts add up."""
        self.store.synchronize()
        for t, _ in self.live:
            assert t.tier is None or t.tier in TIERS
        pages = {p for t, _ in self.live for p in t.pages}
        slots = [(tier, slot) for p in pages for tier, slot in self.store.copies(p).items()]
        assert len(set(slots)) == len(slots)
        s = self.store.stats()
        assert sum(s[n].used_pages for n in TIERS) == len(slots)
        assert sum(s[n].live_bytes for n in TIERS) == sum(t.nbytes for t, _ in self.live)
        assert s.pinned_pages == len(self.pinned_pages())

    # -- invariants
    @invariant()
    def every_live_tensor_reads_back_what_was_written(self):
        for k, (t, expected) in enumerate(self.live):
            for attempt in range(12):  # an injected read fault fails one read, never the data
                try:
                    out = t.to_torch()
                    break
                except pagemem.TierIOError:
                    continue
                except pagemem.TornPage:
                    assert expected is TORN, "torn data appeared without a failed in-place write"
                    out = None
                    break
            else:
                pytest.fail("reads kept failing")
            if out is None:
                continue
            assert expected is not TORN, "a torn tensor was returned as data"
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

    @invariant()
    def leased_tensors_stay_put(self):
        for t, lease in self.leases:
            assert lease.active and not t.is_freed

    @invariant()
    def a_read_only_lease_reads_as_the_tensor_does(self):
        """An alias sees later writes; a merged copy (scattered pages) must too ([Note: read-only
        merged copies follow writes])."""
        for t, lease in self.leases:
            expected = next((e for u, e in self.live if u is t), None)
            if isinstance(expected, torch.Tensor):
                assert same_bytes(lease.tensor, expected), "a read-only lease went stale" + (
                    " (a merged copy)" if lease.copied else "")


machine_settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("engine", ENGINES)
def test_store_state_machine(engine):
    machine = type(f"StoreMachine_{engine}", (StoreMachine,), {"engine": engine})
    run_state_machine_as_test(machine, settings=machine_settings)


def test_store_state_machine_with_inline_copies():
    machine = type("StoreMachine_inline", (StoreMachine,), {"copy_threads": 0})
    run_state_machine_as_test(machine, settings=settings(machine_settings, max_examples=50))
