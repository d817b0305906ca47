"""A training run's directory: what ``pagemem train`` writes, and how ``--resume`` finds it.

``runs/<name>/`` holds:
- ``config.toml`` (to read) and ``config.json`` (what ``--resume`` runs with): the resolved config,
  and ``config-history.jsonl``: the resolved config of every start and resume, with its step;
- ``lock``: the pid of the process training the run (``flock``: a second one is refused);
- ``metrics.jsonl``: one JSON object per step (``METRIC_KEYS``; NaN and infinities as null), and
  ``metrics.csv``; TensorBoard event files in ``tensorboard/`` where ``tensorboard`` is installed,
  written as each line is logged ([Note: TensorBoard live] in ``train_board.py``);
- ``trace.json`` and ``trace.chrome.json``: the traced iteration, as data and as a timeline;
- ``timeline-planned.json``: the simulator's timeline of the plan the engine followed;
- ``timeline-measured.json``: each step's forward, backward, grad norm, update, evaluation and
  checkpoint as they ran; the store's moves (h2d, d2h, nvme reads and writes) as the spans it
  measured, a row per direction; the tiers' bytes in use and the bytes moved per second, as counters;
- ``loss.png``, ``memory.png`` and ``throughput.png``; ``summary.json``;
- ``export/`` (``train.export``): the weights as safetensors (and ``config.json``: a Hugging Face
  model directory);
- ``checkpoints/step-N/`` and ``checkpoints/latest`` (``Engine.save``).
The timelines are Chrome trace-event JSON: they open in Perfetto (ui.perfetto.dev) and
``chrome://tracing``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from typing import Any, Iterable

from pagemem.errors import ConfigError

METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "seconds", "tokens_per_s", "gpu_peak_bytes", "gpu_budget_bytes",
               "tier_used_bytes", "moved_bytes_per_s", "gpu_idle", "staleness_mean", "time", "wall_seconds",
               "val_loss", "val_perplexity")
"""The fields of every line of ``metrics.jsonl``; with several ranks a log step's line also
holds ``ranks`` ([Note: pagemem train under torchrun])."""
MOVE_NAMES = {"cpu->gpu": "h2d", "gpu->cpu": "d2h", "nvme->cpu": "nvme read", "nvme->gpu": "nvme read",
              "cpu->nvme": "nvme write", "gpu->nvme": "nvme write"}
"""The measured timeline's name of each move direction."""
MOVE_SPANS_KEPT = 200_000
"""Move spans a session writes into the measured timeline at most (the first ones)."""


class RunDir:
    """The files of one run (see the module docs)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.checkpoints = os.path.join(path, "checkpoints")
        self._events: list[dict[str, Any]] = []
        self._move_spans = 0
        self._lock: int | None = None

    # ------------------------------------------------------------------ one writer

    def lock(self) -> None:
        """Hold the run for this process (until :meth:`unlock` or its end, kill -9 included: an
        ``flock``); one held by another process is refused with its pid."""
        fd = os.open(self.file("lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"resume: {self.path} is being trained by another pagemem train (pid {holder}); "
                              "wait for it to end, or stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def remove_stale_page_files(self) -> list[str]:
        """Remove the page files a process that is gone left in the run's own ``nvme/`` (kill -9
        gives no chance to remove them; ``pagemem-PID-*.pages``); the names removed."""
        nvme = self.file("nvme")
        removed = []
        for name in sorted(os.listdir(nvme)) if os.path.isdir(nvme) else []:
            parts = name.split("-")
            if len(parts) >= 3 and parts[0] == "pagemem" and name.endswith(".pages") and parts[1].isdigit():
                if not _alive(int(parts[1])):
                    os.remove(os.path.join(nvme, name))
                    removed.append(name)
        return removed

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

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

    def add_history(self, step: int, plain: dict[str, Any], overrides: dict[str, str]) -> None:
        """One line of ``config-history.jsonl``: the config a start (step 0) or resume ran with."""
        line = {"step": step, "time": time.time(), "overrides": overrides, "config": plain}
        with open(self.file("config-history.jsonl"), "a") as f:
            f.write(_json(line) + "\n")

    def read_config(self) -> dict[str, Any]:
        with open(self.file("config.json")) as f:
            return json.load(f)

    def keep_metrics_until(self, step: int) -> None:
        """Drop metric lines after ``step`` (a resumed run logs them again)."""
        kept = [m for m in self.metrics() if m["step"] <= step]
        _write(self.file("metrics.jsonl"), "".join(_json(m) + "\n" for m in kept))

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.file("metrics.jsonl"), "a") as f:
            f.write(_json(metrics) + "\n")

    def update_last_metrics(self, values: dict[str, Any]) -> None:
        """Set ``values`` on the last metrics line (the end's evaluation)."""
        metrics = self.metrics()
        if metrics:
            metrics[-1].update(values)
            _write(self.file("metrics.jsonl"), "".join(_json(m) + "\n" for m in metrics))

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

    def moves(self, spans: Iterable[Any]) -> None:
        """The store's move spans (``MoveSpan``: direction, start, end, bytes), a row per direction."""
        for span in spans:
            if self._move_spans >= MOVE_SPANS_KEPT:
                return
            self._move_spans += 1
            seconds = span.end - span.start
            self._events.append({"name": MOVE_NAMES.get(span.direction, span.direction), "ph": "X", "pid": 0,
                                 "tid": _move_row(span.direction), "ts": span.start * 1e6, "dur": seconds * 1e6,
                                 "args": {"direction": span.direction, "bytes": span.bytes,
                                          "GB/s": round(span.bytes / seconds / 1e9, 3) if seconds > 0 else None}})

    def counters(self, at: float, used: dict[str, int], name: str = "tier used bytes") -> None:
        """Counters at ``at`` (``time.perf_counter`` seconds): the tiers' bytes in use, or the
        step's moves (``name``)."""
        self._events.append({"name": name, "ph": "C", "pid": 0, "ts": at * 1e6, "args": dict(used)})

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
        for direction in sorted({e["args"]["direction"] for e in events if e.get("tid", 0) > 0}):
            meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": _move_row(direction),
                         "args": {"name": f"moves {direction} ({MOVE_NAMES.get(direction, 'other')})"}})
        _write(measured, json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        self._events.clear()
        if trace is not None:
            trace.save(self.file("trace.json"))
            trace.to_chrome(self.file("trace.chrome.json"))
        if planned is not None:
            planned.to_chrome(self.file("timeline-planned.json"))

    # ------------------------------------------------------------------ plots and summary

    def write_plots(self, metrics: list[dict[str, Any]], floor: float | None,
                    budgets: dict[str, int] | None = None) -> None:
        """``loss.png`` (training loss, the validation loss where evaluated, the task's floor),
        ``memory.png`` (each tier's bytes in use against its budget, the gpu's peak) and
        ``throughput.png`` (tokens per second), each titled, with axes from 0."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [m["step"] for m in metrics]
        name = os.path.basename(os.path.normpath(self.path))

        def save(fig: Any, ax: Any, title: str, ylabel: str, file: str) -> None:
            ax.set_title(f"{title} ({name})")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
            fig.tight_layout()
            fig.savefig(self.file(file), dpi=100)
            plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(steps, [_nan(m["loss"]) for m in metrics], lw=1, label="training loss")
        evals = [m for m in metrics if m.get("val_loss") is not None]
        if evals:
            ax.plot([m["step"] for m in evals], [m["val_loss"] for m in evals], "o-", ms=3, lw=1,
                    label="validation loss")
        if floor is not None:
            ax.axhline(floor, ls=":", color="gray", label=f"task floor ({floor:.3f})")
        save(fig, ax, "loss", "loss (nats)", "loss.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        budgets = dict(budgets or {})
        budgets.setdefault("gpu", metrics[-1]["gpu_budget_bytes"])
        for tier, color in (("gpu", "C0"), ("cpu", "C1"), ("nvme", "C2")):
            ys = [m["tier_used_bytes"].get(tier, 0) / 2**20 for m in metrics]
            budget = budgets.get(tier) or 0
            if not any(ys) and not budget:
                continue
            ax.plot(steps, ys, lw=1.2, color=color, label=f"{tier} in use")
            if budget:
                ax.axhline(budget / 2**20, lw=1, ls="--", color=color, label=f"{tier} budget")
        ax.plot(steps, [m["gpu_peak_bytes"] / 2**20 for m in metrics], lw=1, ls=":", color="C3",
                label="gpu peak in the step")
        save(fig, ax, "memory by tier", "MiB", "memory.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(steps, [m["tokens_per_s"] for m in metrics], lw=1, label="tokens/s (all ranks)")
        save(fig, ax, "throughput", "tokens per second", "throughput.png")

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write(self.file("summary.json"), _json(summary, indent=2))

    def write_csv(self, metrics: list[dict[str, Any]]) -> None:
        """``metrics.csv``: the metrics' numbers (a tier's bytes as ``tier_used_bytes.gpu``)."""
        import csv
        import io

        rows = [_flat(m) for m in metrics]
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        out = io.StringIO()
        writer = csv.DictWriter(out, keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _write(self.file("metrics.csv"), out.getvalue())

    def write_tensorboard(self, metrics: list[dict[str, Any]]) -> bool:
        """TensorBoard event files in ``tensorboard/`` from ``metrics``, where ``tensorboard`` is
        installed (a run writes them as it goes: [Note: TensorBoard live]); whether it wrote them."""
        from pagemem.commands.train_board import Board

        board = Board(self.file("tensorboard"), metrics)
        wrote = board.writing
        board.close()
        return wrote


def files_of_a_finished_run() -> Iterable[str]:
    """The files a finished run directory holds (checked by tests)."""
    return ("config.toml", "config.json", "config-history.jsonl", "metrics.jsonl", "metrics.csv", "trace.json",
            "trace.chrome.json", "timeline-planned.json", "timeline-measured.json", "loss.png", "memory.png",
            "throughput.png", "summary.json", "checkpoints/latest")


def _move_row(direction: str) -> int:
    """The measured timeline's row (``tid``) of a move direction: one each, the same every session."""
    known = list(MOVE_NAMES)
    return 1 + (known.index(direction) if direction in known else len(known) + sum(map(ord, direction)) % 50)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _json(value: Any, indent: int | None = None) -> str:
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _flat(m: dict[str, Any]) -> dict[str, Any]:
    from pagemem.commands.train_board import flat

    return flat(m)


def _write(path: str, text: str) -> None:
    """Write whole or not at all (a temporary file renamed over)."""
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
