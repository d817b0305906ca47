"""Both NVMe I/O engines, for real, against files under the test's temporary directory."""

import errno
import mmap
import os
import threading

import pytest

from pagemem.tiers.io.aio import AioEngine
from pagemem.tiers.io.faults import FaultyEngine
from pagemem.tiers.io.threads import ThreadEngine

from conftest import ENGINES

PAGE = 8192


def make(name, depth):
    return AioEngine(depth) if name == "aio" else ThreadEngine(depth)


@pytest.fixture
def direct_file(tmp_path):
    path = tmp_path / "pages"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 64 * PAGE)
    os.close(fd)
    fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    yield fd
    os.close(fd)


def run_all(engine, requests):
    """Submit (write, offset, buf) requests; return their results in order."""
    results = [None] * len(requests)
    left = [len(requests)]
    finished = threading.Event()
    lock = threading.Lock()

    def done_for(i):
        def done(n):
            with lock:
                results[i] = n
                left[0] -= 1
                if left[0] == 0:
                    finished.set()
        return done

    for i, (write, fd, offset, buf) in enumerate(requests):
        engine.submit(write, fd, offset, buf, done_for(i))
    assert finished.wait(30)
    return results


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("depth", [1, 4, 32])
def test_write_then_read_back_many_pages(name, depth, direct_file):
    engine = make(name, depth)
    try:
        n = 48  # more than the deepest queue: exercises the backlog
        src = mmap.mmap(-1, n * PAGE)
        src.write(os.urandom(n * PAGE))
        views = memoryview(src)
        res = run_all(engine, [(True, direct_file, i * PAGE, views[i * PAGE:(i + 1) * PAGE]) for i in range(n)])
        assert res == [PAGE] * n
        dst = mmap.mmap(-1, n * PAGE)
        dviews = memoryview(dst)
        order = list(reversed(range(n)))
        res = run_all(engine, [(False, direct_file, i * PAGE, dviews[i * PAGE:(i + 1) * PAGE]) for i in order])
        assert res == [PAGE] * n
        assert dst[:] == src[:]
    finally:
        engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_errors_come_back_as_negative_errno(name, tmp_path):
    engine = make(name, 4)
    try:
        buf = memoryview(mmap.mmap(-1, PAGE))
        ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
        try:
            (res,) = run_all(engine, [(True, ro, 0, buf)])
        finally:
            os.close(ro)
        assert res == -errno.EBADF
    finally:
        engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_read_past_end_is_short(name, direct_file):
    engine = make(name, 2)
    try:
        buf = memoryview(mmap.mmap(-1, PAGE))
        (res,) = run_all(engine, [(False, direct_file, 64 * PAGE, buf)])
        assert res == 0
    finally:
        engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_faulty_engine_injects_each_fault_once(name, direct_file):
    engine = FaultyEngine(make(name, 4))
    try:
        buf = mmap.mmap(-1, PAGE)
        buf.write(b"x" * PAGE)
        view = memoryview(buf)
        engine.fail_next("write", "enospc")
        engine.fail_next("write", "eio")
        engine.fail_next("write", "short")
        res = run_all(engine, [(True, direct_file, i * PAGE, view) for i in range(4)])
        assert res == [-errno.ENOSPC, -errno.EIO, PAGE // 2, PAGE]
        assert engine.injected == 3
    finally:
        engine.close()


def test_aio_close_waits_for_requests_in_flight(direct_file):
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    engine = AioEngine(2)
    buf = memoryview(mmap.mmap(-1, 16 * PAGE))
    results = []
    for i in range(16):
        engine.submit(True, direct_file, i * PAGE, buf[i * PAGE:(i + 1) * PAGE], results.append)
    engine.close()
    assert results == [PAGE] * 16
    with pytest.raises(RuntimeError):
        engine.submit(True, direct_file, 0, buf[:PAGE], results.append)


def test_aio_close_after_a_refused_submit_does_not_hang(tmp_path):
    """The kernel refuses a write to a read-only fd at io_submit; the reaper must not wait for it."""
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    import threading as th

    for attempt in range(20):
        engine = AioEngine(4)
        ro = os.open(tmp_path / f"ro{attempt}", os.O_RDONLY | os.O_CREAT, 0o600)
        got = th.Event()
        engine.submit(True, ro, 0, memoryview(mmap.mmap(-1, PAGE)), lambda n: got.set())
        assert got.wait(10)
        closer = th.Thread(target=engine.close, daemon=True)
        closer.start()
        closer.join(10)
        os.close(ro)
        assert not closer.is_alive(), f"close() hung on attempt {attempt}"


def test_aio_a_signal_interrupting_the_reaper_loses_nothing(direct_file, monkeypatch):
    """io_getevents cut short by a signal (EINTR: a profiler attaching, say) is waited again;
    it used to kill the reaper, failing every request in flight and after."""
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    engine = AioEngine(4)
    real = engine._ctx.getEvents
    interrupted = []

    def get_events(**kw):
        if len(interrupted) < 3:
            interrupted.append(1)
            raise InterruptedError(errno.EINTR, "io_getevents")
        return real(**kw)

    monkeypatch.setattr(engine._ctx, "getEvents", get_events)
    try:
        src = mmap.mmap(-1, 8 * PAGE)
        src.write(os.urandom(8 * PAGE))
        views = memoryview(src)
        res = run_all(engine, [(True, direct_file, i * PAGE, views[i * PAGE:(i + 1) * PAGE]) for i in range(8)])
        assert res == [PAGE] * 8 and len(interrupted) == 3
        assert engine.broken is None
    finally:
        engine.close()
