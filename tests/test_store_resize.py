"""Resizing a memory tier's arena: what an engine does to size its gpu arena from its plan."""

from __future__ import annotations

import pytest
import torch

import pagemem
from conftest import PAGE, random_tensor, same_bytes


def test_resize_keeps_every_page_and_sets_the_capacity(make_store):
    store = make_store(gpu_bytes=8 * PAGE)
    a = store.allocate((2 * PAGE,), torch.uint8, tier="gpu")
    b = store.allocate((PAGE,), torch.uint8, tier="cpu")
    data_a, data_b = random_tensor(a.shape, a.dtype, 1), random_tensor(b.shape, b.dtype, 2)
    a.copy_(data_a)
    b.copy_(data_b)
    b.copy("gpu").wait()  # a replica on the gpu: slot 2
    store.resize("gpu", 3)
    assert store.tier("gpu").capacity == 3 and store.stats()["gpu"].capacity_bytes == 3 * PAGE
    assert same_bytes(a.to_torch(), data_a) and same_bytes(b.to_torch(), data_b)
    b.release("cpu").wait()  # the gpu replica is now the only copy: its bytes came across
    assert same_bytes(b.to_torch(), data_b)
    with pytest.raises(pagemem.OutOfMemory) as info:
        store.allocate((PAGE,), torch.uint8, tier="gpu")
    assert info.value.tier == "gpu" and info.value.free_pages == 0
    store.resize("gpu", 8)
    c = store.allocate((5 * PAGE,), torch.uint8, tier="gpu")
    assert c.pages and c.is_viewable  # the grown slots join the free run: adjacent
    assert same_bytes(a.to_torch(), data_a) and same_bytes(b.to_torch(), data_b)


def test_refused_resizes_name_the_reason_and_change_nothing(make_store):
    store = make_store(gpu_bytes=8 * PAGE)
    low = store.allocate((PAGE,), torch.uint8, tier="gpu")
    high = store.allocate((PAGE,), torch.uint8, tier="gpu")
    low.copy_(random_tensor(low.shape, low.dtype, 1))
    low.free()  # slot 0 free, slot 1 used
    with pytest.raises(pagemem.InvalidRequest, match="slot 1 is in use"):
        store.resize("gpu", 1)
    view = high.view("gpu")
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):
        store.resize("gpu", 4)
    del view
    for bad in (-1, 9, 2.0, True):
        with pytest.raises(pagemem.InvalidRequest, match=r"\[0, 8\]"):
            store.resize("gpu", bad)
    with pytest.raises(pagemem.InvalidRequest, match="memory tiers"):
        store.resize("nvme", 1)
    assert store.tier("gpu").capacity == 8 and high.tier == "gpu"
    store.resize("gpu", 2)
    assert store.tier("gpu").capacity == 2


@pytest.mark.parametrize("second_fails", [False, True])
def test_a_resize_that_cannot_hold_both_arenas_parks_the_pages_on_the_host(make_store, monkeypatch, second_fails):
    """A gpu arena that takes most of the device cannot be shrunk by taking the new one first:
    the used slots wait on the host while the old one is given back. If even then the new one
    cannot be had, the old size is taken again: nothing changes but the error."""
    from pagemem.tiers.memory import MemoryTier

    store = make_store(gpu_bytes=8 * PAGE)
    a = store.allocate((2 * PAGE + 100,), torch.uint8, tier="gpu")
    data = random_tensor(a.shape, a.dtype, 3)
    a.copy_(data)
    tier = store.tier("gpu")
    real = MemoryTier._new_arena
    calls = []

    def new_arena(self, pages):
        calls.append((pages, self.arena.closed))
        if not self.arena.closed or (second_fails and pages == 4):  # both at once: no room
            raise MemoryError("no room for both arenas")
        return real(self, pages)

    monkeypatch.setattr(MemoryTier, "_new_arena", new_arena)
    if second_fails:
        with pytest.raises(pagemem.OutOfMemory):
            store.resize("gpu", 4)
        assert calls == [(4, False), (4, True), (8, True)] and tier.capacity == 8
    else:
        store.resize("gpu", 4)
        assert calls == [(4, False), (4, True)] and tier.capacity == 4
    assert same_bytes(a.to_torch(), data) and a.tier == "gpu"
    b = store.allocate((PAGE,), torch.uint8, tier="gpu")  # the slots above the used ones are free
    b.copy_(random_tensor(b.shape, b.dtype, 4))
    assert same_bytes(a.to_torch(), data)
