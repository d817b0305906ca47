"""Fault injection: a full disk, an I/O error, a short write, a flipped byte. Each gives its clear
error and nothing already stored is lost."""

import os

import pytest
import torch

import pagemem
from pagemem.tiers.io.faults import FaultyEngine

from conftest import PAGE, random_tensor, same_bytes


def faulty(store) -> FaultyEngine:
    nvme = store.tier("nvme")
    nvme.engine = FaultyEngine(nvme.engine)
    return nvme.engine


@pytest.mark.parametrize("kind,match", [
    ("enospc", r"ENOSPC \(No space left on device\)"),
    ("eio", r"EIO \(Input/output error\)"),
    ("short", r"short write: \d+ of \d+ bytes"),
])
@pytest.mark.parametrize("source", ["cpu", "gpu"])
def test_failed_write_keeps_the_source_copy(store, kind, match, source):
    faults = faulty(store)
    t = store.allocate((3, PAGE), torch.uint8, tier=source)
    other = store.allocate((PAGE,), torch.uint8, tier="nvme")
    d, od = random_tensor((3, PAGE), torch.uint8, 1), random_tensor((PAGE,), torch.uint8, 2)
    t.copy_(d)
    other.copy_(od)
    before = store.stats()
    faults.fail_next("write", kind)
    h = t.move("nvme")
    with pytest.raises(pagemem.TierIOError, match=match) as err:
        h.wait(timeout=10)
    assert "source copy is unchanged" in str(err.value)
    assert isinstance(err.value, OSError)
    # from the gpu the pages bounce one request each: two of the three landed, the failed one
    # stayed; from the cpu the run of three is one request ([Note: runs of pages in one
    # request]): all three stayed
    landed = 2 if source == "gpu" else 0
    locations = [store.location(p)[0] for p in t.pages]
    assert sorted(locations) == sorted(["nvme"] * landed + [source] * (3 - landed))
    assert t.tier == (None if landed else source)
    assert same_bytes(t.to_torch(), d) and same_bytes(other.to_torch(), od)
    after = store.stats()
    assert after["nvme"].used_pages == before["nvme"].used_pages + landed
    assert after[source].used_pages == before[source].used_pages - landed
    assert after.staging_free == after.staging_pages  # bounce pages given back
    t.move("nvme").wait(timeout=10)  # the disk recovered: the move completes
    assert t.tier == "nvme" and same_bytes(t.to_torch(), d)


def test_read_error_leaves_the_page_on_disk(store):
    faults = faulty(store)
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    d = random_tensor((2 * PAGE,), torch.uint8)
    t.copy_(d)
    t.move("nvme").wait()
    faults.fail_next("read", "eio", count=2)
    with pytest.raises(pagemem.TierIOError, match="EIO.*the page stays where it was"):
        t.move("gpu").wait(timeout=10)
    assert t.tier == "nvme"
    assert store.stats()["gpu"].used_pages == 0
    assert same_bytes(t.to_torch(), d)


def test_failed_copy_into_nvme_tensor_changes_nothing(store):
    faults = faulty(store)
    a, b = store.allocate_group([((1000,), torch.uint8), ((2 * PAGE,), torch.uint8)], tier="nvme")
    da, db = random_tensor((1000,), torch.uint8, 1), random_tensor((2 * PAGE,), torch.uint8, 2)
    a.copy_(da)
    b.copy_(db)
    used = store.stats()["nvme"].used_pages
    faults.fail_next("write", "eio")
    with pytest.raises(pagemem.TierIOError):
        b.copy_(torch.zeros(2 * PAGE, dtype=torch.uint8))
    assert same_bytes(b.to_torch(), db)  # copy-on-write: the old pages are still the tensor's
    assert same_bytes(a.to_torch(), da)  # the neighbour sharing b's first page is intact
    assert store.stats()["nvme"].used_pages == used


def flip_byte(store, page_id: int, where: int = 100) -> None:
    tier, slot = store.location(page_id)
    assert tier == "nvme"
    f, offset = store.tier("nvme").locate(slot)
    fd = os.open(f.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + where)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset + where)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_flipped_byte_is_detected_never_returned(store):
    t = store.allocate((3 * PAGE,), torch.uint8, tier="cpu")
    u = store.allocate((PAGE,), torch.uint8, tier="cpu")
    d, du = random_tensor((3 * PAGE,), torch.uint8, 5), random_tensor((PAGE,), torch.uint8, 6)
    t.copy_(d)
    u.copy_(du)
    store.move([t, u], "nvme").wait()
    flip_byte(store, t.pages[1])
    with pytest.raises(pagemem.CorruptPage, match="checksum") as err:
        t.to_torch()
    assert err.value.tier == "nvme" and err.value.expected != err.value.actual
    with pytest.raises(pagemem.CorruptPage):
        t.move("cpu").wait(timeout=10)
    assert store.location(t.pages[1])[0] == "nvme"  # the corrupt page was not brought in
    assert same_bytes(u.to_torch(), du)  # other pages unaffected


def test_preallocation_on_a_full_disk_is_refused(tmp_path):
    st = os.statvfs(tmp_path)
    too_much = st.f_bavail * st.f_frsize + (1 << 40)
    with pytest.raises(pagemem.ConfigError, match="nvme_bytes: requested .* free"):  # before any file
        pagemem.PageStore(pagemem.StoreConfig(nvme_bytes=too_much, nvme_path=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []
