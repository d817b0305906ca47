"""pagemem against DeepSpeed ZeRO-3 with offload, and plain PyTorch where the model fits.

One GPT, one batch, bf16 compute with fp32 AdamW states, trained by each system in a process of
its own (so each starts with an empty GPU and host, and one's out-of-memory cannot touch the
other's):

- ``plain``: the model on the GPU, ``torch.autocast(bfloat16)``, ``torch.optim.AdamW(fused=True)``
  (PyTorch's documented mixed-precision recipe; fp32 weights: 16 B per parameter on the GPU);
- ``pagemem``: ``pagemem.Engine``, compute dtype bf16, optimizer states on ``--offload`` (cpu or
  nvme), the gpu budget ``--gpu-fraction`` of the GPU's free memory (the first iteration needs
  its activations beside the budget: see run_pagemem's Note); the model is built on
  ``meta`` and initialized into pages one module at a time (``Engine(init=)``);
- ``deepspeed``: ZeRO-3 with parameters and optimizer states offloaded to ``--offload``, in the
  configuration DeepSpeed documents for it (``ds_config`` below: bf16, pinned buffers, overlapped
  communication, contiguous gradients, buckets sized from the hidden size, DeepSpeedCPUAdam), the
  model built under ``deepspeed.zero.Init`` so no process ever holds it whole.

Reported per system: median iteration time after warm-up, tokens/s, model TFLOPS (per token
6 * N + 12 * layers * hidden * seq FLOPs, N the parameters doing matrix work: every one but the
position embeddings; activation recomputation not counted), peak GPU memory, first and last loss,
and the ratio to DeepSpeed measured in the same run. Goal (issue 10): pagemem >= 2x DeepSpeed's
tokens/s with CPU offload at the largest model DeepSpeed can train.

``--largest``: instead of one model, find the largest GPT each system trains at all (one full
iteration) with ``--offload``: layers of ``--hidden`` width are added until a run fails, then
bisected. Goal (issue 10, NVMe): pagemem >= 1.5x DeepSpeed's parameters, and >= 90% of the
machine's limit, (GPU + host + NVMe bytes) / 16 B per parameter.

Without CUDA it runs on the host (pagemem's gpu tier is the host stand-in; DeepSpeed runs with
``DS_ACCELERATOR=cpu``): a check that the script and both systems work, not a measurement.

Usage (the exact commands for a GPU machine are in benchmarks/GPU.md):
  python benchmarks/bench_offload.py --model gpt-1.3b --batch 8 --seq 1024 --offload cpu
  python benchmarks/bench_offload.py --largest --hidden 4096 --offload nvme --nvme-path /mnt/nvme
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
import time

from common import ROOT, machine, table, write_json

SYSTEMS = ("plain", "pagemem", "deepspeed")
PAGE = 4 << 20
GOAL_SPEED = 2.0
GOAL_PARAMS = 1.5
GOAL_LIMIT = 0.9
BYTES_PER_PARAM = 16  # a mixed-precision Adam parameter: bf16 weight + bf16 grad + fp32 master + 2 moments


# ------------------------------------------------------------------------------- the workers


def gpt_config(spec: dict):
    from pagemem.models.gpt import gpt_config as preset

    return preset(spec["model"], seq=spec["seq"], checkpoint_activations=spec["checkpoint_activations"],
                  **spec.get("shape", {}))


def batches(spec: dict, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(1)
    for _ in range(spec["warmup"] + spec["iters"]):
        x = torch.randint(0, vocab, (spec["batch"], spec["seq"] + 1), generator=g)
        yield x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def timed_loop(spec: dict, vocab: int, device, one_iteration) -> dict:
    import torch

    times, losses = [], []
    for idx, tgt in batches(spec, vocab, device):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = one_iteration(idx, tgt)
        losses.append(loss.item())  # waits for the iteration
        times.append(time.perf_counter() - t0)
    return {"iteration_s": times[spec["warmup"]:], "losses": losses}


def train_step(engine):
    """One iteration of an engine with ``engine(x, y) -> loss``, ``backward``, ``step`` (pagemem's
    and DeepSpeed's)."""
    def one(idx, tgt):
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return one


def host_bytes_available() -> int:
    import psutil

    return psutil.virtual_memory().available


def run_plain(spec: dict, cfg) -> dict:
    import torch

    from pagemem.models.gpt import GPT

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(spec["seed"])
    with device:
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def one(idx, tgt):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return timed_loop(spec, cfg.vocab, device, one)


def run_pagemem(spec: dict, cfg, n_params: int) -> dict:
    import torch

    import pagemem
    from pagemem.models.gpt import GPT, init_module

    cuda = torch.cuda.is_available()
    # [Note: the warm-up's headroom] the first iteration runs with the arena at the whole budget
    # (pagemem/engine/paging/pager.py, the Note on the gpu budget): on CUDA its activations need room
    # beside it, so the budget is a share of the free memory, not all of it
    gpu_bytes = spec["gpu_bytes"] or (int(torch.cuda.mem_get_info()[0] * spec["gpu_fraction"]) if cuda else 0)
    if not gpu_bytes:
        raise SystemExit("pagemem: --gpu-bytes is needed without CUDA (the stand-in's budget)")
    nvme = spec["offload"] == "nvme"
    # cpu: compute copies (bf16) + fp32 gradient sums, + the fp32 states when they live there
    per_param = 2 + 4 + (0 if nvme else 12)
    want_cpu = per_param * n_params + 256 * PAGE  # slack: per-unit partial pages, staging
    cpu_bytes = min(want_cpu, int(host_bytes_available() * spec["host_fraction"]))
    store = pagemem.StoreConfig(page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes,
                                nvme_bytes=(12 * n_params + 256 * PAGE) if nvme else 0,
                                nvme_path=spec["nvme_path"] if nvme else None)
    config = pagemem.EngineConfig(store=store, optimizer_tier=spec["offload"], compute_dtype=torch.bfloat16,
                                  optimizer=pagemem.AdamW(lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1))
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    with pagemem.Engine(model, config, init=init_module(cfg)) as engine:
        build_s = time.perf_counter() - t0
        out = timed_loop(spec, cfg.vocab, engine.device, train_step(engine))
        stats = engine.stats()
    return {**out, "build_s": build_s, "gpu_budget_bytes": gpu_bytes, "cpu_bytes": cpu_bytes,
            "iterations": stats["iterations"], "pagemem_gpu_peak_bytes": stats.get("gpu_peak_bytes")}


def ds_config(spec: dict, cfg) -> dict:
    """DeepSpeed's documented ZeRO-3 offload configuration (ZeRO-Infinity for nvme)."""
    h = cfg.hidden
    offload_param = {"device": spec["offload"], "pin_memory": True}
    offload_opt = {"device": spec["offload"], "pin_memory": True}
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9), "stage3_max_reuse_distance": int(1e9), "sub_group_size": int(1e9),
            "offload_param": offload_param, "offload_optimizer": offload_opt}
    conf = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1}},
            "zero_optimization": zero}
    if spec["offload"] == "nvme":
        largest = max(cfg.vocab, cfg.seq) * h  # the embedding: the largest parameter
        offload_param.update(nvme_path=spec["nvme_path"], buffer_count=5, buffer_size=max(int(1e8), largest),
                             max_in_cpu=int(1e9))
        offload_opt.update(nvme_path=spec["nvme_path"], buffer_count=4, fast_init=False)
        conf["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                       "overlap_events": True}
    return conf


def run_deepspeed(spec: dict, cfg) -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from pagemem.models.gpt import GPT, init_module
    from pagemem.ownership import owning_modules

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed()
    conf = ds_config(spec, cfg)
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device=spec["offload"], pin_memory=True):
        model = GPT(cfg)
    torch.manual_seed(spec["seed"])
    init = init_module(cfg)
    for name, module, own in owning_modules(model):  # GPT's own initialization, one module at a time
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
            init(name, module)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    build_s = time.perf_counter() - t0
    out = timed_loop(spec, cfg.vocab, torch.device(get_accelerator().device_name()), train_step(engine))
    return {**out, "build_s": build_s, "ds_config": conf}


