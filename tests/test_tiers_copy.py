"""Copy engines and memory tiers: copies ordered after a fence (``after``), and span copies."""

import threading
import time

import pytest
import torch

from pagemem.tiers.arena import CudaArena, HostArena, HostBuffer
from pagemem.tiers.copy import CudaCopyEngine, HostCopyEngine
from pagemem.tiers.memory import MemoryTier

from conftest import DelayedCopier, Delayer

PAGE = 256


class Waiter:
    """Collects a completion; ``wait()`` returns its error."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error = "not called"

    def __call__(self, error) -> None:
        self.error = error
        self.event.set()

    def wait(self):
        assert self.event.wait(10), "copy never completed"
        return self.error


class GateFence:
    """A fence that completes when the test opens it; records when someone waits on it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.error = error

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        if self.error:
            raise self.error


@pytest.fixture(params=[2, 0], ids=["threads", "inline"])
def copier(request):
    c = HostCopyEngine(request.param)
    yield c
    c.close()


@pytest.fixture
def tier(copier):
    t = MemoryTier("gpu", HostArena(8 * PAGE, pin=False), PAGE, copier, "test", host_addressable=False)
    yield t
    t.close()


def pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_host_copy_waits_for_its_fence(copier):
    if copier.inline:
        pytest.skip("inline: see test_an_inline_copy_is_done_on_return_after_its_fence")
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    fence, done = GateFence(), Waiter()
    copier.copy(dst, src, done, after=fence)
    assert fence.entered.wait(10)
    assert not dst.any() and not done.event.is_set()  # the copy is held behind the fence
    fence.gate.set()
    assert done.wait() is None
    assert torch.equal(dst, src)


def test_an_inline_copy_is_done_on_return_after_its_fence():
    copier = HostCopyEngine(0)
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    fence, done = GateFence(), Waiter()
    opener = threading.Thread(target=lambda: fence.entered.wait(10) and fence.gate.set())
    opener.start()
    copier.copy(dst, src, done, after=fence)  # blocks until the other thread opens the fence
    opener.join()
    assert fence.entered.is_set() and done.event.is_set() and done.error is None
    assert torch.equal(dst, src)
    copier.close()


def test_a_failing_fence_is_the_copy_error(copier):
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    fence, done = GateFence(RuntimeError("device lost")), Waiter()
    fence.gate.set()
    copier.copy(dst, src, done, after=fence)
    assert isinstance(done.wait(), RuntimeError)
    assert not dst.any()


def test_span_copies_move_adjacent_slots_in_one_copy(tier):
    calls = []
    inner = tier.copier

    class Counting:
        name = inner.name

        def copy(self, dst, src, done, after=None):
            calls.append((dst.numel(), after))
            inner.copy(dst, src, done, after=after)

    tier.copier = Counting()
    data = pattern(3 * PAGE)
    done = Waiter()
    tier.write_span(2, 3, data, done)
    assert done.wait() is None
    assert torch.equal(tier.span(2, 3), data)
    out = torch.empty(3 * PAGE, dtype=torch.uint8)
    done = Waiter()
    tier.read_span(2, 3, out, done)
    assert done.wait() is None and torch.equal(out, data)
    one = HostBuffer(torch.empty(PAGE, dtype=torch.uint8), None)
    done = Waiter()
    tier.start_read(3, one, done)  # the one-page case of read_span
    assert done.wait() is None and torch.equal(one.tensor, data[PAGE:2 * PAGE])
    assert [n for n, _ in calls] == [3 * PAGE, 3 * PAGE, PAGE]


def test_span_into_a_shaped_tensor(tier):
    data = pattern(2 * PAGE, seed=1).view(2, PAGE)
    done = Waiter()
    tier.write_span(0, 2, data, done)
    assert done.wait() is None
    out = torch.empty(2, PAGE, dtype=torch.uint8)
    done = Waiter()
    tier.read_span(0, 2, out, done)
    assert done.wait() is None and torch.equal(out, data)


def test_tier_copies_pass_their_fence_on(tier):
    fence = GateFence()
    data = pattern(PAGE, seed=2)
    done = Waiter()
    if tier.copier.inline:  # the write blocks until the fence opens: open it from another thread
        threading.Thread(target=lambda: fence.entered.wait(10) and (time.sleep(0.05), fence.gate.set())).start()
        tier.start_write(5, HostBuffer(data, None), done, after=fence)
        assert fence.entered.is_set() and done.event.is_set()
        assert done.error is None and torch.equal(tier.buffer(5), data)
        return
    tier.start_write(5, HostBuffer(data, None), done, after=fence)
    assert fence.entered.wait(10)
    assert not done.event.is_set()
    fence.gate.set()
    assert done.wait() is None and torch.equal(tier.buffer(5), data)


@pytest.mark.parametrize("first,count,size,dtype", [
    (-1, 1, PAGE, torch.uint8),
    (7, 2, 2 * PAGE, torch.uint8),
    (0, 0, 0, torch.uint8),
    (0, 2, PAGE, torch.uint8),
    (0, 1, PAGE // 4, torch.int32),
])
def test_bad_spans_are_refused_before_any_copy(tier, first, count, size, dtype):
    done = Waiter()
    with pytest.raises(ValueError):
        tier.read_span(first, count, torch.empty(size, dtype=dtype), done)
    with pytest.raises(ValueError):
        tier.write_span(first, count, torch.empty(size, dtype=dtype), done)
    assert not done.event.is_set()


def test_delayed_copier_forwards_the_fence(copier):
    delayer = Delayer()
    delayed = DelayedCopier(copier, delayer)
    try:
        dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
        fence, done = GateFence(), Waiter()
        delayed.copy(dst, src, done, after=fence)
        assert fence.entered.wait(10)
        fence.gate.set()
        assert done.wait() is None and torch.equal(dst, src)
    finally:
        delayer.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cuda_copy_waits_for_the_producing_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    engine = CudaCopyEngine(device)
    try:
        grad = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        compute = torch.cuda.Stream(device)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # the compute stream is still busy...
            grad.fill_(9)  # ...when it writes the gradient
            written = torch.cuda.Event()
            written.record(compute)
        host = torch.empty(grad.numel(), dtype=torch.uint8).pin_memory()
        done = Waiter()
        engine.copy(host, grad, done, after=written)
        assert done.wait() is None
        assert bool((host == 9).all())
    finally:
        engine.close()


@pytest.mark.cuda
@cuda
def test_cuda_tier_spans_and_fenced_release():
    device = torch.device("cuda", torch.cuda.current_device())
    engine = CudaCopyEngine(device)
    tier = MemoryTier("gpu", CudaArena(8 * PAGE, device), PAGE, engine, "cuda", host_addressable=False)
    try:
        data = pattern(3 * PAGE, seed=3).pin_memory()
        done = Waiter()
        tier.write_span(1, 3, data, done)
        assert done.wait() is None
        out = torch.empty(3 * PAGE, dtype=torch.uint8, device=device)
        done = Waiter()
        tier.read_span(1, 3, out, done)  # device to device
        assert done.wait() is None and torch.equal(out.cpu(), data)
        slots = tier.allocate(8)
        torch.cuda._sleep(100_000_000)
        fence = tier.fence()
        assert isinstance(fence, torch.cuda.Event)
        tier.release(slots, fence)
        assert tier.free_pages == 8
        tier.allocate(8)  # waits on the event rather than handing out slots still in use
        assert fence.query()
    finally:
        tier.close()
        engine.close()
