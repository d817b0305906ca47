"""``PageStore.write_many``: several tensors written under one wait, every copy."""

from __future__ import annotations

import pytest
import torch

import pagemem


def store() -> pagemem.PageStore:
    return pagemem.PageStore(pagemem.StoreConfig(page_bytes=4096, gpu_backend="host", gpu_bytes=16 * 4096,
                                                 cpu_bytes=16 * 4096))


def test_every_copy_of_every_tensor_gets_its_values():
    with store() as s:
        a, b = s.allocate_group([((1000,), torch.float32), ((300,), torch.float32)], tier="cpu")
        s.copy([a, b], "gpu").wait()  # a second copy of each page: both must be written
        s.write_many([(a, torch.arange(1000.0)), (b, torch.full((300,), 7.0))])
        s.release([a, b], "cpu").wait()  # what is left is the gpu copy
        assert torch.equal(a.to_torch(), torch.arange(1000.0))
        assert torch.equal(b.to_torch(), torch.full((300,), 7.0))


def test_a_freed_tensor_is_refused_and_nothing_is_written():
    with store() as s:
        a, b = s.allocate_group([((100,), torch.float32), ((100,), torch.float32)], tier="cpu")
        a.copy_(torch.zeros(100))
        b.free()
        with pytest.raises(pagemem.InvalidRequest):
            s.write_many([(a, torch.ones(100)), (b, torch.ones(100))])
        assert torch.equal(a.to_torch(), torch.zeros(100))
