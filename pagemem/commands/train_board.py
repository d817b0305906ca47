"""TensorBoard event files for ``pagemem train``, written as the run goes.

[Note: TensorBoard live] Where ``tensorboard`` is installed (``torch.utils.tensorboard``), the
run's ``tensorboard/`` gets each metrics line's numbers as the line is logged, flushed at once, so
``tensorboard --logdir runs`` follows a running job and a job killed outright (kill -9) leaves
the steps it logged. A session starts the directory afresh from ``metrics.jsonl`` (which a
resumed run keeps up to its checkpoint), so the steps a killed session logged past its last
checkpoint are not shown twice. Without ``tensorboard`` nothing is written (``metrics.csv`` always is).
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, Iterable


class Board:
    """The event files of one session (``writer`` None: ``tensorboard`` is not installed, or
    ``path`` None: a rank that writes nothing)."""

    def __init__(self, path: str | None, before: Iterable[dict[str, Any]] = ()) -> None:
        self.writer: Any = None
        if path is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        shutil.rmtree(path, ignore_errors=True)
        try:
            self.writer = SummaryWriter(path)
            for m in before:
                self._add(m)
            self.writer.flush()
        except OSError as exc:
            self._give_up(exc)

    @property
    def writing(self) -> bool:
        return self.writer is not None

    def add(self, m: dict[str, Any]) -> None:
        """One metrics line's numbers, flushed to disk before this returns."""
        if self.writer is not None:
            try:
                self._add(m)
                self.writer.flush()
            except OSError as exc:
                self._give_up(exc)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _give_up(self, exc: OSError) -> None:
        """A disk that refuses the event files (full, or a file where the directory goes): the
        run goes on without them (``metrics.jsonl`` and ``metrics.csv`` hold the same)."""
        print(f"pagemem train: warning: TensorBoard event files are not written from here on ({exc}); "
              "metrics.jsonl and metrics.csv hold the metrics", file=sys.stderr)
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass

    def _add(self, m: dict[str, Any]) -> None:
        for key, value in flat(m).items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key.replace(".", "/"), value, m["step"], walltime=m.get("time"))


def flat(m: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A metrics line with its tables' keys dotted (``tier_used_bytes.gpu``); lists left out."""
    out: dict[str, Any] = {}
    for k, v in m.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[prefix + k] = v
    return out
