"""CUDA paths: device arena, pinned cpu arena, stream copies. Skipped without a GPU."""

import pytest
import torch


from conftest import random_tensor, same_bytes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAGE = 1 << 20


@pytest.fixture
def cuda_store(make_store):
    return make_store(page_bytes=PAGE, gpu_bytes=16 * PAGE, cpu_bytes=16 * PAGE, nvme_bytes=32 * PAGE)


def test_tiers_are_device_memory_and_pinned_host_memory(cuda_store):
    assert cuda_store.cuda
    gpu, cpu = cuda_store.tier("gpu"), cuda_store.tier("cpu")
    assert gpu.buffer(0).is_cuda
    assert gpu.describe()["backend"].startswith("cuda")
    assert cpu.describe()["backend"] == "pinned host memory"
    assert cpu.buffer(0).is_pinned()
    assert cuda_store.tier("cpu").arena.nbytes == 16 * PAGE  # exact size, not rounded up


def test_round_trip_through_every_tier(cuda_store):
    d = random_tensor((3, PAGE // 4 + 5), torch.float32, 1)
    t = cuda_store.allocate(d.shape, d.dtype, tier="cpu")
    t.copy_(d)
    for dest in ("gpu", "nvme", "gpu", "cpu", "nvme", "cpu"):
        t.move(dest).wait()
        assert same_bytes(t.to_torch(), d)


def test_gpu_resident_tensor_reads_and_views_on_the_device(cuda_store):
    d = random_tensor((PAGE // 2,), torch.float16, 2).cuda()
    t = cuda_store.allocate(d.shape, d.dtype, tier="gpu")
    t.copy_(d)
    out = t.to_torch()
    assert out.is_cuda and torch.equal(out.view(torch.int16), d.view(torch.int16))
    v = t.view()
    assert v.is_cuda
    v.zero_()
    assert torch.count_nonzero(t.to_torch()) == 0


def _busy(cycles: int = 200_000_000) -> None:
    """Keep the current stream busy for a while (about 0.1 s) so later kernels are still queued."""
    torch.cuda._sleep(cycles)


def test_device_to_host_copy_waits_for_the_kernels_that_produce_the_data(cuda_store):
    """A move of a page the compute stream is still writing must copy the finished data."""
    t = cuda_store.allocate((PAGE // 4,), torch.float32, tier="gpu")
    t.copy_(torch.zeros(PAGE // 4))
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        with t.lease() as x:
            _busy()
            x.fill_(7.0)  # queued behind the sleep: not done when the move is issued
        h = t.move("cpu")  # issued on the compute stream: must wait for fill_
    h.wait()
    assert torch.all(t.to_torch() == 7.0)


def test_freed_gpu_slot_is_not_refilled_while_queued_kernels_read_it(cuda_store):
    """Free a tensor whose memory a queued kernel still reads; a host-to-device copy into a new
    tensor that takes the same slot must not land before that kernel ran."""
    a = cuda_store.allocate((PAGE // 4,), torch.float32, tier="gpu")
    a.copy_(torch.full((PAGE // 4,), 3.0))
    compute = torch.cuda.current_stream()
    with a.lease() as x:
        _busy()
        total = x.sum()  # queued behind the sleep
    a.free()
    b = cuda_store.allocate((PAGE // 4,), torch.float32, tier="cpu")
    b.copy_(torch.full((PAGE // 4,), 5.0))
    b.move("gpu").wait()  # may reuse a's slot only after the sum has read it
    compute.synchronize()
    assert float(total) == 3.0 * (PAGE // 4)
    assert torch.all(b.to_torch() == 5.0)


def test_close_frees_the_device_arena(make_store):
    before = torch.cuda.memory_allocated()
    store = make_store(page_bytes=PAGE, gpu_bytes=64 * PAGE, cpu_bytes=4 * PAGE)
    assert torch.cuda.memory_allocated() - before >= 64 * PAGE
    store.close()
    assert torch.cuda.memory_allocated() - before < PAGE
