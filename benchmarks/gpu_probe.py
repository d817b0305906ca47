"""bench_offload's pagemem row, iteration by iteration: a diagnostic, not a benchmark.

For each iteration: the mode it ran in (traced, planned, left its plan, on demand), where a
planned one left its plan (the op, what the trace had there, what ran), and the time of its
forward, backward and step, each behind a device synchronize; then what ``engine.stats()``
counted in it. With ``--profile``, the last iteration runs under ``torch.profiler`` and the ops
that took the most time are listed. Writes ``benchmarks/results/gpu_probe.json``.

  python benchmarks/gpu_probe.py --model gpt-1.3b --batch 8 --seq 1024 --offload cpu --checkpoint-activations
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench_offload import PAGE, gpt_config
from common import write_json

import pagemem
from pagemem.models.gpt import GPT, init_module

COUNTED = ("moved_bytes", "seconds", "fetches", "prefetches", "evictions", "misses", "host_stages",
           "gpu_wait_seconds", "executor_seconds", "executor_releases", "unforeseen_reads", "view_copies")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def delta(after, before):
    if isinstance(after, dict):
        return {k: delta(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()
                if isinstance(v, (int, float, dict))}
    return after - before if isinstance(after, (int, float)) else after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--nvme-path")
    ap.add_argument("--checkpoint-activations", action="store_true")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu-fraction", type=float, default=0.6)
    ap.add_argument("--gpu-bytes", type=int, default=0, help="the gpu budget (default: --gpu-fraction of the free GPU memory; 1 GiB without CUDA)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    spec = {"model": args.model, "seq": args.seq, "checkpoint_activations": args.checkpoint_activations,
            "shape": {"layers": args.layers} if args.layers else {}}
    cfg = gpt_config(spec)
    n = cfg.param_count()
    gpu_bytes = args.gpu_bytes or (int(torch.cuda.mem_get_info()[0] * args.gpu_fraction) if torch.cuda.is_available()
                                   else 1 << 30)
    nvme = args.offload == "nvme"
    cpu_bytes = min((2 + 4 + (0 if nvme else 12)) * n + 256 * PAGE, int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.85))
    store = pagemem.StoreConfig(page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes,
                                nvme_bytes=(12 * n + 256 * PAGE) if nvme else 0, nvme_path=args.nvme_path if nvme else None)
    config = pagemem.EngineConfig(store=store, optimizer_tier=args.offload, compute_dtype=torch.bfloat16,
                                  optimizer=pagemem.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1))
    print(f"GPT {cfg.layers}L h{cfg.hidden} {n / 1e9:.2f}B, batch {args.batch} x {args.seq}, offload {args.offload}, "
          f"checkpointing {args.checkpoint_activations}, gpu budget {gpu_bytes / 2**30:.1f} GiB, cpu {cpu_bytes / 2**30:.1f} GiB",
          flush=True)
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    engine = pagemem.Engine(model, config, init=init_module(cfg))
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    out = []
    try:
        for it in range(args.iters):
            x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g)
            idx, tgt = x[:, :-1].contiguous().to(engine.device), x[:, 1:].contiguous().to(engine.device)
            before = engine.stats()
            prof = None
            if args.profile and it == args.iters - 1:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                prof = profile(activities=acts)
                prof.__enter__()
            sync()
            t = [time.perf_counter()]
            loss = engine(idx, tgt)
            sync(); t.append(time.perf_counter())
            engine.backward(loss)
            sync(); t.append(time.perf_counter())
            engine.step()
            sync(); t.append(time.perf_counter())
            if prof is not None:
                prof.__exit__(None, None, None)
            after = engine.stats()
            modes = {k: v - before["iterations"].get(k, 0) for k, v in after["iterations"].items()
                     if v != before["iterations"].get(k, 0)}
            row = {"iteration": it, "modes": modes, "forward_s": t[1] - t[0], "backward_s": t[2] - t[1],
                   "step_s": t[3] - t[2], "loss": loss.item(), "left_plan_at": after["left_plan_at"],
                   "counted": {k: delta(after[k], before[k]) for k in COUNTED if k in after},
                   "plan_note": after["plan_note"]}
            out.append(row)
            print(f"it {it}: {modes} forward {row['forward_s']:.2f} s, backward {row['backward_s']:.2f} s, "
                  f"step {row['step_s']:.2f} s, loss {row['loss']:.4f}; left plan at {row['left_plan_at']}", flush=True)
            print("   ", json.dumps(row["counted"], default=str)[:1500], flush=True)
            if prof is not None:
                ka = prof.key_averages()
                print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
                if torch.cuda.is_available():
                    print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        final = engine.stats()
    finally:
        engine.close()
    print("plan:", json.dumps(final.get("plan"), default=str))
    print("peaks:", final.get("gpu_peak_bytes_by_mode"), "arena", final.get("gpu_arena_bytes"))
    print("wrote", write_json("gpu_probe", {"args": vars(args), "iterations": out, "stats": final}))


if __name__ == "__main__":
    main()
