"""The nvme tier's files, engines and checksums."""

import os
import stat

import pytest
import torch

import pagemem

from conftest import ENGINES, PAGE, random_tensor, same_bytes


def test_page_file_is_private_preallocated_and_removed_on_close(make_store, tmp_path):
    store = make_store(nvme_bytes=32 * PAGE)
    nvme = store.tier("nvme")
    (path,) = nvme.paths
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 32 * PAGE
    assert st.st_blocks * 512 >= 32 * PAGE  # really allocated, not sparse
    store.close()
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_direct_io_on_a_filesystem_that_has_it(make_store):
    store = make_store()
    info = store.tier("nvme").describe()
    assert info["direct_io"] is True, "the test directory's filesystem should support O_DIRECT"
    assert info["checksum"] == "xxh3_64"


def test_buffered_io_uses_the_thread_engine(make_store):
    store = make_store(direct_io=False)
    info = store.tier("nvme").describe()
    assert info["direct_io"] is False
    assert info["io_engine"] == "threads"
    t = store.allocate((3000,), torch.float32, tier="cpu")
    data = random_tensor((3000,), torch.float32)
    t.copy_(data)
    t.move("nvme").wait()
    assert same_bytes(t.to_torch(), data)


def test_asking_for_aio_without_direct_io_is_a_config_error(make_store):
    with pytest.raises(pagemem.ConfigError, match="io_engine: .*O_DIRECT"):
        make_store(io_engine="aio", direct_io=False)


def test_auto_engine_prefers_aio_when_it_works(make_store):
    store = make_store(io_engine="auto")
    expected = "aio" if "aio" in ENGINES else "threads"
    assert store.tier("nvme").describe()["io_engine"] == expected


def test_pages_striped_over_several_directories(make_store, tmp_path, engine):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(); b.mkdir()
    store = make_store(nvme_path=[str(a), str(b)], nvme_bytes=8 * PAGE, io_engine=engine)
    assert len(store.tier("nvme").paths) == 2
    ts = [store.allocate((PAGE,), torch.uint8, tier="cpu") for _ in range(6)]
    data = [random_tensor((PAGE,), torch.uint8, seed=i) for i in range(6)]
    for t, d in zip(ts, data):
        t.copy_(d)
    store.move(ts, "nvme").wait()
    files = {store.tier("nvme").locate(store.location(t.pages[0])[1])[0].path for t in ts}
    assert len(files) == 2
    for t, d in zip(ts, data):
        assert same_bytes(t.to_torch(), d)


def test_unwritten_nvme_pages_read_as_zeros(store):
    t = store.allocate((5000,), torch.int16, tier="nvme")
    assert torch.equal(t.to_torch(), torch.zeros(5000, dtype=torch.int16))


def test_checksums_off_still_round_trips(make_store):
    store = make_store(checksums=False)
    assert store.tier("nvme").describe()["checksum"] is None
    t = store.allocate((2, PAGE), torch.uint8, tier="cpu")
    d = random_tensor((2, PAGE), torch.uint8)
    t.copy_(d)
    t.move("nvme").wait()
    assert same_bytes(t.to_torch(), d)


def _tier_io(start, slot, buf):
    """Run one start_read / start_write and return its error (None on success)."""
    import threading

    got, finished = [], threading.Event()
    start(slot, buf, lambda e: (got.append(e), finished.set()))
    assert finished.wait(10)
    return got[0]


@pytest.mark.parametrize("kind", ["short", "eio"])
@pytest.mark.parametrize("checksums", [True, False])
def test_a_failed_write_leaves_a_torn_slot_that_never_reads_as_data(tmp_path, engine, kind, checksums):
    from pagemem.tiers.arena import HostArena
    from pagemem.tiers.io.faults import FaultyEngine
    from pagemem.tiers.nvme import NvmeTier

    tier = NvmeTier((str(tmp_path),), 4, PAGE, engine=engine, io_depth=4, direct=True, checksums=checksums)
    arena = HostArena(2 * PAGE, pin=False)
    try:
        faults = tier.engine = FaultyEngine(tier.engine)
        src, dst = arena.buffer(0, PAGE), arena.buffer(PAGE, PAGE)
        (slot,) = tier.allocate(1)
        old = random_tensor((PAGE,), torch.uint8, seed=1)
        src.tensor.copy_(old)
        assert _tier_io(tier.start_write, slot, src) is None
        assert not tier.is_torn(slot)

        src.tensor.copy_(random_tensor((PAGE,), torch.uint8, seed=2))
        faults.fail_next("write", kind)
        assert isinstance(_tier_io(tier.start_write, slot, src), pagemem.TierIOError)
        assert tier.is_torn(slot)
        dst.tensor.fill_(0xAB)
        err = _tier_io(tier.start_read, slot, dst)
        assert isinstance(err, pagemem.CorruptPage)
        assert "last write to this slot failed" in str(err) and err.slot == slot
        assert bool((dst.tensor == 0xAB).all())  # nothing partial was handed over

        assert _tier_io(tier.start_write, slot, src) is None  # a good write clears the mark
        assert not tier.is_torn(slot)
        assert _tier_io(tier.start_read, slot, dst) is None
        assert same_bytes(dst.tensor, src.tensor)

        faults.fail_next("write", kind)
        _tier_io(tier.start_write, slot, src)
        tier.release([slot])  # releasing clears it too: the slot is unwritten again
        assert not tier.is_torn(slot)
        (again,) = tier.allocate(1)
        assert again == slot
        assert _tier_io(tier.start_read, slot, dst) is None and not dst.tensor.any()
    finally:
        tier.close()
        arena.close()


def test_a_write_that_never_wrote_a_slot_before_still_tears_it(tmp_path):
    from pagemem.tiers.arena import HostArena
    from pagemem.tiers.io.faults import FaultyEngine
    from pagemem.tiers.nvme import NvmeTier

    tier = NvmeTier((str(tmp_path),), 2, PAGE, engine="threads", io_depth=2, direct=True, checksums=True)
    arena = HostArena(PAGE, pin=False)
    try:
        tier.engine = FaultyEngine(tier.engine)
        buf = arena.buffer(0, PAGE)
        buf.tensor.fill_(5)
        tier.engine.fail_next("write", "short")
        assert _tier_io(tier.start_write, 1, buf) is not None
        # never written successfully, so it used to read back as zeros: now refused
        assert isinstance(_tier_io(tier.start_read, 1, buf), pagemem.CorruptPage)
    finally:
        tier.close()
        arena.close()
