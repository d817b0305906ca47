"""[Note: no operation is lost] An exception on any thread the store starts (an I/O engine's
reaper or pool, a copy thread, a CUDA event waiter, a staging hand-off) completes the operation
it belongs to with that error: the waiter raises instead of blocking forever, and a dead thread
makes later operations raise too, never hang. Every wait here runs in a thread joined with a
generous bound: a test fails if it is still alive (a hang), never on how long anything took."""

from __future__ import annotations

import mmap
import os
import queue
import threading

import pytest
import torch

import pagemem
from pagemem.errors import OperationFailed, PageMemError, TierIOError
from pagemem.store import placement as placement_mod
from pagemem.tiers import nvme as nvme_mod
from pagemem.tiers.copy import HostCopyEngine, _EventWaiter
from pagemem.tiers.io import threads as threads_mod
from pagemem.tiers.io.aio import AioEngine
from pagemem.tiers.io.threads import ThreadEngine
from pagemem.tiers.staging import StagingPool

from conftest import ENGINES, PAGE, random_tensor, same_bytes

BOUND = 120  # seconds a test waits before calling an operation hung


def outcome(fn, *args):
    """Run ``fn(*args)`` on a thread; return what it raised (None if it returned). Fails the test
    if it is still running after BOUND seconds."""
    box: list = []

    def run() -> None:
        try:
            fn(*args)
            box.append(None)
        except BaseException as exc:  # what reached the caller
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung: an operation was lost"
    return box[0]


class Boom(BaseException):
    """Not an Exception: what a bare ``except Exception`` lets through (like SystemExit)."""


# ---------------------------------------------------------------- the nvme tier, both engines

def test_a_checksum_raising_on_the_io_thread_fails_the_read(make_store, engine, monkeypatch):
    store = make_store(io_engine=engine)
    data = random_tensor((3 * PAGE,), torch.uint8, seed=1)
    t = store.allocate(data.shape, data.dtype, tier="cpu")
    t.copy_(data)
    t.move("nvme").wait()
    real = nvme_mod.page_checksum
    on_io_thread = []

    def failing(buf):
        on_io_thread.append(threading.current_thread() is not threading.main_thread())
        raise MemoryError("planted: no memory for the checksum")

    monkeypatch.setattr(nvme_mod, "page_checksum", failing)
    err = outcome(lambda: t.move("cpu").wait())
    assert isinstance(err, TierIOError) and isinstance(err.__cause__, MemoryError)
    assert "nvme read of slot" in str(err) and "verifying its checksum" in str(err)
    assert any(on_io_thread)
    monkeypatch.setattr(nvme_mod, "page_checksum", real)
    assert t.tier == "nvme" and same_bytes(t.to_torch(), data)  # the page stayed, intact
    assert outcome(lambda: t.move("cpu").wait()) is None


def test_a_checksum_raising_before_a_write_fails_it_and_tears_nothing(make_store, engine, monkeypatch):
    store = make_store(io_engine=engine)
    data = random_tensor((2 * PAGE,), torch.uint8, seed=2)
    t = store.allocate(data.shape, data.dtype, tier="cpu")
    t.copy_(data)
    monkeypatch.setattr(nvme_mod, "page_checksum", lambda buf: (_ for _ in ()).throw(MemoryError("planted")))
    err = outcome(lambda: t.move("nvme").wait())
    assert isinstance(err, TierIOError) and "computing its checksum" in str(err)
    monkeypatch.undo()
    assert t.tier == "cpu" and same_bytes(t.to_torch(), data)
    assert outcome(lambda: t.move("nvme").wait()) is None and same_bytes(t.to_torch(), data)


def test_a_syscall_raising_a_non_os_error_fails_the_request(make_store, monkeypatch):
    """The threads engine's pool thread: ``pwritev`` raising something other than OSError."""
    store = make_store(io_engine="threads")
    data = random_tensor((2 * PAGE,), torch.uint8, seed=3)
    t = store.allocate(data.shape, data.dtype, tier="cpu")
    t.copy_(data)

    def pwritev(*args):
        raise MemoryError("planted in pwritev")

    monkeypatch.setattr(threads_mod.os, "pwritev", pwritev)
    err = outcome(lambda: t.move("nvme").wait())
    monkeypatch.undo()
    assert isinstance(err, TierIOError) and isinstance(err.__cause__, MemoryError)
    assert t.tier == "cpu" and same_bytes(t.to_torch(), data)


