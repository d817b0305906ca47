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
