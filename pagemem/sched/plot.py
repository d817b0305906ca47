"""Memory over logical time against the budget, as a PNG (needs matplotlib: ``pip install
pagemem[plot]``)."""

from __future__ import annotations

import os

import numpy as np

from pagemem.sched.validate import ValidationReport


def plot_memory(report: ValidationReport, path: str | os.PathLike, title: str = "",
                phases: list[str] | None = None) -> str:
    """Draw gpu memory (non-model memory and model states stacked) and cpu memory over logical
    time, each against its budget; ``phases`` (one per op) shades the backward pass. Returns
    the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    x = np.arange(len(report.non_model))
    fig, (ax_gpu, ax_cpu) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    non_model = report.non_model / gib
    model = (report.timeline["gpu"] - report.non_model) / gib
    ax_gpu.stackplot(x, non_model, model, labels=["non-model (activations, temporaries)",
                                                  "model states (pages)"],
                     colors=["#c7d7ee", "#3b6fb6"], step="post")
    ax_gpu.axhline(report.budgets.gpu / gib, color="#c0392b", lw=1.5, label="gpu budget")
    ax_gpu.set_ylabel("gpu GiB")
    ax_gpu.legend(loc="upper left", fontsize=8)
    ax_cpu.step(x, report.timeline["cpu"] / gib, where="post", color="#2e8b57", label="cpu pages")
    ax_cpu.axhline(report.budgets.cpu / gib, color="#c0392b", lw=1.5, label="cpu budget")
    ax_cpu.set_ylabel("cpu GiB")
    ax_cpu.set_xlabel("logical time (op id)")
    ax_cpu.legend(loc="upper left", fontsize=8)
    if phases:
        back = [i for i, p in enumerate(phases) if p == "backward"]
        if back:
            for ax in (ax_gpu, ax_cpu):
                ax.axvspan(back[0], back[-1] + 1, color="#eeeeee", zorder=0)
            ax_gpu.text(back[0], ax_gpu.get_ylim()[1] * 0.97, " backward", va="top", fontsize=8, color="#666")
    status = "valid" if report.ok else f"{len(report.violations)} violation(s)"
    ax_gpu.set_title(title or f"memory over logical time ({status})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)
