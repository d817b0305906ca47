"""``pagemem simulate``: plan one training iteration and simulate it on a hardware profile."""

from __future__ import annotations

import argparse
import os
import sys

from pagemem.commands.plan import add_plan_arguments, load_trace, make_plan
from pagemem.errors import one_line
from pagemem.sched.errors import InfeasiblePlan
from pagemem.units import format_bytes


def configure(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--profile", default="a100-server",
                     help="a built-in profile (a100-server, dev-vm) or a profile JSON file (pagemem profile)")
    sim.add_argument("--iterations", type=int, default=2, help="at least this many iterations (default 2)")
    sim.add_argument("--chrome", default=None, help="write the simulated timeline (Chrome trace-event JSON)")


def run(args: argparse.Namespace) -> int:
    from pagemem.sched.hardware import HardwareProfile
    from pagemem.sched.simulate import simulate

    try:
        hw = HardwareProfile.load(args.profile) if os.path.exists(args.profile) else HardwareProfile.builtin(args.profile)
        tr = load_trace(args, cost=hw.cost_model())
        print(f"trace: {len(tr.ops)} ops, {len(tr.layers)} layers, peak non-model memory "
              f"{format_bytes(tr.peak_non_model_bytes)}; compute {tr.iteration_seconds:.4g} s per iteration")
        p = make_plan(args, tr)
        print(p.summary())
        result = simulate(p, tr, hw, iterations=args.iterations)
    except InfeasiblePlan as e:
        print(f"pagemem simulate: {one_line(str(e))}", file=sys.stderr)
        return 3
    print(result.summary())
    if args.chrome:
        result.to_chrome(args.chrome)
        print(f"wrote {args.chrome} (open it in https://ui.perfetto.dev)")
    return 0
