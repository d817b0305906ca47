"""Shared fixtures: small stores on a temporary directory, with either I/O engine."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import pagemem
from pagemem.tiers.io.base import EngineUnavailable, IOEngine

PAGE = 4096


def aio_available() -> bool:
    try:
        from pagemem.tiers.io.aio import AioEngine

        AioEngine(1).close()
        return True
    except EngineUnavailable:
        return False


def _engines() -> list:
    """Both engines; under CI the AIO one must work (set-up installs libaio1), elsewhere it may skip."""
    if aio_available() or os.environ.get("CI", "").lower() == "true":
        aio = "aio"
    else:
        aio = pytest.param("aio", marks=pytest.mark.skip(reason="libaio.so.1 not installed"))
    return [aio, "threads"]


ENGINES = _engines()


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture
def make_store(tmp_path):
    """Build stores with tiny capacities; closed at the end of the test."""
    stores = []

    def make(**overrides) -> pagemem.PageStore:
        cfg = dict(page_bytes=PAGE, gpu_bytes=8 * PAGE, cpu_bytes=16 * PAGE, nvme_bytes=32 * PAGE,
                   nvme_path=str(tmp_path), staging_pages=4)
        cfg.update(overrides)
        store = pagemem.PageStore(pagemem.StoreConfig(**cfg))
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store, engine) -> pagemem.PageStore:
    return make_store(io_engine=engine)


def random_tensor(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic random contents for any dtype (raw random bytes reinterpreted)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.cpu().contiguous().reshape(-1).view(torch.uint8),
                       b.cpu().contiguous().reshape(-1).view(torch.uint8))


class GatedEngine(IOEngine):
    """Holds every request until ``open()`` is called: lets a test look at in-flight state."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.name = f"{inner.name}+gate"
        self.depth = inner.depth
        self._gate = threading.Event()
        self._held: list = []
        self._lock = threading.Lock()

    def submit(self, write, fd, offset, buf, done) -> None:
        with self._lock:
            if not self._gate.is_set():
                self._held.append((write, fd, offset, buf, done))
                return
        self.inner.submit(write, fd, offset, buf, done)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def open(self) -> None:
        with self._lock:
            self._gate.set()
            held, self._held = self._held, []
        for req in held:
            self.inner.submit(*req)

    def close(self) -> None:
        self.open()
        self.inner.close()


class Delayer:
    """Runs callbacks after a short random delay on one background thread."""

    def __init__(self, max_delay: float = 0.002, seed: int = 0) -> None:
        import heapq
        import random

        self._heapq = heapq
        self._rng = random.Random(seed)
        self._max = max_delay
        self._heap: list = []
        self._seq = 0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def later(self, fn) -> None:
        import time

        with self._cv:
            self._seq += 1
            self._heapq.heappush(self._heap, (time.monotonic() + self._rng.random() * self._max, self._seq, fn))
            self._cv.notify()

    def _run(self) -> None:
        import time

        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._cv.wait()
                if not self._heap:
                    return
                due, _, fn = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                self._heapq.heappop(self._heap)
            fn()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()


class DelayedEngine(IOEngine):
    """Starts each request, and reports it done, after random delays: widens every race window."""

    def __init__(self, inner: IOEngine, delayer: Delayer) -> None:
        self.inner, self.delayer = inner, delayer
        self.name, self.depth = f"{inner.name}+delay", inner.depth

    def submit(self, write, fd, offset, buf, done) -> None:
        late_done = lambda n: self.delayer.later(lambda: done(n))  # noqa: E731
        self.delayer.later(lambda: self.inner.submit(write, fd, offset, buf, late_done))

    def close(self) -> None:
        self.inner.close()


class DelayedCopier:
    """Starts each memory copy, and reports it done, after random delays."""

    def __init__(self, inner, delayer: Delayer) -> None:
        self.inner, self.delayer, self.name = inner, delayer, inner.name

    def copy(self, dst, src, done, after=None) -> None:
        late_done = lambda e: self.delayer.later(lambda: done(e))  # noqa: E731
        self.delayer.later(lambda: self.inner.copy(dst, src, late_done, after=after))

    def close(self) -> None:
        self.inner.close()


def engine_gpu_budget(model, step, page_bytes: int, param_fraction: float) -> int:
    """A gpu budget for ``pagemem.Engine`` that covers activations and the other non-model memory
    and leaves room for ``param_fraction`` of the parameters' bytes beyond that: the smallest budget
    the scheduler accepts for a trace of ``step()`` on a copy of ``model`` (its layers are whole
    blocks, coarser than the engine's units, so this is an upper bound on the engine's own), plus
    that fraction. Pages move every iteration when the fraction is small."""
    import copy

    from pagemem.sched import least_gpu_bytes
    from pagemem.tracer import trace

    twin = copy.deepcopy(model)
    tr = trace(twin, lambda: step(twin)).with_non_model_peak_reserved()  # as the engine plans
    least = least_gpu_bytes(tr, page_bytes=page_bytes)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return -(-(least + int(params * param_fraction)) // page_bytes) * page_bytes


def exit_status(*argv: str) -> int:
    """``pagemem ARGV`` in this process: its exit status, argparse's exits included."""
    from pagemem.cli import main

    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code)
