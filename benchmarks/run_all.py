"""Run every benchmark that can run here (``make bench``); each writes its own JSON.

``SUITE`` is the one list of the benchmarks: this script and ``pagemem bench`` (which prints
each headline figure beside its anchor in one table) both run it. ``--quick`` passes each
benchmark its smallest settings (a check that it runs, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))


class Bench(NamedTuple):
    name: str
    """The script, ``benchmarks/<name>.py``."""
    quick: tuple[str, ...] = ()
    """Arguments for its smallest settings (``--quick``)."""
    needs: str | None = None
    """``"fio"`` or ``"cuda"``: skipped where that is missing."""
    default: bool = True
    """Run without ``--only``; the others are long or need what this project does not install
    (DeepSpeed), and run when named."""
    result: str = ""
    """Its results file, ``results/<result>.json`` (default: ``name``)."""

    @property
    def result_name(self) -> str:
        return self.result or self.name


SUITE: list[Bench] = [
    Bench("bench_allocator", ("--rounds", "1", "--churn-steps", "300", "--no-real-store")),
    Bench("bench_store_ops", ("--rounds", "3")),
    Bench("bench_cpu_adam", ("--elements", "4000000", "--rounds", "3", "--no-deepspeed")),
    Bench("bench_engine", ("--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "1024", "--seq", "64",
                           "--warmup", "2", "--iters", "3")),
    Bench("bench_tracer", ("--repeats", "3", "--only", "h128")),
    Bench("bench_planner", ("--repeats", "1")),
    Bench("bench_simulate", ("--batch", "4")),
    Bench("bench_paper_scale", ("--worlds", "256", "--batch", "1"), default=False),
    Bench("bench_nvme", ("--size", "64MiB", "--repeats", "1", "--depths", "8"), needs="fio"),
    Bench("bench_gpu_moves", ("--size", "256MiB", "--repeats", "2"), needs="cuda"),
    Bench("bench_homes", ("--steps", "2", "--multiples", "1"), default=False),
    Bench("bench_ranks", ("--steps", "4", "--worlds", "1,2"), default=False),
    Bench("bench_lockfree", ("--steps", "20", "--seeds", "1", "--throughput-steps", "10"), default=False),
    Bench("bench_integrations", ("--layers", "2", "--hidden", "64", "--seq", "32", "--vocab", "128", "--steps", "6",
                                 "--warmup", "2"), default=False),
    Bench("bench_train_loop", ("--steps", "3", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "64",
                               "--seq", "16")),
    Bench("bench_offload", ("--model", "tiny", "--batch", "1", "--seq", "64", "--warmup", "1", "--iters", "2",
                            "--gpu-bytes", str(64 << 20)), default=False, result="bench_offload_cpu"),
]


def unavailable(bench: Bench) -> str | None:
    """Why ``bench`` cannot run on this machine, or None."""
    if bench.needs == "fio" and not shutil.which("fio"):
        return "fio is not installed"
    if bench.needs == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each benchmark's smallest settings")
    args = ap.parse_args()
    failed = 0
    for bench in SUITE:
        if not bench.default:
            continue
        why = unavailable(bench)
        if why:
            print(f"skipping {bench.name}.py: {why}")
            continue
        print(f"\n=== {bench.name}.py ===", flush=True)
        extra = list(bench.quick) if args.quick else []
        failed += subprocess.call([sys.executable, os.path.join(HERE, bench.name + ".py"), *extra]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
