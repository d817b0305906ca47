"""Follow a plan's task queue during an iteration, on the shared op clock.

``Schedule.compile(plan, trace, bank)`` turns a plan into what to do at the start and at the end
of each op (the task table, ``pagemem.sched.tasks``, says at which edge each task is issued):

- ``move_to_cpu param.j`` (compute copies on nvme) -> ``Residency.stage_host``: start copying a
  run of the unit's pages from nvme to a cpu copy, which the ``move_to_gpu`` then copies from;
  ``release param @cpu`` -> ``Residency.release_host`` drops it;
- ``move_to_gpu param.j`` -> ``Residency.stage``: start copying a run of the unit's pages to the
  gpu (consecutive pages of one layer issued at one op travel as one call), from the cpu copy
  where there is one, else (``source="nvme"``: a page the plan did not stage) straight from nvme
  through the store's staging pages, which the cpu budget does not count;
- ``compute layer`` -> ``Residency.bind``: wait for that unit's copies only, then point its
  parameters at them;
- ``release param`` -> ``Residency.release``;
- ``move_to_cpu optim`` (optimizer states on nvme) -> ``ParamBank.stage_states``: a cpu copy
  (of as many pages as the unit's streamed update holds) started during backward, which the update
  then finds in memory.

[Note: what the executor leaves to the updater] Every row of the task table has its handler in
``HANDLERS``; gradient offloads, optimizer-state write-backs and updates are the updater's
(``update.py``), and their rows say so there: the engine's gradients are fp32 sums
that autograd's gradient is added into as soon as it is ready (so the gpu holds it for less time
than the plan's ``grad@gpu`` reserves), on the cpu, or on the gpu beside optimizer states kept
there (``ParamBank.grad_tier_of``), and the update runs at ``step()``, or during
backward when that is exact (``EngineConfig.overlap_update``); states on nvme are written back
behind the next iteration. Layers the plan caches on the gpu keep their parameters resident
across iterations, as their only copy (``Residency.settle``), and their optimizer states and
gradient sums on the gpu (``ParamBank.place_states``), so that their update runs there, as the
plan's ``update`` task says (the planner counted them at what the engine keeps there: the
layout the engine hands it, ``unit_layout``); the others' stay on the optimizer tier.

[Note: leaving the plan] Every op is checked against the trace the plan was made from (its event
and module). At the first op that differs, or when the iteration ends early, the executor stops
and the engine finishes the iteration on demand; the plan is dropped and the next iteration with
these inputs is traced and planned again. Results never depend on the plan, only speed and
memory do.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.residency import Residency
from pagemem.engine.units.shards import unit_gather_elements
from pagemem.errors import OutOfMemory
from pagemem.sched import Layout, Plan
from pagemem.sched.tasks import EFFECTS
from pagemem.tracer import Op, Trace


class PlanMismatch(Exception):
    """The plan does not describe the engine's units (the engine then pages on demand)."""


@dataclass(frozen=True)
class Handler:
    """Who carries out one row of the task table (``pagemem.sched.tasks.EFFECTS``) in this engine."""

    action: str | None
    """The ``Action`` the executor runs at the task's edge; None where another part does it."""
    by: str = "executor"
    why: str = ""


