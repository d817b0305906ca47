"""ANGEL-PTM §6.4 in simulation: GPT3-175B on 256 and 768 GPUs against Figure 7's throughput.

The paper trains GPT3-175B of Table 4 (70 layers, 112 heads, hidden 14336, FFN 57344) with data
parallelism and sharded parameters (§3.2) on 32 and 96 of its A100 servers (8 GPUs each, NVLink-3
inside, 16 x 12.5 GB/s RoCE between them, §6.1) and reports 11.68 and 36.46 samples/s (§6.4,
Figure 7's text), optimizer states in CPU memory (§6.1: only §6.5 uses SSDs). This benchmark
plans and simulates the same model on the ``a100-server`` profile, whose network has both
levels (``pagemem.sched.network``), with ``world_size`` 256 and 768: each rank holds a
``1 / world_size`` shard of every layer (checked below) and all-gathers the rest page by page.

Batch: the paper gives none for Figure 7, only that more GPUs let it "increase the global batch
size, which in turn fully utilizes the available GPU memory". So, as it says, the per-rank batch
is the largest that plans within a rank's 40 GB (one micro-batch per iteration, no gradient
accumulation), and the global batch is ``world_size`` times that. Sequence length 2048 (§2.2's
figure for GPT-3 175B), bf16 compute (§6.1), activation checkpointing per block (without it one
sample's activations reach 67 GB even with fused attention: over 40 GB). Budgets per rank: gpu
40 GB, cpu 1 TiB / 8 (Table 3: 32 x 32 GB per server). No shortcut: the whole model is traced,
planned and simulated (a few seconds each). Nothing is tuned to the paper's figures; the extra
rows show what moves them.
"""

from __future__ import annotations

import argparse
import time

from common import table, write_json

from pagemem.sched import HardwareProfile, InfeasiblePlan, plan, simulate, validate
from pagemem.sched.network import collective_time
from pagemem.sched.simulate import STREAMS
from pagemem.tracer import synthetic_transformer

