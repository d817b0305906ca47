"""``pagemem plan`` and ``pagemem simulate``: plan (and simulate) one training iteration of a
model configuration (synthetic trace) or of a trace file."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from pagemem.commands.flags import add_shape_arguments, add_switch, shape_overrides
from pagemem.errors import ConfigError, one_line
from pagemem.models import gpt_config
from pagemem.sched.errors import InfeasiblePlan
from pagemem.sched.plan import HOME_TIERS, Plan
from pagemem.sched.layout import SHARDINGS
from pagemem.sched.planner import plan
from pagemem.sched.validate import validate
from pagemem.tracer import Trace, synthetic_from_config
from pagemem.units import format_bytes, parse_size

DTYPES = ("bfloat16", "float16", "float32")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("what to plan")
    src.add_argument("--trace", default=None, help="a trace file (pagemem trace writes one); else --model")
    src.add_argument("--model", default="angel-gpt3-175b",
                     help="GPT preset for a synthetic trace (default angel-gpt3-175b, ANGEL-PTM Table 4)")
    add_shape_arguments(src)
    src.add_argument("--batch", type=int, default=1, help="sequences per rank (default 1)")
    src.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
    src.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    where = parser.add_argument_group("where it runs")
    where.add_argument("--world_size", type=int, default=8, help="data-parallel ranks (default 8)")
    where.add_argument("--sharding", default="params", choices=SHARDINGS,
                       help="what the ranks shard: params (ZeRO-3, default) or states (ZeRO-1: the optimizer states "
                            "only, as the engine runs today)")
    where.add_argument("--gpu_bytes", default="40GiB", help="gpu budget per rank (default 40GiB)")
    where.add_argument("--cpu_bytes", default="128GiB", help="cpu budget per rank (default 128GiB)")
    where.add_argument("--nvme_bytes", default="1400GiB", help="nvme budget per rank (default 1400GiB)")
    where.add_argument("--optimizer_tier", default="cpu", choices=("cpu", "nvme"))
    where.add_argument("--home_tier", default="cpu", choices=HOME_TIERS,
                       help="where parameters and gradients rest (default cpu; nvme: staged through the cpu)")
    where.add_argument("--page_bytes", default="4MiB")
    add_switch(where, "cache_optimizer", True,
               "keep the optimizer states of layers that fit on the gpu (default true; false: never)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, help="write the plan as JSON to this file")
    out.add_argument("--plot", default=None, help="draw memory over logical time to this PNG")


def load_trace(args: argparse.Namespace, cost=None) -> Trace:
    if args.trace:
        return Trace.load(args.trace)
    cfg = gpt_config(args.model, **shape_overrides(args))
    if args.batch < 1:
        raise ConfigError(f"batch: must be >= 1, got {args.batch}")
    return synthetic_from_config(cfg, batch=args.batch, seq=args.seq, dtype=getattr(torch, args.dtype), cost=cost)


def make_plan(args: argparse.Namespace, tr: Trace) -> Plan:
    budgets = {tier: parse_size(getattr(args, f"{tier}_bytes"), f"{tier}_bytes") for tier in ("gpu", "cpu", "nvme")}
    return plan(tr, budgets, world_size=args.world_size,
                optimizer_tier=args.optimizer_tier, page_bytes=args.page_bytes, cache_optimizer=args.cache_optimizer,
                home_tier=args.home_tier, sharding=args.sharding)


def report_plan(args: argparse.Namespace, tr: Trace, p: Plan) -> int:
    print(p.summary())
    t0 = time.perf_counter()
    report = validate(p, tr)
    print(f"validated in {(time.perf_counter() - t0) * 1000:.0f} ms: {report.summary()}")
    if args.out:
        p.save(args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from pagemem.sched.plot import plot_memory

        plot_memory(report, args.plot, title=f"{_describe(args, tr)}: memory over logical time",
                    phases=[op.phase for op in tr.ops] + ["end"])
        print(f"wrote {args.plot}")
    return 0 if report.ok else 1


def _describe(args: argparse.Namespace, tr: Trace) -> str:
    return os.path.basename(args.trace) if args.trace else f"{args.model}, batch {args.batch}"


# ---------------------------------------------------------------------- pagemem plan

def configure(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        t0 = time.perf_counter()
        tr = load_trace(args)
        took = time.perf_counter() - t0
        print(f"trace: {_describe(args, tr)}, {len(tr.ops)} ops, {len(tr.layers)} layers, "
              f"peak non-model memory {format_bytes(tr.peak_non_model_bytes)} (built in {took * 1000:.0f} ms)")
        p = make_plan(args, tr)
    except InfeasiblePlan as e:
        print(f"pagemem plan: {one_line(str(e))}", file=sys.stderr)
        return 3
    return report_plan(args, tr, p)