HANDLERS: dict[tuple[str, str], Handler] = {
    ("move_to_gpu", "param"): Handler("stage"),
    ("move_to_cpu", "param"): Handler("stage_host"),
    ("compute", "layer"): Handler("bind"),
    ("release", "param"): Handler("release"),
    ("move_to_cpu", "optim"): Handler("fetch_optim"),
    ("offload", "grad"): Handler(None, "the gradient hand-off", "autograd's gradient is added into the fp32 "
                                 "sums in its post-accumulate hook (Gradients.hand_off); sums on nvme are "
                                 "written there through the store"),
    ("move_to_cpu", "grad"): Handler(None, "the updater", "step() brings the sums on nvme to the cpu a batch at a "
                                     "time, with the states ([Note: homes on nvme])"),
    ("release", "grad"): Handler(None, "the gradient hand-off", "autograd's own gradient is dropped when the hook "
                                 "returns; the sums are the update's"),
    ("update", "layer"): Handler(None, "the updater", "in step(), or during backward where that is exact"),
    ("all_reduce", "grad"): Handler(None, "the gradient averaging", "at the end of the backward that completes an "
                                    "accumulation step, every unit's sums at once ([Note: data parallel over the "
                                    "process group]); with gathered units, each unit's reduce-scatter once every "
                                    "rank has its gradients ([Note: sharded gradient sums])"),
    ("all_gather", "optim"): Handler(None, "the updater", "after step() updated this rank's share, every unit's at "
                                     "once (ranks/gather.py)"),
    ("offload", "optim"): Handler(None, "the updater", "the write-back to nvme after the update, behind the next "
                                  "iteration"),
    ("release", "optim"): Handler(None, "the updater", "the write-back moves the states home, which drops the cpu "
                                  "copy"),
}
"""Each row of the task table, and what carries it out: ``Schedule.compile`` refuses a plan with
a task whose row is not here (all-gathers and reduce-scatters exist only with several ranks,
and get their handlers with data parallelism)."""


def unhandled_rows(world_size: int) -> list[tuple[str, str]]:
    """Rows of the task table that plans at ``world_size`` may contain and no handler carries out."""
    return [key for key, eff in EFFECTS.items()
            if key not in HANDLERS and not ("W>1" in eff.when and world_size == 1)]


@dataclass(frozen=True)
class Action:
    kind: str
    """``stage``, ``stage_host``, ``bind``, ``release``, ``release_host`` or ``fetch_optim``."""
    unit: int
    pages: range | None = None


@dataclass(frozen=True)
class Schedule:
    """A plan compiled for the engine's units: actions per op edge, and what each op must be."""

    at_start: tuple[tuple[Action, ...], ...]
    at_end: tuple[tuple[Action, ...], ...]
    expected: tuple[tuple[str, str], ...]
    """(event, module) of every op the plan covers before the optimizer step."""
    non_model: tuple[int, ...]
    """The trace's non-model bytes per op."""
    cached: frozenset[int]
    """Units whose parameters stay on the gpu between iterations."""
    plan: Plan
    trace: Trace
    gpu_states: frozenset[int] = frozenset()
    """Cached units whose optimizer states and gradient sums the engine keeps on the gpu: every
    cached one (the plan counted them at what the engine keeps there)."""

    @classmethod
    def compile(cls, plan: Plan, trace: Trace, bank: ParamBank) -> "Schedule":
        to_unit = units_of_layers(trace, bank)
        for layer in trace.layers:
            u = to_unit[layer.index]
            pages = bank.compute_pages(u)
            if plan.layout.layers[layer.index].param_pages != pages:
                raise PlanMismatch(f"layer {layer.name!r}: the plan moves {plan.layout.layers[layer.index].param_pages}"
                                   f" pages, the engine's unit has {pages}")
        n = plan.n_ops + 1
        start: list[list[Action]] = [[] for _ in range(n)]
        end: list[list[Action]] = [[] for _ in range(n)]
        for task in plan.tasks:
            target = task.target
            handler = HANDLERS.get((task.operation, target.kind))
            if handler is None:
                raise PlanMismatch(f"the plan has a {task.operation} {target.kind} task (world size "
                                   f"{plan.world_size}), a row of the task table this engine has no handler for")
            if handler.action is None:
                continue  # carried out elsewhere (see HANDLERS)
            pages = range(target.page, target.page + 1) if target.page is not None else None
            action = handler.action
            if action == "release" and task.tier == "cpu":  # the cpu copy staged from nvme goes
                action = "release_host"
            act = Action(action, to_unit[target.layer], pages if action in ("stage", "stage_host") else None)
            edge = end if task.issued_at_end else start
            _append(edge[task.trigger_id], act)
        expected = tuple((op.event, op.module) for op in trace.ops if op.phase != "step")
        cached = frozenset(to_unit[L] for L in plan.cached_layers)
        return cls(tuple(map(tuple, start)), tuple(map(tuple, end)), expected,
                   tuple(op.non_model_bytes for op in trace.ops), cached, plan, trace, cached)


