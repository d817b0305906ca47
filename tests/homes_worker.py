"""Train a GPT built on ``meta`` with everything on nvme, in a process of its own, and report
its peak resident memory (``ru_maxrss``) before, after training (``trained``) and after
``close()`` (which gives the trained weights back to the model in host memory), as JSON on stdout.

``python homes_worker.py DIR LAYERS HIDDEN VOCAB GPU_BYTES CPU_BYTES HOME_TIER OPTIMIZER_TIER STEPS``
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

import pagemem
from pagemem.models.gpt import GPT, GPTConfig, init_module


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    directory, layers, hidden, vocab, gpu, cpu, home, opt, steps = sys.argv[1:10]
    cfg = GPTConfig(layers=int(layers), hidden=int(hidden), heads=12, vocab=int(vocab), seq=128)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (1, 65))
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    before = peak_rss()
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=int(gpu), cpu_bytes=int(cpu),
                                # what the states can take (24 bytes a parameter) and room: not a fixed 64 GiB,
                                # which the shared disk has not always had free
                                nvme_bytes=32 * sum(p.numel() for p in model.parameters()) + (1 << 30),
                                nvme_path=directory, page_bytes="4MiB")
    config = pagemem.EngineConfig(store=store, optimizer_tier=opt, home_tier=home, compute_dtype=torch.float32,
                                  adam_threads=2)
    losses, seconds = [], []
    with pagemem.Engine(model, config, init=init_module(cfg)) as engine:
        built = peak_rss()
        for _ in range(int(steps)):
            t0 = time.perf_counter()
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        stats = engine.stats()
        trained = peak_rss()
    after = peak_rss()
    state = stats["optimizer_state_bytes"] + stats["grad_bytes"] + sum(
        p.numel() * 4 for p in model.parameters())
    print(json.dumps({"before": before, "built": built, "trained": trained, "after": after,
                      "training_growth": trained - before, "growth": after - before,
                      "training_state_bytes": state, "losses": losses, "seconds": seconds,
                      "home_tier": stats["home_tier"], "params": sum(p.numel() for p in model.parameters()),
                      "moved_bytes": stats["moved_bytes"], "layer_bytes": 12 * int(hidden) ** 2 * 4,
                      "iterations": stats["iterations"]}))


if __name__ == "__main__":
    main()
