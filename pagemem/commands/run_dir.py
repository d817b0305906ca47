"""A training run's directory: what ``pagemem train`` writes, and how ``--resume`` finds it.

``runs/<name>/`` holds:
- ``config.toml`` (to read) and ``config.json`` (what ``--resume`` runs with): the resolved config;
- ``metrics.jsonl``: one JSON object per step (``METRIC_KEYS``);
- ``trace.json`` and ``trace.chrome.json``: the traced iteration, as data and as a timeline;
- ``timeline-planned.json``: the simulator's timeline of the plan the engine followed;
- ``timeline-measured.json``: each step's forward, backward and step as they ran, and the tiers'
  bytes in use, as counters;
- ``loss.png`` and ``memory.png``; ``summary.json``;
- ``checkpoints/step-N/`` and ``checkpoints/latest`` (``Engine.save``).
The timelines are Chrome trace-event JSON: they open in Perfetto (ui.perfetto.dev) and
``chrome://tracing``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

from pagemem.errors import ConfigError

METRIC_KEYS = ("step", "loss", "grad_norm", "seconds", "tokens_per_s", "gpu_peak_bytes", "gpu_budget_bytes",
               "tier_used_bytes", "moved_bytes_per_s", "gpu_idle", "staleness_mean")
"""The fields of every line of ``metrics.jsonl``; with several ranks a log step's line also
holds ``ranks`` ([Note: pagemem train under torchrun])."""


class RunDir:
    """The files of one run (see the module docs)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.checkpoints = os.path.join(path, "checkpoints")
        self._events: list[dict[str, Any]] = []

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ------------------------------------------------------------------ finding runs

    @staticmethod
    def newest(runs: str) -> "RunDir":
        """The run under ``runs`` with the newest checkpoint (``--resume auto``)."""
        found = []
        if os.path.isdir(runs):
            for name in os.listdir(runs):
                latest = os.path.join(runs, name, "checkpoints", "latest")
                if os.path.exists(os.path.join(runs, name, "config.json")) and os.path.lexists(latest):
                    found.append((os.lstat(latest).st_mtime, name))
        if not found:
            raise ConfigError(f"resume: no run with a checkpoint under {runs!r} (train.runs); start one without --resume")
        return RunDir(os.path.join(runs, max(found)[1]))

    @staticmethod
    def named(path: str) -> "RunDir":
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError(f"resume: {path!r} is not a run directory (no config.json)")
        if not os.path.lexists(os.path.join(path, "checkpoints", "latest")):
            raise ConfigError(f"resume: {path!r} has no checkpoint to resume from")
        return RunDir(path)

    def latest_step(self) -> int | None:
        """The step of the checkpoint ``latest`` names (None: none)."""
        try:
            with open(os.path.join(self.checkpoints, "latest")) as f:
                name = f.read().strip()
            return int(name.split("-")[1])
        except (OSError, ValueError, IndexError):
            return None

    def has_checkpoint(self) -> bool:
        return os.path.lexists(os.path.join(self.checkpoints, "latest"))

    # ------------------------------------------------------------------ config and metrics

    def write_config(self, plain: dict[str, Any], toml_text: str) -> None:
        _write(self.file("config.json"), json.dumps(plain, indent=2))
        _write(self.file("config.toml"), toml_text)

    def read_config(self) -> dict[str, Any]:
        with open(self.file("config.json")) as f:
            return json.load(f)

    def keep_metrics_until(self, step: int) -> None:
        """Drop metric lines after ``step`` (a resumed run logs them again)."""
        kept = [m for m in self.metrics() if m["step"] <= step]
        _write(self.file("metrics.jsonl"), "".join(json.dumps(m) + "\n" for m in kept))

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.file("metrics.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def metrics(self) -> list[dict[str, Any]]:
        try:
            with open(self.file("metrics.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------------ the measured timeline

    def phase(self, name: str, start: float, seconds: float, step: int) -> None:
        """One phase of a step as it ran (``time.perf_counter`` seconds)."""
        self._events.append({"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": start * 1e6, "dur": seconds * 1e6,
                             "args": {"step": step}})

    def counters(self, at: float, used: dict[str, int]) -> None:
        self._events.append({"name": "tier used bytes", "ph": "C", "pid": 0, "ts": at * 1e6,
                             "args": dict(used)})

    def write_timelines(self, trace: Any, planned: Any) -> None:
        """The traced iteration, the planned timeline (a ``SimResult``) and the measured one."""
        measured = self.file("timeline-measured.json")
        events = list(self._events)
        if os.path.exists(measured):  # a resumed run goes on after the events of the runs before it
            with open(measured) as f:
                before = [e for e in json.load(f)["traceEvents"] if e["ph"] != "M"]
            end = max((e["ts"] + e.get("dur", 0) for e in before), default=0.0)
            shift = end - min((e["ts"] for e in events), default=end) + 1e6 if events else 0.0
            events = before + [{**e, "ts": e["ts"] + shift} for e in events]
        meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pagemem train (measured)"}},
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "training loop"}}]
        _write(measured, json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        self._events.clear()
        if trace is not None:
            trace.save(self.file("trace.json"))
            trace.to_chrome(self.file("trace.chrome.json"))
        if planned is not None:
            planned.to_chrome(self.file("timeline-planned.json"))

    # ------------------------------------------------------------------ plots and summary

    def write_plots(self, metrics: list[dict[str, Any]], floor: float | None) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [m["step"] for m in metrics]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [m["loss"] for m in metrics], lw=1, label="loss")
        if floor is not None:
            ax.axhline(floor, ls=":", color="gray", label=f"task floor ({floor:.3f})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.file("loss.png"), dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(7, 4))
        for tier in ("gpu", "cpu", "nvme"):
            ys = [m["tier_used_bytes"].get(tier, 0) / 2**20 for m in metrics]
            if any(ys):
                ax.plot(steps, ys, lw=1, label=f"{tier} in use")
        ax.plot(steps, [m["gpu_peak_bytes"] / 2**20 for m in metrics], lw=1, ls="--", label="gpu peak")
        ax.plot(steps, [m["gpu_budget_bytes"] / 2**20 for m in metrics], lw=1, ls=":", label="gpu budget")
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.file("memory.png"), dpi=100)
        plt.close(fig)

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write(self.file("summary.json"), json.dumps(summary, indent=2))


def files_of_a_finished_run() -> Iterable[str]:
    """The files a finished run directory holds (checked by tests)."""
    return ("config.toml", "config.json", "metrics.jsonl", "trace.json", "trace.chrome.json", "timeline-planned.json",
            "timeline-measured.json", "loss.png", "memory.png", "summary.json", "checkpoints/latest")


def _write(path: str, text: str) -> None:
    """Write whole or not at all (a temporary file renamed over)."""
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
