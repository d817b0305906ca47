"""Engine throughput: training the project's GPT through ``pagemem.Engine`` against plain PyTorch.

Rows (same GPT 6L h512, batch 2 x seq 128, fp32; on the CPU, where the ``gpu`` tier is the host
stand-in, or on CUDA when present (not yet run there). Every engine row has its own anchor
measured in the same run, iterations interleaved engine / plain so both see the same load):

Every gpu budget covers the engine's pages *and* the non-model memory (activations, autograd's
gradients), as on a real GPU:

- ``fits``: what plain PyTorch keeps on its gpu (16 bytes per parameter: weights, gradients, two
  moments) plus the activations, optimizer states on the ``gpu`` tier too: in fp32 the engine's
  parameters are then views of its master pages (``ParamBank.compute_is_master``), so it holds
  what plain PyTorch holds. Goal: engine iterations/s >= 0.9x plain PyTorch
  (``torch.optim.AdamW(fused=True)``).
- ``4x cpu``: gpu budget = model states (params + grads + fp32 master + 2 moments = 20 bytes per
  parameter) / 4, at least the least the scheduler accepts; optimizer states on ``cpu``.
- ``4x nvme``: the same budget, optimizer states on ``nvme`` (a temporary directory).

An iteration is forward + backward + optimizer step; after warm-up the median of N is reported
(and tokens/s). Beside each engine row: what the engine's ``stats()`` says per iteration (units
staged by the plan, missed, fetched on demand; evictions; time waited for pages; the measured gpu
peak, pages plus non-model bytes, against the budget; bytes moved; seconds per phase), and the
simulator's prediction for that row: **the plan the engine followed**, simulated on the
``dev-vm`` profile with the op durations of traces of a third copy of the model (forward +
backward, one after each timed pair of iterations so they see the same load; per op, the median
over those traces; the engine's own warm-up durations include its demand paging). Goal: within 15% of the
measured engine iteration. Neither number is adjusted to the other: the profile's
``window_host_seconds`` (the executor's host time per moved window) was measured by ``pagemem
profile`` on another model, not in this run. A last block splits the
engine's extra time over plain PyTorch by phase, beside what the simulator assumes is exposed.
Every iteration also checks that the engine's loss equals plain PyTorch's bit for bit (fp32).

Store copies between host-memory arenas run inline on the host stand-in (``--copy-threads 0``):
its "gpu" and its copies share the same two cores, so a copy thread buys no overlap and only
contends with compute (one run: the 4x cpu row took 304 ms inline, 338 ms with 2 copy threads),
and the simulator's ``shared_processor`` assumes exactly that: one at a time.

Usage: ``python benchmarks/bench_engine.py [--iters N] [--rows fits,cpu,nvme] [--copy-threads N]
[--engine-option k=v]``.
``--engine-option`` passes extra ``EngineConfig`` fields (e.g. an executor mode, once the engine
has one); the engine's ``stats()["iterations"]`` (traced, planned, left_plan, demand) is reported.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import shutil
import statistics
import tempfile
import time

import torch
from common import table, write_json

import pagemem
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.sched import HardwareProfile, least_gpu_bytes, simulate, validate
from pagemem.tracer import trace

PAGE = 4 << 20
STATE_BYTES_PER_PARAM = 20  # fp32: compute copy 4 + gradient 4 + master 4 + exp_avg 4 + exp_avg_sq 4
ALIGN = 256  # the store lays tensors of one group back to back, 256-byte aligned
GOAL_FITS = 0.9
GOAL_SIM = 0.15


# ---------------------------------------------------------------------------------- sizes


def layer_param_bytes(model: torch.nn.Module) -> list[tuple[str, int]]:
    """Bytes of each module's own parameters (a tied parameter counted once, at its first
    owner); with each on fresh pages they bound the engine's gpu footprint from above."""
    seen, out = set(), []
    for name, module in model.named_modules():
        nbytes = 0
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                nbytes += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        if nbytes:
            out.append((name, nbytes))
    return out


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


