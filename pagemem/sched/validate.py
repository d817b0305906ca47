"""Replay a plan against its trace: memory per tier over logical time, and every violation.

The replay knows nothing of how the planner works. It starts from the state at rest (the home
copies: parameter shards on the plan's home tier, optimizer states on their tier, cached layers
on gpu), applies
each task as the task table of ``pagemem.sched.tasks`` says (what it takes, needs, writes and
gives back, on which tiers, under which conditions), checks at every op that the parameters the
trace accesses there are on the gpu inside a compute window of the plan and that the gradients it
writes have their buffer, and accounts memory per tier, non-model memory included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from pagemem.sched.layout import Layout
from pagemem.sched.plan import Budgets, Plan
from pagemem.sched.holdings import Key, Setting, effects, paused_gc, tier_allowed
from pagemem.sched.tasks import OPERATIONS, TIERS, Target, Task, effect_of
from pagemem.sched.windows import Usage
from pagemem.tracer import Trace
from pagemem.units import format_bytes


@dataclass(frozen=True)
class Violation:
    kind: str
    """``not_resident``, ``use_after_release``, ``over_budget``, ``bad_task``, ``not_updated``,
    ``leak``, ``lost_update``."""
    op_id: int
    target: str
    message: str

    def __str__(self) -> str:
        return f"op {self.op_id}: {self.kind}: {self.message}"


@dataclass
class ValidationReport:
    peak: dict[str, int]
    """Peak bytes per tier over logical time (gpu includes non-model memory)."""
    peak_op: dict[str, int]
    violations: list[Violation]
    timeline: dict[str, np.ndarray]
    """Bytes per tier at each op 0..n (gpu includes non-model memory)."""
    non_model: np.ndarray
    budgets: Budgets
    max_violations: int = 1000
    dropped: int = field(default=0)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = ["valid" if self.ok else f"{len(self.violations) + self.dropped} violation(s)"]
        for tier in TIERS:
            if self.budgets[tier] or self.peak[tier]:
                lines.append(f"  {tier}: peak {format_bytes(self.peak[tier])} at op {self.peak_op[tier]}, "
                             f"budget {format_bytes(self.budgets[tier])}")
        lines += [f"  {v}" for v in self.violations[:10]]
        return "\n".join(lines)


class _Replay:
    """The state of every holding over logical time, changed only as the task table says."""

    def __init__(self, plan: Plan, trace: Trace, budgets: Budgets) -> None:
        self.plan, self.trace, self.budgets = plan, trace, budgets
        self.W = plan.world_size
        self.layout: Layout = plan.layout
        self.setting = Setting.of(plan)
        self.usage = Usage.from_trace(trace)
        self.n = len(trace.ops)
        self.violations: list[Violation] = []
        self.dropped = 0
        self.homes = set(self.setting.at_rest())
        self.held: set[Key] = set(self.homes)
        self.used = dict.fromkeys(TIERS, 0)  # pages
        for k in self.homes:
            self.used[k.tier] += self.setting.held_pages(k)
        self.dirty: set[tuple[str, int]] = set()  # copies written since their home copy was
        self.released: set[int] = set()  # layers whose parameter pages were given back once
        self.windows: dict[int, tuple[int, frozenset[Key]]] = {}  # layer -> (end op, what it reads)
        self.changes = [0] * len(self.layout.layers)  # per layer: holdings taken or given back so far
        self.resident: dict[int, tuple[int, frozenset[Key]]] = {}  # layer -> (changes, reads) found held
        self.updates = [0] * len(self.layout.layers)
        # which layers' params / grads each op accesses, and what an access needs on the gpu
        self.param_at: dict[int, list[int]] = {}
        for ws in self.usage.windows:
            for w in ws:
                for op in w.accesses:
                    self.param_at.setdefault(op, []).append(w.layer)
        self.grad_at: dict[int, list[int]] = {}
        self.grad_last = {}
        for g in self.usage.grads:
            if g is None:
                continue
            for op in g.accesses:
                self.grad_at.setdefault(op, []).append(g.layer)
            self.grad_last[g.layer] = g.last
        self.compute_fx = [effects(Task("compute", Target("layer", L), 0, "gpu", produces_grads=True), self.setting)
                           for L in range(len(self.layout.layers))]

    def bad(self, kind: str, op: int, target: object, message: str) -> None:
        if len(self.violations) < 1000:
            self.violations.append(Violation(kind, op, str(target), message))
        else:
            self.dropped += 1

    # ------------------------------------------------------------------ tasks

    def apply(self, task: Task) -> None:
        fx = effects(task, self.setting)
        if fx is None or not fx.tier_ok:
            self._reject(task)
            return
        eff, t, L, held = fx.effect, task.trigger_id, task.target.layer, self.held
        if eff.after_grads and t <= self.grad_last.get(L, -1):
            self.bad("bad_task", t, task.target, f"{task.operation} before the last gradient access "
                     f"(op {self.grad_last[L]})")
        if task.operation == "update":
            self.updates[L] += 1
        if eff.gates_ops:  # its reads are checked at every op of its window that uses the layer
            self.windows[L] = (task.end_id if task.end_id is not None else t, frozenset(fx.reads))
        elif not held.issuperset(fx.reads):
            missing = [k for k in fx.reads if k not in held]
            self.bad("not_resident", t, task.target, f"{task.operation} needs {_describe(missing)}, not there")
            return
        if fx.takes:
            if held.isdisjoint(fx.takes):
                held.update(fx.takes)
                for tier, pages in fx.taken:
                    self.used[tier] += pages
            else:
                dup = [k for k in fx.takes if k in held]
                self.bad("bad_task", t, task.target, f"{task.operation} takes {_describe(dup)}, already there")
                for k in fx.takes:
                    if k not in dup:
                        held.add(k)
                        self.used[k.tier] += self.setting.held_pages(k)
            self.changes[L] += 1
        for k in fx.writes:
            home = self.setting.home(k.name, k.layer)
            if home is None:  # a holding with no home copy (gradients): nothing to write back
                continue
            if k.tier == home:
                self.dirty.discard((k.name, k.layer))
            else:
                self.dirty.add((k.name, k.layer))
        if fx.frees:
            self._free(task, fx.frees)

    def _reject(self, task: Task) -> None:
        """Say why the task table has no effect for ``task`` (or not on its tier)."""
        op, tg, t, L = task.operation, task.target, task.trigger_id, task.target.layer
        eff = effect_of(task)
        if not 0 <= L < len(self.layout.layers):
            self.bad("bad_task", t, tg, f"{op} names layer {L}, which does not exist")
        elif tg.page is not None and not 0 <= tg.page < self.layout.layers[L].param_pages:
            self.bad("bad_task", t, tg, f"{op} names page {tg.page} of {self.layout.layers[L].param_pages}")
        elif eff is None:
            self.bad("bad_task", t, tg, f"unknown operation {op!r}" if op not in OPERATIONS
                     else f"{op} of a {tg.kind}: no such task")
        elif not tier_allowed(task, self.setting):
            self.bad("bad_task", t, tg, f"{op} of a {tg.kind} on tier {task.tier}: the task table allows "
                     f"{', '.join(str(x) for x in eff.tiers)}")
        else:  # the row's own condition does not hold
            self.bad("bad_task", t, tg, f"{op} of a {tg.kind}: the task table has it only where {eff.when} "
                     f"(world size {self.W}, parameters homed on {self.setting.home('param', L)})")

    def _free(self, task: Task, keys: tuple[Key, ...]) -> None:
        t, tg, L = task.trigger_id, task.target, task.target.layer
        end, reads = self.windows.get(L, (-1, frozenset()))
        if end > t and reads.intersection(keys):
            self.bad("bad_task", t, tg, f"release inside the layer's compute window, which ends at op {end}")
        absent = [k for k in keys if k not in self.held and k.page is None]
        if absent:
            self.bad("bad_task", t, tg, f"release of {_describe(absent)}, which is not there")
        if any((k.name, L) in self.dirty and k in self.held for k in keys):
            self.bad("lost_update", t, tg, f"{tg.kind} released before it was written back")
        for k in keys:
            if k in self.held:
                self.held.discard(k)
                self.used[k.tier] -= self.setting.held_pages(k)
                if k.name == "param" and k.tier == "gpu":
                    self.released.add(L)
        self.changes[L] += 1

    # ------------------------------------------------------------------ accesses

    def check_op(self, t: int) -> None:
        for L in self.param_at.get(t, ()):
            lay = self.layout.layers[L]
            end, reads = self.windows.get(L, (-1, frozenset()))
            if end < t:
                self.bad("bad_task", t, f"layer[{L}]", f"op {t} ({self.trace.ops[t].module}) uses layer {lay.name} "
                         "outside every compute window of the plan")
                reads = frozenset(self.compute_fx[L].reads)
            if self.resident.get(L) == (self.changes[L], reads):
                continue
            if all(k in self.held for k in reads):
                self.resident[L] = (self.changes[L], reads)
            else:
                kind = "use_after_release" if L in self.released else "not_resident"
                what = "gathered " if self.W > 1 else ""
                have = sum(all(k in self.held for k in reads if k.page == j) for j in range(lay.param_pages))
                self.bad(kind, t, f"param[{L}]",
                         f"op {t} ({self.trace.ops[t].module}) uses layer {lay.name}: {have} of "
                         f"{lay.param_pages} pages {what}on the gpu")
        for L in self.grad_at.get(t, ()):
            if not all(k in self.held for k in self.compute_fx[L].takes):
                self.bad("not_resident", t, f"grad[{L}]",
                         f"op {t} writes layer {self.layout.layers[L].name}'s gradients, which have no gpu buffer")

    def finish(self) -> None:
        n = self.n
        for L, lay in enumerate(self.layout.layers):
            if L in self.grad_last and self.updates[L] != 1:
                self.bad("not_updated", n, f"layer[{L}]", f"layer {lay.name} updated {self.updates[L]} times")
        for name, L in sorted(self.dirty):
            self.bad("lost_update", n, f"{name}[{L}]",
                     f"layer {self.layout.layers[L].name}'s updated {name} states never written back")
        left: dict[tuple[int, bool], list[Key]] = {}
        for k in self.held - self.homes:
            left.setdefault((k.layer, k.name == "optim"), []).append(k)
        for (L, optim), keys in sorted(left.items()):
            name = self.layout.layers[L].name
            if optim:
                self.bad("leak", n, f"optim[{L}]", f"layer {name}'s optimizer states still staged")
            else:
                self.bad("leak", n, f"layer[{L}]", f"layer {name} still holds pages at the end of the iteration: "
                         + _describe(keys))


def _describe(keys: list[Key]) -> str:
    """``param[3].0..7@gpu``-style summary of some holdings."""
    groups: dict[tuple[str, int, str], list[int | None]] = {}
    for k in keys:
        groups.setdefault((k.name, k.layer, k.tier), []).append(k.page)
    parts = []
    for (name, L, tier), pages in sorted(groups.items()):
        ps = sorted(p for p in pages if p is not None)
        span = "" if not ps else f".{ps[0]}" if len(ps) == 1 else f".{{{len(ps)} pages}}"
        parts.append(f"{name}[{L}]{span}@{tier}")
    return ", ".join(parts)


def validate(plan: Plan, trace: Trace, budgets: "Budgets | Mapping[str, int | str] | None" = None) -> ValidationReport:
    """Replay ``plan`` against ``trace``; report peak memory per tier and every violation."""
    b = Budgets.parse(budgets) if budgets is not None else plan.budgets
    n, pb = len(trace.ops), plan.page_bytes
    non_model = np.array([op.non_model_bytes for op in trace.ops] + [0], dtype=np.int64)
    series = {tier: np.zeros(n + 1, dtype=np.int64) for tier in TIERS}
    if trace.fingerprint != plan.trace_fingerprint or plan.n_ops != n or len(trace.layers) != len(plan.layout.layers):
        mismatch = Violation("bad_task", 0, "plan", "the plan was made for a trace with another access order; "
                             "nothing was replayed")
        return ValidationReport(dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0), [mismatch], series, non_model, b)
    with paused_gc():
        return _replay(plan, trace, b, n, pb, non_model, series)


def _replay(plan: Plan, trace: Trace, b: Budgets, n: int, pb: int, non_model: np.ndarray,
            series: dict[str, np.ndarray]) -> ValidationReport:
    rp = _Replay(plan, trace, b)
    by_trigger: list[list[Task]] = [[] for _ in range(n + 1)]
    ends: list[list[Task]] = [[] for _ in range(n + 1)]
    last = -1
    for task in plan.tasks:
        t = task.trigger_id
        if not 0 <= t <= n:
            rp.bad("bad_task", 0, task.target, f"trigger {t} is outside 0..{n}")
            continue
        at_end = task.issued_at_end
        key = 2 * t + at_end
        if key < last:
            rp.bad("bad_task", t, task.target, "the queue is not ordered by trigger")
        last = max(last, key)
        (ends if at_end else by_trigger)[t].append(task)
    for t in range(n + 1):
        for task in by_trigger[t]:
            rp.apply(task)
        if t < n:
            rp.check_op(t)
        for tier in TIERS:
            series[tier][t] = rp.used[tier] * pb
        for task in ends[t]:
            rp.apply(task)
    rp.finish()
    series["gpu"] = series["gpu"] + non_model
    peak, peak_op = {}, {}
    for tier in TIERS:
        i = int(np.argmax(series[tier]))
        peak[tier], peak_op[tier] = int(series[tier][i]), i
        if peak[tier] > b[tier]:
            first = int(np.argmax(series[tier] > b[tier]))
            rp.bad("over_budget", first, tier,
                   f"{tier} holds {format_bytes(int(series[tier][first]))} at op {first}, over its budget of "
                   f"{format_bytes(b[tier])} (peak {format_bytes(peak[tier])} at op {i})")
    return ValidationReport(peak, peak_op, rp.violations, series, non_model, b, dropped=rp.dropped)
