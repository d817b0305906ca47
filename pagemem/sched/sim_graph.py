"""One iteration of a plan as a dependency graph, for :mod:`pagemem.sched.simulate`.

Every node is read off the task table (``pagemem.sched.tasks``, applied by ``holdings.effects``):
a task's stream and cost, the memory it takes and gives back, and what it waits for
(``deps.links``). The compute stream gets
two nodes per op: its *reservation* (the op's non-model memory, and the gradient buffer a
``produces_grads`` compute takes) and its *run*. A ``compute`` task is a marker: what it waits for
holds back the run of its trigger op; a task that waits for it as the taker of the gradient buffer
waits for that reservation, one that waits for it as the reader of the parameters (a release)
waits for the last run of its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemem.errors import ConfigError
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.plan import Plan
from pagemem.sched.sim_result import TIERS
from pagemem.sched.deps import links
from pagemem.sched.holdings import Key, Setting, costs, effects, executor_cost, host_cost, paused_gc
from pagemem.sched.tasks import Task
from pagemem.sched.windows import Usage
from pagemem.tracer import Trace

_GRADS = ("grad", "fullgrad")


@dataclass(slots=True)
class Node:
    """One thing that happens once per iteration: a task, an op's reservation or its run."""

    name: str
    stream: str | None
    duration: float
    alloc: dict[str, int]
    """Bytes per tier granted once it is issued, in queue order; a reservation's negative gpu
    entry (less non-model memory than the op before) is given back when it starts."""
    free: dict[str, int]
    """Bytes per tier a release gives back."""
    deps: list[tuple[int, int]]
    """``(node, iteration offset)``: 0 for this iteration, -1 for the previous one."""
    export: bool
    iteration_start: bool = False
    issue: tuple[int, int] | None = None
    """The dependency whose finishing issues it (None: issued at the start)."""


def build(plan: Plan, trace: Trace, profile: HardwareProfile) -> list[Node]:
    """The nodes of one iteration, in logical (queue) order."""
    with paused_gc():
        return _Builder(plan, trace, profile).build()


