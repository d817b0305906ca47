"""The page store's public surface: allocation, writes, reads, views, moves, stats."""

import threading

import pytest
import torch

import pagemem

from conftest import PAGE, GatedEngine, random_tensor, same_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.float64, torch.complex64]


def test_public_surface_round_trip(tmp_path):
    cfg = pagemem.StoreConfig(page_bytes="4MiB", gpu_bytes="16MiB", cpu_bytes="32MiB",
                              nvme_bytes="64MiB", nvme_path=str(tmp_path))
    with pagemem.PageStore(cfg) as store:
        t = store.allocate((1024, 1024), torch.float16, tier="cpu")
        assert isinstance(t, pagemem.PagedTensor)
        src = torch.randn(1024, 1024).half()
        t.copy_(src)
        handle = t.move("nvme")
        assert isinstance(handle, pagemem.MoveHandle)
        handle.wait()
        assert t.tier == "nvme"
        assert torch.equal(t.to_torch(), src)
        t.move("gpu").wait()
        assert t.tier == "gpu" and torch.equal(t.to_torch().cpu(), src)  # read on the gpu tier's device
        ts = store.allocate_group([((4096,), torch.float32), ((64, 64), torch.bfloat16)], tier="cpu")
        assert [x.shape for x in ts] == [torch.Size([4096]), torch.Size([64, 64])]
        t.free()
        s = store.stats()
        assert isinstance(s, pagemem.StoreStats)
        assert s["gpu"].used_pages == 0 and s["cpu"].used_pages == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_every_dtype_round_trips_on_every_tier(store, dtype, tier):
    shape = (3, 500)
    data = random_tensor(shape, dtype, seed=7)
    t = store.allocate(shape, dtype, tier=tier)
    t.copy_(data)
    out = t.to_torch()
    assert out.shape == shape and out.dtype == dtype
    assert same_bytes(out, data)
    for dest in ("nvme", "gpu", "cpu", "gpu", "nvme"):
        t.move(dest).wait()
        assert t.tier == dest
        assert same_bytes(t.to_torch(), data)


def test_empty_and_scalar_tensors(store):
    e = store.allocate((0, 5), torch.float32, tier="gpu")
    assert e.pages == () and e.tier == "gpu"
    assert e.to_torch().shape == (0, 5)
    e.move("nvme").wait()
    assert e.tier == "nvme"
    s = store.allocate((), torch.float64, tier="nvme")
    s.copy_(torch.tensor(2.5, dtype=torch.float64))
    assert s.to_torch().item() == 2.5


def test_group_packs_small_tensors_into_shared_pages(store):
    specs = [((100,), torch.float32), ((16, 16), torch.bfloat16), ((10,), torch.int8), ((300,), torch.float16)]
    ts = store.allocate_group(specs, tier="cpu")
    assert len({p for t in ts for p in t.pages}) == 1
    assert store.stats()["cpu"].used_pages == 1
    datas = [random_tensor(s, d, seed=i) for i, (s, d) in enumerate(specs)]
    for t, d in zip(ts, datas):
        t.copy_(d)
    for t, d in zip(ts, datas):
        assert same_bytes(t.to_torch(), d)
    # byte ranges inside the shared page are disjoint
    ranges = sorted((lo, hi) for t in ts for _, lo, hi in t.extents())
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def test_tensor_spanning_pages_starts_and_ends_mid_page(store):
    a, b, c = store.allocate_group([((1000,), torch.uint8), ((3 * PAGE,), torch.uint8), ((10,), torch.uint8)])
    ext = b.extents()
    assert len(ext) == 4
    assert ext[0][1] == 1024 and ext[-1][2] == 1024
    assert [e[2] - e[1] for e in ext] == [PAGE - 1024, PAGE, PAGE, 1024]
    assert a.pages[0] == b.pages[0] and c.pages[0] == b.pages[-1]


