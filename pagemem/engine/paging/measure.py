"""The executor's own host time per window of a layer it moves, for a hardware profile's
``window_host_seconds`` (see ``pagemem.sched.hardware``): ``pagemem profile`` calls
:func:`window_host_seconds`.

[Note: what a window costs the host] Following a plan, the executor runs Python at op edges:
for every window of a layer the plan moves it stages the pages (page-table bookkeeping, the copy
call), binds the parameters (one view of page memory each) and releases them (placeholders, the
replica given back). On the host stand-in that time is spent on the thread that computes, so it
adds to the iteration; the copies themselves are the simulator's h2d stream and are subtracted
here. It is measured on the project's GPT with hidden 512, whose units hold 2 to 4 parameters,
under the least gpu budget the scheduler accepts, so that every layer not cached moves.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from pagemem.config import StoreConfig
from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.sched import least_gpu_bytes

PAGE = 4 << 20


def window_host_seconds(iterations: int = 8, repeats: int = 3) -> tuple[float, dict[str, Any]]:
    """Host seconds the executor spends per window of a moved layer, copies excluded (median over
    ``repeats`` runs of ``iterations`` planned iterations each), and how it was measured."""
    cfg = GPTConfig(layers=2, hidden=512, heads=8, vocab=2048, seq=64)
    torch.manual_seed(0)
    state = GPT(cfg).state_dict()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
    tgt = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
    n_params = sum(t.numel() for t in state.values())
    cpu_bytes = 64 * n_params + (64 << 20)

    def engine(gpu_bytes: int) -> Engine:
        model = GPT(cfg)
        model.load_state_dict(state)
        store = StoreConfig(page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, copy_threads=0)
        return Engine(model, EngineConfig(store=store, optimizer_tier="cpu", compute_dtype=torch.float32))

    def iterate(e: Engine) -> None:
        e.backward(e(idx.to(e.device), tgt.to(e.device)))
        e.step()

    with engine(cpu_bytes) as probe:  # room for everything: the trace a budget is chosen from
        probe.backward(probe(idx.to(probe.device), tgt.to(probe.device)))
        least = least_gpu_bytes(probe.pager.last_trace.with_non_model_peak_reserved(), page_bytes=PAGE)
    gpu_bytes = -(-least // PAGE) * PAGE
    samples, windows = [], 0
    for _ in range(repeats):
        with engine(gpu_bytes) as e:
            for _ in range(3):  # trace, plan, one planned iteration
                iterate(e)
            before, moved0 = e.stats(), _copy_seconds(e)
            for _ in range(iterations):
                iterate(e)
            after, moved1 = e.stats(), _copy_seconds(e)
        if after["iterations"].get("planned", 0) - before["iterations"].get("planned", 0) != iterations:
            raise RuntimeError("window_host_seconds: the measured iterations did not all follow the plan")
        releases = after["executor_releases"] - before["executor_releases"]
        if releases <= 0:
            raise RuntimeError("window_host_seconds: the plan moved no layer at the least budget")
        host = after["executor_seconds"] - before["executor_seconds"] - (moved1 - moved0)
        samples.append(max(host, 0.0) / releases)
        windows = releases // iterations
    how = {"model": f"GPT {cfg.layers}L h{cfg.hidden} vocab {cfg.vocab}, batch 2 x seq {cfg.seq}, fp32",
           "gpu_bytes": gpu_bytes, "windows_per_iteration": windows, "iterations": iterations,
           "samples_s": samples}
    return statistics.median(samples), how


def _copy_seconds(e: Engine) -> float:
    """Seconds the store's cpu -> gpu copies took so far (inline: on the executor's thread)."""
    move = e.store.stats().moves.get("cpu->gpu")
    return move.seconds if move is not None else 0.0
