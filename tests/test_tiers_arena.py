"""Arenas give their memory back at close(), even while tensor views of them are still alive."""

import os

import pytest
import torch

from pagemem.tiers.arena import CudaArena, HostArena
from pagemem.tiers.staging import StagingPool

MiB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")


@needs_proc
def test_host_arena_close_returns_memory_while_a_view_lives():
    arena = HostArena(256 * MiB, pin=False)
    arena.tensor.fill_(7)  # resident for certain (MAP_POPULATE does it too)
    view = arena.tensor[100 * MiB:100 * MiB + 4096]
    buf = arena.buffer(0, 4096)
    before = resident_bytes()
    arena.close()
    after = resident_bytes()
    assert before - after >= 200 * MiB, f"only {(before - after) // MiB} MiB returned"
    assert not view.any() and not buf.tensor.any()  # stale views read zeros, not old data
    assert bytes(buf.view[:16]) == bytes(16)
    assert resident_bytes() - after < 16 * MiB  # reading them maps nothing new
    arena.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        arena.buffer(0, 4096)


def test_a_tensor_holding_no_buffer_export_reads_zeros_after_close():
    """torch.frombuffer tensors keep the mmap object alive but export no buffer: closing the
    mapping under them would make them read unmapped memory (a crash). It stays mapped, empty."""
    arena = HostArena(4 * MiB, pin=False)
    arena.tensor.fill_(9)
    alias = torch.from_numpy(arena.tensor[:4096].numpy())  # no buffer export either
    arena.close()
    assert int(alias.sum()) == 0


def test_empty_arena_closes():
    arena = HostArena(0, pin=False)
    arena.close()
    arena.close()


@needs_proc
def test_staging_pool_close_returns_memory_while_a_buffer_is_held():
    pool = StagingPool(64, 4 * MiB, pin=False)
    (held,) = pool.acquire_blocking(1)
    pool.arena.tensor.fill_(3)
    before = resident_bytes()
    pool.close()
    assert before - resident_bytes() >= 200 * MiB
    assert not held.tensor.any()
    pool.release([held])  # giving a buffer back after close is harmless
    assert pool.free == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1, lambda bufs: None)
    pool.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_close_frees_device_memory_while_a_view_lives():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    arena = CudaArena(256 * MiB, device)
    view = arena.tensor[:4096]
    view.fill_(1)
    assert torch.cuda.memory_allocated(device) - base >= 256 * MiB
    arena.close()
    assert torch.cuda.memory_allocated(device) - base < MiB
    # the views share the freed storage: it holds no bytes, so nothing can reach another tensor's
    # memory through them (a kernel launched on one would fault, which poisons the CUDA context)
    assert view.untyped_storage().nbytes() == 0 and view.untyped_storage().data_ptr() == 0
    arena.close()  # idempotent