class _DyingContext:
    """An AIO context whose ``getEvents`` raises: the reaper thread dies mid-flight."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def submit(self, blocks):
        return self.inner.submit(blocks)

    def getEvents(self, **kwargs):
        raise MemoryError("planted in the reaper")

    def close(self):
        self.inner.close()


def test_a_dead_aio_reaper_fails_requests_in_flight_and_later_ones(make_store):
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    store = make_store(io_engine="aio")
    io = store.tier("nvme").engine
    assert io.name == "aio"
    a = store.allocate((PAGE,), torch.uint8, tier="cpu")
    b = store.allocate((PAGE,), torch.uint8, tier="cpu")
    a.copy_(random_tensor((PAGE,), torch.uint8, seed=4))
    io._ctx = _DyingContext(io._ctx)
    err = outcome(lambda: a.move("nvme").wait())
    assert isinstance(err, TierIOError) and isinstance(err.__cause__, OperationFailed)
    assert "reaper thread died" in str(err)
    assert io.broken is not None and not io._reaper.is_alive()
    later = outcome(lambda: b.move("nvme").wait())  # the dead thread makes the next wait raise too
    assert isinstance(later, TierIOError) and "reaper thread died" in str(later)
    assert a.tier == "cpu" and b.tier == "cpu"
    assert outcome(store.close) is None


@pytest.mark.parametrize("name", ENGINES)
def test_an_engine_calls_a_raising_callback_again_with_its_error(name, tmp_path):
    """The engine level: a completion callback that raises is completed with its own error."""
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 4 * PAGE)
    os.close(fd)
    fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    io = AioEngine(2) if name == "aio" else ThreadEngine(2)
    try:
        buf = memoryview(mmap.mmap(-1, PAGE))
        got: queue.SimpleQueue = queue.SimpleQueue()

        def done(res):
            got.put(res)
            if not isinstance(res, BaseException):
                raise MemoryError("planted in the callback")

        io.submit(True, fd, 0, buf, done)
        assert got.get(timeout=BOUND) == PAGE
        second = got.get(timeout=BOUND)
        assert isinstance(second, OperationFailed) and isinstance(second.__cause__, MemoryError)
        io.submit(True, fd, PAGE, buf, got.put)  # the engine's thread lives on
        assert got.get(timeout=BOUND) == PAGE
    finally:
        assert outcome(io.close) is None
        os.close(fd)


# ---------------------------------------------------------------- the store's callbacks, every path

PATHS = [("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "gpu"), ("gpu", "cpu"), ("nvme", "gpu"), ("gpu", "nvme")]


@pytest.mark.parametrize("src,dst", PATHS, ids=[f"{s}->{d}" for s, d in PATHS])
def test_a_raising_store_callback_fails_the_move_and_later_moves_run(make_store, engine, src, dst, monkeypatch):
    """The store's completion (``Placement._landed``) raising on whichever thread lands the pages
    (I/O thread, copy thread, staging hand-off for gpu<->nvme) fails the move with an
    OperationFailed; the pages stay with their data; the next move on them runs."""
    store = make_store(io_engine=engine, copy_threads=2)
    data = random_tensor((3 * PAGE,), torch.uint8, seed=5)
    t = store.allocate(data.shape, data.dtype, tier=src)
    t.copy_(data)
    real = placement_mod.Placement._landed
    threads = set()

    def landed(self, op, plan, batch, error):
        threads.add(threading.current_thread().name)
        raise MemoryError("planted in the store's completion")

    monkeypatch.setattr(placement_mod.Placement, "_landed", landed)
    err = outcome(lambda: t.move(dst).wait())
    assert isinstance(err, OperationFailed) and isinstance(err.__cause__, MemoryError), err
    assert f"{src}->{dst}" in str(err)
    monkeypatch.setattr(placement_mod.Placement, "_landed", real)
    assert t.tier == src and same_bytes(t.to_torch(), data)
    free = store.tier(dst).free_pages
    assert free == store.tier(dst).capacity  # the reserved destination slots came back
    assert outcome(lambda: t.move(dst).wait()) is None
    assert t.tier == dst and same_bytes(t.to_torch(), data)
    assert outcome(store.close) is None


def test_an_operation_whose_start_raises_fails_and_the_queue_goes_on(make_store, monkeypatch):
    """The store's queue: an operation that cannot start is completed with its error, and the
    operations queued behind it on the same pages still run."""
    store = make_store(io_engine="threads")
    data = random_tensor((PAGE,), torch.uint8, seed=6)
    t = store.allocate(data.shape, data.dtype, tier="cpu")
    t.copy_(data)
    monkeypatch.setattr(placement_mod.Placement, "_start",
                        lambda self, plan, op: (_ for _ in ()).throw(MemoryError("planted in start")))
    err = outcome(lambda: t.move("nvme").wait())
    monkeypatch.undo()
    assert isinstance(err, MemoryError)
    assert outcome(lambda: t.move("gpu").wait()) is None and same_bytes(t.to_torch(), data)


# ---------------------------------------------------------------- copy threads and fences

class RaisingFence:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise self.exc


def test_a_fence_raising_a_base_exception_on_a_copy_thread_is_the_copy_error():
    copier = HostCopyEngine(1)
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()
        dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
        copier.copy(dst, src, got.put, after=RaisingFence(Boom("planted in the fence")))
        assert isinstance(got.get(timeout=BOUND), Boom) and not dst.any()
        copier.copy(dst, src, got.put)  # the copy thread lives on
        assert got.get(timeout=BOUND) is None and dst.all()
    finally:
        assert outcome(copier.close) is None


def test_a_copy_callback_that_raises_is_completed_with_its_error():
    copier = HostCopyEngine(1)
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()

        def done(error):
            got.put(error)
            if error is None:
                raise MemoryError("planted in the copy's callback")

        copier.copy(torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8), done)
        assert got.get(timeout=BOUND) is None
        second = got.get(timeout=BOUND)
        assert isinstance(second, OperationFailed) and isinstance(second.__cause__, MemoryError)
    finally:
        assert outcome(copier.close) is None


class GatedEvent:
    def __init__(self) -> None:
        self.gate = threading.Event()

    def synchronize(self) -> None:
        assert self.gate.wait(BOUND)


def test_a_dead_event_waiter_fails_what_it_holds_and_later_copies():
    """The CUDA copy engine's event-waiter thread (run here with stand-in events)."""
    waiter = _EventWaiter("pagemem-test-waiter")
    got: queue.SimpleQueue = queue.SimpleQueue()
    first = GatedEvent()
    waiter.push(first, lambda e: got.put(("first", e)))
    waiter._queue.put("not a request")  # the waiter's loop raises on it and the thread dies
    waiter.push(GatedEvent(), lambda e: got.put(("queued", e)))
    first.gate.set()
    assert got.get(timeout=BOUND) == ("first", None)
    which, err = got.get(timeout=BOUND)
    assert which == "queued" and isinstance(err, OperationFailed) and "event waiter, died" in str(err)
    waiter.push(GatedEvent(), lambda e: got.put(("later", e)))
    which, err = got.get(timeout=BOUND)
    assert which == "later" and isinstance(err, OperationFailed)
    assert outcome(waiter.close) is None


