"""Runs of pages between the cpu and the disk in a few requests ([Note: runs of pages in one
request] in ``tiers/nvme.py``): what goes to the engine, and that each page keeps its checksum,
its torn flag and its failure semantics."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagemem
from pagemem.tiers import nvme as nvme_mod
from pagemem.tiers.arena import HostArena
from pagemem.tiers.io.base import IOEngine, Request
from pagemem.tiers.nvme import NvmeTier, TornSlot

from conftest import ENGINES, PAGE, random_tensor, same_bytes


class Counting(IOEngine):
    """Passes everything to ``inner``; records each ``submit_many``'s request sizes in pages."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner, self.name, self.depth = inner, f"{inner.name}+count", inner.depth
        self.calls: list[tuple[bool, list[int]]] = []

    def submit(self, write, fd, offset, buf, done) -> None:
        self.submit_many(write, [Request(fd, offset, buf, done)])

    def submit_many(self, write, requests) -> None:
        self.calls.append((write, [len(r.buf) // PAGE for r in requests]))
        self.inner.submit_many(write, requests)

    def close(self) -> None:
        self.inner.close()


def counting(store) -> Counting:
    tier = store.tier("nvme")
    tier.engine = Counting(tier.engine)
    return tier.engine


@pytest.mark.parametrize("pages,most,requests", [(1, 8, [1]), (5, 8, [5]), (8, 8, [8]), (11, 4, [4, 4, 3])])
def test_a_run_is_one_call_of_requests_at_most_max_request_bytes(make_store, engine, monkeypatch, pages, most,
                                                                 requests):
    monkeypatch.setattr(nvme_mod, "MAX_REQUEST_BYTES", most * PAGE)
    store = make_store(io_engine=engine)
    io = counting(store)
    t = store.allocate((pages * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, torch.uint8, pages)
    t.copy_(data)
    t.move("nvme").wait(timeout=30)
    assert io.calls == [(True, requests)]
    t.move("cpu").wait(timeout=30)
    assert io.calls[1:] == [(False, requests)]
    assert t.tier == "cpu" and same_bytes(t.to_torch(), data)


def test_striped_files_take_a_request_per_page_in_one_call(make_store, tmp_path, engine):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    store = make_store(nvme_path=[str(a), str(b)], nvme_bytes=8 * PAGE, io_engine=engine)
    io = counting(store)
    t = store.allocate((4 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, torch.uint8, 9)
    t.copy_(data)
    t.move("nvme").wait(timeout=30)
    t.move("cpu").wait(timeout=30)
    assert io.calls == [(True, [1, 1, 1, 1]), (False, [1, 1, 1, 1])]  # adjacent slots alternate files
    assert same_bytes(t.to_torch(), data)


def test_a_corrupt_page_inside_a_run_is_named_and_never_brought_in(make_store, engine):
    store = make_store(io_engine=engine)
    t = store.allocate((4 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, torch.uint8, 3)
    t.copy_(data)
    t.move("nvme").wait(timeout=30)
    tier, slot = store.location(t.pages[2])
    f, offset = store.tier("nvme").locate(slot)
    fd = os.open(f.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset + 7)[0] ^ 1]), offset + 7)
        os.fsync(fd)
    finally:
        os.close(fd)
    with pytest.raises(pagemem.CorruptPage) as err:
        t.move("cpu").wait(timeout=30)
    assert err.value.slot == slot and err.value.expected != err.value.actual
    assert [store.location(p)[0] for p in t.pages] == ["nvme"] * 4  # the run stays where it was


def test_aio_admits_up_to_its_depth_in_one_io_submit_and_the_rest_later(tmp_path):
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    from pagemem.tiers.io.aio import AioEngine

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 16 * PAGE)
    os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    io = AioEngine(4)
    sizes: list[int] = []
    real = io._ctx.submit
    io._ctx.submit = lambda blocks: (sizes.append(len(blocks)), real(blocks))[1]
    try:
        src, back = mmap.mmap(-1, 16 * PAGE), mmap.mmap(-1, 16 * PAGE)
        src[:] = bytes(random_tensor((16 * PAGE,), torch.uint8, 4).numpy())
        for write, buf in ((True, src), (False, back)):
            left, got, lock, finished = [16], [], threading.Lock(), threading.Event()

            def done(n):
                with lock:
                    got.append(n)
                    left[0] -= 1
                    if not left[0]:
                        finished.set()

            view = memoryview(buf)
            io.submit_many(write, [Request(fd, i * PAGE, view[i * PAGE:(i + 1) * PAGE], done) for i in range(16)])
            assert finished.wait(30) and got == [PAGE] * 16
            del view
        assert sizes[0] == 4 and sum(sizes) == 32  # the first call: as many as the depth; the rest refilled
        assert back[:] == src[:]
    finally:
        io.close()
        os.close(fd)


# ---------------------------------------------------------------- the tier's spans, stateful

SLOTS = 12


class FailOne(IOEngine):
    """Passes requests to ``inner``; ``plan = (k, kind)`` fails request ``k`` of the next call:
    ``eio`` without touching the disk, ``short`` writing half of it (as ``FaultyEngine``)."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner, self.name, self.depth = inner, f"{inner.name}+fail-one", inner.depth
        self.plan: tuple[int, str] | None = None

    def submit(self, write, fd, offset, buf, done) -> None:
        self.submit_many(write, [Request(fd, offset, buf, done)])

    def submit_many(self, write, requests) -> None:
        plan, self.plan = self.plan, None
        passed = []
        for k, r in enumerate(requests):
            if plan is None or k != plan[0]:
                passed.append(r)
            elif plan[1] == "short" and len(r.buf) >= 2 * PAGE:
                passed.append(r._replace(buf=r.buf[:len(r.buf) // 2 // PAGE * PAGE]))
            else:
                r.done(-errno.EIO if plan[1] == "eio" else 0)
        self.inner.submit_many(write, passed)

    def close(self) -> None:
        self.inner.close()


class Spans(RuleBasedStateMachine):
    """Spans written and read at random, one request of a write failing now and then: a read
    returns what the last successful write of each page put there (zeros if none) or refuses a
    torn page without touching the buffer; a failed request tears exactly its slots; ``done``
    is called once per span, with an error exactly when a request failed."""

    @initialize(engine=st.sampled_from([e for e in ENGINES if isinstance(e, str)]),
                most=st.sampled_from([1, 2, 5, 64]))
    def setup(self, engine: str, most: int) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self._saved = nvme_mod.MAX_REQUEST_BYTES
        nvme_mod.MAX_REQUEST_BYTES = most * PAGE
        self.most = most
        self.tier = NvmeTier((self._dir.name,), SLOTS, PAGE, engine=engine, io_depth=3, direct=True,
                             checksums=True)
        assert self.tier.allocate(SLOTS) == list(range(SLOTS))
        self.faults = self.tier.engine = FailOne(self.tier.engine)
        self.host = HostArena(SLOTS * PAGE, pin=False)
        self.model: list[bytes | None] = [None] * SLOTS
        self.torn = [False] * SLOTS
        self.seed = 0

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            nvme_mod.MAX_REQUEST_BYTES = self._saved
            self.tier.close()
            self.host.close()
            self._dir.cleanup()

    def _call(self, start, first: int, count: int) -> BaseException | None:
        results: list = []
        finished = threading.Event()

        def done(error):
            results.append(error)
            finished.set()

        start(first, count, self.host.buffer(0, count * PAGE), done)
        assert finished.wait(30)
        time.sleep(0.005)
        assert len(results) == 1  # once
        return results[0]

    @rule(data=st.data())
    def write(self, data) -> None:
        first = data.draw(st.integers(0, SLOTS - 1))
        count = data.draw(st.integers(1, SLOTS - first))
        kind = data.draw(st.sampled_from([None, "eio", "short"]))
        pieces = -(-count // self.most)
        failing = data.draw(st.integers(0, pieces - 1)) if kind else None
        self.faults.plan = None if kind is None else (failing, kind)
        self.seed += 1
        payload = random_tensor((count * PAGE,), torch.uint8, self.seed)
        self.host.tensor[:count * PAGE].copy_(payload)
        error = self._call(self.tier.start_write_span, first, count)
        for s in range(first, first + count):
            if (s - first) // self.most == failing:
                self.torn[s] = True
            else:
                self.model[s] = bytes(payload[(s - first) * PAGE:(s - first + 1) * PAGE].numpy())
                self.torn[s] = False
        assert (error is None) == (kind is None)
        if kind is not None:
            assert isinstance(error, pagemem.TierIOError) and "source copy is unchanged" in str(error)

    @rule(data=st.data())
    def read(self, data) -> None:
        first = data.draw(st.integers(0, SLOTS - 1))
        count = data.draw(st.integers(1, SLOTS - first))
        self.host.tensor.fill_(0xAB)
        error = self._call(self.tier.start_read_span, first, count)
        torn = [s for s in range(first, first + count) if self.torn[s]]
        if torn:
            assert isinstance(error, TornSlot) and error.slot == torn[0]
            assert bool((self.host.tensor[:count * PAGE] == 0xAB).all())  # untouched
            return
        assert error is None
        for s in range(first, first + count):
            got = bytes(self.host.tensor[(s - first) * PAGE:(s - first + 1) * PAGE].numpy())
            assert got == (self.model[s] if self.model[s] is not None else bytes(PAGE))

    @precondition(lambda self: any(self.torn))
    @rule()
    def release_torn(self) -> None:
        """Released slots forget that they were torn, and what they held."""
        slots = [s for s in range(SLOTS) if self.torn[s]]
        self.tier.release(slots)
        assert sorted(self.tier.allocate(len(slots))) == slots
        for s in slots:
            self.torn[s], self.model[s] = False, None

    @invariant()
    def torn_flags_match(self) -> None:
        if hasattr(self, "tier"):
            assert [self.tier.is_torn(s) for s in range(SLOTS)] == self.torn


TestSpans = Spans.TestCase
TestSpans.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


class RefusesFrom(IOEngine):
    """Passes requests to ``inner`` until ``left`` have started; then ``submit`` raises (as a
    closed engine does). Uses the default ``submit_many``."""

    def __init__(self, inner: IOEngine, left: int) -> None:
        self.inner, self.name, self.depth, self.left = inner, f"{inner.name}+refuses", inner.depth, left

    def submit(self, write, fd, offset, buf, done) -> None:
        if self.left <= 0:
            raise RuntimeError("I/O engine is closed")
        self.left -= 1
        self.inner.submit(write, fd, offset, buf, done)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("started", [0, 1, 2])
def test_an_engine_that_refuses_part_of_a_span_completes_it_once_with_the_error(tmp_path, engine, monkeypatch,
                                                                              started):
    """Requests it started complete as usual; the rest fail on their own callbacks (the default
    ``submit_many``); where it refused the first, nothing was written and no slot is torn."""
    monkeypatch.setattr(nvme_mod, "MAX_REQUEST_BYTES", PAGE)
    tier = NvmeTier((str(tmp_path),), 4, PAGE, engine=engine, io_depth=4, direct=True, checksums=True)
    host = HostArena(3 * PAGE, pin=False)
    try:
        tier.allocate(4)
        tier.engine = RefusesFrom(tier.engine, started)
        got: list = []
        finished = threading.Event()
        tier.start_write_span(0, 3, host.buffer(0, 3 * PAGE),
                              lambda e: (got.append(e), finished.set()))
        assert finished.wait(30)
        time.sleep(0.01)
        assert len(got) == 1 and isinstance(got[0], BaseException)
        assert [tier.digest(s) is not None for s in range(3)] == [s < started for s in range(3)]
        assert [tier.is_torn(s) for s in range(3)] == [started > 0 and s >= started for s in range(3)]
    finally:
        tier.engine = tier.engine.inner
        tier.close()
        host.close()
