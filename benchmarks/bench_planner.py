"""Planning GPT-3 175B: how long ``plan()`` takes, the plan's size and its validated peak memory.

The model is ANGEL-PTM Table 4's GPT3-175B (70 layers, hidden 14336, ffn 57344, 112 heads),
seq 2048, bf16, activation checkpointing per block, on 8 ranks with 4 MiB pages; per-rank budgets
are one A100-40GB server's share: gpu 40 GiB, cpu 1 TB / 8, nvme 11 TB / 8, optimizer states on
nvme (they do not fit in the server's memory). Anchors from the same run: the same planner with a
timeline that rescans a numpy array per query, and the time to build the synthetic trace and to
validate the plan, and to derive what each of its tasks waits for (``Plan.deps``, computed from the
task table the first time an executor, the simulator or ``Plan.save`` asks). Goal: planning takes at
most 1 second.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from common import table, write_json

import torch

from pagemem.models import gpt_config
from pagemem.sched import plan, validate
from pagemem.tracer import synthetic_from_config
from pagemem.units import format_bytes

BUDGETS = {"gpu": "40GiB", "cpu": str(10**12 // 8), "nvme": str(11 * 10**12 // 8)}


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    cfg = gpt_config("angel-gpt3-175b", checkpoint_activations=True)
    t_trace, tr = timed(lambda: synthetic_from_config(cfg, batch=args.batch, seq=2048, dtype=torch.bfloat16), args.repeats)
    kw = dict(world_size=8, optimizer_tier="nvme", page_bytes="4MiB")
    t_seg, p = timed(lambda: plan(tr, BUDGETS, timeline="segment", **kw), args.repeats)
    t_scan, q = timed(lambda: plan(tr, BUDGETS, timeline="scan", **kw), args.repeats)
    assert p.tasks == q.tasks, "the two timelines planned differently"
    t_val, report = timed(lambda: validate(p, tr), args.repeats)
    # what each task waits for: derived from the task table on first use (Plan.deps), a fresh plan each time
    t_deps, deps = timed(lambda: dataclasses.replace(p).deps, args.repeats)
    counts = p.counts()
    rows = [
        ["build the synthetic trace", f"{t_trace * 1000:.0f}", "-"],
        ["plan() with the segment-tree timeline", f"{t_seg * 1000:.0f}", "1.00"],
        ["plan() with a rescanning timeline (anchor)", f"{t_scan * 1000:.0f}", f"{t_scan / t_seg:.2f}"],
        ["validate() the plan", f"{t_val * 1000:.0f}", f"{t_val / t_seg:.2f}"],
        ["the plan's dependencies (Plan.deps)", f"{t_deps * 1000:.0f}", f"{t_deps / t_seg:.2f}"],
    ]
    print(table(["step", "ms (median)", "x plan()"], rows,
                f"GPT3-175B (ANGEL Table 4), seq 2048, batch {args.batch}/rank, checkpointing, 8 ranks, 4 MiB pages"))
    print()
    print(p.summary())
    print(f"validated: {'valid' if report.ok else report.summary()}; peak " +
          ", ".join(f"{t} {format_bytes(v)}" for t, v in report.peak.items()))
    goal = t_seg <= 1.0
    print(f"\ngoal (plan() <= 1 s): {'met' if goal else 'NOT met'}")
    path = write_json("bench_planner", {
        "model": "angel-gpt3-175b", "batch": args.batch, "seq": 2048, "world_size": 8, "budgets": BUDGETS,
        "ops": len(tr.ops), "tasks": len(p.tasks), "task_counts": counts,
        "seconds": {"trace": t_trace, "plan_segment": t_seg, "plan_scan": t_scan, "validate": t_val,
                    "deps": t_deps},
        "dependencies": sum(len(d.same) + len(d.previous) for d in deps),
        "peak": report.peak, "valid": report.ok, "min_gpu_bytes": p.min_gpu_bytes,
        "cached_layers": list(p.cached_layers), "bytes_moved": p.bytes_moved(), "goal_met": goal})
    print("wrote", path)


if __name__ == "__main__":
    main()