def test_moving_one_tensor_carries_its_shared_pages(store):
    a, b = store.allocate_group([((1000,), torch.uint8), ((PAGE,), torch.uint8)], tier="cpu")
    assert a.pages[0] == b.pages[0] and len(b.pages) == 2
    da, db = random_tensor((1000,), torch.uint8, 1), random_tensor((PAGE,), torch.uint8, 2)
    a.copy_(da); b.copy_(db)
    a.move("nvme").wait()
    assert a.tier == "nvme"
    assert b.tier is None  # b's first page (shared with a) moved; b's second page did not
    assert same_bytes(b.to_torch(), db)
    b.move("nvme").wait()
    assert b.tier == "nvme"
    assert same_bytes(a.to_torch(), da) and same_bytes(b.to_torch(), db)


def test_view_is_zero_copy_when_pages_are_adjacent(store):
    t = store.allocate((3, PAGE // 2), torch.float32, tier="cpu")
    assert t.is_viewable
    v = t.view()
    v.fill_(1.5)
    assert torch.all(t.to_torch() == 1.5)
    t.copy_(torch.full((3, PAGE // 2), 2.0))
    assert torch.all(v == 2.0)  # the view aliases the page memory
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):  # a live view pins the pages
        t.move("nvme")
    del v
    t.move("nvme").wait()
    assert not t.is_viewable
    with pytest.raises(pagemem.InvalidRequest, match="to_torch"):
        t.view()


def test_view_refused_when_pages_are_not_adjacent(store):
    singles = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(8)]
    for s in singles[::2]:
        s.free()  # only every other slot is free: no two adjacent
    z = store.allocate((2 * PAGE,), torch.uint8, tier="gpu")
    slots = [store.location(p)[1] for p in z.pages]
    assert slots[1] != slots[0] + 1
    assert not z.is_viewable
    with pytest.raises(pagemem.InvalidRequest, match="not adjacent"):
        z.view()
    d = random_tensor((2 * PAGE,), torch.uint8)
    z.copy_(d)
    assert same_bytes(z.to_torch(), d)  # merged into a contiguous buffer


def test_view_many_views_every_tensor_or_pins_none(store):
    group = store.allocate_group([((PAGE // 4,), torch.float32), ((10,), torch.int64), ((0,), torch.float32)],
                                 tier="cpu")
    views = store.view_many(group)
    assert [tuple(v.shape) for v in views] == [(PAGE // 4,), (10,), (0,)]
    views[0].fill_(3.0)
    views[1].copy_(torch.arange(10))
    assert torch.all(group[0].to_torch() == 3.0) and torch.equal(group[1].to_torch(), torch.arange(10))
    with pytest.raises(pagemem.InvalidRequest, match="pinned"):  # each view pins its pages
        store.move(group[:2], "nvme")
    del views
    store.move(group, "nvme").wait()
    # one tensor on pages that are not adjacent: nothing is viewed, nothing stays pinned
    singles = [store.allocate((PAGE,), torch.uint8, tier="gpu") for _ in range(8)]
    for x in singles[::2]:
        x.free()
    scattered = store.allocate((2 * PAGE,), torch.uint8, tier="gpu")
    fine = store.allocate((PAGE // 2,), torch.uint8, tier="cpu")
    views_before = store.stats().views
    with pytest.raises(pagemem.InvalidRequest, match="tensor 1's pages are not adjacent"):
        store.view_many([fine, scattered])
    assert store.stats().views == views_before  # checked before any was made
    fine.move("nvme").wait()  # not pinned by the refused call
    with pytest.raises(pagemem.InvalidRequest, match="expected PagedTensors"):
        store.view_many([fine, torch.zeros(1)])


def test_to_torch_is_an_independent_copy(store):
    t = store.allocate((100,), torch.int32, tier="gpu")
    t.copy_(torch.arange(100, dtype=torch.int32))
    out = t.to_torch()
    out.zero_()
    assert torch.equal(t.to_torch().cpu(), torch.arange(100, dtype=torch.int32))


def test_tier_is_none_while_a_move_is_in_flight(store):
    nvme = store.tier("nvme")
    gate = GatedEngine(nvme.engine)
    nvme.engine = gate
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    d = random_tensor((2 * PAGE,), torch.uint8)
    t.copy_(d)
    h = t.move("nvme")
    assert t.tier is None and not h.done()
    assert gate.held == 1  # both pages in flight at once, in one request ([Note: runs of pages in one request])
    during = store.stats()
    assert during["cpu"].used_pages == 2 and during["nvme"].used_pages == 2  # source kept until landed
    gate.open()
    h.wait(timeout=10)
    assert t.tier == "nvme" and h.done()
    after = store.stats()
    assert after["cpu"].used_pages == 0 and after["nvme"].used_pages == 2
    assert same_bytes(t.to_torch(), d)


def test_moves_of_the_same_page_run_in_order(store):
    t = store.allocate((3 * PAGE // 4,), torch.float32, tier="cpu")
    d = random_tensor(t.shape, torch.float32, 3)
    t.copy_(d)
    handles = [t.move(x) for x in ("nvme", "gpu", "nvme", "cpu", "gpu", "nvme", "cpu")]
    out = t.to_torch()  # ordered after every move queued before it
    assert all(h.done() for h in handles)
    assert t.tier == "cpu" and same_bytes(out, d)
    s = store.stats()
    assert s["nvme"].used_pages == 0 and s["gpu"].used_pages == 0 and s["cpu"].used_pages == 3


def test_free_while_move_in_flight_is_safe(store):
    nvme = store.tier("nvme")
    gate = GatedEngine(nvme.engine)
    nvme.engine = gate
    t = store.allocate((4 * PAGE,), torch.uint8, tier="cpu")
    h = t.move("nvme")
    t.free()
    assert t.is_freed
    with pytest.raises(pagemem.InvalidRequest, match="freed"):
        t.to_torch()
    gate.open()
    h.wait(timeout=10)
    store.synchronize()
    s = store.stats()
    assert s["cpu"].used_pages == 0 and s["nvme"].used_pages == 0
    t.free()  # a second free is harmless


def test_move_several_tensors_at_once(store):
    ts = store.allocate_group([((PAGE + 17,), torch.uint8)] * 3, tier="gpu")
    ds = [random_tensor((PAGE + 17,), torch.uint8, i) for i in range(3)]
    for t, d in zip(ts, ds):
        t.copy_(d)
    store.move(ts, "nvme").wait()
    assert [t.tier for t in ts] == ["nvme"] * 3
    assert store.stats()["gpu"].used_pages == 0
    store.move(ts, "cpu").wait()
    assert all(same_bytes(t.to_torch(), d) for t, d in zip(ts, ds))


def test_stats_report_capacity_use_utilization_and_moves(store):
    s0 = store.stats()
    assert (s0["gpu"].capacity_pages, s0["cpu"].capacity_pages, s0["nvme"].capacity_pages) == (8, 16, 32)
    assert s0["cpu"].capacity_bytes == 16 * PAGE
    assert s0.moves == {}
    t = store.allocate((PAGE + PAGE // 2,), torch.uint8, tier="cpu")
    s1 = store.stats()
    assert s1["cpu"].used_pages == 2 and s1["cpu"].live_bytes == PAGE + PAGE // 2
    assert s1["cpu"].utilization == pytest.approx(0.75)
    t.move("nvme").wait()
    s2 = store.stats()
    assert s2["nvme"].live_bytes == PAGE + PAGE // 2 and s2["cpu"].live_bytes == 0
    m = s2.moves["cpu->nvme"]
    assert m.pages == 2 and m.bytes == 2 * PAGE and m.seconds > 0 and m.gbps > 0
    assert "gpu" in s2.table() and "cpu->nvme" in s2.table()
    assert s2["nvme"].backend["io_engine"] in ("aio", "threads")


def test_describe_says_when_gpu_is_a_stand_in(store):
    text = store.describe()
    if not store.cuda:
        assert "host-memory stand-in" in text
        assert store.stats()["gpu"].backend["backend"].startswith("host-memory stand-in")


def test_bad_requests_raise_clear_errors(store):
    with pytest.raises(pagemem.InvalidRequest, match="tier: must be one of"):
        store.allocate((4,), torch.float32, tier="ssd")
    with pytest.raises(pagemem.InvalidRequest, match="dtype"):
        store.allocate((4,), "float32")  # type: ignore[arg-type]
    with pytest.raises(pagemem.InvalidRequest, match="non-negative"):
        store.allocate((4, -1), torch.float32)
    t = store.allocate((4,), torch.float32)
    with pytest.raises(pagemem.InvalidRequest, match=r"source is \(5,\)"):
        t.copy_(torch.zeros(5))
    with pytest.raises(pagemem.InvalidRequest, match="float64"):
        t.copy_(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(pagemem.InvalidRequest, match="tier"):
        t.move("tape")


def test_closed_store_refuses_work(make_store):
    store = make_store()
    t = store.allocate((4,), torch.float32)
    store.close()
    with pytest.raises(pagemem.InvalidRequest, match="closed"):
        store.allocate((4,), torch.float32)
    with pytest.raises(pagemem.InvalidRequest, match="closed"):
        t.to_torch()
    t.free()  # harmless after close
    store.close()  # closing twice is harmless


def test_tensors_from_another_store_are_refused(make_store):
    a, b = make_store(), make_store()
    t = a.allocate((4,), torch.float32)
    with pytest.raises(pagemem.InvalidRequest, match="another store"):
        b.move([t], "nvme")


def test_concurrent_threads(store):
    """Several threads allocate, write, move, read and free at once; every read is exact."""
    errors = []
    shared = store.allocate_group([((700,), torch.float32)] * 4, tier="cpu")
    shared_data = [random_tensor((700,), torch.float32, 100 + i) for i in range(4)]
    for t, d in zip(shared, shared_data):
        t.copy_(d)

    def worker(k):
        try:
            for i in range(15):
                d = random_tensor((PAGE // 4 + k,), torch.float32, seed=k * 1000 + i)
                while True:
                    try:
                        t = store.allocate(d.shape, d.dtype, tier=["cpu", "gpu", "nvme"][(i + k) % 3])
                        break
                    except pagemem.OutOfMemory:
                        threading.Event().wait(0.001)
                t.copy_(d)
                for dest in (["nvme", "gpu", "cpu"][(i + j) % 3] for j in range(3)):
                    try:
                        t.move(dest)
                    except pagemem.OutOfMemory:
                        pass
                    s = shared[(i + k) % 4]
                    try:
                        s.move(dest)
                    except pagemem.OutOfMemory:
                        pass
                    assert same_bytes(t.to_torch(), d)
                    assert same_bytes(s.to_torch(), shared_data[(i + k) % 4])
                t.free()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors[0]
    store.synchronize()
    for t, d in zip(shared, shared_data):
        assert same_bytes(t.to_torch(), d)
    s = store.stats()
    for name in ("gpu", "cpu", "nvme"):
        assert s[name].used_pages + s[name].free_pages == s[name].capacity_pages
    assert sum(s[n].used_pages for n in ("gpu", "cpu", "nvme")) == len({p for t in shared for p in t.pages})


def test_groups_chained_with_after_share_the_boundary_page(store):
    a = store.allocate_group([((PAGE + 500,), torch.uint8)], tier="cpu")
    b = store.allocate_group([((300,), torch.uint8), ((PAGE,), torch.uint8)], tier="cpu", after=a[-1])
    assert b[0].pages[0] == a[0].pages[-1]  # b starts in a's tail page
    assert store.stats()["cpu"].used_pages == 3  # 4096+500 + 300 + 4096 bytes in 3 pages, not 4
    c = store.allocate_group([((10,), torch.uint8)], tier="cpu", after=a[-1])
    assert c[0].pages[0] not in a[0].pages  # something already follows a: fresh page
    datas = [random_tensor(t.shape, t.dtype, i) for i, t in enumerate(a + b + c)]
    for t, d in zip(a + b + c, datas):
        t.copy_(d)
    store.move(b, "nvme").wait()
    assert a[0].tier is None  # the shared page went with b
    for t, d in zip(a + b + c, datas):
        assert same_bytes(t.to_torch(), d)
    d = store.allocate_group([((10,), torch.uint8)], tier="gpu", after=b[-1])
    assert d[0].pages[0] not in b[-1].pages  # b's tail is on nvme, not gpu: fresh page


def test_chained_group_oom_changes_nothing(store):
    a = store.allocate((100,), torch.uint8, tier="gpu")
    before = store.stats()["gpu"]
    with pytest.raises(pagemem.OutOfMemory):
        store.allocate_group([((9 * PAGE,), torch.uint8)], tier="gpu", after=a)
    after = store.stats()["gpu"]
    assert (after.used_pages, after.live_bytes) == (before.used_pages, before.live_bytes)
    b = store.allocate_group([((50,), torch.uint8)], tier="gpu", after=a)  # the tail is still open
    assert b[0].pages == a.pages


def test_copy_into_a_split_tensor_with_no_room_for_copy_on_write(make_store, engine):
    """A tensor with pages on cpu and nvme, the nvme tier full: the disk page is written in place
    (no slot for copy-on-write), the neighbour's bytes on the shared page survive the
    read-modify-write, and every copy ends up with the new data."""
    store = make_store(io_engine=engine, nvme_bytes=3 * PAGE)
    a, b = store.allocate_group([((1000,), torch.uint8), ((2 * PAGE,), torch.uint8)], tier="cpu")
    da, db = random_tensor((1000,), torch.uint8, 1), random_tensor((2 * PAGE,), torch.uint8, 2)
    a.copy_(da)
    b.copy_(db)
    a.move("nvme").wait()  # b's first page goes with a; b's other two pages stay on cpu
    filler = store.allocate((2 * PAGE,), torch.uint8, tier="nvme")  # nvme is now full
    assert store.stats()["nvme"].free_pages == 0
    b.copy_(torch.zeros(2 * PAGE, dtype=torch.uint8))
    assert torch.count_nonzero(b.to_torch()) == 0 and same_bytes(a.to_torch(), da)
    assert store.stats()["nvme"].free_pages == 0
    filler.free()

def test_export_page_writes_a_pages_bytes_and_their_checksum(make_store, tmp_path):
    """``PageStore.export_page``: a page in memory or only on nvme lands in the caller's file
    byte for byte, with the XXH3-64 checksum of what was written."""
    import os

    import xxhash

    store = make_store()
    a = store.allocate((store.page_bytes // 4,), torch.float32, tier="cpu")
    b = store.allocate((store.page_bytes // 4,), torch.float32, tier="cpu")
    a.copy_(torch.arange(a.shape[0], dtype=torch.float32))
    b.copy_(-torch.arange(b.shape[0], dtype=torch.float32))
    b.move("nvme").wait()
    store.synchronize()
    path = tmp_path / "out.pages"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 2 * store.page_bytes)
        for pos, t in enumerate((a, b)):
            (page_id, _lo, _hi), = t.extents()
            digest = store.export_page(page_id, fd, pos * store.page_bytes)
            data = os.pread(fd, store.page_bytes, pos * store.page_bytes)
            assert digest == xxhash.xxh3_64_intdigest(data)
            assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), t.to_torch())
    finally:
        os.close(fd)
    store.close()
    with pytest.raises(pagemem.InvalidRequest):
        store.export_page(0, 0, 0)
