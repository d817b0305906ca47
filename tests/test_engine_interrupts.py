"""Ctrl-C anywhere: the engine's bookkeeping is never left torn ([Note: Ctrl-C inside the engine]).

A real SIGINT (``signal.raise_signal`` at a chosen point inside the engine, or
``_thread.interrupt_main`` from a timer at a random moment) while a loop trains; the loop
skips an interrupted batch (``zero_grad``) or retries an interrupted step, as a user would.
The weights must equal plain PyTorch trained on the batches that counted.
"""

from __future__ import annotations

import _thread
import random
import signal
import threading
import time

import pytest
import torch
from torch import nn

import pagemem
from pagemem.engine.gradients import grads as grads_module
from pagemem.engine.units import residency as residency_module
from pagemem.tiers import memory as memory_module

D = 256


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.ReLU())], nn.Linear(D, 1))


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)


def config(tmp_path, tier: str) -> pagemem.EngineConfig:
    store = pagemem.StoreConfig(page_bytes="64KiB", gpu_bytes="1536KiB", cpu_bytes="16MiB", gpu_backend="host",
                                nvme_bytes="16MiB" if tier == "nvme" else 0,
                                nvme_path=str(tmp_path) if tier == "nvme" else None)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=1e-2, weight_decay=0.1), optimizer_tier=tier)


class Reference:
    def __init__(self) -> None:
        self.model = make()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    def train(self, i: int) -> None:
        x, y = batch(i)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def same(engine: pagemem.Engine, ref: Reference) -> list[str]:
    got, want = engine.state_dict(), ref.model.state_dict()
    return [k for k in want if not torch.equal(got[k], want[k])]


def ctrl_c_at(monkeypatch, target, name: str, nth: int) -> dict:
    """A real SIGINT from inside ``target.name`` on its ``nth`` call while ``armed``."""
    real = getattr(target, name)
    state = {"armed": False, "calls": 0, "fired": 0}

    def fake(*args, **kwargs):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == nth:
                state["armed"] = False
                state["fired"] += 1
                signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fake)
    return state


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("where,nth", [("eviction", 1), ("eviction", 2), ("eviction", 5), ("handles", 1),
                                       ("copy-start", 1), ("copy-start", 2), ("copy-start", 5)])
def test_ctrl_c_inside_the_engine_leaves_it_whole(where, nth, tier, tmp_path, monkeypatch):
    """Inside an eviction (the attack that made every weight NaN), while the gradient handles
    go up (zero_grad then discarded only some), inside a page copy's start (every later call
    re-raised the same Ctrl-C)."""
    target, name = {"eviction": (residency_module, "placeholder"), "handles": (grads_module.GradHandles, "show"),
                    "copy-start": (memory_module.MemoryTier, "_span_for")}[where]
    state = ctrl_c_at(monkeypatch, target, name, nth)
    model, ref = make(), Reference()
    with pagemem.Engine(model, config(tmp_path, tier)) as engine:
        for i in range(6):
            state["armed"] = i == 2
            x, y = batch(i)
            try:
                engine.backward(nn.functional.mse_loss(engine(x), y))
            except KeyboardInterrupt:
                engine.zero_grad()  # skip the batch
                continue
            engine.step()
            ref.train(i)
        assert not same(engine, ref)
        assert all(torch.isfinite(v).all() for v in engine.state_dict().values())
    assert state["fired"] == 1
    with pytest.raises(KeyboardInterrupt):  # outside the engine's code a Ctrl-C is raised at once
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ctrl_c_at_random_moments_never_tears_the_engine(seed, tmp_path):
    rng = random.Random(seed)
    model, ref = make(), Reference()
    interrupts = 0
    with pagemem.Engine(model, config(tmp_path, "cpu")) as engine:
        for i in range(20):
            timer = threading.Timer(rng.uniform(0, 0.04), _thread.interrupt_main)
            phase, steps = "forward", engine.global_step
            timer.start()
            try:
                x, y = batch(i)
                loss = nn.functional.mse_loss(engine(x), y)
                phase = "backward"
                engine.backward(loss)
                phase = "step"
                engine.step()
                phase = "done"
                timer.join()
                time.sleep(0.001)
            except KeyboardInterrupt:
                interrupts += 1
                timer.join()
            if phase in ("forward", "backward"):
                engine.zero_grad()  # the batch is skipped
                continue
            if engine.global_step == steps:  # interrupted before the update: retry it
                engine.step()
            ref.train(i)
        assert not same(engine, ref), same(engine, ref)
    assert interrupts > 0
