"""Homes on the cpu against homes on nvme ([Note: homes on nvme]): peak resident memory and
iteration time when the model's training state is 1x, 3x and 10x the host budget.

The host budget is the store's ``cpu_bytes`` (256 MiB); the gpu tier is the host stand-in (a
``gpu_bytes`` of 128 MiB, host memory too). The model is the project's GPT (hidden 512, vocab
2048, batch 1 x seq 64, fp32) with as many layers as make its training state (compute copy,
gradient sums, fp32 master and two moments: 20 bytes per parameter) the multiple asked; optimizer
states on nvme in every row. Each row runs in a process of its own (so ``ru_maxrss`` is its own):
the engine is built on ``meta`` with ``init=``, trains ``--steps`` steps, and reports

- ``rss growth``: the peak resident memory after training less the peak before the engine was
  built (``close()``, which gives the weights back to the model in host memory, is after it);
- ``iteration``: the median wall time of the steps after the first (traced) one;
- ``sim``: the simulator's prediction for the plan the engine followed, on the ``dev-vm``
  profile (none when the iterations ran on demand);
- the anchors: the training state's bytes, and the bound ``gpu + cpu + 4 layers + 256 MiB``.

With homes on the cpu a state over the cpu budget is refused at construction, naming the least
cpu budget that works: those rows say so instead of running.

Usage: ``python benchmarks/bench_homes.py [--steps N] [--multiples 1,3,10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, table, write_json

HIDDEN, VOCAB, SEQ = 512, 2048, 64
CPU, GPU = 256 << 20, 128 << 20
PER_LAYER = 12 * HIDDEN * HIDDEN + 13 * HIDDEN  # parameters of one block
BYTES_PER_PARAM = 20

WORKER = r'''
import json, resource, statistics, sys, time
import torch, pagemem
from pagemem.models.gpt import GPT, GPTConfig, init_module
from pagemem.sched import HardwareProfile, simulate
layers, home, steps, directory, cpu, gpu = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg = GPTConfig(layers=layers, hidden=%(hidden)d, heads=8, vocab=%(vocab)d, seq=%(seq)d)
torch.manual_seed(0)
with torch.device("meta"):
    model = GPT(cfg)
x = torch.randint(0, cfg.vocab, (1, %(seq)d + 1))
inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
before = peak()
store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=gpu, cpu_bytes=cpu, nvme_bytes=64 << 30, nvme_path=directory,
                            copy_threads=0)
config = pagemem.EngineConfig(store=store, optimizer_tier="nvme", home_tier=home, compute_dtype=torch.float32)
try:
    engine = pagemem.Engine(model, config, init=init_module(cfg))
except pagemem.OutOfMemory as exc:
    print(json.dumps({"refused": str(exc), "least_cpu_bytes": exc.least_bytes if exc.tier == "cpu" else None}))
    sys.exit(0)
seconds, losses = [], []
with engine:
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    trained = peak()
    stats = engine.stats()
    plan, trace = engine.pager.last_plan, engine.pager.last_trace
    sim = simulate(plan, trace, HardwareProfile.builtin("dev-vm")).iteration_time if plan is not None else None
state = stats["optimizer_state_bytes"] + stats["grad_bytes"] + sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({"growth": trained - before, "seconds": seconds, "losses": losses, "home_tier": stats["home_tier"],
                  "state_bytes": state, "iterations": stats["iterations"], "sim_seconds": sim,
                  "moved_bytes": stats["moved_bytes"]}))
''' % {"hidden": HIDDEN, "vocab": VOCAB, "seq": SEQ}


def layers_for(multiple: int) -> int:
    return max(1, round(multiple * CPU / (BYTES_PER_PARAM * PER_LAYER)))


def run(layers: int, home: str, steps: int) -> dict:
    directory = tempfile.mkdtemp(prefix="pagemem-bench-homes-")
    try:
        env = {**os.environ, "PYTHONPATH": ROOT}
        out = subprocess.run([sys.executable, "-c", WORKER, str(layers), home, str(steps), directory, str(CPU),
                              str(GPU)], capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--multiples", default="1,3,10")
    args = ap.parse_args()
    rows, out = [], []
    mib = 1 << 20
    for multiple in [int(m) for m in args.multiples.split(",")]:
        layers = layers_for(multiple)
        bound = GPU + CPU + 4 * 4 * PER_LAYER + (256 << 20)
        for home in ("cpu", "nvme"):
            r = run(layers, home, args.steps)
            r.update(multiple=multiple, layers=layers, home=home, bound_bytes=bound)
            out.append(r)
            if "refused" in r:
                least = r["least_cpu_bytes"]
                rows.append([f"{multiple}x {home}", layers, "-", "-", "-", "-",
                             f"refused: least cpu_bytes {least // mib} MiB" if least else "refused"])
                continue
            steady = statistics.median(r["seconds"][1:]) if len(r["seconds"]) > 1 else r["seconds"][0]
            r["iteration_seconds"] = steady
            sim = r["sim_seconds"]
            rows.append([f"{multiple}x {home}", layers, f"{r['state_bytes'] / mib:.0f}", f"{r['growth'] / mib:.0f}",
                         f"{bound / mib:.0f}", f"{steady:.2f}",
                         f"{sim:.2f} ({steady / sim:.2f}x)" if sim else "on demand"])
    print(table(["row", "layers", "state MiB", "rss growth MiB", "bound MiB", "iteration s", "sim s (measured/sim)"],
                rows, title=f"GPT h{HIDDEN}, cpu_bytes {CPU >> 20} MiB, gpu_bytes {GPU >> 20} MiB (host stand-in), "
                            f"optimizer states on nvme, {args.steps} steps"))
    print("wrote", write_json("bench_homes", {"cpu_bytes": CPU, "gpu_bytes": GPU, "hidden": HIDDEN, "rows": out}))


if __name__ == "__main__":
    main()