class _Builder:
    def __init__(self, plan: Plan, trace: Trace, profile: HardwareProfile) -> None:
        self.plan, self.trace, self.hw = plan, trace, profile
        self.W = plan.world_size
        self.pb = plan.page_bytes
        self.setting = Setting.of(plan)
        self.nodes: list[Node] = []
        self.held: dict[Key, int] = {}  # bytes taken per holding since it was last given back
        self.node_of: dict[int, int] = {}  # task (in build order) -> its node
        self.reserve_of: dict[int, int] = {}  # op -> its reservation
        self.last_run: dict[int, int] = {}  # compute task -> the last run of its window so far

    def add(self, node: Node, issued_by: tuple[int, int] | None = None) -> int:
        if issued_by is not None:
            node.issue = issued_by
            node.deps.insert(0, issued_by)
        self.nodes.append(node)
        return len(self.nodes) - 1

    def build(self) -> list[Node]:
        plan, trace = self.plan, self.trace
        n = len(trace.ops)
        for task in plan.tasks:
            t, L = task.trigger_id, task.target.layer
            if not 0 <= t <= n:
                raise ConfigError(f"plan: task {task} has trigger {t} outside 0..{n}")
            if not 0 <= L < len(plan.layout.layers):
                raise ConfigError(f"plan: task {task} names layer {L}, which does not exist")
            if effects(task, self.setting) is None:
                raise ConfigError(f"plan: cannot simulate task {task}")
        # build order: by trigger, tasks issued at an op's start before those issued at its end
        self.tasks = sorted(plan.tasks, key=lambda x: 2 * x.trigger_id + x.issued_at_end)
        self.fx = [effects(x, self.setting) for x in self.tasks]
        self.links = links(self.tasks, self.setting)
        starts: list[list[int]] = [[] for _ in range(n + 1)]
        ends: list[list[int]] = [[] for _ in range(n + 1)]
        for i, task in enumerate(self.tasks):
            (ends if task.issued_at_end else starts)[task.trigger_id].append(i)
        usage = Usage.from_trace(trace)
        first_op = min((w.start for ws in usage.windows for w in ws), default=0)  # held back by updates
        nm = [op.non_model_bytes for op in trace.ops] + [0]
        scale = self.hw.compute_scale
        open_windows: list[int] = []
        cross: list[tuple[int, list[int]]] = []  # (node, tasks of the previous iteration it waits for)
        prev_run = None
        for t in range(n + 1):
            # reserve op t's memory: its non-model bytes instead of op t-1's, and gradient buffers
            computes = [i for i in starts[t] if self.fx[i].effect.gates_ops]
            grads = [i for i in computes if self.fx[i].takes]
            gpu = nm[t] - nm[t - 1]  # nm[-1] is op n's: 0, as at rest
            for i in grads:
                gpu += self.fx[i].pages("takes", self.setting).get("gpu", 0) * self.pb
            label = "end of iteration" if t == n else f"op {t}"
            reached = (prev_run, 0) if prev_run is not None else None  # op 0: after op n of the last iteration
            reserve = self.add(Node(f"reserve {label}", "compute", 0.0, {"gpu": gpu}, {}, [], False), reached)
            self.reserve_of[t] = reserve
            if prev_run is None:
                first_reserve = reserve
            for i in grads:
                self.hold(i, reserve)
            for i in starts[t]:
                if i not in computes:
                    cross.append((self.start_task(i, reserve), self.previous(i)))
            if t < n:
                op = trace.ops[t]
                dur = 0.0 if op.phase == "step" else op.duration * scale
                run = self.add(Node(f"{op.event} {op.module or '<model>'}", "compute", dur, {}, {}, [],
                                    op.phase != "step", iteration_start=(t == first_op)))
                for i in computes:  # the op waits for what its compute tasks wait for
                    self.nodes[run].deps.extend(self.waits(i))
                    cross.append((run, self.previous(i)))
                    open_windows.append(i)
                for i in open_windows:
                    self.last_run[i] = run
                open_windows = [i for i in open_windows if (self.tasks[i].end_id or self.tasks[i].trigger_id) > t]
            else:
                run = self.add(Node("end of iteration", "compute", 0.0, {}, {}, [], False))
            prev_run = run
            for i in ends[t]:
                self.release(i, prev_run)
        self.nodes[first_reserve].deps.append((prev_run, -1))  # iteration k+1 starts after op n of k
        self.nodes[first_reserve].issue = (prev_run, -1)
        # waits across iterations, now that every task has its node
        for node, on in cross:
            self.nodes[node].deps.extend((self.node_for(j), -1) for j in on)
        return self.nodes

    # ------------------------------------------------------------------ tasks

    def node_for(self, j: int, key: Key | None = None) -> int:
        """The node that stands for task ``j`` when waited for through ``key``."""
        if j in self.node_of:
            return self.node_of[j]
        task = self.tasks[j]  # a compute: the taker of gradient buffers, or the reader of parameters
        if key is not None and key.name in _GRADS or j not in self.last_run:
            return self.reserve_of[task.trigger_id]
        return self.last_run[j]

    def waits(self, i: int) -> list[tuple[int, int]]:
        return [(self.node_for(l.on, l.key), 0) for l in self.links[i] if not l.previous]

    def previous(self, i: int) -> list[int]:
        return [l.on for l in self.links[i] if l.previous]

    def hold(self, i: int, node: int) -> None:
        for k in self.fx[i].takes:
            if k.tier in TIERS:
                self.held[k] = self.held.get(k, 0) + self.setting.held_pages(k) * self.pb

    def start_task(self, i: int, reserve: int) -> int:
        task, fx = self.tasks[i], self.fx[i]
        seconds = sum(self.hw.seconds(resource, amount, task.tier, self.W)
                      for resource, amount in costs(task, self.setting) if amount)
        alloc = {tier: pages * self.pb for tier, pages in fx.pages("takes", self.setting).items() if tier in TIERS}
        node = self.add(Node(_name(task), fx.effect.stream_of(task), seconds,
                             alloc, {}, [], True), (reserve, 0))
        self.nodes[node].deps.extend(self.waits(i))
        self.node_of[i] = node
        host = host_cost(task, self.setting)
        if host and host[1]:
            # the CPU's share of a disk transfer (checksums, submission) runs on its own stream
            # beside the transfer; the task is done when both are (a zero-time join)
            resource, amount = host
            cpu = self.add(Node(f"{_name(task)} (host)", "io", self.hw.seconds(resource, amount, task.tier, self.W),
                                {}, {}, self.waits(i), True), (reserve, 0))
            self.node_of[i] = self.add(Node(f"{_name(task)} (done)", None, 0.0, {}, {}, [(node, 0), (cpu, 0)],
                                            False))
        self.hold(i, node)
        return node

    def release(self, i: int, run: int) -> None:
        task = self.tasks[i]
        node = self.add(Node(f"release {task.target} @{task.tier}", None, 0.0, {}, {}, [], False), (run, 0))
        self.nodes[node].deps.extend(self.waits(i))
        self.node_of[i] = node
        free: dict[str, int] = {}
        for k in self.fx[i].frees:
            if k.tier in TIERS:  # the simulator accounts gpu and cpu memory (nvme is checked by the planner)
                free[k.tier] = free.get(k.tier, 0) + self.held.pop(k, 0)
        self.nodes[node].free = free or {task.tier or "gpu": 0}
        executor = executor_cost(task, self.setting)
        seconds = self.hw.seconds(executor[0], executor[1], task.tier, self.W) if executor else 0.0
        if seconds:
            # the executor's host time for the window this release ends, on the thread that runs
            # the model: the compute stream, before the next op (memory is given back meanwhile)
            self.add(Node(f"executor window {task.target}", "compute", seconds, {}, {}, [], True), (run, 0))


def _name(task: Task) -> str:
    if task.operation == "offload" and task.target.kind == "optim":
        return f"write_back {task.target}"
    if task.operation == "update" and task.tier == "gpu":
        return f"update {task.target} (gpu)"
    return f"{task.operation} {task.target}"
