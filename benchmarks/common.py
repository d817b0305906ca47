"""Helpers shared by the benchmarks: where results go, machine facts, tables."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.environ.get("PAGEMEM_BENCH_RESULTS") or os.path.join(ROOT, "benchmarks", "results")
"""Where results go: ``benchmarks/results``, or ``$PAGEMEM_BENCH_RESULTS`` (``pagemem bench --results_dir``)."""
sys.path.insert(0, ROOT)


def machine() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return info


def write_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), **payload}, f, indent=2)
    return path


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    """Format rows (already strings or numbers) as an aligned plain-text table."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.4f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)
