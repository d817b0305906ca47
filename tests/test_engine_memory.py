"""The engine's memory: the gpu tier never holds more than its budget, and nothing leaks over many
iterations (pages, threads, open files, process memory)."""

from __future__ import annotations

import gc
import os
import threading

import torch

import pagemem
from conftest import engine_gpu_budget
from pagemem.models.gpt import GPT, GPTConfig

PAGE = 64 * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> tuple[str, ...]:
    """Live threads by name, a pool's workers (``prefix_N``) counted once: a pool may start its
    threads lazily (up to its fixed size) long after the first iterations."""
    return tuple(sorted({t.name.split("_")[0] for t in threading.enumerate()}))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_two_hundred_iterations_leak_nothing_and_stay_under_budget(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=16))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 128, (2, 17), generator=g)

    def loss_of(m):
        return torch.nn.functional.cross_entropy(m(data[:, :-1]).reshape(-1, 128), data[:, 1:].reshape(-1))

    budget = engine_gpu_budget(model, lambda m: loss_of(m).backward(), PAGE, 0.5)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=16 * nbytes + 64 * PAGE,
                                nvme_bytes=16 * nbytes + 64 * PAGE, nvme_path=str(tmp_path))
    cfg = pagemem.EngineConfig(store=store, optimizer_tier="nvme", adam_threads=2)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 128, (2, 17), generator=g)
    with pagemem.Engine(model, cfg) as engine:
        samples = []
        for it in range(200):
            loss = torch.nn.functional.cross_entropy(engine(data[:, :-1]).reshape(-1, 128), data[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            if it in (20, 100, 199):
                gc.collect()
                s = engine.store.stats()
                samples.append(({n: s[n].used_pages for n in ("gpu", "cpu", "nvme")}, threading.active_count(),
                                _fds(), _rss()))
        stats = engine.stats()
    (pages0, _, _, rss0), (pages_mid, threads_mid, fds_mid, _), (pages1, threads1, fds1, rss1) = samples
    assert pages0 == pages_mid == pages1
    # thread pools start their threads lazily, up to their size: compare once they are warm
    assert threads1 == threads_mid and fds1 == fds_mid
    assert rss1 - rss0 < 32 << 20, f"process memory grew by {(rss1 - rss0) >> 20} MiB over 180 iterations"
    assert stats["evictions"] > 0
    assert 0 < stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]
    assert not list(tmp_path.iterdir())  # the page file went with the engine
