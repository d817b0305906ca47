"""Run every benchmark that can run here (``make bench``); each writes its own JSON."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    import torch

    runs = [["bench_allocator.py"], ["bench_store_ops.py"], ["bench_cpu_adam.py"], ["bench_engine.py"],
            ["bench_tracer.py"], ["bench_planner.py"], ["bench_simulate.py"]]
    if shutil.which("fio"):
        runs.append(["bench_nvme.py"])
    else:
        print("skipping bench_nvme.py: fio is not installed")
    if torch.cuda.is_available():
        runs.append(["bench_gpu_moves.py"])
    else:
        print("skipping bench_gpu_moves.py: no CUDA device")
    failed = 0
    for args in runs:
        print(f"\n=== {args[0]} ===", flush=True)
        failed += subprocess.call([sys.executable, os.path.join(HERE, args[0]), *args[1:]]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
