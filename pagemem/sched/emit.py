"""The planner's last step: its decisions -- when each run of pages moves, when all-gathers run,
which layers stay on the gpu, what the host tiers step placed -- written out as the task queue,
each task as the table of ``pagemem.sched.tasks`` defines it."""

from __future__ import annotations

from dataclasses import dataclass

from pagemem.sched.host_plan import HostPlan
from pagemem.sched.layout import Layout
from pagemem.sched.tasks import EFFECTS, Target, Task
from pagemem.sched.windows import Usage, Window


@dataclass
class Run:
    """Pages ``[lo, hi)`` of window ``w`` moved to the gpu at trigger ``m``."""

    w: int
    lo: int
    hi: int
    m: int


@dataclass
class Decisions:
    """What the planner decided, for one rank."""

    n: int
    """Ops in the trace (op ``n``: the end of the iteration)."""
    layout: Layout
    usage: Usage
    windows: list[Window]
    """Every window, in time order (``Usage.all_windows``)."""
    runs: list[Run]
    gathers: dict[tuple[int, int], list[tuple[int, int, int]]]
    """Per (window, first page of a run): ``(lo, hi, trigger)`` of its all-gathers (W > 1)."""
    cached: set[int]
    updates: dict[int, int]
    """Per layer with gradients: the op of its reduce-scatter, offload and update."""
    host: HostPlan
    optimizer_tier: str
    home_tier: str


def emit(d: Decisions) -> list[Task]:
    """The task queue: every task the decisions call for, ordered by trigger op, those issued at
    an op's start before those issued at its end (each in the order made here)."""
    n, cached, host = d.n, d.cached, d.host
    sharded = d.layout.shards_params  # ZeRO-3: all-gathers before compute, reduce-scatters after
    averaged = d.layout.shards_states  # ZeRO-1: an all-reduce before the update, an all-gather after
    combined = averaged or d.layout.gathers_units  # units: a reduce-scatter before the update, nothing after
    starts: list[list[Task]] = [[] for _ in range(n + 1)]
    ends: list[list[Task]] = [[] for _ in range(n + 1)]

    at_end = {key: e.issued == "end" for key, e in EFFECTS.items()}

    def put(task: Task) -> None:  # the table says when in its trigger op a task is issued
        (ends if at_end[task.operation, task.target.kind] else starts)[task.trigger_id].append(task)

    layers = d.layout.layers
    runs_of: dict[int, list[Run]] = {}
    for run in d.runs:
        runs_of.setdefault(run.w, []).append(run)
    grad_window = {(g.layer, d.usage.windows[g.layer][g.window].start)
                   for g in d.usage.grads if g is not None}
    # nvme homes: the pages of each window that the cpu holds are staged there first (queued
    # before the moves that read them, also at one op), the staged copy given back after the
    # window's last move; the others move straight from nvme
    staged: dict[int, set[int]] = {}
    for wi, runs in host.stage.items():
        L = d.windows[wi].layer
        for lo, hi, f in runs:
            for j in range(lo, hi):
                put(Task("move_to_cpu", Target("param", L, j), f, "cpu"))
            staged.setdefault(wi, set()).update(range(lo, hi))
        put(Task("release", Target("param", L), host.unstage[wi], "cpu"))
    direct = "nvme" if d.home_tier == "nvme" else None
    for wi, w in enumerate(d.windows):
        L = w.layer
        is_cached = L in cached
        mine = staged.get(wi, set())
        for run in runs_of.get(wi, []):
            if not is_cached:
                for j in range(run.lo, run.hi):
                    put(Task("move_to_gpu", Target("param", L, j), run.m, "gpu",
                             source=None if j in mine else direct))
            if sharded:
                for glo, ghi, g in d.gathers[(wi, run.lo)]:
                    for j in range(glo, ghi):
                        put(Task("all_gather", Target("param", L, j), g))
        put(Task("compute", Target("layer", L), w.start, "gpu", end_id=w.end,
                 produces_grads=(L, w.start) in grad_window))
        if not is_cached or sharded:
            put(Task("release", Target("param", L), w.end, "gpu"))
    for g in d.usage.grads:
        if g is None:
            continue
        L, r = g.layer, d.updates[g.layer]
        pages = layers[L].param_pages
        if sharded:
            for j in range(pages):
                put(Task("reduce_scatter", Target("grad", L, j), r))
            put(Task("release", Target("fullgrad", L), r, "gpu"))
        if L in cached:
            if combined:
                put(Task("all_reduce", Target("grad", L), r, "gpu"))
            put(Task("update", Target("layer", L), r, "gpu"))
            if averaged:
                put(Task("all_gather", Target("optim", L), r, "gpu"))
            put(Task("release", Target("grad", L), r, "gpu"))
            continue
        through = d.home_tier == "nvme"  # gradients go to nvme, come back for the update
        for j in range(pages):
            put(Task("offload", Target("grad", L, j), r, "nvme" if through else "cpu"))
        put(Task("release", Target("grad", L), r, "gpu"))
        if through:
            put(Task("move_to_cpu", Target("grad", L), r, "cpu"))
        if d.optimizer_tier == "nvme":
            put(Task("move_to_cpu", Target("optim", L), host.fetch[L], "cpu"))
        if combined:
            put(Task("all_reduce", Target("grad", L), r, "cpu"))
        put(Task("update", Target("layer", L), r, "cpu"))
        if averaged:
            put(Task("all_gather", Target("optim", L), r, "cpu"))
        put(Task("release", Target("grad", L), r, "cpu"))
        if through:
            put(Task("release", Target("grad", L), r, "nvme"))
        if d.optimizer_tier == "nvme":
            put(Task("offload", Target("optim", L), r, "nvme"))
            put(Task("release", Target("optim", L), r, "cpu"))
    tasks: list[Task] = []
    for t in range(n + 1):
        tasks.extend(starts[t])
        tasks.extend(ends[t])
    return tasks
