"""Data parallel over gloo ranks ([Note: data parallel over the process group]): per-rank tokens/s
for 1, 2 and 4 ranks beside the simulator's prediction, and the bytes each rank sends per
iteration beside the figure the ring all-reduce of its gradients gives.

Each row spawns W processes (gloo over loopback) that train the project's GPT (hidden 256,
4 layers, vocab 2048, fp32, 2 sequences of 64 tokens per rank per step, optimizer states on the
cpu, a gpu budget on the host stand-in that holds the model) for ``--steps`` steps, with
``torch.set_num_threads(max(1, cores // W))``; tokens/s is each rank's own tokens over the median
step after the first two. Anchors, from the same run:

- ``sim``: the simulator's iteration for the rank's own plan (the one its engine followed, on
  the ``dev-vm`` profile), whose ``states`` rows hold the all-reduce of the fp32 gradient sums
  and the all-gather of the updated share on the profile's network (``pagemem/sched/network.py``).
  The simulator models one GPU per rank: on this 2-core VM, W ranks share two cores, which it
  does not see;
- ``plan``: the network bytes per rank per iteration of that plan (``Plan.bytes_moved``), which
  the engine's count must equal but for its headers and flags;
- ``ring bytes``: ``2 (W - 1) / W`` x the fp32 gradient bytes, what a ring all-reduce of the
  gradients must send per rank, plus, with sharded moments ([Note: sharded moments]), ``W - 1``
  x the largest rank's share of the fp32 master weights (the ring all-gather after the update);
  ``sent``: what the engine counted, which adds each operation's header and the per-parameter
  flags the ranks agree on first (``tests/test_engine_ranks.py`` checks that count to the byte);
- each world size runs three times: states sharded (the default), replicas
  (``shard_optimizer_states=False``) and states and parameters sharded (``shard_parameters=True``:
  no compute copy at rest, each unit gathered when fetched, [Note: gathered units]), with the
  optimizer-state bytes and the compute copy's bytes at rest per rank and ``step()``'s time per
  rank. For the last the plan is a ``units`` one (each layer's move carries its all-gather, its
  gradient sums are reduce-scattered: the table's ``U`` rows), and its ring anchor is, per
  gather the engine made in the iteration, ``W - 1`` x the largest rank's share of that unit,
  and per unit, ``W - 1`` x that share of fp32 gradient (its reduce-scatter, [Note: sharded
  gradient sums]) instead of the all-reduce and the all-gather after the update;
- ``zero-3 plan``: the network bytes per rank the scheduler's ``params`` plan at this world size
  would send (all-gathers and reduce-scatters of page shards), which the engine does not run as
  such (``shard_parameters`` gathers and reduce-scatters each unit's element shares instead).

A second table measures what one gloo all-reduce costs by size (``COST``: each size reduced
``--calls`` times after a warm-up), from which ``BATCH_BYTES`` (``engine/ranks/collectives.py``)
was chosen: the batch where the per-call cost is about a tenth of a batch's time.

Usage: ``python benchmarks/bench_ranks.py [--steps N] [--worlds 1,2,4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, table, write_json

HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 256, 4, 2048, 64, 2

WORKER = r'''
import json, os, statistics, sys, time
import torch, torch.distributed as dist, pagemem
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.sched import HardwareProfile, simulate
rank, world, port, steps, shard = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
cfg = GPTConfig(layers=%(layers)d, hidden=%(hidden)d, heads=8, vocab=%(vocab)d, seq=%(seq)d)
torch.manual_seed(0)
model = GPT(cfg)
params = sum(p.numel() for p in model.parameters())
n_params = len(list(model.parameters()))
store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=64 << 20, cpu_bytes=512 << 20)
config = pagemem.EngineConfig(store=store, compute_dtype=torch.float32, adam_threads=max(1, (os.cpu_count() or 1) // world),
                              shard_optimizer_states=bool(shard), shard_parameters=shard == 2)
g = torch.Generator().manual_seed(rank)
seconds, sent, gathers = [], [], []
with pagemem.Engine(model, config) as engine:
    for step in range(steps):
        x = torch.randint(0, cfg.vocab, (%(batch)d, %(seq)d + 1), generator=g)
        before = engine.stats()["ranks"]["sent_bytes"]
        t0 = time.perf_counter()
        loss = engine(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - t0)
        sent.append(engine.stats()["ranks"]["sent_bytes"] - before)
        gathers.append(engine.stats()["ranks"]["unit_gathers"])
    stats = engine.stats()
    at_rest = sum(t.nbytes for layer in engine.bank.layers for t in layer.compute)  # compute copy between steps
    grad_at_rest = engine.bank.state_bytes()["grad"]
    # each unit's gather sends the largest rank's share of it (fp32 here) from every rank
    unit_gather = []
    if world > 1 and shard:
        shares = engine.bank.every_share()
        unit_gather = [max(sum(sh.owned(i) for i in layer.params) for sh in shares) * 4 for layer in engine.bank.layers]
    plan, trace = engine.pager.last_plan, engine.pager.last_trace
    sim = simulate(plan, trace, HardwareProfile.builtin("dev-vm")).iteration_time if plan is not None else None
    plan_network = plan.bytes_moved()["network"] if plan is not None else None
zero3 = None
if world > 1 and trace is not None:
    from pagemem.sched import plan as make_plan
    try:
        zero3 = make_plan(trace, {"gpu": 64 << 20, "cpu": 512 << 20, "nvme": 0}, world_size=world).bytes_moved()["network"]
    except Exception as exc:
        zero3 = repr(exc)
print(json.dumps({"rank": rank, "seconds": seconds, "sent": sent, "sim_seconds": sim, "params": params,
                  "n_params": n_params, "wait_seconds": stats["ranks"]["collective_wait_seconds"],
                  "collectives": stats["ranks"]["collectives"], "zero3_network_bytes": zero3,
                  "plan_network_bytes": plan_network, "compute_at_rest": at_rest, "grad_at_rest": grad_at_rest, "gathers": gathers,
                  "unit_gather_bytes": unit_gather,
                  "optimizer_state_bytes": stats["optimizer_state_bytes"], "moment_shares": stats["ranks"]["moment_shares"],
                  "step_seconds": stats["seconds"]["step"] / steps}))
if world > 1:
    dist.destroy_process_group()
''' % {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "seq": SEQ, "batch": BATCH}


COST = r'''
import json, sys, time, torch, torch.distributed as dist
rank, world, port, calls, _ = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
out = {}
for nbytes in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
    t = torch.ones(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    out[nbytes] = (time.perf_counter() - t0) / calls
print(json.dumps(out))
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, steps: int, script: str = WORKER, shard: int = 1) -> list[dict]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"r{r}.err"), "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), str(port), str(steps),
                                   str(shard)],
                                  stdout=subprocess.PIPE, stderr=logs[r], text=True, env=env) for r in range(world)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        for r, p in enumerate(procs):
            if p.returncode != 0:
                logs[r].seek(0)
                raise RuntimeError(f"rank {r} of {world} failed:\n{logs[r].read()[-3000:]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    from pagemem.sched import HardwareProfile

    hw = HardwareProfile.builtin("dev-vm")
    rows, out = [], []
    for world in [int(w) for w in args.worlds.split(",")]:
        for shard in ((1, 0, 2) if world > 1 else (0,)):  # states sharded, replicas, parameters sharded too
            ranks = run(world, args.steps, shard=shard)
            tokens = BATCH * SEQ
            for r in ranks:
                r["tokens_per_s"] = tokens / statistics.median(r["seconds"][2:] or r["seconds"])
                r["sent_per_iteration"] = statistics.median(r["sent"][2:] or r["sent"])
            r0 = ranks[0]
            # the anchor: the ring all-reduce of the gradients, and with sharded moments the
            # all-gather of the largest share of master weights ([Note: sharded moments])
            share = max(r0["moment_shares"]) if shard else 0
            ring = 2 * (world - 1) * 4 * r0["params"] // world
            if shard == 2:  # per unit: its gathers and one reduce-scatter, each of the largest share from each rank
                ring = (world - 1) * sum(r0["unit_gather_bytes"])  # fp32 model: the gradient share is the gather's size
                counts = [[0] * len(r0["unit_gather_bytes"])] + r0["gathers"]  # each unit's gathers so far, by step
                per_step = [[a - b for a, b in zip(now, then)] for then, now in zip(counts, counts[1:])][2:]
                ring += statistics.median((world - 1) * sum(g * n for g, n in zip(step, r0["unit_gather_bytes"]))
                                          for step in per_step)
                row_gathers = statistics.median(sum(step) for step in per_step)
            elif shard:
                ring += (world - 1) * 4 * share
            sim_s = r0["sim_seconds"]  # the plan's collectives are in it (the "states" and "units" rows)
            sim_tps = tokens / sim_s if sim_s else None
            mean_tps = statistics.mean(r["tokens_per_s"] for r in ranks)
            row = {"world_size": world, "sharded": ("replicas", "states", "params")[shard], "ranks": ranks,
                   "unit_gathers_per_iteration": row_gathers if shard == 2 else 0,
                   "compute_copy_bytes_at_rest": r0["compute_at_rest"], "per_rank_tokens_per_s": mean_tps,
                   "grad_sum_bytes_at_rest": r0["grad_at_rest"],
                   "sim_tokens_per_s": sim_tps, "sim_iteration_s": sim_s,
                   "ring_bytes_per_iteration": ring, "sent_bytes_per_iteration": r0["sent_per_iteration"],
                   "plan_network_bytes": r0["plan_network_bytes"],
                   "zero3_plan_network_bytes": r0["zero3_network_bytes"],
                   "optimizer_state_bytes_per_rank": r0["optimizer_state_bytes"],
                   "step_seconds_per_rank": statistics.mean(r["step_seconds"] for r in ranks)}
            out.append(row)
            mib = 1 << 20
            z3 = row["zero3_plan_network_bytes"]
            rows.append([world, ("replicas", "states", "states+params")[shard], f"{mean_tps:.0f}",
                         f"{sim_tps:.0f} ({mean_tps / sim_tps:.2f}x)" if sim_tps else "on demand",
                         f"{mean_tps * world:.0f}", f"{row['optimizer_state_bytes_per_rank'] / mib:.2f}",
                         f"{r0['compute_at_rest'] / mib:.2f}", f"{r0['grad_at_rest'] / mib:.2f}",
                         f"{row['step_seconds_per_rank'] * 1e3:.0f}",
                         f"{row['sent_bytes_per_iteration'] / mib:.2f}",
                         f"{r0['plan_network_bytes'] / mib:.2f}" if r0["plan_network_bytes"] is not None else "-",
                         f"{ring / mib:.2f}",
                         f"{z3 / mib:.2f}" if isinstance(z3, int) else "-",
                         f"{statistics.mean(r['wait_seconds'] for r in ranks) / args.steps * 1e3:.1f}"])
    print(table(["ranks", "sharded", "tokens/s per rank", "sim tokens/s (measured/sim)", "tokens/s all ranks",
                 "optimizer states MiB/rank", "compute copy at rest MiB/rank", "gradient sums MiB/rank", "step() ms", "sent MiB/iter", "plan MiB/iter", "ring MiB/iter",
                 "zero-3 plan MiB/iter",
                 "collective wait ms/iter"], rows,
                title=f"GPT h{HIDDEN} x{LAYERS} layers, vocab {VOCAB}, {BATCH}x{SEQ} tokens per rank per step, gloo "
                      f"on loopback, {os.cpu_count()} cores, {args.steps} steps"))
    cost_rows, costs = [], {}
    for world in [int(w) for w in args.worlds.split(",") if int(w) > 1]:
        per_call = {int(k): v for k, v in run(world, args.calls, COST)[0].items()}
        costs[world] = per_call
        for nbytes, sec in per_call.items():
            cost_rows.append([world, f"{nbytes >> 10} KiB", f"{sec * 1e3:.2f}", f"{nbytes / sec / 1e9:.2f}"])
    print(table(["ranks", "all-reduce size", "ms per call", "GB/s of buffer"], cost_rows,
                title=f"gloo all-reduce per call, {args.calls} calls per size (the engine batches {16} MiB)"))
    print("wrote", write_json("bench_ranks", {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "seq": SEQ,
                                              "batch": BATCH, "nvlink_bytes_per_s": hw.nvlink_bytes_per_s, "rows": out,
                                              "allreduce_seconds_per_call": costs}))


if __name__ == "__main__":
    main()