# ---------------------------------------------------------------------------------- one row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def iterate_engine(engine, idx, tgt) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()
    sync()
    return time.perf_counter() - t0, loss.item()


def iterate_plain(model, opt, idx, tgt, phases: dict[str, list[float]] | None = None,
                  max_grad_norm: float | None = None) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = model(idx, tgt)
    sync()
    t1 = time.perf_counter()
    loss.backward()
    sync()
    t2 = time.perf_counter()
    if max_grad_norm is not None:  # the same arithmetic as the engine's clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    t3 = time.perf_counter()
    if phases is not None:
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            phases[k].append(v)
    return t3 - t0, loss.item()


def stats_delta(after: dict, before: dict, n: int) -> dict:
    """Per-iteration averages of the engine's cumulative counters between two stats() calls."""
    moved = {k: (v - before["moved_bytes"].get(k, 0)) / n for k, v in after["moved_bytes"].items()}
    return {
        "moved_bytes": {k: v for k, v in moved.items() if v},
        "seconds": {k: (v - before["seconds"].get(k, 0.0)) / n for k, v in after["seconds"].items()},
        "fetches": (after["fetches"] - before["fetches"]) / n,
        "prefetches": (after["prefetches"] - before["prefetches"]) / n,
        "misses": (after["misses"] - before["misses"]) / n,
        "gpu_wait_s": (after["gpu_wait_seconds"] - before["gpu_wait_seconds"]) / n,
        "evictions": (after["evictions"] - before["evictions"]) / n,
        "view_copies": (after.get("view_copies", 0) - before.get("view_copies", 0)) / n,
        "executor_s": (after["executor_seconds"] - before["executor_seconds"]) / n,
        "executor_releases": (after["executor_releases"] - before["executor_releases"]) / n,
    }


def median_durations(traces):
    """The first trace with each op's duration (and cpu / gpu time) the median of that op's over
    all ``traces`` (same model and batch: the same ops). On a noisy VM one trace's total moved by
    up to 50% between rows of a run; per-op medians over the row's traces are far steadier."""
    first = traces[0]
    if any(len(t.ops) != len(first.ops) for t in traces):
        raise ValueError("the timing traces number different ops")

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    ops = tuple(dataclasses.replace(o, duration=med([t.ops[k].duration for t in traces]),
                                    cpu_time=med([t.ops[k].cpu_time for t in traces]),
                                    gpu_time=med([t.ops[k].gpu_time for t in traces]))
                for k, o in enumerate(first.ops))
    return dataclasses.replace(first, ops=ops)


def with_durations(engine_trace, timed):
    """The engine's own trace (its units, the access order its plan was made for) with the op
    durations of ``timed``, a trace of the same model and batch taken under this run's load (the
    engine's warm-up durations include its demand paging). Both number the same ops."""
    if [(o.event, o.module) for o in engine_trace.ops] != [(o.event, o.module) for o in timed.ops]:
        raise ValueError("the engine's trace and the timing trace number different ops")
    ops = tuple(dataclasses.replace(o, duration=t.duration, cpu_time=t.cpu_time, gpu_time=t.gpu_time)
                for o, t in zip(engine_trace.ops, timed.ops))
    return dataclasses.replace(engine_trace, ops=ops)


def predict(engine_plan, engine_trace, timed, hw: HardwareProfile) -> dict:
    """Simulate the plan the engine followed, with this run's op durations."""
    if engine_plan is None:
        return {"infeasible": "the engine made no plan (see its plan_note)"}
    tr = with_durations(engine_trace, timed)
    s = simulate(engine_plan, tr, hw)
    windows = sum(t.operation == "release" and t.target.kind == "param" for t in engine_plan.tasks)
    return {
        "executor_windows": windows, "executor_s": windows * hw.window_host_seconds,
        "budgets": engine_plan.budgets.as_dict(), "valid": validate(engine_plan, tr).ok,
        "iteration_s": s.iteration_time, "steady": s.steady,
        "gpu_idle": s.gpu_idle_fraction, "busy_s": dict(s.busy), "stalls_s": dict(s.stalls),
        "plan_bytes_moved": engine_plan.bytes_moved(), "plan_counts": dict(engine_plan.counts()),
        "cached_layers": len(engine_plan.cached_layers), "min_gpu_bytes": engine_plan.min_gpu_bytes,
    }