# ---------------------------------------------------------------- staging

def test_a_staging_waiter_that_raises_does_not_starve_the_next():
    pool = StagingPool(2, PAGE, pin=False)
    try:
        held = pool.acquire_blocking(2)
        served = threading.Event()
        pool.acquire(1, lambda bufs: (_ for _ in ()).throw(MemoryError("planted in a waiter")))
        pool.acquire(1, lambda bufs: served.set())
        pool.release(held)
        assert served.is_set()
    finally:
        pool.close()


def test_a_bounce_whose_write_raises_gives_the_staging_page_back(make_store, engine, monkeypatch):
    """gpu->nvme bounces through staging; the nvme write raising inside the staging hand-off
    fails the move and returns the staging page."""
    store = make_store(io_engine=engine, staging_pages=1)
    data = random_tensor((2 * PAGE,), torch.uint8, seed=7)
    t = store.allocate(data.shape, data.dtype, tier="gpu")
    t.copy_(data)
    monkeypatch.setattr(nvme_mod.NvmeTier, "start_write",
                        lambda self, *a, **k: (_ for _ in ()).throw(MemoryError("planted in start_write")))
    err = outcome(lambda: t.move("nvme").wait())
    monkeypatch.undo()
    assert isinstance(err, PageMemError) and isinstance(err.__cause__, MemoryError)
    assert store.stats().staging_free == 1
    assert store.tier("nvme").free_pages == store.tier("nvme").capacity
    assert outcome(lambda: t.move("nvme").wait()) is None and same_bytes(t.to_torch(), data)
