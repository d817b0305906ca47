"""What a simulation returns: the events of every stream and the figures of the last iteration
(see :mod:`pagemem.sched.simulate`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from pagemem.errors import PageMemError
from pagemem.sched.hardware import STREAMS, HardwareProfile
from pagemem.units import format_bytes

TIERS = ("gpu", "cpu")
"""The tiers the simulation accounts in bytes."""


class SimulationError(PageMemError):
    """The plan cannot be simulated (its state at rest does not fit its budgets)."""


class SimulationDeadlock(SimulationError):
    """Nothing can move again: every stream waits for something that will never happen.

    ``time`` is the simulated second it happened, ``iteration`` the iteration of the earliest
    unfinished task, ``blocked`` one line per stream saying what it waits for."""

    def __init__(self, time: float, iteration: int, blocked: list[str]) -> None:
        self.time = time
        self.iteration = iteration
        self.blocked = blocked
        super().__init__(f"deadlock at {time:.6f} s in iteration {iteration}: "
                         + "; ".join(blocked))


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One task or op that ran on a stream."""

    stream: str
    name: str
    iteration: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """The simulated timeline and what it says about the steady-state (last) iteration."""

    iteration_time: float
    """Seconds of the last simulated iteration (first use of parameters to the next one's)."""
    busy: Mapping[str, float]
    """Seconds of work per stream belonging to the last iteration."""
    stalls: Mapping[str, float]
    """The compute stream's idle seconds in the last iteration, by the stream that caused them."""
    peak: Mapping[str, int]
    """Highest bytes held on ``gpu`` (non-model memory included) and ``cpu`` during the run."""
    iteration_times: tuple[float, ...]
    """Every simulated iteration's time, the last one included."""
    world_size: int
    profile: HardwareProfile
    steady: bool
    """True when the last two iterations took the same time (to 1e-9) and no stream had more
    work per iteration than that: a steady state."""
    events: tuple[SimEvent, ...] = field(repr=False)
    memory: tuple[tuple[float, int, int], ...] = field(repr=False)
    """``(time, gpu bytes, cpu bytes)`` after every change."""

    @property
    def iterations(self) -> int:
        """How many iterations were simulated (the last is reported)."""
        return len(self.iteration_times)

    @property
    def gpu_idle_fraction(self) -> float:
        """1 - compute busy / iteration time (0 for an iteration that takes no time)."""
        return 1.0 - self.busy["compute"] / self.iteration_time if self.iteration_time > 0 else 0.0

    def utilization(self) -> dict[str, float]:
        """Busy seconds per stream over the iteration time."""
        t = self.iteration_time
        return {s: b / t if t > 0 else 0.0 for s, b in self.busy.items()}

    def summary(self) -> str:
        util = self.utilization()
        state = "steady state" if self.steady else "NOT steady"
        lines = [f"simulated on {self.profile.name} (world size {self.world_size}, {self.iterations} iterations, "
                 f"{state}): iteration {self.iteration_time:.4g} s, gpu idle {self.gpu_idle_fraction:.1%}",
                 "  busy: " + ", ".join(f"{s} {self.busy[s]:.4g} s ({util[s]:.0%})" for s in STREAMS),
                 "  gpu idle by cause: " + (", ".join(f"{k} {v:.4g} s" for k, v in
                                                      sorted(self.stalls.items(), key=lambda kv: -kv[1]) if v > 0)
                                            or "none"),
                 "  peak: " + ", ".join(f"{t} {format_bytes(self.peak[t])}" for t in TIERS)]
        return "\n".join(lines)

    def chrome_events(self) -> dict[str, Any]:
        """The timeline as a Chrome trace-event document: one track per stream, memory counters."""
        tids = {s: i + 1 for i, s in enumerate(STREAMS)}
        ev: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1,
                                     "args": {"name": f"pagemem simulation on {self.profile.name}"}}]
        for s, tid in tids.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": s}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for e in self.events:
            ev.append({"name": e.name, "cat": e.stream, "ph": "X", "pid": 1, "tid": tids[e.stream],
                       "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": {"iteration": e.iteration}})
        for t, gpu, cpu in self.memory:
            ev.append({"name": "memory (MiB)", "ph": "C", "pid": 1, "ts": t * 1e6,
                       "args": {"gpu": gpu / 2**20, "cpu": cpu / 2**20}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"iteration_time": self.iteration_time, "gpu_idle_fraction": self.gpu_idle_fraction,
                              "profile": self.profile.name, "world_size": self.world_size}}

    def to_chrome(self, path: str | os.PathLike) -> None:
        """Write :meth:`chrome_events` as JSON (Perfetto, chrome://tracing)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_events(), f, separators=(",", ":"))