def worker(system: str, spec: dict) -> dict:
    import torch

    cfg = gpt_config(spec)
    n_params = cfg.param_count()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = {"plain": lambda: run_plain(spec, cfg), "pagemem": lambda: run_pagemem(spec, cfg, n_params),
           "deepspeed": lambda: run_deepspeed(spec, cfg)}[system]
    out = run()
    if torch.cuda.is_available():
        out["gpu_peak_bytes"] = torch.cuda.max_memory_reserved()
    return out


# ------------------------------------------------------------------------------- the parent


def model_flops_per_token(cfg) -> int:
    matrix_params = cfg.param_count() - cfg.seq * cfg.hidden
    return 6 * matrix_params + 12 * cfg.layers * cfg.hidden * cfg.seq


def launch(system: str, spec: dict, timeout: float) -> dict:
    """Run one system in a process of its own; its last line is its result."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    import torch

    if system == "deepspeed" and not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--spec", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        return {"ok": True, **json.loads(lines[-1][7:]), "wall_s": time.perf_counter() - t0}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    oom = any(s in "\n".join(tail) for s in ("OutOfMemory", "out of memory", "Cannot allocate memory", "MemoryError"))
    return {"ok": False, "oom": oom or proc.returncode in (-9, 137), "returncode": proc.returncode,
            "error": " | ".join(tail)[-600:], "wall_s": time.perf_counter() - t0}


def summarize(system: str, result: dict, cfg, spec: dict) -> dict:
    if not result["ok"]:
        return result
    med = statistics.median(result["iteration_s"])
    tokens = spec["batch"] * spec["seq"]
    result.update(median_iteration_s=med, tokens_per_s=tokens / med,
                  model_tflops=model_flops_per_token(cfg) * tokens / med / 1e12)
    return result


def compare(args, spec: dict) -> dict:
    cfg = gpt_config(spec)
    results = {}
    for system in args.systems:
        print(f"  {system} ...", flush=True)
        results[system] = summarize(system, launch(system, spec, args.timeout), cfg, spec)
    ds = results.get("deepspeed", {})
    rows = []
    for system, r in results.items():
        if not r["ok"]:
            rows.append([system, "OOM" if r.get("oom") else "failed", "", "", "", "", "", r["error"][-80:]])
            continue
        ratio = r["tokens_per_s"] / ds["tokens_per_s"] if ds.get("ok") else None
        peak = r.get("gpu_peak_bytes")
        rows.append([system, f"{r['median_iteration_s'] * 1e3:.0f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['model_tflops']:.3g}", f"{ratio:.2f}x" if ratio else "-",
                     f"{peak / 2**30:.1f}" if peak else "-",
                     f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", f"build {r['build_s']:.0f} s" if "build_s" in r else ""])
    print(table(["system", "iteration ms", "tokens/s", "model TFLOPS", "vs deepspeed", "GPU peak GiB", "loss",
                 "note"], rows,
                f"GPT {cfg.layers}L h{cfg.hidden} ({cfg.param_count() / 1e9:.2f}B params), batch {spec['batch']} x "
                f"seq {spec['seq']}, bf16, offload {spec['offload']}; median of {spec['iters']} after {spec['warmup']}"))
    pm = results.get("pagemem", {})
    if pm.get("ok") and ds.get("ok"):
        ratio = pm["tokens_per_s"] / ds["tokens_per_s"]
        print(f"\ngoal pagemem >= {GOAL_SPEED}x DeepSpeed tokens/s: {'met' if ratio >= GOAL_SPEED else 'NOT met'} "
              f"({ratio:.2f}x)")
    return {"model": cfg.__dict__, "params": cfg.param_count(), "results": results}


def probe(args, spec: dict, system: str, layers: int) -> bool:
    s = {**spec, "shape": {**spec.get("shape", {}), "layers": layers}, "warmup": 1, "iters": 1}
    r = launch(system, s, args.timeout)
    cfg = gpt_config(s)
    print(f"    {system} {layers} layers ({cfg.param_count() / 1e9:.2f}B): "
          f"{'ok' if r['ok'] else ('OOM' if r.get('oom') else 'failed: ' + r['error'][-160:])} "
          f"({r['wall_s']:.0f} s)", flush=True)
    return r["ok"]


def largest(args, spec: dict) -> dict:
    """Per system, the most layers (of the given width) with which one iteration completes."""
    found = {}
    for system in args.systems:
        print(f"  {system}:", flush=True)
        good, bad, n = 0, None, args.start_layers
        while bad is None and good < args.max_layers:  # double until a run fails; --max-layers the last tried
            n = min(n, args.max_layers)
            if probe(args, spec, system, n):
                good, n = n, n * 2
            else:
                bad = n
        while bad is not None and bad - good > 1:
            mid = (good + bad) // 2
            if probe(args, spec, system, mid):
                good = mid
            else:
                bad = mid
        params = gpt_config({**spec, "shape": {**spec.get("shape", {}), "layers": good}}).param_count() if good else 0
        found[system] = {"layers": good, "params": params}
    limit = machine_limit_params(spec)
    rows = [[s, f["layers"], f"{f['params'] / 1e9:.2f}", f"{f['params'] / limit:.0%}" if limit else "-"]
            for s, f in found.items()]
    print(table(["system", "layers", "params (B)", "of the machine's limit"], rows,
                f"largest GPT (hidden {args.hidden}) trained with offload {spec['offload']}; machine limit "
                f"{limit / 1e9:.1f}B params at {BYTES_PER_PARAM} B/param"))
    pm, ds = found.get("pagemem", {}).get("params"), found.get("deepspeed", {}).get("params")
    if pm and ds:
        print(f"\ngoal pagemem >= {GOAL_PARAMS}x DeepSpeed's parameters: "
              f"{'met' if pm >= GOAL_PARAMS * ds else 'NOT met'} ({pm / ds:.2f}x)")
    if pm and limit and spec["offload"] == "nvme":
        print(f"goal pagemem >= {GOAL_LIMIT:.0%} of the machine's limit: "
              f"{'met' if pm >= GOAL_LIMIT * limit else 'NOT met'} ({pm / limit:.0%})")
    return {"largest": found, "machine_limit_params": limit}


def machine_limit_params(spec: dict) -> float:
    import psutil
    import torch

    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    host = psutil.virtual_memory().total
    nvme = shutil.disk_usage(spec["nvme_path"]).free if spec["offload"] == "nvme" else 0
    return (gpu + host + nvme) / BYTES_PER_PARAM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt-1.3b", help="a pagemem.models.gpt preset")
    ap.add_argument("--layers", type=int, help="override the preset's layers")
    ap.add_argument("--hidden", type=int, help="override the preset's hidden size (and heads = hidden / 128)")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--nvme-path", default=None, help="directory for nvme offload (default: a temporary one)")
    ap.add_argument("--systems", default="plain,pagemem,deepspeed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-activations", action="store_true", help="recompute each block in backward")
    ap.add_argument("--gpu-bytes", type=int, default=0, help="pagemem's gpu budget (default: --gpu-fraction of the free GPU memory)")
    ap.add_argument("--gpu-fraction", type=float, default=0.6,
                    help="share of the free GPU memory that is pagemem's budget; the rest is the first iteration's headroom")
    ap.add_argument("--host-fraction", type=float, default=0.85, help="most of the available host memory pagemem pins")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per system run")
    ap.add_argument("--largest", action="store_true", help="find the largest GPT each system trains")
    ap.add_argument("--start-layers", type=int, default=4)
    ap.add_argument("--max-layers", type=int, default=512)
    args = ap.parse_args()

    if args.worker:
        out = worker(args.worker, json.loads(args.spec))
        print("RESULT " + json.dumps(out), flush=True)
        return

    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    shape = {k: v for k, v in (("layers", args.layers), ("hidden", args.hidden), ("vocab", args.vocab)) if v}
    if args.hidden:
        shape["heads"] = max(1, args.hidden // 128)
    tmp = None
    if args.offload == "nvme" and not args.nvme_path:
        tmp = args.nvme_path = tempfile.mkdtemp(prefix="bench_offload_")
    spec = {"model": args.model, "shape": shape, "batch": args.batch, "seq": args.seq, "offload": args.offload,
            "nvme_path": args.nvme_path, "warmup": args.warmup, "iters": args.iters, "lr": args.lr, "seed": args.seed,
            "checkpoint_activations": args.checkpoint_activations, "gpu_bytes": args.gpu_bytes,
            "gpu_fraction": args.gpu_fraction, "host_fraction": args.host_fraction}
    print(f"machine: {json.dumps(machine())}")
    try:
        if args.largest:
            if not args.hidden:
                raise SystemExit("--largest needs --hidden (the width whose layers are counted)")
            out = largest(args, spec)
        else:
            out = compare(args, spec)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    versions = {}
    for name in ("torch", "deepspeed"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    name = "bench_offload_largest" if args.largest else "bench_offload"
    print("wrote", write_json(f"{name}_{args.offload}", {"spec": spec, "versions": versions, **out,
                                                         "anchor": "DeepSpeed ZeRO-3 offload, same model and batch, "
                                                                   "same run"}))


if __name__ == "__main__":
    main()
