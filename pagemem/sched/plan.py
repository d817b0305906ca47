"""A plan: the ordered task queue, with what it was made for and a readable summary."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from pagemem.errors import ConfigError
from pagemem.sched.layout import LayerLayout, Layout
from pagemem.sched.deps import Deps, dependencies
from pagemem.sched.holdings import Setting, costs
from pagemem.sched.network import COLLECTIVES, bus_bytes
from pagemem.sched.tasks import TIERS, TRANSFERS, Target, Task
from pagemem.units import format_bytes, parse_size

FORMAT = "pagemem-plan"
HOME_TIERS: tuple[str, ...] = ("cpu", "nvme")
"""Where a plan may home the compute copies of the layers it does not cache on the gpu."""
VERSION = 4
"""Version 4 adds each task's ``source`` (a move to the gpu straight from nvme) and each layer's
``stream_pages``; version 3 plans load with neither (their tasks copy from the cpu, their updates
hold whole layers). Version 3 added the plan's ``home_tier``; version 2 plans load with
``home_tier="cpu"`` (their tasks mean what they meant). Version 2 added to each task its compute window's end, whether it
produces gradients, and what it waits for; version 1 plans load when given the trace they were
made from."""


@dataclass(frozen=True)
class Budgets:
    """Per-rank memory budgets in bytes. Accepts ints or "8GiB"-style strings."""

    gpu: int
    cpu: int
    nvme: int = 0

    @classmethod
    def parse(cls, value: "Budgets | Mapping[str, int | str]") -> "Budgets":
        if isinstance(value, Budgets):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"budgets: expected a mapping like {{'gpu': '8GiB', 'cpu': '64GiB'}}, got {value!r}")
        unknown = set(value) - set(TIERS)
        if unknown:
            raise ConfigError(f"budgets: unknown tier(s) {sorted(unknown)}; tiers are 'gpu', 'cpu', 'nvme'")
        for tier in ("gpu", "cpu"):
            if tier not in value:
                raise ConfigError(f"budgets['{tier}']: required")
        return cls(**{t: parse_size(v, f"budgets['{t}']") for t, v in value.items()})

    def __getitem__(self, tier: str) -> int:
        return getattr(self, tier)

    def as_dict(self) -> dict[str, int]:
        return {t: self[t] for t in TIERS}


@dataclass
class Plan:
    """The task queue for one training iteration on one rank, in order (``tasks``)."""

    tasks: list[Task]
    layout: Layout
    budgets: Budgets
    world_size: int
    optimizer_tier: str
    n_ops: int
    """Ops in the trace; trigger ids run from 0 to ``n_ops`` (the end of the iteration)."""
    cached_layers: tuple[int, ...]
    """Layers whose parameters, gradients and optimizer states stay on the gpu (updated there)."""
    min_gpu_bytes: int
    """The smallest GPU budget with which the planner finds a plan for this trace."""
    predicted_peak: dict[str, int]
    """Peak bytes per tier over logical time, as the planner's own timelines saw it."""
    trace_fingerprint: str
    non_model: tuple[int, ...] = ()
    """The non-model bytes per op the plan was made for."""
    planning_seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    home_tier: str = "cpu"
    """Where the compute copies (``param``) of layers not cached on the gpu rest: ``cpu``, or
    ``nvme`` with the cpu tier a working set they (and the gradients) are staged through."""
    _deps: tuple = field(default=(None, ()), init=False, repr=False, compare=False)

    @property
    def deps(self) -> tuple[Deps, ...]:
        """Per task (same index as ``tasks``), the tasks it waits for: derived once from the task
        table (``pagemem.sched.tasks``), so always those of ``tasks`` (treat ``tasks`` as
        immutable; ``dataclasses.replace`` makes a plan with other tasks)."""
        tasks, deps = self._deps
        if tasks is not self.tasks or len(deps) != len(self.tasks):
            deps = dependencies(self.tasks, self.setting)
            self._deps = (self.tasks, deps)
        return deps

    @property
    def setting(self) -> Setting:
        """What the task table's symbols stand for in this plan."""
        return Setting.of(self)

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def counts(self) -> dict[str, int]:
        """Tasks per operation."""
        return dict(Counter(t.operation for t in self.tasks))

    def bytes_moved(self) -> dict[str, int]:
        """Bytes per transfer kind: ``h2d``, ``d2h``, ``nvme_read``, ``nvme_write``, ``network``
        (what this rank sends in its collectives, ``network.bus_bytes``)."""
        out = dict.fromkeys(TRANSFERS, 0)
        setting = self.setting
        for t in self.tasks:
            for resource, amount in costs(t, setting):
                if resource in COLLECTIVES:
                    out["network"] += bus_bytes(resource, amount, self.world_size)
                elif resource in out:
                    out[resource] += amount
        return out

    def holds_for(self, trace) -> bool:
        """True when the plan is safe for ``trace``: the same access order (fingerprint) and, at
        every op, no more non-model memory than the plan's spare gpu memory absorbs."""
        if trace.fingerprint != self.trace_fingerprint or len(trace.ops) != self.n_ops:
            return False
        spare = self.budgets.gpu - self.predicted_peak.get("gpu", 0)
        return all(op.non_model_bytes <= planned + spare for op, planned in zip(trace.ops, self.non_model))

    def summary(self) -> str:
        """A few lines for people: size, traffic, peaks against budgets, caching."""
        counts = self.counts()
        moved = self.bytes_moved()
        lines = [
            f"plan: {len(self.tasks)} tasks for {len(self.layout.layers)} layers, {self.n_ops} ops, "
            f"world size {self.world_size}, {format_bytes(self.page_bytes)} pages, optimizer states on "
            f"{self.optimizer_tier}" + (f", parameters and gradients on {self.home_tier}" if self.home_tier != "cpu"
                                        else "") + f"; planned in {self.planning_seconds * 1000:.0f} ms",
            "  tasks: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            "  traffic per iteration: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in moved.items() if v),
            "  peak / budget: " + ", ".join(
                f"{t} {format_bytes(self.predicted_peak.get(t, 0))} / {format_bytes(self.budgets[t])}"
                for t in TIERS if self.budgets[t] or self.predicted_peak.get(t)),
            f"  smallest gpu budget that works: {format_bytes(self.min_gpu_bytes)}",
            "  layers cached on gpu (params, grads, optimizer states): "
            + (", ".join(self.layout.layers[i].name for i in self.cached_layers) if self.cached_layers else "none"),
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "optimizer_tier": self.optimizer_tier,
            "home_tier": self.home_tier,
            "n_ops": self.n_ops,
            "budgets": self.budgets.as_dict(),
            "cached_layers": list(self.cached_layers),
            "min_gpu_bytes": self.min_gpu_bytes,
            "predicted_peak": self.predicted_peak,
            "trace_fingerprint": self.trace_fingerprint,
            "non_model": list(self.non_model),
            "planning_seconds": self.planning_seconds,
            "meta": self.meta,
            "layout": {"page_bytes": self.layout.page_bytes, "world_size": self.layout.world_size,
                       "sharding": self.layout.sharding,
                       "layers": [list(_layer_fields(l)) for l in self.layout.layers]},
            "tasks": [[t.operation, t.target.kind, t.target.layer, t.target.page, t.trigger_id, t.tier,
                       t.end_id, t.produces_grads, list(d.same), list(d.previous), t.source]
                      for t, d in zip(self.tasks, self.deps)],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], trace=None) -> "Plan":
        """A plan from :meth:`to_dict`'s form. A version 1 plan (which lacks compute window ends
        and dependencies) needs ``trace``, the trace it was made from, to be completed; plans
        before version 3 have their parameters homed on ``cpu``."""
        if data.get("format") != FORMAT:
            raise ConfigError(f"not a pagemem plan (format {data.get('format')!r})")
        version = data.get("version")
        if version not in (1, 2, 3, VERSION):
            raise ConfigError(f"plan version {version!r} is not supported (this pagemem reads 1 to {VERSION})")
        home_tier = data.get("home_tier", "cpu") if version >= 3 else "cpu"
        if home_tier not in HOME_TIERS:
            raise ConfigError(f"plan: home_tier must be one of {', '.join(HOME_TIERS)}, got {home_tier!r}")
        lay = data["layout"]
        layout = Layout(lay["page_bytes"], lay["world_size"], tuple(LayerLayout(*f) for f in lay["layers"]),
                        lay.get("sharding", "params"))
        rows = data["tasks"]
        if version == 1:
            if trace is None:
                raise ConfigError("plan version 1 does not say where compute windows end nor what each task "
                                  "waits for: load it with the trace it was made from (Plan.load(path, trace=...)) "
                                  "or plan again")
            tasks = _complete(
                [Task(op, Target(kind, layer, page), trig, tier) for op, kind, layer, page, trig, tier in rows], trace)
        else:
            tasks = [Task(r[0], Target(r[1], r[2], r[3]), r[4], r[5], r[6], bool(r[7]), r[10] if version >= 4 else None)
                     for r in rows]
        p = cls(tasks, layout, Budgets(**data["budgets"]), data["world_size"], data["optimizer_tier"],
                data["n_ops"], tuple(data["cached_layers"]), data["min_gpu_bytes"],
                dict(data["predicted_peak"]), data["trace_fingerprint"], tuple(data["non_model"]),
                data["planning_seconds"], dict(data.get("meta", {})), home_tier)
        if version == 1 and trace.fingerprint != p.trace_fingerprint:
            raise ConfigError("plan version 1: the trace given is not the one the plan was made from")
        if version != 1:  # version 2 to 4 rows are alike (4 adds a task's source after its waits)
            stored = tuple(Deps(tuple(r[8]), tuple(r[9])) for r in rows)
            if stored != p.deps:
                bad = next(i for i, (a, b) in enumerate(zip(stored, p.deps)) if a != b)
                raise ConfigError(f"plan: task {bad} ({tasks[bad]}) waits for {stored[bad]}, but the task table "
                                  f"of this pagemem says {p.deps[bad]} (a plan written by another version?)")
        return p

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str | os.PathLike, trace=None) -> "Plan":
        """Read a plan written by :meth:`save` (``trace``: see :meth:`from_dict`)."""
        with open(path) as f:
            return cls.from_dict(json.load(f), trace)


def _complete(tasks: list[Task], trace) -> list[Task]:
    """Version 1 tasks with each compute's window end and gradient flag, from the trace."""
    from pagemem.sched.windows import Usage

    usage = Usage.from_trace(trace)
    out = []
    for t in tasks:
        L = t.target.layer
        if t.operation == "compute" and 0 <= L < len(usage.windows):
            win = next((i for i, w in enumerate(usage.windows[L]) if w.start == t.trigger_id), None)
            if win is not None:
                g = usage.grads[L]
                t = replace(t, end_id=usage.windows[L][win].end, produces_grads=g is not None and g.window == win)
        out.append(t)
    return out


def _layer_fields(layer: LayerLayout) -> tuple:
    return (layer.index, layer.name, layer.param_bytes, layer.shard_elements, layer.shard_bytes,
            layer.param_pages, layer.optim_bytes, layer.optim_pages, layer.cached_pages, layer.stream_pages,
            layer.elements, layer.gather_elements, layer.unit_gather_bytes)
