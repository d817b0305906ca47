"""Adopt pagemem in a training loop you already have: five lines change.

A plain PyTorch loop trains the project's GPT on a synthetic task (each token has four
successors, so the loss falls towards ln 4). The same loop through pagemem differs in the five
lines commented ``pagemem``: the store's budgets, the engine's config, the engine, and
``engine.backward`` / ``engine.step`` in place of ``loss.backward`` / ``opt.step`` +
``opt.zero_grad``. The gpu budget is too small for the model's states beside its activations, so
its layers move in and out of the ``gpu`` tier every step (here the host stands in for the GPU:
``gpu_backend="host"``).

At the end both runs' weights are compared: in fp32 the engine does the same arithmetic as
``torch.optim.AdamW(fused=True)``, so they agree bit for bit.

    python examples/adopt_existing_loop.py [--steps 30] [--layers 4] [--hidden 128] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import pagemem
from pagemem.models import GPT, GPTConfig
from pagemem.models.tasks import BranchingTask
from pagemem.sched import least_gpu_bytes
from pagemem.tracer import trace

PAGE = 64 * 1024
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def loss_fn(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: ``logits`` of ``x[:, :-1]`` against ``x[:, 1:]``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def make(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # the same initial weights every time
    return GPT(cfg)


def plain(cfg: GPTConfig, task: BranchingTask, steps: int) -> dict[str, torch.Tensor]:
    """The loop as it was."""
    model = make(cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HP)
    table = task.table()
    for step in range(steps):
        x = task.batch_at(step, table)
        loss = loss_fn(model(x[:, :-1]), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def with_pagemem(cfg: GPTConfig, task: BranchingTask, steps: int) -> dict[str, torch.Tensor]:
    """The same loop through the engine."""
    model = make(cfg)
    table = task.table()
    budget = gpu_budget(make(cfg), task.batch_at(0, table))
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,  # pagemem
                                cpu_bytes=40 * nbytes + (64 << 20))
    config = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier="cpu")  # pagemem
    engine = pagemem.Engine(model, config)  # pagemem
    try:
        for step in range(steps):
            x = task.batch_at(step, table)
            loss = loss_fn(engine(x[:, :-1]), x)  # the engine calls the model
            engine.backward(loss)  # pagemem: was loss.backward()
            engine.step()  # pagemem: was opt.step(); opt.zero_grad()
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == steps:
                print(f"step {step + 1:>4}  loss {loss.item():.4f}")
        stats = engine.stats()
        print(f"gpu budget {budget >> 10} KiB, gpu peak {stats['gpu_peak_bytes'] >> 10} KiB; layers paged in: "
              f"{stats['moved_bytes'].get('cpu->gpu', 0) >> 10} KiB over {steps} steps")
        return model.state_dict()  # the trained values, read back from the pages
    finally:
        engine.close()


def gpu_budget(model: GPT, x: torch.Tensor) -> int:
    """How much gpu memory to give the engine. On a GPU you would give it what you have; here,
    to make pages move, the least the scheduler accepts for one traced iteration of the plain
    model (activations and the layers in use) plus three quarters of the parameters (the engine
    pages groups of modules, larger than one layer: they need room beyond that least)."""
    tr = trace(model, lambda: loss_fn(model(x[:, :-1]), x).backward()).with_non_model_peak_reserved()
    params = 4 * sum(p.numel() for p in model.parameters())
    return -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params * 3 // 4) // PAGE) * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=4, vocab=256, seq=args.seq)
    task = BranchingTask(vocab=256, seq=args.seq, batch=args.batch)

    ours = with_pagemem(cfg, task, args.steps)
    ref = plain(cfg, task, args.steps)
    diff = max(float((ours[k] - ref[k]).abs().max()) for k in ref)
    same = all(torch.equal(ours[k], ref[k]) for k in ref)
    print(f"against plain PyTorch on the same batches: {'bit-identical' if same else f'max difference {diff:.3g}'}")
    if diff > 1e-6:  # more than rounding: something is wrong
        print("the engine's weights differ from plain PyTorch's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
