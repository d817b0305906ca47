"""``PageStore.write_packed``: one flat source into several tensors, every copy, one copy per run
of adjacent bytes ([Note: a packed write] in ``store/data.py``)."""

from __future__ import annotations

import pytest
import torch

import pagemem
from pagemem.tiers.memory import MemoryTier

from conftest import PAGE, random_tensor, same_bytes

SHAPES = [(PAGE // 4 + 100,), (30,), (7, 50), (PAGE // 2,)]
"""Tensors of a group: some across page boundaries, some sharing a page, with gaps between them
(the group aligns each tensor)."""
ADJACENT = [(PAGE // 4 + 64,), (64,), (4, 64), (PAGE // 2,)]
"""The same without gaps: every tensor's bytes a multiple of the alignment."""


def group(store: pagemem.PageStore, tier: str, shapes: list = SHAPES) -> list:
    return store.allocate_group([(s, torch.float32) for s in shapes], tier=tier)


def expected(tensors: list, flat: torch.Tensor) -> list[torch.Tensor]:
    out, n = [], 0
    for t in tensors:
        out.append(flat[n:n + t.shape.numel()].reshape(t.shape))
        n += t.shape.numel()
    return out


@pytest.mark.parametrize("home,extra", [("cpu", "gpu"), ("cpu", None), ("nvme", "cpu"), ("nvme", None),
                                        ("gpu", "nvme")])
def test_every_copy_of_every_tensor_gets_its_elements(make_store, home, extra):
    store = make_store()
    tensors = group(store, home)
    for n, t in enumerate(tensors):
        t.copy_(random_tensor(t.shape, t.dtype, n))
    if extra:
        store.copy(tensors, extra).wait()
    flat = random_tensor((sum(t.shape.numel() for t in tensors),), torch.float32, 9)
    store.write_packed(tensors, flat)
    for tier in [extra, home] if extra else [home]:  # each copy alone holds the new elements
        for t, want in zip(tensors, expected(tensors, flat)):
            assert same_bytes(t.to_torch(), want), (tier, t.shape)
        if tier == extra:
            store.release(tensors, extra).wait()


def test_a_subset_of_a_group_leaves_the_others_alone(make_store):
    store = make_store()
    tensors = group(store, "cpu")
    before = [random_tensor(t.shape, t.dtype, n) for n, t in enumerate(tensors)]
    for t, b in zip(tensors, before):
        t.copy_(b)
    store.copy(tensors, "gpu").wait()
    picked = [tensors[0], tensors[2]]
    flat = random_tensor((sum(t.shape.numel() for t in picked),), torch.float32, 5)
    store.write_packed(picked, flat)
    want = dict(zip(map(id, picked), expected(picked, flat)))
    for tier in ("gpu", "cpu"):
        for t, b in zip(tensors, before):
            assert same_bytes(t.to_torch(), want.get(id(t), b)), (tier, t.shape)
        if tier == "gpu":
            store.release(tensors, "gpu").wait()


def test_adjacent_bytes_are_one_copy_per_tier(make_store, monkeypatch):
    store = make_store()
    tensors = group(store, "cpu", ADJACENT)
    store.copy(tensors, "gpu").wait()
    spans = []
    real = MemoryTier.span
    monkeypatch.setattr(MemoryTier, "span", lambda self, first, count: spans.append(self.name) or real(self, first, count))
    flat = random_tensor((sum(t.shape.numel() for t in tensors),), torch.float32, 3)
    store.write_packed(tensors, flat)
    assert sorted(spans) == ["cpu", "gpu"]  # the group's pages are adjacent in both tiers
    monkeypatch.setattr(MemoryTier, "span", real)
    store.release(tensors, "cpu").wait()
    for t, want in zip(tensors, expected(tensors, flat)):
        assert same_bytes(t.to_torch(), want)


def test_a_read_only_merged_copy_follows(make_store):
    """[Note: read-only merged copies follow writes]: the packed write reaches them too."""
    store = make_store(gpu_bytes=6 * PAGE)
    holes = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(6)]
    for h in holes[::2]:
        h.free()
    t = store.allocate((3 * PAGE // 4,), torch.float32, tier="gpu")  # 3 pages on scattered slots
    t.copy_(random_tensor(t.shape, t.dtype, 1))
    reader = t.lease("gpu", write=False)
    assert reader.copied
    new = random_tensor(t.shape, t.dtype, 2)
    store.write_packed([t], new.reshape(-1))
    assert same_bytes(reader.tensor, new) and same_bytes(t.to_torch(), new)
    reader.release()


def test_a_wrong_source_is_refused_and_nothing_is_written(make_store):
    store = make_store()
    tensors = group(store, "cpu")
    for t in tensors:
        t.copy_(torch.zeros(t.shape))
    n = sum(t.shape.numel() for t in tensors)
    for bad in (torch.ones(n - 1), torch.ones(n, dtype=torch.float64), "not a tensor"):
        with pytest.raises(pagemem.InvalidRequest):
            store.write_packed(tensors, bad)
    tensors[1].free()
    with pytest.raises(pagemem.InvalidRequest):
        store.write_packed(tensors, torch.ones(n))
    for t in (tensors[0], *tensors[2:]):
        assert torch.equal(t.to_torch(), torch.zeros(t.shape))
