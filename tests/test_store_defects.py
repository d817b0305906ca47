"""Regression tests for the defects adversarial testing found in the page store (issue 8).
Each failed on the store before the fix."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch

import pagemem
from pagemem.tiers.io import FaultyEngine

from conftest import PAGE, GatedEngine, aio_available, random_tensor, same_bytes


# -- 1. a tensor holding more than half of the nvme tier's free pages can be written

def test_large_nvme_tensor_is_writable_and_rewritable(make_store, engine):
    store = make_store(nvme_bytes=24 * PAGE, io_engine=engine)
    t = store.allocate((19, 24, 27), torch.float32, tier="nvme")
    assert len(t.pages) == 13
    for seed in (1, 2, 3):  # the first write needs no copy-on-write; later ones write in place
        data = random_tensor(t.shape, t.dtype, seed)
        t.copy_(data)
        assert same_bytes(t.to_torch(), data)
    assert store.stats()["nvme"].used_pages == 13


def test_copy_on_write_keeps_the_old_data_when_there_is_room(make_store):
    store = make_store(nvme_bytes=32 * PAGE, io_engine="threads")
    t = store.allocate((3 * PAGE,), torch.uint8, tier="nvme")
    old = random_tensor(t.shape, t.dtype, 1)
    t.copy_(old)
    faults = FaultyEngine(store.tier("nvme").engine)
    store.tier("nvme").engine = faults
    faults.fail_next("write", "eio")
    with pytest.raises(pagemem.TierIOError):
        t.copy_(random_tensor(t.shape, t.dtype, 2))
    assert same_bytes(t.to_torch(), old)  # nothing changed
    assert store.stats()["nvme"].used_pages == 3


def test_failed_in_place_write_tears_the_tensor_until_rewritten(make_store):
    store = make_store(nvme_bytes=4 * PAGE, io_engine="threads")
    t = store.allocate((3 * PAGE,), torch.uint8, tier="nvme")
    t.copy_(random_tensor(t.shape, t.dtype, 1))
    store.allocate((PAGE,), torch.uint8, tier="nvme")  # no room left for copy-on-write
    faults = FaultyEngine(store.tier("nvme").engine)
    store.tier("nvme").engine = faults
    faults.fail_next("write", "short")
    with pytest.raises(pagemem.TierIOError):
        t.copy_(random_tensor(t.shape, t.dtype, 2))
    with pytest.raises(pagemem.TornPage, match="copy_"):
        t.to_torch()
    with pytest.raises(pagemem.TornPage):
        t.view() if t.is_viewable else t.lease("cpu")
    fresh = random_tensor(t.shape, t.dtype, 3)
    t.copy_(fresh)
    assert same_bytes(t.to_torch(), fresh)


def test_torn_shared_page_refuses_the_neighbour_until_it_is_rewritten(make_store):
    store = make_store(nvme_bytes=2 * PAGE, io_engine="threads")
    a, b = store.allocate_group([((100,), torch.uint8), ((100,), torch.uint8)], tier="nvme")
    da, db = random_tensor((100,), torch.uint8, 1), random_tensor((100,), torch.uint8, 2)
    a.copy_(da)
    b.copy_(db)
    store.allocate((PAGE,), torch.uint8, tier="nvme")  # full: in-place writes from now on
    faults = FaultyEngine(store.tier("nvme").engine)
    store.tier("nvme").engine = faults
    faults.fail_next("write", "eio")
    with pytest.raises(pagemem.TierIOError):
        a.copy_(random_tensor((100,), torch.uint8, 3))
    for t in (a, b):
        with pytest.raises(pagemem.TornPage):
            t.to_torch()
    a.copy_(da)
    assert same_bytes(a.to_torch(), da)
    with pytest.raises(pagemem.TornPage):  # b's bytes are still lost
        b.to_torch()
    b.copy_(db)
    assert same_bytes(b.to_torch(), db) and same_bytes(a.to_torch(), da)


# -- 2. a failed move with a read queued behind it leaves the tensor where it was

def test_failed_move_with_a_queued_read_leaves_the_tensor_home(make_store):
    store = make_store(nvme_bytes=4 * PAGE, io_engine="threads")
    nvme = store.tier("nvme")
    faults = FaultyEngine(nvme.engine)
    gate = GatedEngine(faults)
    nvme.engine = gate
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    data = random_tensor(t.shape, t.dtype, 1)
    t.copy_(data)
    h = t.move("nvme")
    got = []

    def read():
        try:
            got.append(t.to_torch())
        except BaseException as exc:  # reported by the assertion below
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    faults.fail_next("write", "eio")  # both pages fail: one request ([Note: runs of pages in one request])
    gate.open()
    with pytest.raises(pagemem.TierIOError):
        h.wait(timeout=30)
    reader.join(30)
    assert got and isinstance(got[0], torch.Tensor), got
    assert same_bytes(got[0], data)
    store.synchronize()
    assert t.tier == "cpu" and t.is_viewable
    # the next move reserves up front: with the tier full, the call itself refuses
    filler = store.allocate((4 * PAGE,), torch.uint8, tier="nvme")
    with pytest.raises(pagemem.OutOfMemory):
        t.move("nvme")
    filler.free()
    t.move("nvme").wait()
    assert t.tier == "nvme" and same_bytes(t.to_torch(), data)


# -- 3. a store dropped without close() is garbage collected, its file removed

@pytest.mark.parametrize("io_engine", ["aio", "threads"])
def test_dropped_store_is_collected_and_its_file_removed(tmp_path, io_engine):
    if io_engine == "aio" and not aio_available():
        pytest.skip("libaio not installed")
    store = pagemem.PageStore(pagemem.StoreConfig(page_bytes=PAGE, cpu_bytes=8 * PAGE, nvme_bytes=8 * PAGE,
                                                  nvme_path=str(tmp_path), io_engine=io_engine))
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    t.copy_(random_tensor(t.shape, t.dtype, 1))
    t.move("nvme").wait()
    t.to_torch()
    ref = weakref.ref(store)
    del store, t
    gc.collect()
    assert ref() is None
    assert not list(tmp_path.iterdir())


# -- 4. close() gives the memory back even while tensors are referenced

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_close_returns_memory_while_tensors_and_views_are_referenced(tmp_path):
    mib = 1 << 20
    store = pagemem.PageStore(pagemem.StoreConfig(page_bytes="4MiB", cpu_bytes=256 * mib, gpu_bytes=64 * mib))
    t = store.allocate((256 * mib,), torch.uint8, tier="cpu")
    t.copy_(torch.full((256 * mib,), 7, dtype=torch.uint8))
    v = t.view()
    lease = store.allocate((mib,), torch.uint8, tier="gpu").lease()
    before = _rss()
    with pytest.raises(pagemem.InvalidRequest):  # the view pins the pages
        t.free()
    store.close()
    assert before - _rss() > 200 * mib
    assert int(v[:4096].sum()) == 0  # a stale view reads zeros, never another tensor's data
    for call in (t.to_torch, lambda: t.copy_(torch.zeros(256 * mib, dtype=torch.uint8)),
                 lambda: t.move("gpu"), t.view, lambda: lease.tensor):
        with pytest.raises(pagemem.InvalidRequest, match="closed"):
            call()
    lease.release()
    t.free()  # harmless after close


# -- 5. bad sources, dtypes and arguments: the right values or a clear error, never a crash

def test_quantized_and_other_unstorable_inputs_are_refused(store):
    t = store.allocate((4,), torch.uint8, tier="cpu")
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(pagemem.InvalidRequest):
        t.copy_(q)
    with pytest.raises(pagemem.InvalidRequest, match="quantized"):
        store.allocate((4,), torch.qint8)
    with pytest.raises(pagemem.InvalidRequest):
        t.copy_(torch.zeros(4, dtype=torch.uint8).to_sparse())
    with pytest.raises(pagemem.InvalidRequest):
        t.copy_(torch.empty(4, dtype=torch.uint8, device="meta"))


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_conjugate_and_negative_views_are_written_resolved(store, tier):
    x = torch.randn(6, dtype=torch.complex64)
    t = store.allocate((6,), torch.complex64, tier=tier)
    t.copy_(x.conj())
    assert torch.equal(t.to_torch().cpu(), x.conj().resolve_conj())
    neg = x.conj().imag  # a view with the negative bit set
    assert neg.is_neg()
    f = store.allocate((6,), torch.float32, tier=tier)
    f.copy_(neg)
    assert torch.equal(f.to_torch().cpu(), -x.imag)


def test_overflowing_shapes_and_wrong_argument_types(store):
    with pytest.raises(pagemem.InvalidRequest):
        store.allocate((2 ** 32, 2 ** 32), torch.float32)
    with pytest.raises(pagemem.OutOfMemory):
        store.allocate((2 ** 40,), torch.uint8)
    a = store.allocate((10,), torch.uint8)
    with pytest.raises(pagemem.InvalidRequest, match="after"):
        store.allocate_group([((10,), torch.uint8)], after=[a])
    with pytest.raises(pagemem.InvalidRequest):
        store.move([a, "x"], "gpu")
    with pytest.raises(pagemem.InvalidRequest):
        store.move(5, "gpu")
    assert store.stats()["gpu"].used_pages == 0
    store.move(a, "gpu").wait()  # one tensor, not in a list
    assert a.tier == "gpu"


# -- 6. views stay valid: pinned while alive, moves and frees refused meanwhile

def test_a_live_view_pins_its_pages(store):
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    other = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    v = t.view()
    part = v[10:20].view(torch.int16)  # a tensor derived from the view keeps the pin
    del v
    gc.collect()
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):
        t.move("gpu")
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):
        t.free()
    assert t.tier == "cpu" and store.stats().pinned_pages == 2
    other.move("gpu").wait()  # other tensors are unaffected
    t.copy("gpu").wait()  # a copy leaves the viewed memory in place: allowed
    del part
    gc.collect()
    assert store.stats().pinned_pages == 0
    t.move("nvme").wait()
    assert t.tier == "nvme"


def test_a_lease_pins_until_released_and_then_refuses_use(store):
    t = store.allocate((PAGE,), torch.float32, tier="gpu")
    t.copy_(torch.arange(PAGE, dtype=torch.float32))
    with t.lease() as x:
        assert x.shape == t.shape and float(x[5]) == 5.0
        x[5] = -1.0
        with pytest.raises(pagemem.InvalidRequest, match="pinned"):
            t.move("cpu")
    assert float(t.to_torch()[5]) == -1.0
    t.move("cpu").wait()
    lease = t.lease("cpu")
    lease.release()
    with pytest.raises(pagemem.InvalidRequest, match="released"):
        lease.tensor
    t.move("gpu").wait()
