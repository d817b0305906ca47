"""Engine threads drop a request's callback and buffers once the callback has run, so whatever
the callback refers to (a whole store) can be garbage collected while the engine lives on."""

import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from pagemem.tiers.copy import HostCopyEngine, _EventWaiter
from pagemem.tiers.io.aio import AioEngine
from pagemem.tiers.io.threads import ThreadEngine

from conftest import ENGINES


class Owner:
    """Stands for the store a completion callback refers to."""


def collected(*refs: weakref.ref) -> bool:
    """True once every ref is dead. Polls: the engine thread may still be finishing the callback."""
    for _ in range(50):
        gc.collect()
        if all(r() is None for r in refs):
            return True
        time.sleep(0.02)
    return False


def io_request(engine, fd: int, write: bool):
    """Submit one request whose callback closes over an Owner; hold neither it nor the buffer."""
    owner, buf = Owner(), np.zeros(4096, dtype=np.uint8)
    finished = threading.Event()

    def done(n, owner=owner):
        finished.set()

    engine.submit(write, fd, 0, memoryview(buf), done)
    return weakref.ref(owner), weakref.ref(buf), finished


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("write", [True, False])
def test_io_engine_forgets_completed_requests(name, write, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    engine = AioEngine(4) if name == "aio" else ThreadEngine(2)
    try:
        owner, buf, finished = io_request(engine, fd, write)
        assert finished.wait(10)
        assert collected(owner, buf), "the engine still holds the callback or the buffer"
    finally:
        engine.close()
        os.close(fd)


def test_aio_forgets_a_request_refused_at_submit(tmp_path):
    if "aio" not in ENGINES:
        pytest.skip("libaio unavailable")
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    engine = AioEngine(4)
    try:
        owner, buf, finished = io_request(engine, fd, write=True)
        assert finished.wait(10)
        assert collected(owner, buf)
    finally:
        engine.close()
        os.close(fd)


def copy_request(copier, fail: bool):
    owner = Owner()
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(32 if fail else 64, dtype=torch.uint8)
    finished = threading.Event()

    def done(error, owner=owner):
        finished.set()

    copier.copy(dst, src, done)
    return weakref.ref(owner), weakref.ref(dst), weakref.ref(src), finished


@pytest.mark.parametrize("fail", [False, True])
def test_host_copy_engine_forgets_completed_copies(fail):
    copier = HostCopyEngine(2)
    try:
        *refs, finished = copy_request(copier, fail)
        assert finished.wait(10)
        assert collected(*refs)
    finally:
        copier.close()


class FakeEvent:
    def __init__(self, error: bool = False) -> None:
        self.error = error

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError("device lost")


@pytest.mark.parametrize("error", [False, True])
def test_event_waiter_forgets_completed_events(error):
    waiter = _EventWaiter("test-waiter")
    try:
        def push():
            owner, event = Owner(), FakeEvent(error)
            finished = threading.Event()

            def done(e, owner=owner):
                finished.set()

            waiter.push(event, done)
            return weakref.ref(owner), weakref.ref(event), finished

        owner, event, finished = push()
        assert finished.wait(10)
        assert collected(owner, event)
    finally:
        waiter.close()