def unit_layout(trace: Trace, bank: ParamBank, page_bytes: int, world_size: int = 1) -> Layout:
    """The pages of every trace layer as the engine lays out its unit (computed once, here, from
    the store's layout, and handed to the planner: ``plan(layout=)``): the compute pages it moves,
    the gpu pages its optimizer states and gradient sums take where a plan caches it
    (``ParamBank.gpu_state_pages``), and the cpu pages its update holds at once where it streams
    them from nvme (``ParamBank.stream_pages``: one parameter at a time). The rest (optimizer
    bytes, elements) is the trace's."""
    to_unit = units_of_layers(trace, bank)
    base = Layout.from_trace(trace, 1, page_bytes)
    layers = tuple(dataclasses.replace(lay, param_pages=bank.compute_pages(u := to_unit[lay.index]),
                                       cached_pages=bank.gpu_state_pages(u), stream_pages=bank.stream_pages(u))
                   for lay in base.layers)
    if world_size == 1:
        return Layout(page_bytes, 1, layers)
    # several ranks ([Note: data parallel over the process group]): every rank holds the whole
    # compute copy and gradient sums, averages the sums (all_reduce) and, with the states
    # sharded, updates its share and all-gathers it ([Note: sharded moments]): the plan's
    # "states" rows, with what this rank updates and sends per unit
    gather = (unit_gather_elements([list(layer.params) for layer in bank.layers], bank.every_share())
              if bank.shards is not None else None)
    units = sharding_of(bank) == "units"  # [Note: gathered units]: no compute copy at rest
    sharded = []
    for lay in layers:
        u = to_unit[lay.index]
        trained = [i for i in bank.layers[u].params if bank.is_trainable(i)]
        numel = {i: bank.params[i][1].numel() for i in trained}
        owned = {i: bank.owned_numel(i) for i in trained}
        optim = sum(4 * (owned[i] if bank.master_sharded(i) else numel[i]) + 8 * owned[i] for i in trained)
        extra = {"gather_elements": gather[u] if gather is not None else 0}
        if units:  # each rank's part of the unit's gather and of its reduce-scatter: the largest rank's share
            members = bank.layers[u].params
            shares = bank.every_share()
            extra = dict(shard_bytes=0, gather_elements=max(sum(sh.owned(i) for i in members) for sh in shares),
                         unit_gather_bytes=max(sum(sh.owned(i) * bank.compute_dtype_of(i).itemsize for i in members)
                                               for sh in shares))
        sharded.append(dataclasses.replace(
            lay, shard_elements=sum(owned.values()), elements=sum(numel.values()), optim_bytes=optim,
            optim_pages=-(-optim // page_bytes), **extra))
    return Layout(page_bytes, world_size, tuple(sharded), sharding_of(bank))


def sharding_of(bank: ParamBank) -> str:
    """How a data-parallel engine's plans shard: ``units`` where its units are gathered (with
    compute copies homed on the cpu: [Note: gathered units]), else ``states``."""
    return "units" if bank.gathered and bank.home_tier == "cpu" else "states"


def units_of_layers(trace: Trace, bank: ParamBank) -> dict[int, int]:
    """The engine's unit of each of the trace's layers (by their parameters); ``PlanMismatch``
    for a layer that is none."""
    unit_of = {frozenset(idx): u for u, (_, idx) in enumerate(bank.units)}
    out = {}
    for layer in trace.layers:
        u = unit_of.get(frozenset(layer.tensor_ids))
        if u is None:
            raise PlanMismatch(f"the trace's layer {layer.name!r} is not one of the engine's units")
        out[layer.index] = u
    return out


def _append(actions: list[Action], act: Action) -> None:
    """Add ``act``, merging a page into the run of the same unit staged just before it."""
    if actions and act.kind in ("stage", "stage_host"):
        last = actions[-1]
        if last.kind == act.kind and last.unit == act.unit and last.pages.stop == act.pages.start:
            actions[-1] = Action(act.kind, act.unit, range(last.pages.start, act.pages.stop))
            return
    actions.append(act)


@dataclass
class ExecutorTotals:
    """What the executors of one engine did, summed over its planned iterations."""

    seconds: float = 0.0
    """Host time spent following plans at op edges (the actions and their checks; copies that run
    inline, as on the host stand-in, included: ``Engine.stats()`` has their own seconds)."""
    releases: int = 0
    """Units given back by a plan's ``release``: one per window of a layer the plan moves."""


class Executor:
    """Runs one schedule's actions as the clock numbers the ops of an iteration."""

    def __init__(self, schedule: Schedule, residency: Residency, totals: ExecutorTotals | None = None) -> None:
        self.schedule = schedule
        self.residency = residency
        self.totals = totals if totals is not None else ExecutorTotals()
        self.diverged_at: int | None = None
        self.diverged_on: tuple[str, str] | None = None
        """The op (event, name) that did not match the trace, where one did not (None where the
        iteration ended early)."""
        self.n_ops = 0
        """Ops of this iteration that matched the trace so far."""

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    def begin(self) -> None:
        """Before op 0: only the cached units may be on the gpu; settle those that are not yet
        (``Residency.settle``: the first planned iteration copies them, later ones find them),
        and put the optimizer states the schedule keeps on the gpu there (``ParamBank.place_states``;
        those of other units home)."""
        res, cached = self.residency, self.schedule.cached
        for u in res.resident_units():
            if u not in cached:
                res.release(u)
        for u in sorted(cached):
            res.settle(u)
        bank, on_gpu = res.bank, self.schedule.gpu_states
        for u in range(len(bank.layers)):  # states going home first: their pages make room
            if u not in on_gpu:
                bank.place_states(u, None)
        for u in sorted(on_gpu):
            bank.place_states(u, "gpu")

    def on_op(self, op_id: int, edge: str, op: Op) -> None:
        if self.diverged or op.event == "step":
            return
        t0 = time.perf_counter()
        try:
            self._on_op(op_id, edge, op)
        finally:
            self.totals.seconds += time.perf_counter() - t0

    def _on_op(self, op_id: int, edge: str, op: Op) -> None:
        sched = self.schedule
        if edge == "start":
            if op_id >= len(sched.expected) or sched.expected[op_id] != (op.event, op.name):
                self.diverged_at, self.diverged_on = op_id, (op.event, op.name)
                return
            self.n_ops = op_id + 1
            for act in sched.at_start[op_id]:
                self._run(act)
            if op.params and op.event in ("forward_pre", "backward_pre"):
                for u in self.residency.units_of(op.params):  # the plan binds them; a safety net
                    self.residency.bind(u)
        else:
            for act in sched.at_end[op_id]:
                self._run(act)

    def divergence(self) -> dict[str, Any] | None:
        """Where this iteration left its plan: the op, what the trace had there, what ran."""
        if self.diverged_at is None:
            return None
        at, expected = self.diverged_at, self.schedule.expected
        return {"op": at, "of": len(expected), "expected": list(expected[at]) if at < len(expected) else None,
                "got": list(self.diverged_on) if self.diverged_on else None}

    def finish(self) -> None:
        """The iteration's backward is over: an iteration shorter than the trace left the plan."""
        if not self.diverged and self.n_ops < len(self.schedule.expected):
            self.diverged_at = self.n_ops

    def _run(self, act: Action) -> None:
        res = self.residency
        if act.kind == "stage":
            if res.is_bound(act.unit):
                return
            try:
                res.stage(act.unit, act.pages)
            except OutOfMemory:
                pass  # the compute copies what is missing (a miss); the plan said it fits, so rare
        elif act.kind == "bind":
            res.bind(act.unit)
        elif act.kind == "stage_host":
            res.stage_host(act.unit, act.pages)
        elif act.kind == "release_host":
            res.release_host(act.unit)
        elif act.kind == "fetch_optim":
            res.bank.stage_states(act.unit)
        else:
            res.release(act.unit)
            self.totals.releases += 1
