"""Copies that keep the source, dropping a copy, leases of scattered pages, and the cost of a
layer's move being one call (issue 8's gaps)."""

from __future__ import annotations

import pytest
import torch

import pagemem
from pagemem.tiers.io import FaultyEngine

from conftest import PAGE, random_tensor, same_bytes


@pytest.mark.parametrize("home,extra", [("cpu", "gpu"), ("nvme", "gpu"), ("nvme", "cpu"), ("cpu", "nvme"),
                                        ("gpu", "cpu")])
def test_copy_keeps_the_source_and_release_drops_the_replica(store, home, extra):
    t = store.allocate((3, PAGE // 2), torch.float32, tier=home)
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    used = {n: store.stats()[n].used_pages for n in ("gpu", "cpu", "nvme")}
    t.copy(extra).wait()
    assert t.tier == home and t.tiers == {home, extra}
    assert store.stats()[extra].used_pages == used[extra] + len(t.pages)
    assert same_bytes(t.to_torch(), data)
    t.release(extra).wait()
    assert t.tiers == {home}
    assert {n: store.stats()[n].used_pages for n in ("gpu", "cpu", "nvme")} == used
    assert same_bytes(t.to_torch(), data)


def test_writes_update_every_copy(store):
    t = store.allocate((PAGE,), torch.uint8, tier="nvme")
    t.copy_(random_tensor(t.shape, t.dtype, 1))
    t.copy("cpu").wait()
    t.copy("gpu").wait()
    new = random_tensor(t.shape, t.dtype, 2)
    t.copy_(new)
    for tier in ("gpu", "cpu"):  # drop the others one by one: each remaining copy holds the new data
        t.release(tier).wait()
        assert same_bytes(t.to_torch(), new)
    assert t.tiers == {"nvme"}


def test_moving_home_onto_a_replica_copies_nothing(store):
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    t.copy("gpu").wait()
    moved = store.stats().moves.get("cpu->gpu").bytes
    t.move("gpu").wait()
    assert t.tier == "gpu" and t.tiers == {"gpu"}
    assert store.stats().moves["cpu->gpu"].bytes == moved
    assert store.stats()["cpu"].used_pages == 0
    assert same_bytes(t.to_torch(), data)


def test_dropping_the_home_copy_promotes_the_replica_and_the_last_copy_stays(store):
    t = store.allocate((PAGE,), torch.uint8, tier="gpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    t.copy("nvme").wait()
    t.release("gpu").wait()
    assert t.tier == "nvme" and t.tiers == {"nvme"}
    with pytest.raises(pagemem.InvalidRequest, match="no other copy"):
        t.release("nvme")
    assert same_bytes(t.to_torch(), data)


def test_copy_out_of_memory_changes_nothing(make_store):
    store = make_store(gpu_bytes=2 * PAGE)
    t = store.allocate((3 * PAGE,), torch.uint8, tier="cpu")
    with pytest.raises(pagemem.OutOfMemory) as info:
        t.copy("gpu")
    assert info.value.tier == "gpu" and info.value.requested_pages == 3
    assert t.tiers == {"cpu"} and store.stats()["gpu"].used_pages == 0


def test_failed_copy_keeps_the_source_and_no_replica(make_store):
    store = make_store(io_engine="threads")
    faults = FaultyEngine(store.tier("nvme").engine)
    store.tier("nvme").engine = faults
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    faults.fail_next("write", "eio")
    with pytest.raises(pagemem.TierIOError):
        t.copy("nvme").wait()
    # the two adjacent pages are one request ([Note: runs of pages in one request]): it failed, so
    # neither replica landed and the tensor has no nvme copy (a partial one: test_faults.py's
    # pages bounced from the gpu, one request each)
    assert t.tier == "cpu" and "nvme" not in t.tiers
    assert store.stats()["nvme"].used_pages == 0
    assert same_bytes(t.to_torch(), data)
    t.copy("nvme").wait()  # and it works once the disk does
    assert t.tiers == {"cpu", "nvme"}


def test_lease_of_scattered_pages_is_a_merged_copy_written_back(make_store):
    store = make_store(gpu_bytes=6 * PAGE)
    holes = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(6)]
    for h in holes[::2]:
        h.free()
    t = store.allocate((3 * PAGE,), torch.uint8, tier="gpu")  # only scattered slots are free
    assert not t.is_viewable
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    with t.lease() as x:
        assert same_bytes(x, data)
        x[:10] = 0
    expected = data.clone()
    expected[:10] = 0
    assert same_bytes(t.to_torch(), expected)
    with t.lease(write=False) as x:
        x.fill_(1)
    assert same_bytes(t.to_torch(), expected)
    s = store.stats()
    assert s.view_copies == 2 and s.views == 0


@pytest.mark.parametrize("replica", [None, "cpu", "nvme"])
def test_a_split_lease_of_scattered_pages_lends_each_run_in_place(make_store, replica):
    """``lease_many(split=True)``: one alias per run of adjacent slots, no copy; writes through
    the pieces reach every other copy of the tensor at release."""
    store = make_store(gpu_bytes=8 * PAGE)
    holes = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(8)]
    for h in (holes[0], holes[1], holes[3], holes[6]):
        h.free()
    t = store.allocate((PAGE + PAGE // 2,), torch.float16, tier="gpu")  # 3 pages, on slots 0, 1 and 3
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    if replica:
        t.copy(replica).wait()
    [lease] = store.lease_many([t], "gpu", split=True)
    assert lease.in_pieces and lease.split and not lease.copied
    pieces = lease.pieces
    assert [(start, x.numel()) for start, x in pieces] == [(0, PAGE), (PAGE, PAGE // 2)]
    with pytest.raises(pagemem.InvalidRequest, match="pieces"):
        lease.tensor
    for start, x in pieces:
        assert same_bytes(x, data[start:start + x.numel()])
        x.add_(1)  # in place: the page memory itself
    lease.release()
    assert store.stats().view_copies == 0
    want = data + 1
    assert same_bytes(t.to_torch(), want)
    if replica:
        t.release("gpu").wait()  # the replica alone
        assert same_bytes(t.to_torch(), want)


def test_write_from_an_element_offset_changes_only_those_elements(make_store):
    store = make_store()
    t = store.allocate((3, PAGE // 2), torch.float32, tier="nvme")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    t.copy("cpu").wait()
    part = torch.arange(PAGE, dtype=torch.float32)  # crosses a page boundary
    store.write(t, part, PAGE // 4)
    want = data.reshape(-1).clone()
    want[PAGE // 4:PAGE // 4 + PAGE] = part
    assert same_bytes(t.to_torch(), want.view(t.shape))
    t.release("cpu").wait()  # the nvme copy got it too
    assert same_bytes(t.to_torch(), want.view(t.shape))
    for bad in (-1, 3 * PAGE // 2 * 3 - PAGE + 1, 1.0):
        with pytest.raises(pagemem.InvalidRequest, match="start"):
            store.write(t, part, bad)
    with pytest.raises(pagemem.InvalidRequest, match="dtype"):
        store.write(t, part.double(), 0)
    assert same_bytes(t.to_torch(), want.view(t.shape))


def test_zero_copy_leases_are_counted(store):
    t = store.allocate((PAGE,), torch.uint8, tier="cpu")
    with t.lease():
        pass
    v = t.view()
    assert store.stats().views == 2 and store.stats().view_copies == 0
    del v


def test_a_run_of_adjacent_pages_moves_in_one_transfer(make_store):
    """Moving a layer's pages costs one copy per run of adjacent slots, not one per page."""
    store = make_store(gpu_bytes=16 * PAGE, cpu_bytes=16 * PAGE)
    calls = []
    gpu = store.tier("gpu")
    inner = gpu.copier

    class Counting:
        name = inner.name

        def copy(self, dst, src, done, after=None):
            calls.append(dst.numel())
            inner.copy(dst, src, done, after=after)

        def close(self):
            inner.close()

    gpu.copier = Counting()
    t = store.allocate((12 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    t.move("gpu").wait()
    t.move("cpu").wait()
    assert calls == [12 * PAGE, 12 * PAGE]
    assert same_bytes(t.to_torch(), data)


def test_lease_many_pins_every_tensor_in_one_call(store):
    ts = store.allocate_group([((PAGE,), torch.uint8), ((100,), torch.uint8), ((2 * PAGE,), torch.uint8)], tier="cpu")
    datas = [random_tensor(t.shape, t.dtype, i) for i, t in enumerate(ts)]
    for t, d in zip(ts, datas):
        t.copy_(d)
    leases = store.lease_many(ts, "cpu")
    assert [same_bytes(lease.tensor, d) for lease, d in zip(leases, datas)] == [True] * 3
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):
        store.move(ts[1], "gpu")
    leases[1].tensor.fill_(7)
    for lease in leases:
        lease.release()
    assert torch.all(ts[1].to_torch() == 7)
    store.move(ts, "gpu").wait()
    with pytest.raises(pagemem.InvalidRequest, match="PagedTensor"):
        store.lease_many([ts[0], "x"])


def test_view_of_a_named_tier_aliases_that_copy_or_refuses(make_store):
    """The engine views the gpu replica of a parameter: when only the cpu copy is adjacent, a view
    of 'gpu' must refuse rather than alias the cpu copy."""
    store = make_store(gpu_bytes=6 * PAGE)
    singles = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(6)]
    for s in singles[::2]:
        s.free()  # the gpu tier's free slots are 0, 2, 4: none adjacent
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    t.copy_(random_tensor(t.shape, t.dtype, 1))
    t.copy("gpu").wait()
    with pytest.raises(pagemem.InvalidRequest, match="not adjacent"):
        t.view("gpu")
    v = t.view()  # the nearest adjacent copy: cpu
    cpu = store.tier("cpu").span(0, store.tier("cpu").capacity)
    assert cpu.data_ptr() <= v.data_ptr() < cpu.data_ptr() + cpu.numel()
    del v
    with pytest.raises(pagemem.InvalidRequest, match="not memory"):
        t.view("nvme")


def test_copy_and_release_a_run_of_pages(store):
    """The scheduler moves a layer page by page: ``pages=`` picks a run of the tensors' pages."""
    group = store.allocate_group([((PAGE // 4,), torch.float32), ((PAGE // 2,), torch.float32)], tier="cpu")
    data = [random_tensor(t.shape, t.dtype, i) for i, t in enumerate(group)]
    for t, d in zip(group, data):
        t.copy_(d)
    n = store.page_count(group)
    assert n == 3
    ids = list(dict.fromkeys(p for t in group for p in t.pages))
    gpu0 = store.stats()["gpu"].used_pages
    store.copy(group, "gpu", pages=range(1, 2)).wait()
    assert [("gpu" in store.copies(i)) for i in ids] == [False, True, False]
    assert store.stats()["gpu"].used_pages == gpu0 + 1
    store.copy(group, "gpu").wait()  # the page already there costs nothing
    assert store.stats()["gpu"].used_pages == gpu0 + 3
    store.release(group, "gpu", pages=range(0, 2)).wait()
    assert [("gpu" in store.copies(i)) for i in ids] == [False, False, True]
    assert all(same_bytes(t.to_torch(), d) for t, d in zip(group, data))
    for bad in (range(2, 4), range(0, 3, 2), range(-1, 1)):
        with pytest.raises(pagemem.InvalidRequest, match="pages"):
            store.copy(group, "gpu", pages=bad)
    with pytest.raises(pagemem.InvalidRequest, match="range"):
        store.copy(group, "gpu", pages=[0])
    assert store.stats()["gpu"].used_pages == gpu0 + 1


def test_a_pin_keeps_every_copy_of_its_pages_until_the_view_dies(store):
    """Pins count per page: a view of the gpu replica forbids dropping the cpu copy too (the
    documented rule), and the drop succeeds once the view and its derivatives are gone."""
    t = store.allocate((PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    t.copy("gpu").wait()
    v = t.view("gpu")[:16]  # a derived tensor keeps the pin
    for tier in ("cpu", "gpu"):
        with pytest.raises(pagemem.InvalidRequest, match="pinned"):
            t.release(tier)
    assert t.tiers == {"cpu", "gpu"}
    del v
    t.release("cpu").wait()
    assert t.tiers == {"gpu"} and same_bytes(t.to_torch(), data)


@pytest.mark.parametrize("replica", [None, "cpu"])
def test_a_read_only_merged_copy_sees_later_writes_as_an_alias_would(make_store, replica):
    """[Note: read-only merged copies follow writes] The engine binds a parameter on scattered
    gpu slots to such a copy; an update writing the compute copy must reach it (it went stale:
    the demand executor trained wrong at budgets that scattered a unit)."""
    store = make_store(gpu_bytes=6 * PAGE)
    holes = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(6)]
    for h in holes[::2]:
        h.free()
    t = store.allocate((3 * PAGE // 4,), torch.float32, tier="gpu")  # 3 pages on scattered slots
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    if replica:
        t.copy(replica).wait()
    reader = t.lease("gpu", write=False)
    writer = t.lease("gpu", write=True)
    assert reader.copied and writer.copied
    new = random_tensor(t.shape, t.dtype, 2)
    t.copy_(new)  # every copy, and the reader's merged copy
    assert same_bytes(reader.tensor, new)
    assert same_bytes(writer.tensor, data)  # a writer's copy is its own until it writes back
    part = random_tensor((100,), t.dtype, 3)
    store.write(t, part, PAGE // 4 - 50)  # a range across a page boundary
    want = new.clone()
    want[PAGE // 4 - 50:PAGE // 4 + 50] = part
    assert same_bytes(reader.tensor, want)
    writer.release()  # writes its (old) bytes back: the reader follows again
    assert same_bytes(reader.tensor, data)
    reader.release()
    t.copy_(new)  # released: nothing follows any more, and nothing fails
    assert same_bytes(t.to_torch(), new)
