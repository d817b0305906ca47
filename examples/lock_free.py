"""The lock-free updater: optimizer states on NVMe, updated off the critical path.

``EngineConfig(lock_free=True)`` hands each iteration's gradients to one updating thread, which
reads each unit's optimizer states from the ``nvme`` tier, updates them and publishes the new
parameters; forward and backward never wait for the disk. A unit's parameters may then be a
few iterations behind: ``engine.stats()["staleness"]`` says how many (mean, max and a histogram
over every unit at each iteration's start). With ``max_staleness=None`` (the default) the compute
never waits; ``max_staleness=0`` waits for every update (synchronous training, bit for bit).
By default a lagging unit's parameters are predicted from its last update
(``staleness_correction="predict"``; README, the engine's lock-free updater).

``--nvme-bandwidth`` caps the disk (bytes/s, a testing knob: ``StoreConfig(nvme_bandwidth=)``)
so that the updater lags further, as it does where the SSD is the bottleneck.

    python examples/lock_free.py [--steps 40] [--layers 4] [--hidden 128] [--batch 8] [--seq 64] [--nvme-bandwidth 50MiB]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.nn.functional as F

import pagemem
from pagemem.models import GPT, GPTConfig
from pagemem.models.tasks import BranchingTask
from pagemem.sched import least_gpu_bytes
from pagemem.tracer import trace

PAGE = 64 * 1024


def loss_fn(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def gpu_budget(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The least the scheduler accepts for one traced iteration, plus three quarters of the
    parameters (on a GPU you would give the engine what you have)."""
    tr = trace(model, lambda: loss_fn(model(x[:, :-1]), x).backward()).with_non_model_peak_reserved()
    params = 4 * sum(p.numel() for p in model.parameters())
    return -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params * 3 // 4) // PAGE) * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--nvme-bandwidth", default=None, help="a cap on the nvme tier's bytes/s (default: none)")
    args = ap.parse_args()
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=4, vocab=256, seq=args.seq)
    task = BranchingTask(vocab=256, seq=args.seq, batch=args.batch)
    table = task.table()

    def make() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)

    model = make()
    states = 12 * sum(p.numel() for p in model.parameters())
    budget = gpu_budget(make(), task.batch_at(0, table))
    with tempfile.TemporaryDirectory(prefix="pagemem-example-") as nvme:
        store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                    cpu_bytes=3 * states + (64 << 20), nvme_bytes=2 * states + (64 << 20),
                                    nvme_path=nvme, nvme_bandwidth=args.nvme_bandwidth, copy_threads=0)
        config = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=3e-3), optimizer_tier="nvme",
                                      lock_free=True)
        with pagemem.Engine(model, config) as engine:
            for step in range(args.steps):
                x = task.batch_at(step, table)
                loss = loss_fn(engine(x[:, :-1]), x)
                engine.backward(loss)
                engine.step()  # hands the gradients to the updating thread and returns
                if step == 0 or (step + 1) % 10 == 0 or step + 1 == args.steps:
                    print(f"step {step + 1:>4}  loss {loss.item():.4f}")
            staleness = engine.stats()["staleness"]
            engine.save(f"{nvme}/checkpoint")  # drains the updater first: a synchronous checkpoint
            done = engine.global_step
    print(f"staleness: {staleness}")
    print(f"mean {staleness['mean']:.2f} iterations behind, max {staleness['max']}; {done} steps, "
          f"all of them applied before the checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
