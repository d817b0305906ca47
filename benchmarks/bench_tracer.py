"""Tracer overhead: a traced training iteration against an untraced one of the same model.

Each configuration runs warm-up iterations, then alternates untraced and traced iterations
(forward + backward + AdamW step + zero_grad, the same work in both) and reports medians:

- ``untraced``: the iteration alone (the anchor, measured in the same run);
- ``traced``: the same iteration with the tracer's hooks installed (``meta["wall_seconds"]``);
- ``trace()``: the whole ``trace()`` call, including building the ``Trace`` records.

The goal is ``traced / untraced <= 1.3`` on a GPT with at least 8 layers. Results go to
``benchmarks/results/bench_tracer.json``. Usage: ``python benchmarks/bench_tracer.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagemem.models import GPT, gpt_config  # noqa: E402
from pagemem.tracer import trace  # noqa: E402

# (label, preset, overrides, batch, seq)
CONFIGS = [
    ("gpt-small 8L h256 b8 s256", "small", {}, 8, 256),
    ("gpt 8L h512 b4 s256", "small", {"hidden": 512, "heads": 8}, 4, 256),
    ("gpt 8L h128 b4 s64 (tiny ops)", "small", {"hidden": 128, "heads": 4, "vocab": 2048}, 4, 64),
]


def bench(label: str, preset: str, overrides: dict, batch: int, seq: int, repeats: int, device: str) -> dict:
    cfg = gpt_config(preset, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (batch, seq), generator=g).to(device)
    tgt = torch.randint(0, cfg.vocab, (batch, seq), generator=g).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step() -> None:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    for _ in range(3):
        step()
    untraced, traced, total = [], [], []
    tr = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        untraced.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tr = trace(model, step)
        total.append(time.perf_counter() - t0)
        traced.append(tr.meta["wall_seconds"])
    assert tr is not None
    med = {k: statistics.median(v) for k, v in (("untraced", untraced), ("traced", traced), ("total", total))}
    return {
        "label": label, "preset": preset, "overrides": overrides, "batch": batch, "seq": seq,
        "layers": cfg.layers, "params": sum(p.numel() for p in model.parameters()),
        "ops": len(tr.ops), "tensors": len(tr.tensors),
        "untraced_s": untraced, "traced_s": traced, "trace_call_s": total,
        "median_untraced_s": med["untraced"], "median_traced_s": med["traced"], "median_trace_call_s": med["total"],
        "ratio_traced": med["traced"] / med["untraced"], "ratio_trace_call": med["total"] / med["untraced"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="", help="run configurations whose label contains this")
    results = os.environ.get("PAGEMEM_BENCH_RESULTS") or os.path.join(os.path.dirname(__file__), "results")
    ap.add_argument("--out", default=os.path.join(results, "bench_tracer.json"))
    args = ap.parse_args()
    rows = [bench(*c, repeats=args.repeats, device=args.device) for c in CONFIGS if args.only in c[0]]
    print(f"tracer overhead, {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (anchor: the untraced iteration of the same model, same run)")
    head = f"{'model':<32}{'params':>9}{'ops':>6}{'untraced ms':>13}{'traced ms':>11}{'trace() ms':>12}{'traced/untr':>13}{'trace()/untr':>14}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['label']:<32}{r['params'] / 1e6:>8.1f}M{r['ops']:>6}{r['median_untraced_s'] * 1e3:>13.1f}"
              f"{r['median_traced_s'] * 1e3:>11.1f}{r['median_trace_call_s'] * 1e3:>12.1f}"
              f"{r['ratio_traced']:>12.3f}x{r['ratio_trace_call']:>13.3f}x")
    goal = [r for r in rows if r["layers"] >= 8]
    ok = all(r["ratio_traced"] <= 1.3 for r in goal)
    print(f"goal traced/untraced <= 1.3x on >= 8-layer GPTs: {'met' if ok else 'NOT met'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "tracer_overhead", "device": args.device, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "machine": platform.machine(), "repeats": args.repeats,
                   "goal_ratio": 1.3, "goal_met": ok, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
