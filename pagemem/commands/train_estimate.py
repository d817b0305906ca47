"""``pagemem train``'s estimate of a step's time on the host stand-in, printed before the first
step ([Note: the host estimate])."""

from __future__ import annotations

import time
from typing import Any

from pagemem.commands.train_config import TrainConfig


def host_estimate(model: Any, cfg: TrainConfig) -> str:
    """What a step will take on the host stand-in, before the first ([Note: the host estimate])."""
    params = sum(p.numel() for p in model.parameters())
    tokens = cfg.data.batch * cfg.data.seq * cfg.engine.accumulation_steps
    rate = host_matmul_rate()
    seconds, compute = host_step_seconds(params, tokens, rate)
    return (f"pagemem train: {params / 1e6:,.1f}M parameters, {tokens:,} tokens a step, on the host stand-in (no "
            f"GPU): about {seconds:,.2f} s a step, within about 2x on a quiet machine ({compute:,.2f} s of matrix "
            f"products at this machine's {rate / 1e9:,.0f} GFLOP/s now, and the update, the pages' moves and the "
            "rest); the first step traces and plans the iteration and takes longer")


def host_step_seconds(params: int, tokens: int, rate: float) -> tuple[float, float]:
    """A step's seconds on the host stand-in, and the matrix products' part of them.

    [Note: the host estimate] About 6 flops per parameter and token (forward and backward) at
    ``rate`` (the best of a few short 512 x 512 products here, just before), times 1.5 for the
    products that run slower than that; 20 ns per parameter for the update and the moves of its
    states; 15 ms a step for the rest. Fitted on the 2-core development host, shared, to the
    median step of three shapes (0.1M, 3.2M and 13M parameters, synchronous and lock-free), and
    checked on a fourth (14M, 8 layers): 1.2x to 1.3x below the steps measured where the rate was
    taken undisturbed; other processes' load moves both the rate and the steps (3x seen)."""
    compute = 6 * params * tokens / rate
    return 1.5 * compute + 20e-9 * params + 0.015, compute


def host_matmul_rate(samples: int = 8, each_s: float = 0.04) -> float:
    """Flops per second of float32 512 x 512 matrix products here, the best of ``samples`` short
    tries (the best is the one other processes disturbed least)."""
    import torch

    a = torch.randn(512, 512)
    a @ a  # the thread pool started
    best = 0.0
    for _ in range(samples):
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < each_s:
            a @ a
            done += 1
        best = max(best, done * 2 * 512**3 / (time.perf_counter() - t0))
    return best
