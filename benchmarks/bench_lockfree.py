"""The lock-free updater: quality over 300 steps, and iteration time with the SSD the bottleneck.

**Convergence** (``--part convergence``): the project's GPT and a Hugging Face GPT-2 built from a
config (when ``transformers`` is installed), on a learnable synthetic task, 300 steps each,
optimizer states on nvme with the disk capped (``StoreConfig(nvme_bandwidth=)``) so that the
updating thread lags behind the compute. The default task, ``branching``, follows a fixed random
table of four successors per token (``x[i+1]`` one of ``table[:, x[i]]``), so its loss has a
floor, ln 4, as language has one; ``--task exact`` has one successor per token and can be learnt
to zero, where the last steps' loss is a few hundredths and moves by tens of percent with the
data order alone. For each of ``--seeds`` data orders, from the same initial weights: the
synchronous engine, the lock-free one (``max_staleness=None``, the paper's behaviour) with each
``staleness_correction`` (``"predict"``, the default, and ``"none"``), and the anchor for what
one step of staleness costs by itself: plain PyTorch whose gradients are computed at the
weights of one update ago. Goal: the lock-free runs' mean loss over their last 20 steps,
averaged over the data orders, within 2% of the synchronous runs'. The loss curves of data
order 0 are plotted (``results/bench_lockfree_loss.png``); the staleness each run saw is reported.

**Throughput** (``--part throughput``): one GPT, three engines: optimizer states in cpu memory
(synchronous: the anchor), on nvme synchronously, on nvme lock-free, the nvme tier capped so
that the synchronous nvme run takes at least twice the anchor's iteration, as on ANGEL-PTM's
A100 server (SSD about 10x slower than PCIe). Goals: lock-free <= 1.15x the anchor, synchronous
nvme >= 2x; beside each, the simulator's prediction (``sched/sim_lockfree.py``; goal: within 15%),
the lock-free rows charged the drain per update the run measured ([Note: the drain, simulated]).

Usage: ``python benchmarks/bench_lockfree.py [--part convergence|throughput|both] [--steps N] [--seeds N]
[--task branching|exact]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time

import torch
from bench_engine import median_durations, with_durations
from common import RESULTS, table, write_json

import pagemem
from pagemem.engine.updates.partition import CorePartition
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.sched import HardwareProfile, least_gpu_bytes, simulate
from pagemem.sched.sim_lockfree import simulate_lock_free
from pagemem.tracer import trace

PAGE = 64 * 1024
VOCAB, SEQ, BATCH = 256, 64, 8


TASKS = {"branching": 4, "exact": 1}
"""Successors per token: ``branching`` has a loss floor of ln 4 (as language has an entropy
floor), ``exact`` can be learnt to zero loss."""
TASK = "branching"
GPU_BACKEND = "host"
"""``--gpu_backend``: ``host`` (the stand-in) or ``cuda`` (a GPU session: benchmarks/GPU.md)."""
SEED_STRIDE = 1000
NEVER_WAITS = {"lock_free": True, "max_staleness": None, "synchronous_steps": 0}
"""The paper's lock-free updater (the engine's default before issue 33): never waits."""


def successor_table() -> torch.Tensor:
    """``[branches, VOCAB]``: each row a random permutation (the successors of every token)."""
    return torch.stack([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7 + j))
                        for j in range(TASKS[TASK])])


def batch(step: int, succ: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Batch ``step`` of data order ``seed``: sequences that follow the table, each next token one
    of its successors uniformly."""
    g = torch.Generator().manual_seed(10_000 + step + SEED_STRIDE * seed)
    x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for i in range(SEQ):
        j = torch.randint(0, succ.shape[0], (BATCH,), generator=g) if succ.shape[0] > 1 else 0
        x[:, i + 1] = succ[j, x[:, i]]
    return x


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=4, hidden=128, heads=4, vocab=VOCAB, seq=SEQ))


def gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def loss_of(run, x: torch.Tensor, hf: bool) -> torch.Tensor:
    if hf:
        return run(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    logits = run(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def config(make, hf: bool, tier: str, nvme: str, bandwidth: int | None, **kw) -> pagemem.EngineConfig:
    model = make()
    x = batch(0, successor_table())
    tr = trace(model, lambda: loss_of(model, x, hf).backward()).with_non_model_peak_reserved()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    gpu = -(-(least_gpu_bytes(tr, page_bytes=PAGE) + nbytes // 2 + (4 << 20)) // PAGE) * PAGE
    store = pagemem.StoreConfig(gpu_backend=GPU_BACKEND, page_bytes=PAGE, gpu_bytes=gpu, cpu_bytes=24 * nbytes + (64 << 20),
                                nvme_bytes=24 * nbytes + (64 << 20) if tier == "nvme" else 0,
                                nvme_path=nvme if tier == "nvme" else None, copy_threads=0,
                                nvme_bandwidth=bandwidth if tier == "nvme" else None)
    return pagemem.EngineConfig(store=store, optimizer_tier=tier, optimizer=pagemem.AdamW(lr=1e-3, weight_decay=0.01),
                                adam_threads=1, **kw)


def run(make, hf: bool, cfg: pagemem.EngineConfig, steps: int, seed: int = 0,
        partition: CorePartition | None = None) -> tuple[list[float], list[float], dict]:
    """Losses and iteration seconds of ``steps`` steps, and the engine's stats (with the plan and
    trace it followed, as ``stats["followed"]``). ``partition``: applied at the start and again
    after the first steps, when the engine has started its threads ([Note: a core partition])."""
    succ = successor_table()
    model = make()
    losses, seconds, cpu, updater = [], [], [], []
    with pagemem.Engine(model, cfg) as engine:
        lf = engine.lockfree
        for s in range(steps):
            if partition is not None and s in (0, 3):
                partition.apply()
            t0, c0, o0, q0 = time.perf_counter(), time.thread_time(), _engine_threads_cpu(), _runnable_s()
            w0, u0, b0 = (lf.waited_s, lf.updates, lf.writebacks) if lf is not None else (0.0, 0, 0)
            loss = loss_of(engine, batch(s, succ, seed), hf)
            engine.backward(loss)
            engine.step()
            seconds.append(time.perf_counter() - t0)
            cpu.append((time.thread_time() - c0, _engine_threads_cpu() - o0, _runnable_s() - q0))
            updater.append((lf.waited_s - w0, lf.updates - u0, lf.writebacks - b0) if lf is not None else (0.0, 0, 0))
            losses.append(loss.item())
        stats = engine.stats()
        # per iteration: the compute thread's cpu seconds, the engine threads', and the seconds the
        # compute thread was runnable but not running (waiting for a core: other processes' load)
        stats["cpu_s"] = cpu
        # per iteration: seconds the compute waited for the updating thread, the unit updates it
        # made and the units' states it wrote back (each read in again later; [Note: a fetch
        # serves the bound's updates])
        stats["updater_per_iteration"] = updater
        stats["units"] = len(engine.bank.layers)

        stats["followed"] = (engine.pager.last_plan, engine.pager.last_trace)
    return losses, seconds, stats


def _engine_threads_cpu() -> float:
    """CPU seconds the engine's threads (``pagemem-*``) have run so far (alive ones)."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("pagemem-") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # it ended meanwhile
                pass
    return total


def _runnable_s() -> float:
    """Seconds the calling thread has waited runnable for a core (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_ms(r, steps: int) -> dict:
    """Per iteration, over the last half (past the default's synchronous steps, whose waits for
    the whole update are not the steady state's): the compute thread's cpu ms, the engine
    threads' cpu ms, the compute thread's wall ms less its cpu ms (waiting: for the updater, the
    GIL, a core taken by another process; medians), the ms it waited for the updating thread and
    the unit updates and write-backs (means; each write-back is one unit's states out and, later,
    in again, so ``pass_fraction`` = write-backs / units is the share of a state pass the disk
    moves per iteration)."""
    half = r[2]["cpu_s"][steps // 2:]
    walls = r[1][steps // 2:]
    upd = r[2].get("updater_per_iteration", [])[steps // 2:]
    out = {"compute_cpu_ms": 1e3 * statistics.median(c for c, _, _ in half),
           "engine_threads_cpu_ms": 1e3 * statistics.median(o for _, o, _ in half),
           "compute_not_running_ms": 1e3 * statistics.median(w - c for w, (c, _, _) in zip(walls, half)),
           # of which runnable, waiting for a core (the machine's load), and blocked (the GIL, a lock,
           # the updating thread, the disk): what the load does not explain
           "compute_waiting_for_a_core_ms": 1e3 * statistics.median(q for _, _, q in half),
           "compute_blocked_ms": 1e3 * statistics.median(w - c - q for w, (c, _, q) in zip(walls, half)),
           "waited_for_updater_ms": 1e3 * statistics.mean(w for w, _, _ in upd) if upd else 0.0,
           "waited_for_updater_all_steps_ms": 1e3 * (r[2]["staleness"] or {}).get("waited_s", 0.0) / steps}
    if upd and r[2]["staleness"]:
        out["updates_per_iteration"] = statistics.mean(n for _, n, _ in upd)
        out["pass_fraction"] = statistics.mean(b for _, _, b in upd) / r[2]["units"]
    return out


def predict(stats: dict, make, bandwidth: int, partition: CorePartition | None = None,
            max_staleness: int | None = None, anchor: tuple[dict, float] | None = None,
            drain_seconds: float = 0.0) -> dict:
    """The simulator's iteration for the plan the engine followed, synchronous and lock-free, on
    the ``dev-vm`` profile with the disk at the capped bandwidth and op durations timed now
    (per op, the median of three traces of a copy of the model, on the compute's cores when
    partitioned). With ``partition``, only the compute and the stand-in's copies share a
    processor, and CPU Adam runs at the profile's rate per thread times the other cores.
    ``anchor``: the anchor run's stats and its measured seconds per iteration: its own plan is
    predicted too, and every row again with the ops' durations scaled so that the anchor's
    prediction is its measurement (``calibrated``: the engine's host work around each op on the
    compute thread, which a plain model's trace does not time; one factor, fitted on the anchor
    alone, so the other rows stay predictions). ``drain_seconds``: the lock-free rows' measured
    compute-side seconds per published update drained ([Note: the drain, simulated])."""
    plan_, engine_trace = stats["followed"]
    if plan_ is None:
        return {}
    succ = successor_table()
    timed = []
    for _ in range(3):
        twin = make()
        timed.append(trace(twin, lambda: loss_of(twin, batch(0, succ), False).backward()))
    durations = median_durations(timed)
    tr = with_durations(engine_trace, durations)
    hw = HardwareProfile.builtin("dev-vm")
    share = hw.ranks_per_server  # the profile's nvme rates are the server's
    hw = dataclasses.replace(hw, nvme_read_bytes_per_s=bandwidth * share, nvme_write_bytes_per_s=bandwidth * share)
    if partition is not None:
        measured_threads = 2  # dev-vm.json's cpu_adam: "2 threads"
        hw = dataclasses.replace(hw, shared_processor=("compute", "h2d", "d2h"),
                                 cpu_adam_elements_per_s=hw.cpu_adam_elements_per_s * len(partition.others)
                                 / measured_threads)

    def rows(profile: HardwareProfile) -> dict:
        sync = simulate(plan_, tr, profile)
        free = simulate_lock_free(plan_, tr, profile, max_staleness, drain_seconds=drain_seconds)
        never = simulate_lock_free(plan_, tr, profile, drain_seconds=drain_seconds)
        return {"ms_sync": 1e3 * sync.iteration_time, "ms_lock_free": 1e3 * free.iteration_time,
                "ms_never_waits": 1e3 * never.iteration_time,
                "ms_update_pass": 1e3 * free.update_pass_time, "staleness": free.staleness,
                "pass_busy_ms": {k: 1e3 * v for k, v in free.pass_busy.items()}}

    out = rows(hw)
    out["drain_ms_per_update"] = 1e3 * drain_seconds
    if anchor is not None and anchor[0]["followed"][0] is not None:
        a_plan, a_trace = anchor[0]["followed"]
        a_tr = with_durations(a_trace, durations)
        predicted = simulate(a_plan, a_tr, hw).iteration_time
        scale = anchor[1] / predicted
        calibrated_hw = dataclasses.replace(hw, compute_scale=hw.compute_scale * scale)
        out["ms_anchor"] = 1e3 * predicted
        out["calibrated"] = {"compute_scale": scale,
                             "ms_anchor": 1e3 * simulate(a_plan, a_tr, calibrated_hw).iteration_time,
                             **rows(calibrated_hw)}
    return out


def drain_per_update(r) -> float:
    """A lock-free run's compute-side seconds per published update it drained (the engine's own
    count, ``stats()["staleness"]``: [Note: the drain, simulated])."""
    st = r[2]["staleness"] or {}
    return st.get("drain_s", 0.0) / st["drained"] if st.get("drained") else 0.0


def state_bytes(make) -> int:
    return 12 * sum(p.numel() for p in make().parameters())


def delayed(make, hf: bool, steps: int, delay: int, seed: int = 0) -> list[float]:
    """Plain PyTorch (fused AdamW, the same hyperparameters) whose gradients are computed at the
    weights of ``delay`` updates ago: the anchor for what a fixed staleness costs by itself."""
    succ = successor_table()
    model, stale = make(), make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    history = [copy.deepcopy(model.state_dict())]
    losses = []
    for s in range(steps):
        stale.load_state_dict(history[max(0, len(history) - 1 - delay)])
        loss = loss_of(stale, batch(s, succ, seed), hf)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad, q.grad = q.grad, None
        opt.step()
        opt.zero_grad()
        history = (history + [copy.deepcopy(model.state_dict())])[-(delay + 1):]
    return losses


def convergence(steps: int, bandwidth_factor: float, seeds: int) -> dict:
    """Per model and data order: the synchronous engine, the lock-free one with each staleness
    correction, and plain PyTorch one step late; tails averaged over the data orders."""
    out = {}
    models = [("gpt", gpt, False)]
    try:
        import transformers  # noqa: F401
        models.append(("hf-gpt2", gpt2, True))
    except ImportError:
        pass
    for name, make, hf in models:
        runs: dict[str, list] = {"sync": [], "predict": [], "none": [], "plain_late": []}
        with tempfile.TemporaryDirectory() as nvme:
            probe = run(make, hf, config(make, hf, "cpu", nvme, None), 8)[1]
            # the disk moves the states in and out in bandwidth_factor x a cpu-states iteration
            bandwidth = int(2 * state_bytes(make) / (bandwidth_factor * statistics.median(probe[3:])))
            for seed in range(seeds):
                runs["sync"].append(run(make, hf, config(make, hf, "nvme", nvme, bandwidth), steps, seed))
                for correction in ("predict", "none"):
                    runs[correction].append(run(make, hf, config(make, hf, "nvme", nvme, bandwidth, **NEVER_WAITS,
                                                                 staleness_correction=correction), steps, seed))
                runs["plain_late"].append((delayed(make, hf, steps, 1, seed), [], {}))
        tails = {k: [statistics.mean(r[0][-20:]) for r in v] for k, v in runs.items()}
        mean = {k: statistics.mean(v) for k, v in tails.items()}
        out[name] = {"bandwidth_bytes_per_s": bandwidth, "tails": tails, "tail_mean": mean,
                     "tail_ratio": {k: mean[k] / mean["sync"] for k in mean},
                     "losses": {k: runs[k][0][0] for k in runs},
                     "staleness": {k: [r[2]["staleness"] for r in runs[k]] for k in ("predict", "none")},
                     "ms": {k: 1e3 * statistics.median(runs[k][0][1][5:]) for k in ("sync", "predict", "none")}}
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot(r["losses"]["sync"], label="synchronous", lw=1)
        for k in ("predict", "none"):
            st = r["staleness"][k][0]
            ax.plot(r["losses"][k], label=f"lock-free, staleness_correction={k!r} (staleness mean {st['mean']:.2f}, "
                                          f"max {st['max']})", lw=1)
        ax.plot(r["losses"]["plain_late"], label="plain PyTorch, one step late", lw=1, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"{name}, {TASK} task, data order 0\ntail x sync over {len(r['tails']['sync'])} orders: "
                     f"predict {r['tail_ratio']['predict']:.4f}, none {r['tail_ratio']['none']:.4f}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def throughput(steps: int, bandwidth_factor: float, partition: CorePartition | None = None,
               lock_free: dict | None = None) -> dict:
    """The three rows, each with ``partition`` ([Note: a core partition]); ``lock_free``: the
    lock-free row's knobs (default: the engine's defaults)."""
    make = gpt
    lock_free = {"lock_free": True, **(lock_free or {})}
    with tempfile.TemporaryDirectory() as nvme:
        anchor_run = run(make, False, config(make, False, "cpu", nvme, None), steps, partition=partition)
        anchor = anchor_run[1]
        t_anchor = statistics.median(anchor[steps // 2:])  # the last half: past the default's synchronous steps
        bandwidth = int(2 * state_bytes(make) / (bandwidth_factor * t_anchor))
        sync = run(make, False, config(make, False, "nvme", nvme, bandwidth), steps, partition=partition)
        free_cfg = config(make, False, "nvme", nvme, bandwidth, **lock_free)
        free = run(make, False, free_cfg, steps, partition=partition)
        never = run(make, False, config(make, False, "nvme", nvme, bandwidth, **NEVER_WAITS), steps,
                    partition=partition)
    t_sync, t_free, t_never = (statistics.median(r[1][steps // 2:]) for r in (sync, free, never))
    return {"partition": None if partition is None else {"compute": sorted(partition.compute),
                                                         "others": sorted(partition.others)},
            "lock_free_knobs": lock_free, "load_average": os.getloadavg(),
            "bandwidth_bytes_per_s": bandwidth, "ms_anchor_cpu_states": 1e3 * t_anchor,
            "ms_sync_nvme": 1e3 * t_sync, "ms_lock_free_nvme": 1e3 * t_free,
            "ratio_sync_nvme": t_sync / t_anchor, "ratio_lock_free_nvme": t_free / t_anchor,
            "staleness": free[2]["staleness"],
            "predicted": predict(free[2], make, bandwidth, partition, free_cfg.effective_max_staleness,
                                 anchor=(anchor_run[2], t_anchor), drain_seconds=drain_per_update(free)),
            "ms_never_waits_nvme": 1e3 * t_never, "ratio_never_waits_nvme": t_never / t_anchor,
            "staleness_never_waits": never[2]["staleness"],
            "cpu": {k: cpu_ms(r, steps) for k, r in (("anchor", anchor_run), ("sync_nvme", sync), ("lock_free", free),
                                                     ("never_waits", never))}}


def main() -> None:
    global TASK, GPU_BACKEND
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="both", choices=["convergence", "throughput", "both"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3, help="data orders the convergence tails are averaged over")
    ap.add_argument("--task", default=TASK, choices=sorted(TASKS))
    ap.add_argument("--gpu_backend", default=GPU_BACKEND, choices=["host", "cuda"])
    ap.add_argument("--throughput-steps", type=int, default=60, help="each row's median is over the last half")
    ap.add_argument("--compute-cores", type=int, default=None,
                    help="throughput: cores for the compute, the rest for the updater and I/O (default: half); 0: "
                         "no partition ([Note: a core partition])")
    ap.add_argument("--bandwidth-factor", type=float, default=2.0,
                    help="the capped disk moves the optimizer states in and out in this many anchor iterations")
    args = ap.parse_args()
    TASK, GPU_BACKEND = args.task, args.gpu_backend
    suffix = "" if TASK == "branching" else f"_{TASK}"  # the exact task's figures go beside, not over
    payload: dict = {"steps": args.steps, "bandwidth_factor": args.bandwidth_factor, "task": TASK, "seeds": args.seeds}
    earlier = os.path.join(RESULTS, f"bench_lockfree{suffix}.json")
    if args.part != "both" and os.path.exists(earlier):  # one part run: the other part's figures stay
        with open(earlier) as f:
            kept = json.load(f)
        payload = {**kept, **{k: v for k, v in payload.items() if args.part == "convergence"
                              or k not in ("steps", "seeds", "task")}}
    if args.part in ("convergence", "both"):
        conv = convergence(args.steps, args.bandwidth_factor, args.seeds)
        payload["convergence"] = conv
        os.makedirs(RESULTS, exist_ok=True)
        plot(conv, os.path.join(RESULTS, f"bench_lockfree{suffix}_loss.png"))
        rows = []
        for n, r in conv.items():
            for k, label in (("sync", "synchronous"), ("predict", "lock-free, predict"), ("none", "lock-free, none"),
                             ("plain_late", "plain PyTorch, 1 step late")):
                ratio = r["tail_ratio"][k]
                st = r["staleness"].get(k)
                rows.append([n, label, " ".join(f"{t:.4f}" for t in r["tails"][k]), f"{r['tail_mean'][k]:.4f}",
                             f"{ratio:.4f}", ("met" if abs(ratio - 1) <= 0.02 else "NOT met") if k in ("predict", "none")
                             else "", " ".join(f"{x['mean']:.2f}/{x['max']}" for x in st) if st else "",
                             f"{r['ms'][k]:.0f}" if k in r["ms"] else ""])
        print(table(["model", "run", "tail per data order", "mean tail", "x sync", "goal <= 1.02",
                     "staleness mean/max", "ms/it"], rows,
                    title=f"convergence, {TASK} task, {args.steps} steps, {args.seeds} data orders, states on nvme "
                          f"capped at {args.bandwidth_factor}x an anchor iteration per state pass"))
    if args.part in ("throughput", "both"):
        part = None if args.compute_cores == 0 else CorePartition.split(args.compute_cores)
        t = throughput(args.throughput_steps, args.bandwidth_factor, part)
        payload["throughput"] = t
        pr = t["predicted"]

        def err(predicted, measured):
            return f"{predicted:.0f} ({100 * (predicted / measured - 1):+.0f}%)" if predicted else "-"

        c = t["cpu"]
        cal = pr.get("calibrated", {})
        rows = [["states on cpu (anchor)", t["ms_anchor_cpu_states"], 1.0, "", pr.get("ms_anchor"),
                 cal.get("ms_anchor"), c["anchor"]],
                ["states on nvme, synchronous", t["ms_sync_nvme"], t["ratio_sync_nvme"],
                 ">= 2: " + ("met" if t["ratio_sync_nvme"] >= 2 else "NOT met"), pr.get("ms_sync"), cal.get("ms_sync"),
                 c["sync_nvme"]],
                ["states on nvme, lock-free (default)", t["ms_lock_free_nvme"], t["ratio_lock_free_nvme"],
                 "<= 1.15: " + ("met" if t["ratio_lock_free_nvme"] <= 1.15 else "NOT met"), pr.get("ms_lock_free"),
                 cal.get("ms_lock_free"), c["lock_free"]],
                ["states on nvme, lock-free, never waits", t["ms_never_waits_nvme"], t["ratio_never_waits_nvme"], "",
                 pr.get("ms_never_waits"), cal.get("ms_never_waits"), c["never_waits"]]]
        print(table(["engine", "ms / iteration", "x anchor", "goal", "simulator ms (error)",
                     f"simulator, ops x{cal.get('compute_scale', 1.0):.2f} (fitted on the anchor)", "compute cpu ms",
                     "engine threads cpu ms", "compute not running ms", "of which blocked ms", "waited for updater ms",
                     "state passes / it"],
                    [[name, f"{ms:.0f}", f"{x:.2f}", goal, err(p, ms), err(q, ms), f"{u['compute_cpu_ms']:.0f}",
                      f"{u['engine_threads_cpu_ms']:.0f}", f"{u['compute_not_running_ms']:.0f}",
                      f"{u['compute_blocked_ms']:.0f}",
                      f"{u['waited_for_updater_ms']:.1f}",
                      f"{u['pass_fraction']:.2f}" if "pass_fraction" in u else ""]
                     for name, ms, x, goal, p, q, u in rows],
                    title=f"throughput, partition {t['partition']}, load average {t['load_average'][0]:.1f} "
                          f"(nvme capped at {t['bandwidth_bytes_per_s'] / 2**20:.1f} MiB/s; "
                          f"lock-free staleness mean {t['staleness']['mean']:.2f}, max {t['staleness']['max']}, "
                          f"predicted {pr.get('staleness', 0):.2f}; drain {pr.get('drain_ms_per_update', 0):.2f} ms "
                          f"per update, measured; simulator goal: within 15%)"))
    print("wrote", write_json(f"bench_lockfree{suffix}", payload))


if __name__ == "__main__":
    main()
