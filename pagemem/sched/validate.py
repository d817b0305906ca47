"""Replay a plan against its trace: memory per tier over logical time, and every violation.

The replay knows nothing of how the planner works. It starts from the state at rest (parameter
shards on cpu, optimizer states on their tier, cached layers on gpu), applies each task with the
meaning given in ``pagemem.sched.tasks``, checks at every op that the parameters and gradients
the trace accesses there are on the gpu, and accounts memory per tier, non-model memory
included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from pagemem.sched.layout import Layout
from pagemem.sched.plan import Budgets, Plan
from pagemem.sched.tasks import TIERS, Task
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
    def __init__(self, plan: Plan, trace: Trace, budgets: Budgets) -> None:
        self.plan, self.trace, self.budgets = plan, trace, budgets
        self.W = plan.world_size
        self.layout: Layout = plan.layout
        self.usage = Usage.from_trace(trace)
        self.n = len(trace.ops)
        self.violations: list[Violation] = []
        self.dropped = 0
        cached = set(plan.cached_layers)
        lay = self.layout.layers
        # per layer: pages on gpu, pages gathered; per page flags
        self.home = ["gpu" if i in cached else "cpu" for i in range(len(lay))]
        self.on_gpu = [[i in cached] * l.param_pages for i, l in enumerate(lay)]
        self.gathered = [[False] * l.param_pages for l in lay]
        self.n_on_gpu = [l.param_pages if i in cached else 0 for i, l in enumerate(lay)]
        self.n_gathered = [0] * len(lay)
        self.released = [False] * len(lay)
        self.fullgrad = [False] * len(lay)
        self.grad = [[set() for _ in range(l.param_pages)] for l in lay]  # tiers holding each grad page
        self.optim_home = ["gpu" if i in cached else plan.optimizer_tier for i in range(len(lay))]
        self.optim = [{h} for h in self.optim_home]
        self.written_back = [True] * len(lay)
        self.updates = [0] * len(lay)
        self.used = dict.fromkeys(TIERS, 0)  # pages
        for l in lay:
            self.used[self.home[l.index]] += l.param_pages
            self.used[self.optim_home[l.index]] += l.optim_pages
        # which layers' params / grads each op accesses; which window allocates gradients
        self.param_at: dict[int, list[int]] = {}
        for ws in self.usage.windows:
            for w in ws:
                for op in w.accesses:
                    self.param_at.setdefault(op, []).append(w.layer)
        self.grad_at: dict[int, list[int]] = {}
        self.grad_alloc: dict[tuple[int, int], int] = {}  # (layer, window start) -> layer
        self.grad_last = {}
        for g in self.usage.grads:
            if g is None:
                continue
            for op in g.accesses:
                self.grad_at.setdefault(op, []).append(g.layer)
            self.grad_alloc[(g.layer, self.usage.windows[g.layer][g.window].start)] = g.layer
            self.grad_last[g.layer] = g.last

    def bad(self, kind: str, op: int, target: object, message: str) -> None:
        if len(self.violations) < 1000:
            self.violations.append(Violation(kind, op, str(target), message))
        else:
            self.dropped += 1

    # ------------------------------------------------------------------ tasks

    def apply(self, task: Task) -> None:
        op, tg, t = task.operation, task.target, task.trigger_id
        L = tg.layer
        if not 0 <= L < len(self.layout.layers):
            self.bad("bad_task", t, tg, f"{op} names layer {L}, which does not exist")
            return
        lay = self.layout.layers[L]
        pages = range(lay.param_pages) if tg.page is None else [tg.page]
        if tg.page is not None and not 0 <= tg.page < lay.param_pages:
            self.bad("bad_task", t, tg, f"{op} names page {tg.page} of {lay.param_pages}")
            return
        handler = getattr(self, f"_{op}", None)
        if handler is None:
            self.bad("bad_task", t, tg, f"unknown operation {op!r}")
            return
        handler(task, L, lay, pages)

    def _move_to_gpu(self, task, L, lay, pages) -> None:
        for j in pages:
            if self.on_gpu[L][j]:
                self.bad("bad_task", task.trigger_id, task.target, "moved to the gpu while already there")
                continue
            self.on_gpu[L][j] = True
            self.n_on_gpu[L] += 1
            self.used["gpu"] += 1

    def _all_gather(self, task, L, lay, pages) -> None:
        if self.W == 1:
            self.bad("bad_task", task.trigger_id, task.target, "all_gather with world size 1")
            return
        for j in pages:
            if not self.on_gpu[L][j]:
                self.bad("not_resident", task.trigger_id, task.target, "all_gather before its page arrived on the gpu")
                continue
            if self.gathered[L][j]:
                self.bad("bad_task", task.trigger_id, task.target, "gathered twice")
                continue
            self.gathered[L][j] = True
            self.n_gathered[L] += 1
            self.used["gpu"] += self.W - 1

    def _compute(self, task, L, lay, pages) -> None:
        if (L, task.trigger_id) in self.grad_alloc:
            if self.W > 1:
                self.fullgrad[L] = True
                self.used["gpu"] += self.W * lay.param_pages
            else:
                for j in range(lay.param_pages):
                    self.grad[L][j].add("gpu")
                self.used["gpu"] += lay.param_pages

    def _reduce_scatter(self, task, L, lay, pages) -> None:
        t = task.trigger_id
        if not self.fullgrad[L]:
            self.bad("not_resident", t, task.target, "reduce_scatter without the layer's full gradients")
            return
        if t <= self.grad_last.get(L, -1):
            self.bad("bad_task", t, task.target, f"reduce_scatter before the last gradient access (op {self.grad_last[L]})")
        for j in pages:
            if "gpu" not in self.grad[L][j]:
                self.grad[L][j].add("gpu")
                self.used["gpu"] += 1

    def _offload(self, task, L, lay, pages) -> None:
        t, tier = task.trigger_id, task.tier
        if task.target.kind == "grad":
            for j in pages:
                if "gpu" not in self.grad[L][j]:
                    self.bad("not_resident", t, task.target, "offload of a gradient page that is not on the gpu")
                    continue
                if tier not in self.grad[L][j]:
                    self.grad[L][j].add(tier)
                    self.used[tier] += 1
        elif task.target.kind == "optim":
            if "cpu" not in self.optim[L] or tier != self.optim_home[L]:
                self.bad("bad_task", t, task.target, f"write-back to {tier} of optimizer states not held on cpu")
                return
            self.written_back[L] = True
        else:
            self.bad("bad_task", t, task.target, "offload of something that is neither grad nor optim")

    def _move_to_cpu(self, task, L, lay, pages) -> None:
        if "cpu" in self.optim[L]:
            self.bad("bad_task", task.trigger_id, task.target, "optimizer states fetched to cpu twice")
            return
        self.optim[L].add("cpu")
        self.used["cpu"] += lay.optim_pages

    def _update(self, task, L, lay, pages) -> None:
        t, tier = task.trigger_id, task.tier
        if t <= self.grad_last.get(L, -1):
            self.bad("bad_task", t, task.target, f"update before the last gradient access (op {self.grad_last[L]})")
        missing = [j for j in range(lay.param_pages) if tier not in self.grad[L][j]]
        if missing:
            self.bad("not_resident", t, task.target, f"update on {tier} without {len(missing)} gradient page(s) there")
        if tier not in self.optim[L]:
            self.bad("not_resident", t, task.target, f"update on {tier} without the optimizer states there")
        self.updates[L] += 1
        if self.optim_home[L] != tier:
            self.written_back[L] = False

    def _release(self, task, L, lay, pages) -> None:
        t, tier, kind = task.trigger_id, task.tier, task.target.kind
        if kind == "param":
            if tier != "gpu":
                self.bad("bad_task", t, task.target, "parameters are only released from the gpu")
                return
            for j in pages:
                if self.gathered[L][j]:
                    self.gathered[L][j] = False
                    self.n_gathered[L] -= 1
                    self.used["gpu"] -= self.W - 1
                if self.on_gpu[L][j] and self.home[L] != "gpu":
                    self.on_gpu[L][j] = False
                    self.n_on_gpu[L] -= 1
                    self.used["gpu"] -= 1
                    self.released[L] = True
        elif kind == "fullgrad":
            if not self.fullgrad[L]:
                self.bad("bad_task", t, task.target, "release of full gradients that do not exist")
                return
            self.fullgrad[L] = False
            self.used["gpu"] -= self.W * lay.param_pages
        elif kind == "grad":
            for j in pages:
                if tier in self.grad[L][j]:
                    self.grad[L][j].discard(tier)
                    self.used[tier] -= 1
        elif kind == "optim":
            if tier == self.optim_home[L] or tier not in self.optim[L]:
                self.bad("bad_task", t, task.target, f"release of optimizer states on {tier}, which is not a copy")
                return
            if not self.written_back[L]:
                self.bad("lost_update", t, task.target, "optimizer states released before they were written back")
            self.optim[L].discard(tier)
            self.used[tier] -= lay.optim_pages
        else:
            self.bad("bad_task", t, task.target, f"release of a {kind}")

    # ------------------------------------------------------------------ accesses

    def check_op(self, t: int) -> None:
        for L in self.param_at.get(t, ()):
            lay = self.layout.layers[L]
            ok = self.n_on_gpu[L] == lay.param_pages and (self.W == 1 or self.n_gathered[L] == lay.param_pages)
            if not ok:
                kind = "use_after_release" if self.released[L] else "not_resident"
                what = "gathered " if self.W > 1 else ""
                have = self.n_gathered[L] if self.W > 1 else self.n_on_gpu[L]
                self.bad(kind, t, f"param[{L}]",
                         f"op {t} ({self.trace.ops[t].module}) uses layer {lay.name}: {have} of "
                         f"{lay.param_pages} pages {what}on the gpu")
        for L in self.grad_at.get(t, ()):
            present = self.fullgrad[L] if self.W > 1 else all("gpu" in g for g in self.grad[L])
            if not present:
                self.bad("not_resident", t, f"grad[{L}]",
                         f"op {t} writes layer {self.layout.layers[L].name}'s gradients, which have no gpu buffer")

    def finish(self) -> None:
        n = self.n
        for L, lay in enumerate(self.layout.layers):
            if L in self.grad_last and self.updates[L] != 1:
                self.bad("not_updated", n, f"layer[{L}]", f"layer {lay.name} updated {self.updates[L]} times")
            if not self.written_back[L]:
                self.bad("lost_update", n, f"optim[{L}]", f"layer {lay.name}'s updated optimizer states never written back")
            extra = self.n_on_gpu[L] - (lay.param_pages if self.home[L] == "gpu" else 0)
            if extra or self.n_gathered[L] or self.fullgrad[L] or any(self.grad[L][j] for j in range(lay.param_pages)):
                self.bad("leak", n, f"layer[{L}]", f"layer {lay.name} still holds pages at the end of the iteration")
            if self.optim[L] != {self.optim_home[L]}:
                self.bad("leak", n, f"optim[{L}]", f"layer {lay.name}'s optimizer states still staged")


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
    rp = _Replay(plan, trace, b)
    by_trigger: list[list[Task]] = [[] for _ in range(n + 1)]
    ends: list[list[Task]] = [[] for _ in range(n + 1)]
    last = -1
    for task in plan.tasks:
        t = task.trigger_id
        if not 0 <= t <= n:
            rp.bad("bad_task", 0, task.target, f"trigger {t} is outside 0..{n}")
            continue
        key = 2 * t + (1 if task.issued_at_end else 0)
        if key < last:
            rp.bad("bad_task", t, task.target, "the queue is not ordered by trigger")
        last = max(last, key)
        (ends if task.issued_at_end else by_trigger)[t].append(task)
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