MODEL = dict(layers=70, hidden=14336, ffn=57344, heads=112, seq=2048, dtype="bfloat16", checkpoint_activations=True)
PAPER = {256: 11.68, 768: 36.46}
"""Samples/s of ANGEL-PTM on GPT3-175B (§6.4, Figure 7's text): 32 and 96 servers."""
BUDGETS = {"gpu": "40GB", "cpu": str(2**40 // 8)}
PAGE = "4MiB"


def build(hw: HardwareProfile, batch: int):
    return synthetic_transformer(**MODEL, batch=batch, cost=hw.cost_model())


def largest_batch(hw: HardwareProfile, world: int, limit: int) -> int:
    best = 0
    for b in range(1, limit + 1):
        try:
            plan(build(hw, b), BUDGETS, world_size=world, optimizer_tier="cpu", page_bytes=PAGE)
        except InfeasiblePlan:
            break
        best = b
    if not best:
        raise SystemExit(f"not even a batch of 1 fits in 40 GB per GPU at world size {world}")
    return best


def check_shards(p, tr, world: int) -> dict:
    """Each rank's pages are a ``1 / world`` shard of each layer (``Layout.from_trace``)."""
    layers = {layer.index: layer.nbytes for layer in tr.layers}
    for lay in p.layout.layers:
        want = -(-layers[lay.index] // world)
        assert lay.shard_bytes == want, (lay.index, lay.shard_bytes, want)
        assert lay.param_pages == -(-want // p.page_bytes)
    total = sum(layers.values())
    per_rank = sum(lay.shard_bytes for lay in p.layout.layers)
    return {"model_param_bytes": total, "rank_param_bytes": per_rank, "rank_share": per_rank / total}


def run(hw: HardwareProfile, world: int, batch: int, check: bool = True) -> dict:
    t0 = time.perf_counter()
    tr = build(hw, batch)
    p = plan(tr, BUDGETS, world_size=world, optimizer_tier="cpu", page_bytes=PAGE)
    report = validate(p, tr) if check else None
    s = simulate(p, tr, hw)
    page = p.page_bytes
    out = {
        "world_size": world, "servers": -(-world // hw.ranks_per_server), "batch_per_rank": batch,
        "global_batch": world * batch, "iteration_s": s.iteration_time, "samples_per_s": world * batch / s.iteration_time,
        "steady": s.steady, "valid": report.ok if report else None, "gpu_idle": s.gpu_idle_fraction,
        "busy_s": dict(s.busy), "stalls_s": dict(s.stalls), "peak_bytes": dict(s.peak), "bytes_moved": p.bytes_moved(),
        "tasks": len(p.tasks), "cached_layers": len(p.cached_layers),
        "collective_per_page": {c: collective_time(hw, c, page, world)._asdict() for c in ("all_gather", "reduce_scatter")},
        "wall_s": time.perf_counter() - t0,
    }
    if check:
        out["shards"] = check_shards(p, tr, world)
    return out


def flat(hw: HardwareProfile) -> HardwareProfile:
    """The network before it had two levels: version 3's one 200 GB/s bus bandwidth everywhere
    (``a100-server``'s old ``network_bytes_per_s``), no latencies."""
    return hw.replace(name="a100-server, one-level network", nvlink_bytes_per_s=200e9, internode_bytes_per_s=200e9,
                      collective_latency_s=0.0, internode_latency_s=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="256,768", help="world sizes to run (default 256,768)")
    parser.add_argument("--batch", type=int, default=0, help="per-rank batch (default: the largest that fits)")
    parser.add_argument("--max_batch", type=int, default=16, help="largest per-rank batch tried (default 16)")
    args = parser.parse_args()
    hw = HardwareProfile.a100_server()
    worlds = [int(w) for w in args.worlds.split(",")]
    results, rows = {}, []
    for world in worlds:
        batch = args.batch or largest_batch(hw, world, args.max_batch)
        r = results[str(world)] = run(hw, world, batch)
        paper = PAPER.get(world)
        r["paper_samples_per_s"] = paper
        r["ratio"] = r["samples_per_s"] / paper if paper else None
        alg = r["collective_per_page"]["all_gather"]
        rows.append([world, r["servers"], f"{batch} / {r['global_batch']}", f"{r['iteration_s']:.2f}",
                     f"{r['samples_per_s']:.2f}", f"{paper:.2f}" if paper else "-",
                     f"{r['ratio']:.2f}" if paper else "-", f"{r['gpu_idle']:.1%}",
                     *(f"{r['busy_s'][s]:.2f}" for s in ("compute", "network", "h2d", "cpu")),
                     f"{alg['algorithm']} {alg['seconds'] * 1e3:.2f}"])
    params = results[str(worlds[0])]["shards"]["model_param_bytes"] // 2
    print(table(["GPUs", "servers", "batch / rank / global", "iteration s", "samples/s", "paper", "ratio",
                 "gpu idle", "compute s", "network s", "h2d s", "cpu s", "all_gather of a page (ms)"], rows,
                f"GPT3-175B of Table 4 ({params / 1e9:.1f}B parameters), seq {MODEL['seq']}, a100-server profile "
                f"(two-level network), optimizer states in CPU memory, synchronous updates, steady state"))
    if len(worlds) > 1:
        a, b = (results[str(w)] for w in worlds[:2])
        print(f"\nspeed-up {worlds[0]} -> {worlds[1]} GPUs: {b['samples_per_s'] / a['samples_per_s']:.2f}x "
              f"(paper: {PAPER[768] / PAPER[256]:.2f}x); every plan valid: "
              f"{all(r['valid'] for r in results.values())}; each rank holds "
              + ", ".join(f"{r['shards']['rank_share']:.5f}" for r in results.values())
              + " of the parameters (1/" + ", 1/".join(str(w) for w in worlds) + ")")

    # what the figures depend on: the network model, and the GPU's sustained rate
    sens_rows, sens = [], []
    variants = [("one-level network (version 3: 200 GB/s everywhere, no latency)", flat(hw)),
                ("NICs at half rate (100 GB/s per server)", hw.replace(internode_bytes_per_s=100e9)),
                ("40% of bf16 peak instead of 60% (125 TFLOP/s)", hw.replace(flops_per_s=0.4 * 312e12))]
    for what, variant in variants:
        for world in worlds:
            base = results[str(world)]
            r = run(variant, world, base["batch_per_rank"], check=False)
            paper = PAPER.get(world)
            sens.append({"change": what, "world_size": world, "samples_per_s": r["samples_per_s"],
                         "iteration_s": r["iteration_s"], "ratio": r["samples_per_s"] / paper if paper else None})
            sens_rows.append([what, world, f"{r['samples_per_s']:.2f}",
                              f"{r['samples_per_s'] / paper:.2f}" if paper else "-", f"{r['busy_s']['network']:.2f}"])
    print()
    print(table(["change to a100-server", "GPUs", "samples/s", "ratio to paper", "network s"], sens_rows,
                "sensitivity (same per-rank batch; one change at a time)"))
    path = write_json("bench_paper_scale", {
        "model": {**MODEL, "parameters": params, "budgets": BUDGETS, "page_bytes": PAGE, "optimizer_tier": "cpu"},
        "profile": hw.to_dict(), "paper_samples_per_s": {str(k): v for k, v in PAPER.items()},
        "results": results, "sensitivity": sens})
    print("wrote", path)


if __name__ == "__main__":
    main()
