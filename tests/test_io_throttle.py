"""The nvme bandwidth knob (``StoreConfig(nvme_bandwidth=)``, ``tiers/io/throttle.py``)."""

from __future__ import annotations

import threading

import pytest
import torch

import pagemem
from pagemem.tiers.io.base import IOEngine
from pagemem.tiers.io.throttle import ThrottledEngine


class Instant(IOEngine):
    name, depth = "instant", 8

    def __init__(self) -> None:
        self.closed = False

    def submit(self, write, fd, offset, buf, done):
        done(len(buf))

    def close(self):
        self.closed = True


def test_completions_arrive_no_faster_than_the_bandwidth_and_in_order(monkeypatch):
    clock = [100.0]
    from pagemem.tiers.io import throttle

    monkeypatch.setattr(throttle.time, "monotonic", lambda: clock[0])
    engine = ThrottledEngine(Instant(), bytes_per_s=1000)
    got: list[int] = []
    arrived = threading.Event()

    def done(result):
        got.append(result)
        if len(got) == 3:
            arrived.set()

    for n in (500, 250, 250):  # due at 100.5, 100.75, 101.0
        engine.submit(True, 0, 0, memoryview(bytearray(n)), done)
    assert not arrived.wait(0.2) and got == []
    clock[0] = 100.8
    with engine._cond:
        engine._cond.notify()
    for _ in range(100):
        if len(got) == 2:
            break
        threading.Event().wait(0.01)
    assert got == [500, 250]  # the third is due at 101.0
    engine.close()  # delivers what is held, closes the disk engine
    assert got == [500, 250, 250] and engine.inner.closed


def test_a_throttled_store_moves_pages_exactly(tmp_path):
    cfg = pagemem.StoreConfig(page_bytes=4096, cpu_bytes=16 * 4096, nvme_bytes=16 * 4096, nvme_path=str(tmp_path),
                              nvme_bandwidth="64MiB")
    with pagemem.PageStore(cfg) as store:
        assert "MiB/s" in store.tier("nvme").engine.name
        t = store.allocate((4096,), torch.float32, tier="cpu")
        t.copy_(torch.arange(4096, dtype=torch.float32))
        store.move([t], "nvme").wait()
        store.move([t], "cpu").wait()
        assert torch.equal(t.to_torch(), torch.arange(4096, dtype=torch.float32))


@pytest.mark.parametrize("value", [0, -1, "fast"])
def test_a_bad_bandwidth_names_the_field(value):
    with pytest.raises(pagemem.ConfigError, match="^nvme_bandwidth"):
        pagemem.StoreConfig(cpu_bytes=4096, nvme_bandwidth=value)