def proc_io() -> dict[str, int]:
    """This process's bytes read from and written to storage (Linux ``/proc/self/io``; {} elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            pairs = (line.split(":") for line in f)
            return {k.strip(): int(v) for k, v in pairs if k.strip() in ("read_bytes", "write_bytes")}
    except OSError:
        return {}


def run_row(name: str, cfg: GPTConfig, state: dict, idx, tgt, row: dict, args, extra: dict) -> dict:
    """Time ``args.iters`` engine and plain iterations, interleaved, and trace a third copy of the
    model (forward + backward, no step: it is never updated) between them, so that the trace the
    prediction is made from sees the same machine load as the measurement."""
    torch.manual_seed(0)
    plain = GPT(cfg)
    plain.load_state_dict(state)
    eng_model = copy.deepcopy(plain)  # on the cpu: the engine puts its parameters on its gpu tier
    traced_model = copy.deepcopy(plain).to(idx.device)
    plain.to(idx.device)
    hp = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(plain.parameters(), **hp, fused=True)
    nvme_dir = tempfile.mkdtemp(prefix="bench_engine_") if row["nvme_bytes"] else None
    store = pagemem.StoreConfig(page_bytes=PAGE, gpu_bytes=row["gpu_bytes"], cpu_bytes=row["cpu_bytes"],
                                nvme_bytes=row["nvme_bytes"], nvme_path=nvme_dir, copy_threads=args.copy_threads)
    ecfg = pagemem.EngineConfig(**{"store": store, "optimizer": pagemem.AdamW(**hp),
                                   "optimizer_tier": row["optimizer_tier"], "compute_dtype": torch.float32, **extra})

    def fwd_bwd() -> None:
        traced_model(idx, tgt).backward()

    t_build = time.perf_counter()
    engine = pagemem.Engine(eng_model, ecfg)
    t_build = time.perf_counter() - t_build
    traces = []
    try:
        e_times, p_times, same = [], [], []
        p_phase: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
        for _ in range(args.warmup):
            _, le = iterate_engine(engine, idx, tgt)
            _, lp = iterate_plain(plain, opt, idx, tgt, max_grad_norm=extra.get('max_grad_norm'))
            same.append(le == lp)
            fwd_bwd()
            traced_model.zero_grad(set_to_none=True)
        before, io0, moves0 = engine.stats(), proc_io(), engine.store.stats().moves
        e_io = {"read_bytes": 0, "write_bytes": 0}
        for i in range(args.iters):
            # alternate which goes first, so neither always follows the other's cache footprint
            if i % 2:
                tp, lp = iterate_plain(plain, opt, idx, tgt, p_phase, extra.get('max_grad_norm'))
            a = proc_io()
            te, le = iterate_engine(engine, idx, tgt)
            b = proc_io()
            for k in e_io:
                e_io[k] += b.get(k, 0) - a.get(k, 0)
            if not i % 2:
                tp, lp = iterate_plain(plain, opt, idx, tgt, p_phase, extra.get('max_grad_norm'))
            e_times.append(te)
            p_times.append(tp)
            same.append(le == lp)
            # a trace after every timed pair (as the engine traces: its optimizer model), per-op
            # medians over them (median_durations)
            traces.append(trace(traced_model, fwd_bwd, options=engine.pager.trace_options))
            traced_model.zero_grad(set_to_none=True)
        after = engine.stats()
        engine_plan, engine_trace = engine.pager.last_plan, engine.pager.last_trace
        moves1 = engine.store.stats().moves
        move_s = {k: (m.seconds - (moves0[k].seconds if k in moves0 else 0.0)) / args.iters
                  for k, m in moves1.items()}
        store_moves = {k: {"bytes": m.bytes, "seconds": m.seconds} for k, m in moves1.items()}
    finally:
        engine.close()
        if nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    n = args.iters
    tokens = idx.numel()
    me, mp = statistics.median(e_times), statistics.median(p_times)
    tr = median_durations(traces)
    per_it = stats_delta(after, before, n)
    per_it["disk_bytes"] = {k: v / n for k, v in e_io.items()} if io0 else {}
    per_it["move_seconds"] = {k: v for k, v in move_s.items() if v}
    return {
        "row": name, **row, "engine_build_s": t_build,
        "mode": after["mode"], "iterations": after["iterations"],
        "engine_s": e_times, "plain_s": p_times, "median_engine_s": me, "median_plain_s": mp,
        "engine_it_per_s": 1 / me, "plain_it_per_s": 1 / mp, "ratio": mp / me,
        "engine_tokens_per_s": tokens / me, "plain_tokens_per_s": tokens / mp,
        "plain_phase_s": {k: statistics.fmean(v) for k, v in p_phase.items()},
        "plain_phase_median_s": {k: statistics.median(v) for k, v in p_phase.items()},
        "same_losses": all(same), "loss_matches": sum(same), "loss_checks": len(same),
        "per_iteration": per_it, "stats_end": after, "store_moves_total": store_moves,
        "trace_fwd_bwd_s": [fwd_bwd_seconds(t) for t in traces], "_trace": tr,
        "_engine_plan": engine_plan, "_engine_trace": engine_trace,
    }


def engine_least(cfg: GPTConfig, state: dict, idx, tgt, gpu_bytes: int, n_params: int) -> int:
    """The least gpu budget the scheduler accepts for the trace an engine with ``gpu_bytes``
    records in its warm-up (its units, its non-model bytes), the non-model peak reserved."""
    model = GPT(cfg)
    model.load_state_dict(state)
    store = pagemem.StoreConfig(page_bytes=PAGE, gpu_bytes=max(gpu_bytes, PAGE), cpu_bytes=64 * n_params + (64 << 20))
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, compute_dtype=torch.float32)) as engine:
        engine.backward(engine(idx, tgt))
        tr = engine.pager.last_trace
    return least_gpu_bytes(tr.with_non_model_peak_reserved(), page_bytes=PAGE)


def fwd_bwd_seconds(tr) -> float:
    return sum(o.duration for o in tr.ops if o.phase != "step")


# ---------------------------------------------------------------------------------- main


def parse_options(items: list[str]) -> dict:
    fields = {f.name: f for f in dataclasses.fields(pagemem.EngineConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--engine-option {key}: EngineConfig has no such field ({', '.join(fields)})")
        if value.startswith("torch.") and isinstance(getattr(torch, value[6:], None), torch.dtype):
            out[key] = getattr(torch, value[6:])
            continue
        try:
            out[key] = ast.literal_eval(value)  # numbers, None, True, tuples, quoted strings
        except (ValueError, SyntaxError):
            out[key] = value  # a bare string (e.g. a mode name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8, help="timed iterations per row (median reported)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rows", default="fits,cpu,nvme", help="which rows: fits, cpu (4x, cpu states), nvme")
    ap.add_argument("--profile", default="dev-vm", help="hardware profile for the simulator")
    ap.add_argument("--copy-threads", type=int, default=None,
                    help="StoreConfig.copy_threads (default: 0, inline, on the host stand-in, whose copies share "
                         "the compute's cores; 2 with CUDA)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                    help="extra EngineConfig field (repeatable), e.g. an executor mode")
    args = ap.parse_args()
    if args.copy_threads is None:
        args.copy_threads = 2 if torch.cuda.is_available() else 0
    extra = parse_options(args.engine_option)
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}

    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq)
    torch.manual_seed(0)
    base = GPT(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    n_params = sum(p.numel() for p in base.parameters())
    layers = layer_param_bytes(base)
    del base
    g = torch.Generator().manual_seed(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the gpu tier's device (host stand-in without CUDA)
    idx = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=g).to(device)
    tgt = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=g).to(device)

    param_bytes = 4 * n_params
    states_bytes = STATE_BYTES_PER_PARAM * n_params
    footprint_pages = sum(pages(b) for _, b in layers)  # the engine's gpu pages with every layer resident
    largest = max(layers, key=lambda x: x[1])
    # the gpu budget covers pages and non-model memory (activations, autograd's gradients): the
    # least the scheduler accepts for this model and batch, over the engine's own units at the 4x
    # budget (its units follow its budget): the trace of one warm-up iteration of an engine, with
    # the non-model peak reserved at every op, as the engine plans (its arena and the allocator
    # are two pools)
    least = engine_least(cfg, state, idx, tgt, states_bytes // 4 // PAGE * PAGE, n_params)
    # fits: what plain PyTorch keeps on its gpu (parameters, gradients, two fp32 moments: 16 B per
    # parameter) plus the activations; every state stays on the gpu (fp32: the parameters are
    # views of the master pages), with a page of slack per unit
    fits_gpu = pages(least + 16 * n_params + (footprint_pages + len(layers)) * PAGE) * PAGE
    small_gpu = max(states_bytes // 4 // PAGE, pages(least)) * PAGE
    # cpu: compute copies + gradients (each per layer on fresh pages) + optimizer states, room to spare
    cpu_bytes = (2 * footprint_pages * PAGE + pages(12 * n_params) * PAGE) * 2
    nvme_bytes = pages(12 * n_params) * PAGE * 2
    row_specs = {
        "fits": ("fits (gpu = plain's need)", dict(gpu_bytes=fits_gpu, cpu_bytes=cpu_bytes, nvme_bytes=0,
                                                      optimizer_tier="gpu")),
        "cpu": ("4x, optimizer on cpu", dict(gpu_bytes=small_gpu, cpu_bytes=cpu_bytes, nvme_bytes=0,
                                             optimizer_tier="cpu")),
        "nvme": ("4x, optimizer on nvme", dict(gpu_bytes=small_gpu, cpu_bytes=cpu_bytes, nvme_bytes=nvme_bytes,
                                               optimizer_tier="nvme")),
    }

    print(f"GPT {cfg.layers}L h{cfg.hidden} vocab {cfg.vocab}, batch {args.batch} x seq {args.seq}, fp32 on {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, copy_threads {args.copy_threads}; {n_params / 1e6:.1f}M params "
          f"({mib(param_bytes)} MiB fp32), model states {mib(states_bytes)} MiB at {STATE_BYTES_PER_PARAM} B/param")
    print(f"model: {len(layers)} modules owning parameters, largest {largest[0]} {mib(largest[1])} MiB; gpu budgets "
          f"cover pages and non-model memory: the scheduler's least for this batch is {mib(least)} MiB; 'fits' = "
          f"{mib(fits_gpu)} MiB (16 B/param + that), the 4x rows = {mib(small_gpu)} MiB (states / 4)")

    hw = HardwareProfile.builtin(args.profile)
    print(f"prediction: plan + simulate on profile '{hw.name}', from a trace taken between each row's timed "
          f"iterations\n")
    results = []
    for key in ("fits", "cpu", "nvme"):
        if key not in wanted:
            continue
        label, row = row_specs[key]
        r = run_row(label, cfg, state, idx, tgt, row, args, extra)
        tr = r.pop("_trace")
        engine_plan, engine_trace = r.pop("_engine_plan"), r.pop("_engine_trace")
        non_model = max(o.non_model_bytes for o in tr.ops)
        r["trace"] = {"ops": len(tr.ops), "layers": len(tr.layers), "fwd_bwd_s": fwd_bwd_seconds(tr),
                      "peak_non_model_bytes": non_model,
                      "engine_units": len(engine_trace.layers) if engine_trace else None}
        r["predicted"] = predict(engine_plan, engine_trace, tr, hw)
        results.append(r)
        print(f"  {label}: engine {r['median_engine_s'] * 1e3:.0f} ms, plain {r['median_plain_s'] * 1e3:.0f} ms, "
              f"predicted {r['predicted'].get('iteration_s', float('nan')) * 1e3:.0f} ms", flush=True)

    # ---- table 1: throughput against the anchor and the prediction
    rows = []
    for r in results:
        pr = r["predicted"]
        pred = pr.get("iteration_s")
        rows.append([
            r["row"], mib(r["gpu_bytes"]), f"{states_bytes / r['gpu_bytes']:.1f}x",
            f"{r['engine_it_per_s']:.2f}", f"{r['plain_it_per_s']:.2f}", f"{r['ratio']:.2f}x",
            f"{r['engine_tokens_per_s']:.0f}", f"{r['plain_tokens_per_s']:.0f}",
            f"{pred * 1e3:.0f}" if pred else "infeasible", f"{r['median_engine_s'] * 1e3:.0f}",
            f"{(pred - r['median_engine_s']) / r['median_engine_s']:+.0%}" if pred else "-",
            f"{r['loss_matches']}/{r['loss_checks']}",
        ])
    print()
    print(table(["row", "gpu MiB", "states/gpu", "engine it/s", "plain it/s", "engine/plain", "engine tok/s",
                 "plain tok/s", "predicted ms", "measured ms", "pred err", "same loss"], rows,
                f"engine vs plain PyTorch (fused AdamW), median of {args.iters} interleaved iterations after "
                f"{args.warmup} warm-up; prediction: plan + simulate on '{hw.name}' from this run's trace"))

    # ---- table 2: what the engine did per iteration, beside the plain phases
    rows = []
    for r in results:
        d = r["per_iteration"]
        pp = r["plain_phase_s"]
        moved = ", ".join(f"{k} {v / 2**20:.0f} in {d['move_seconds'].get(k, 0) * 1e3:.0f} ms"
                          for k, v in sorted(d["moved_bytes"].items())) or "-"
        disk = d["disk_bytes"]
        disk = f"{disk['read_bytes'] / 2**20:.0f} / {disk['write_bytes'] / 2**20:.0f}" if disk else "n/a"
        end = r["stats_end"]
        planned = end.get("gpu_peak_bytes_by_mode", {}).get("plan")
        peak = (f"{mib(end['gpu_arena_bytes'])} / {mib(planned)} / {mib(r['gpu_bytes'])}"
                if planned is not None else "n/a")
        mode = ", ".join(f"{k} {v}" for k, v in r["iterations"].items())
        rows.append([r["row"], mode, f"{d['prefetches']:.0f} / {d['misses']:.0f} / {d['fetches']:.0f}",
                     f"{d['evictions']:.0f}", f"{d['gpu_wait_s'] * 1e3:.0f}", peak,
                     f"{d['view_copies']:.0f}", moved, disk,
                     *(f"{d['seconds'].get(k, 0) * 1e3:.0f} / {pp[k] * 1e3:.0f}" for k in ("forward", "backward",
                                                                                          "step"))])
    print()
    print(table(["row", "iterations", "staged / missed / on demand", "evictions", "waited for pages ms",
                 "gpu arena / planned peak / budget MiB", "view copies", "moved MiB (per direction, time in flight)",
                 "disk MiB read / written", "fwd ms eng/plain", "bwd ms eng/plain", "step ms eng/plain"], rows,
                "engine.stats() per timed iteration, means (disk: this process's /proc/self/io during engine "
                "iterations; phases: plain PyTorch's means beside the engine's)"))

    # ---- table 3: the simulator's view of each row
    rows = []
    for r in results:
        pr = r["predicted"]
        if "iteration_s" not in pr:
            rows.append([r["row"], mib(pr["budgets"]["gpu"]), f"infeasible (min gpu {mib(pr['min_gpu_bytes'])} MiB)",
                         "", "", "", "", "", ""])
            continue
        bm = pr["plan_bytes_moved"]
        stalls = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(pr["stalls_s"].items(), key=lambda kv: -kv[1])
                           if v > 0) or "-"
        pfb = r["plain_phase_s"]["forward"] + r["plain_phase_s"]["backward"]
        rows.append([r["row"], mib(pr["budgets"]["gpu"]), f"{pfb * 1e3:.0f}", f"{pr['busy_s']['compute'] * 1e3:.0f}",
                     f"{pr['busy_s']['cpu'] * 1e3:.0f}",
                     ", ".join(f"{k} {v / 2**20:.0f}" for k, v in bm.items() if v) or "-",
                     f"{pr['gpu_idle']:.1%}", stalls, "yes" if pr["valid"] else "NO"])
    print()
    print(table(["row", "plan gpu MiB", "plain fwd+bwd ms", "sim compute ms", "sim cpu-adam ms", "plan moves MiB",
                 "sim gpu idle", "idle by cause (ms)", "plan valid"], rows,
                "simulator: the plan the engine followed (its gpu budget, its units), this run's op durations"))

    fits = [r for r in results if r["row"].startswith("fits")]
    small = [r for r in results if not r["row"].startswith("fits")]
    print()
    if fits:
        f = fits[0]
        print(f"goal engine/plain >= {GOAL_FITS}x with all parameters on the gpu tier: "
              f"{'met' if f['ratio'] >= GOAL_FITS else 'NOT met'} ({f['ratio']:.2f}x)")
    for r in small:
        pred = r["predicted"].get("iteration_s")
        if pred:
            err = (pred - r["median_engine_s"]) / r["median_engine_s"]
            print(f"goal prediction within {GOAL_SIM:.0%} ({r['row']}): {'met' if abs(err) <= GOAL_SIM else 'NOT met'} "
                  f"(predicted {pred * 1e3:.0f} ms, measured {r['median_engine_s'] * 1e3:.0f} ms, {err:+.0%})")
    print("\nwhere the time goes (engine - plain, per phase; the simulator's compute is the trace's fwd+bwd, its "
          "transfers and updates overlap it):")
    for r in results:
        d, pp, pr = r["per_iteration"]["seconds"], r["plain_phase_s"], r["predicted"]
        diff = ", ".join(f"{k} {(d.get(k, 0) - pp[k]) * 1e3:+.0f}" for k in ("forward", "backward", "step"))
        line = (f"  {r['row']}: engine - plain = {(r['median_engine_s'] - r['median_plain_s']) * 1e3:+.0f} ms "
                f"(means by phase: {diff} ms)")
        if "iteration_s" in pr:
            pfb = pp["forward"] + pp["backward"]
            exposed = pr["iteration_s"] - pr["busy_s"]["compute"]
            pi = r["per_iteration"]
            own = pi["executor_s"] - pi["move_seconds"].get("cpu->gpu", 0.0)  # inline copies are h2d
            line += (f"; simulator: trace fwd+bwd - plain fwd+bwd "
                     f"{(pr['busy_s']['compute'] - pr['executor_s'] - pfb) * 1e3:+.0f} ms, executor "
                     f"{pr['executor_s'] * 1e3:.0f} ms for {pr['executor_windows']} windows (engine's own: "
                     f"{own * 1e3:.0f} ms for {pi['executor_releases']:.0f}), "
                     f"exposed transfers/updates {exposed * 1e3:+.0f} ms (cpu adam {pr['busy_s']['cpu'] * 1e3:.0f} ms "
                     f"busy, overlapped with backward)")
        print(line)
    bad = [r["row"] for r in results if not r["same_losses"]]
    if bad:
        print(f"WARNING: engine and plain losses differ (expected bit-identical in fp32) in: {', '.join(bad)}")

    path = write_json("bench_engine", {
        "model": dataclasses.asdict(cfg), "device": device, "batch": args.batch, "seq": args.seq, "params": n_params,
        "state_bytes": states_bytes, "engine_layers": len(layers), "engine_param_pages": footprint_pages,
        "largest_layer": {"name": largest[0], "bytes": largest[1]}, "warmup": args.warmup, "iters": args.iters,
        "threads": torch.get_num_threads(), "copy_threads": args.copy_threads, "engine_options": {k: repr(v) for k, v in extra.items()},
        "profile": hw.to_dict(), "goals": {"engine_over_plain": GOAL_FITS, "prediction_error": GOAL_SIM},
        "anchor": "plain PyTorch, same model and batch, torch.optim.AdamW(fused=True), interleaved in the same run",
        "rows": results,
    })
    print("wrote", path)


if __name__ == "__main__":
    main()
