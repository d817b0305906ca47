"""Run a plan's task queue on a model of the hardware, in wall time: a discrete-event simulation.

>>> s = simulate(p, trace, HardwareProfile.a100_server())
>>> s.iteration_time, s.gpu_idle_fraction, s.busy["ssd"], s.stalls
>>> s.to_chrome("timeline.json")            # one track per stream; opens in Perfetto

**Streams.** Each runs its tasks one at a time, in queue order:

========  ===========================================  =========================================
stream    tasks                                        seconds per task
========  ===========================================  =========================================
compute   the trace's ops in order; ``update`` of      ``op.duration * compute_scale`` (ops of
          layers cached on the gpu (GPU Adam kernels   the ``step`` phase take 0: the queue's
          share the GPU, so they run here, before the  updates replace them); shard elements /
          op that triggers them)                       ``gpu_adam_elements_per_s``
h2d       ``move_to_gpu``                              page bytes / ``h2d_bytes_per_s``
d2h       ``offload`` of a gradient page               page bytes / ``d2h_bytes_per_s``
network   ``all_gather``, ``reduce_scatter``           (W - 1) page bytes / ``network_bytes_per_s``
ssd       ``move_to_cpu`` (read), ``offload`` of       optimizer bytes / the rank's share of the
          optimizer states (write-back)                server's SSD read / write bandwidth
cpu       ``update`` on cpu                            shard elements / the rank's share of the
                                                       server's CPU Adam rate
========  ===========================================  =========================================

Every transfer moves whole pages, as ``Plan.bytes_moved`` counts them. ``release`` and the
``compute`` markers take no time and run on no stream.

**When a task starts.** When (1) it is issued: the compute stream has *reached* its trigger op
(the previous op finished and the op's memory is reserved, see below) -- or, for ``release``,
the trigger op has finished; (2) the memory it allocates has been granted (below); (3) what it
depends on has finished; (4) its stream is free and it is next in the stream's order.
Dependencies, within an iteration: ``all_gather`` after its page's ``move_to_gpu``; an op after
every move and all-gather of the layers whose parameters it accesses; ``reduce_scatter`` after
the layer's last gradient access (it is issued after it); a gradient ``offload`` after its page's
``reduce_scatter`` (W > 1); ``update`` after all of the layer's offloads (or reduce-scatters, on
the gpu) and its ``move_to_cpu``; the write-back after the update; a ``release`` after every task
that allocated or used what it frees (moves, all-gathers, reduce-scatters, offloads, the update,
the write-back) since that was last released; a second fetch of the same pages after their
release. Across iterations (synchronous updates): iteration k+1's ``move_to_gpu`` and
``all_gather`` of a layer's pages, and its ops that use a layer cached on the gpu, wait for
iteration k's ``update`` of that layer; its ``move_to_cpu`` waits for iteration k's write-back.

**Memory in wall time.** The gpu and cpu tiers are accounted in bytes against the plan's
budgets, starting from the state at rest (parameter shards on cpu, optimizer states on their
tier, cached layers on gpu). Allocations are those of ``pagemem.sched.tasks``: ``move_to_gpu``
+1 page, ``all_gather`` +(W-1) pages, the gradient-producing ``compute`` its gradient buffer,
``reduce_scatter`` +1 page, gradient ``offload`` +1 cpu page, ``move_to_cpu`` the optimizer
pages on cpu; a ``release`` frees what those allocated once everything that touched it is done.
When the compute stream reaches op t it *reserves* op t's memory: its non-model bytes (replacing
op t-1's) and any gradient buffer its ``compute`` task allocates. A task's memory is taken when
it is issued, not when its stream gets to it (a runtime reserves the destination pages, then
queues the copy), and each tier grants requests strictly in queue order: a request that does not
fit waits until releases make room, and every later request on that tier waits behind it. That
is the order the planner and the validator count memory in, so a plan the validator accepts
cannot deadlock here; a stuck queue (a broken plan) raises :class:`SimulationDeadlock` naming
what each stream and tier waits for.

**What is reported.** Iterations are simulated until the last two take the same time (at least
``iterations``, at most ``max_iterations``; ``steady`` says which), plus one more to time the
last. Iteration k lasts from the start of its first op that uses parameters (the op synchronous
updates hold back) to the start of the same op in iteration k+1: its period, in steady state.
For the last iteration: ``iteration_time``; ``busy`` (seconds of work per stream that belong to
it: the sum of its tasks' durations); ``gpu_idle_fraction`` = 1 - compute busy / iteration time;
``stalls``: the compute stream's idle time split by cause, found by walking back from each op
that waited along the chain of what it waited for (a move, which waited for an update, which
waited for an SSD read ...) and charging each stretch to the stream running it (``memory`` where
the chain is lost in a wait for memory). ``peak``: the highest gpu and cpu bytes held at any
moment of the run. ``events`` and ``memory`` (every change of gpu and cpu bytes) feed
:meth:`SimResult.to_chrome`.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from pagemem.checks import check_int
from pagemem.errors import ConfigError, PageMemError
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.plan import Plan
from pagemem.sched.tasks import Task
from pagemem.sched.windows import Usage
from pagemem.tracer import Trace
from pagemem.units import format_bytes

STREAMS: tuple[str, ...] = ("compute", "h2d", "d2h", "network", "ssd", "cpu")
_TIERS = ("gpu", "cpu")
_EPS = 1e-12


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
    """True when the last two iterations took the same time (to 1e-9): a steady state."""
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
                 "  peak: " + ", ".join(f"{t} {format_bytes(self.peak[t])}" for t in _TIERS)]
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


# ---------------------------------------------------------------------------------------- graph

@dataclass(slots=True)
class _Node:
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


class _Builder:
    """Turns the queue into one iteration's dependency graph, in logical order."""

    def __init__(self, plan: Plan, trace: Trace, profile: HardwareProfile) -> None:
        self.plan, self.trace, self.hw = plan, trace, profile
        self.W = plan.world_size
        self.pb = plan.page_bytes
        self.layers = plan.layout.layers
        self.cached = set(plan.cached_layers)
        self.nodes: list[_Node] = []
        self.held: dict[tuple[str, int], int] = {}
        self.touch: dict[tuple[str, int], list[int]] = {}
        self.fresh: dict[tuple[str, int], list[int]] = {}  # holders no op has waited for yet
        self.last_release: dict[tuple[str, int], int] = {}
        self.move_of: dict[tuple[int, int], int] = {}
        self.rs_of: dict[tuple[int, int], int] = {}
        self.update_of: dict[int, int] = {}
        self.writeback_of: dict[int, int] = {}
        self.cross: list[tuple[int, str, int]] = []  # (node, "update" | "writeback", layer)

    def add(self, node: _Node, issued_by: tuple[int, int] | None = None) -> int:
        if issued_by is not None:
            node.issue = issued_by
            node.deps.insert(0, issued_by)
        self.nodes.append(node)
        return len(self.nodes) - 1

    def hold(self, res: str, layer: int, i: int, nbytes: int = 0) -> None:
        key = (res, layer)
        self.held[key] = self.held.get(key, 0) + nbytes
        self.touch.setdefault(key, []).append(i)
        if res in ("param_gpu", "gathered"):
            self.fresh.setdefault(key, []).append(i)

    def use(self, res: str, layer: int, i: int) -> None:
        self.touch.setdefault((res, layer), []).append(i)

    def build(self) -> list[_Node]:
        plan, trace, W = self.plan, self.trace, self.W
        n = len(trace.ops)
        usage = Usage.from_trace(trace)
        param_at: dict[int, list[int]] = {}
        for ws in usage.windows:
            for w in ws:
                for op in w.accesses:
                    param_at.setdefault(op, []).append(w.layer)
        grad_alloc = {(g.layer, usage.windows[g.layer][g.window].start) for g in usage.grads if g is not None}
        starts: list[list[Task]] = [[] for _ in range(n + 1)]
        ends: list[list[Task]] = [[] for _ in range(n + 1)]
        for task in plan.tasks:
            t = task.trigger_id
            if not 0 <= t <= n:
                raise ConfigError(f"plan: task {task} has trigger {t} outside 0..{n}")
            L = task.target.layer
            if not 0 <= L < len(self.layers):
                raise ConfigError(f"plan: task {task} names layer {L}, which does not exist")
            (ends if task.issued_at_end else starts)[t].append(task)
        nm = [op.non_model_bytes for op in trace.ops] + [0]
        scale = self.hw.compute_scale
        first_use_done: set[int] = set()
        first_op = min(param_at, default=0)  # where synchronous updates hold an iteration back
        prev_run = None
        for t in range(n + 1):
            # reserve op t's memory: its non-model bytes instead of op t-1's, and gradient buffers
            gpu = nm[t] - nm[t - 1]  # nm[-1] is op n's: 0, as at rest
            grads = [task.target.layer for task in starts[t]
                     if task.operation == "compute" and (task.target.layer, t) in grad_alloc]
            for L in grads:
                gpu += self.grad_buffer(L)
            label = "end of iteration" if t == n else f"op {t}"
            reached = (prev_run, 0) if prev_run is not None else None  # op 0: after op n of the last iteration
            reserve = self.add(_Node(f"reserve {label}", "compute", 0.0, {"gpu": gpu}, {}, [], False), reached)
            if prev_run is None:
                first_reserve = reserve
            for L in grads:
                self.hold("fullgrad" if W > 1 else "grad_gpu", L, reserve, self.grad_buffer(L))
            for task in starts[t]:
                self.start_task(task, reserve)
            if t < n:
                op = trace.ops[t]
                dur = 0.0 if op.phase == "step" else op.duration * scale
                name = f"{op.event} {op.module or '<model>'}"
                run = self.add(_Node(name, "compute", dur, {}, {}, [], op.phase != "step",
                                     iteration_start=(t == first_op)))
                deps = self.nodes[run].deps
                for L in param_at.get(t, ()):
                    for res in ("param_gpu", "gathered"):
                        deps.extend((j, 0) for j in self.fresh.pop((res, L), ()))
                        self.use(res, L, run)
                    if L in self.cached and L not in first_use_done:
                        self.cross.append((run, "update", L))
                    first_use_done.add(L)
            else:
                run = self.add(_Node("end of iteration", "compute", 0.0, {}, {}, [], False))
            prev_run = run
            for task in ends[t]:
                self.release(task, prev_run)
        self.nodes[first_reserve].deps.append((prev_run, -1))  # iteration k+1 starts after op n of k
        self.nodes[first_reserve].issue = (prev_run, -1)
        # cross-iteration dependencies, now that every update and write-back is known
        for i, what, L in self.cross:
            j = (self.update_of if what == "update" else self.writeback_of).get(L)
            if j is not None:
                self.nodes[i].deps.append((j, -1))
        return self.nodes

    def grad_buffer(self, L: int) -> int:
        return self.plan.layout.grad_buffer_pages(L) * self.pb

    def start_task(self, task: Task, reserve: int) -> None:
        op, tg, W, pb, hw = task.operation, task.target, self.W, self.pb, self.hw
        L, j = tg.layer, tg.page
        lay = self.layers[L]
        issue = (reserve, 0)
        if op == "compute":
            return  # a marker: its gradient buffer is in the reservation
        if op == "move_to_gpu":
            i = self.add(_Node(f"move_to_gpu {tg}", "h2d", pb / hw.h2d_bytes_per_s, {"gpu": pb}, {}, [], True), issue)
            self.after_release(i, "param_gpu", L)
            self.cross.append((i, "update", L))
            self.hold("param_gpu", L, i, pb)
            self.move_of[(L, j)] = i
        elif op == "all_gather":
            i = self.add(_Node(f"all_gather {tg}", "network", (W - 1) * pb / hw.network_bytes_per_s,
                               {"gpu": (W - 1) * pb}, {}, [], True), issue)
            if (L, j) in self.move_of:
                self.nodes[i].deps.append((self.move_of[(L, j)], 0))
            self.after_release(i, "gathered", L)
            self.cross.append((i, "update", L))
            self.hold("gathered", L, i, (W - 1) * pb)
        elif op == "reduce_scatter":
            i = self.add(_Node(f"reduce_scatter {tg}", "network", (W - 1) * pb / hw.network_bytes_per_s,
                               {"gpu": pb}, {}, [], True), issue)
            self.use("fullgrad", L, i)
            self.hold("grad_gpu", L, i, pb)
            self.rs_of[(L, j)] = i
        elif op == "offload" and tg.kind == "grad":
            i = self.add(_Node(f"offload {tg}", "d2h", pb / hw.d2h_bytes_per_s, {task.tier or "cpu": pb}, {},
                               [], True), issue)
            if (L, j) in self.rs_of:
                self.nodes[i].deps.append((self.rs_of[(L, j)], 0))
            else:  # W = 1: the gradient pages came from the compute that allocated them
                self.nodes[i].deps.extend((k, 0) for k in self.touch.get(("grad_gpu", L), ()))
            self.use("grad_gpu", L, i)
            self.hold("grad_cpu", L, i, pb)
        elif op == "offload" and tg.kind == "optim":
            nbytes = lay.optim_pages * pb
            i = self.add(_Node(f"write_back {tg}", "ssd", nbytes / hw.ssd_write_per_rank(W), {}, {}, [], True), issue)
            if L in self.update_of:
                self.nodes[i].deps.append((self.update_of[L], 0))
            self.use("optim_cpu", L, i)
            self.writeback_of[L] = i
        elif op == "move_to_cpu":
            nbytes = lay.optim_pages * pb
            i = self.add(_Node(f"move_to_cpu {tg}", "ssd", nbytes / hw.ssd_read_per_rank(W), {"cpu": nbytes}, {},
                               [], True), issue)
            self.after_release(i, "optim_cpu", L)
            self.cross.append((i, "writeback", L))
            self.hold("optim_cpu", L, i, nbytes)
        elif op == "update":
            if task.tier == "gpu":
                i = self.add(_Node(f"update {tg} (gpu)", "compute", lay.shard_elements / hw.gpu_adam_elements_per_s,
                                   {}, {}, [], True), issue)
                self.nodes[i].deps.extend((k, 0) for k in self.touch.get(("grad_gpu", L), ()))
                self.use("grad_gpu", L, i)
            else:
                i = self.add(_Node(f"update {tg}", "cpu", lay.shard_elements / hw.cpu_adam_per_rank(W),
                                   {}, {}, [], True), issue)
                for res in ("grad_cpu", "optim_cpu"):
                    self.nodes[i].deps.extend((k, 0) for k in self.touch.get((res, L), ()))
                    self.use(res, L, i)
            self.update_of[L] = i
        else:
            raise ConfigError(f"plan: cannot simulate task {task}")

    def after_release(self, i: int, res: str, L: int) -> None:
        r = self.last_release.get((res, L))
        if r is not None:
            self.nodes[i].deps.append((r, 0))

    def release(self, task: Task, run: int) -> None:
        tg, tier = task.target, task.tier
        L = tg.layer
        if tg.kind == "param":
            res = ["gathered"] + ([] if L in self.cached else ["param_gpu"])
        elif tg.kind == "fullgrad":
            res = ["fullgrad"]
        elif tg.kind == "grad":
            res = ["grad_gpu" if tier == "gpu" else "grad_cpu"]
        elif tg.kind == "optim":
            res = ["optim_cpu"]
        else:
            raise ConfigError(f"plan: cannot simulate task {task}")
        i = self.add(_Node(f"release {tg} @{tier}", None, 0.0, {}, {}, [], False), (run, 0))
        freed = 0
        for r in res:
            key = (r, L)
            self.nodes[i].deps.extend((k, 0) for k in self.touch.pop(key, ()))
            freed += self.held.pop(key, 0)
            self.fresh.pop(key, None)
            self.last_release[key] = i
        self.nodes[i].free = {tier or "gpu": freed}


# ---------------------------------------------------------------------------------------- engine

def simulate(plan: Plan, trace: Trace, profile: HardwareProfile, iterations: int = 2, *,
             max_iterations: int = 32) -> SimResult:
    """Simulate training iterations of ``plan`` (made from ``trace``) on ``profile``, with
    synchronous updates, and report the last one (see the module docs).

    At least ``iterations`` iterations are simulated; while the last two take different times
    (the first iterations fill the streams' backlogs) the run is repeated with twice as many, up
    to ``max_iterations``; ``SimResult.steady`` says whether the last two agreed. Raises
    ``SimulationDeadlock`` when the queue cannot finish, ``ConfigError`` for bad input."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan: expected a pagemem.sched.Plan, got {type(plan).__name__}")
    if not isinstance(trace, Trace):
        raise ConfigError(f"trace: expected a pagemem.tracer.Trace, got {type(trace).__name__}")
    if not isinstance(profile, HardwareProfile):
        raise ConfigError(f"profile: expected a HardwareProfile, got {type(profile).__name__}")
    for name, value in (("iterations", iterations), ("max_iterations", max_iterations)):
        check_int(name, value, 1, 1000)
    if plan.n_ops != len(trace.ops) or not plan.holds_for(trace):
        raise ConfigError("plan: it was made for a trace with another access order")
    nodes = _Builder(plan, trace, profile).build()
    k = iterations
    while True:
        result = _Engine(plan, nodes, profile, k + 1).run(k)
        if result.steady or k >= max_iterations:
            return result
        k = min(2 * k, max_iterations)


class _Engine:
    """Instances of the graph's nodes, one set per iteration: instance ``x = k * N + i`` is node
    ``i`` of iteration ``k``, and ``x`` is also its place in queue order."""

    def __init__(self, plan: Plan, nodes: list[_Node], profile: HardwareProfile, K: int) -> None:
        self.plan, self.nodes, self.profile, self.K = plan, nodes, profile, K
        N = self.N = len(nodes)
        total = N * K
        self.budget = {t: plan.budgets[t] for t in _TIERS}
        self.used = self._at_rest()
        for t in _TIERS:
            if self.used[t] > self.budget[t]:
                raise SimulationError(f"the state at rest needs {format_bytes(self.used[t])} on {t}, "
                                      f"over its budget of {format_bytes(self.budget[t])}")
        self.peak = dict(self.used)
        self.memory: list[tuple[float, int, int]] = [(0.0, self.used["gpu"], self.used["cpu"])]
        self.rev: list[list[tuple[int, int]]] = [[] for _ in range(N)]
        pending_all = [0] * N
        pending_first = [0] * N
        for i, nd in enumerate(nodes):
            for j, off in nd.deps:
                self.rev[j].append((i, off))
                pending_all[i] += 1
                if off == 0:
                    pending_first[i] += 1
        self.pending = pending_first + pending_all * (K - 1)
        self.start = [-1.0] * total
        self.end = [-1.0] * total
        self.dep_ready = [0.0] * total
        self.binder = [-1] * total  # the instance whose finishing let this one start
        self.granted = [-1.0] * total
        self.grant_binder = [-1] * total
        # each stream runs its nodes in queue order; each tier grants its allocations in queue order
        self.order = {s: [i for i, nd in enumerate(nodes) if nd.stream == s] for s in STREAMS}
        self.head = dict.fromkeys(STREAMS, 0)
        self.busy_until = dict.fromkeys(STREAMS, 0.0)
        self.last_on = dict.fromkeys(STREAMS, -1)
        self.running: dict[str, int | None] = dict.fromkeys(STREAMS, None)
        self.alloc_order = {t: [i for i, nd in enumerate(nodes) if nd.alloc.get(t, 0) > 0] for t in _TIERS}
        self.alloc_next = dict.fromkeys(_TIERS, 0)
        self.releases: deque[int] = deque(x for x in range(N) if nodes[x].stream is None and pending_first[x] == 0)
        self.heap: list[tuple[float, int, int]] = []
        self.now = 0.0
        self.done = 0
        self.last_freer = -1
        self.events: list[SimEvent] = []

    def _at_rest(self) -> dict[str, int]:
        p, pb = self.plan, self.plan.page_bytes
        used = dict.fromkeys(_TIERS, 0)
        for lay in p.layout.layers:
            if lay.index in p.cached_layers:
                used["gpu"] += (lay.param_pages + lay.optim_pages) * pb
            else:
                used["cpu"] += lay.param_pages * pb
                if p.optimizer_tier == "cpu":
                    used["cpu"] += lay.optim_pages * pb
        return used

    # ---------------------------------------------------------------- state changes

    def _mem(self, delta: Mapping[str, int], sign: int) -> None:
        for t, b in delta.items():
            if b:
                self.used[t] += sign * b
                if self.used[t] > self.peak[t]:
                    self.peak[t] = self.used[t]
        self.memory.append((self.now, self.used["gpu"], self.used["cpu"]))

    def _finish(self, x: int) -> None:
        N, nd = self.N, self.nodes[x % self.N]
        self.end[x] = self.now
        self.done += 1
        if nd.stream is not None:
            self.running[nd.stream] = None
            self.head[nd.stream] += 1
            self.busy_until[nd.stream] = self.now
            self.last_on[nd.stream] = x
        k, i = divmod(x, N)
        for d, off in self.rev[i]:
            kd = k - off
            if kd >= self.K:
                continue
            y = kd * N + d
            self.pending[y] -= 1
            if self.pending[y] == 0:
                self.dep_ready[y] = self.now
                self.binder[y] = x
                if self.nodes[d].stream is None:
                    self.releases.append(y)

    def _begin(self, x: int, binder: int) -> None:
        nd = self.nodes[x % self.N]
        self.start[x] = self.now
        self.binder[x] = binder
        shrink = {t: b for t, b in nd.alloc.items() if b < 0}
        if shrink:  # a reservation smaller than the one before frees memory
            self._mem(shrink, +1)
            self.last_freer = x
        if nd.stream is not None:
            self.running[nd.stream] = x
        if nd.duration > 0:
            heapq.heappush(self.heap, (self.now + nd.duration, x, x))
        else:
            self._finish(x)

    def _release(self, x: int) -> None:
        nd = self.nodes[x % self.N]
        self.start[x] = self.now
        if any(nd.free.values()):
            self._mem(nd.free, -1)
            self.last_freer = x
        self._finish(x)

    def _at(self, order: list[int], pos: int) -> int | None:
        if not order:
            return None
        k, i = divmod(pos, len(order))
        return None if k >= self.K else k * self.N + order[i]

    def _issued(self, x: int) -> bool:
        iss = self.nodes[x % self.N].issue
        if iss is None:
            return True
        k = x // self.N + iss[1]
        return k < 0 or self.end[k * self.N + iss[0]] >= 0

    def _grant(self) -> bool:
        """Give memory to the next allocations, in queue order per tier, while it fits."""
        changed = False
        for t in _TIERS:
            while True:
                x = self._at(self.alloc_order[t], self.alloc_next[t])
                if x is None or not self._issued(x):
                    break
                need = self.nodes[x % self.N].alloc[t]
                if self.used[t] + need > self.budget[t]:
                    break
                self._mem({t: need}, +1)
                self.granted[x] = self.now
                self.grant_binder[x] = self.last_freer
                self.alloc_next[t] += 1
                changed = True
        return changed

    def _step(self) -> None:
        """Start everything that can start now."""
        changed = True
        while changed:
            changed = False
            while self.releases:
                self._release(self.releases.popleft())
                changed = True
            changed |= self._grant()
            for s in STREAMS:
                if self.running[s] is not None:
                    continue
                x = self._at(self.order[s], self.head[s])
                if x is None or self.pending[x] or (self._allocates(x) and self.granted[x] < 0):
                    continue
                ready = max(self.dep_ready[x], self.busy_until[s])
                if self.granted[x] > ready + _EPS:
                    binder = self.grant_binder[x]  # it waited for memory
                elif self.dep_ready[x] >= self.busy_until[s] and self.binder[x] >= 0:
                    binder = self.binder[x]
                else:
                    binder = self.last_on[s]
                self._begin(x, binder)
                changed = True

    def _allocates(self, x: int) -> bool:
        return any(b > 0 for b in self.nodes[x % self.N].alloc.values())

    def run(self, iterations: int) -> SimResult:
        self._step()
        while self.heap:
            t, _, x = heapq.heappop(self.heap)
            self.now = t
            self._finish(x)
            self._step()
        if self.done < self.N * self.K:
            self._deadlock()
        return self._result(iterations)

    # ---------------------------------------------------------------- reporting

    def _describe(self, x: int) -> str:
        k, i = divmod(x, self.N)
        return f"{self.nodes[i].name} (iteration {k})"

    def _deadlock(self) -> None:
        blocked = []
        unfinished = [x for x in range(self.N * self.K) if self.end[x] < 0]
        for t in _TIERS:
            x = self._at(self.alloc_order[t], self.alloc_next[t])
            if x is not None and self._issued(x):
                need = self.nodes[x % self.N].alloc[t]
                blocked.append(f"{t} memory: {self._describe(x)} needs {format_bytes(need)}, "
                               f"{format_bytes(self.budget[t] - self.used[t])} free of {format_bytes(self.budget[t])}")
        for s in STREAMS:
            x = self._at(self.order[s], self.head[s])
            if x is None or self.end[x] >= 0:
                continue
            nd = self.nodes[x % self.N]
            k = x // self.N
            waits = [self._describe((k + off) * self.N + j) for j, off in nd.deps
                     if k + off >= 0 and self.end[(k + off) * self.N + j] < 0]
            if waits:
                why = "waits for " + ", ".join(waits[:3]) + (f" and {len(waits) - 3} more" if len(waits) > 3 else "")
            else:
                why = "waits for its memory"
            blocked.append(f"{s}: {self._describe(x)} {why}")
        raise SimulationDeadlock(self.now, unfinished[0] // self.N, blocked)

    def _result(self, iterations: int) -> SimResult:
        N, nodes = self.N, self.nodes
        first = next(i for i, nd in enumerate(nodes) if nd.iteration_start)
        starts = [self.start[k * N + first] for k in range(self.K)]
        periods = tuple(b - a for a, b in zip(starts, starts[1:]))
        last = iterations - 1
        busy = dict.fromkeys(STREAMS, 0.0)
        for i, nd in enumerate(nodes):
            if nd.stream is not None:
                busy[nd.stream] += nd.duration
        stalls: dict[str, float] = {}
        comp = self.order["compute"]
        seq = [last * N + i for i in comp] + [(last + 1) * N + i for i in comp]
        lo_i = seq.index(last * N + first)
        hi_i = seq.index((last + 1) * N + first)
        for a, b in zip(seq[lo_i:hi_i], seq[lo_i + 1:hi_i + 1]):
            gap = self.start[b] - self.end[a]
            if gap > _EPS:
                self._charge(b, self.end[a], stalls)
        events = []
        for x in range(iterations * N):
            nd = nodes[x % N]
            if nd.export:
                events.append(SimEvent(nd.stream or "", nd.name, x // N, self.start[x], self.end[x]))
        steady = len(periods) >= 2 and abs(periods[-1] - periods[-2]) <= 1e-9 * periods[-1]
        return SimResult(periods[last], busy, stalls, dict(self.peak), periods, self.plan.world_size,
                         self.profile, steady, tuple(events), tuple(self.memory))

    def _charge(self, x: int, lo: float, stalls: dict[str, float]) -> None:
        """Charge the wait before ``x`` back to ``lo`` along the chain of what it waited for."""
        t = self.start[x]
        while t > lo + _EPS:
            p = self.binder[x]
            if p < 0:
                stalls["other"] = stalls.get("other", 0.0) + t - lo
                return
            if self.end[p] < t - _EPS:  # it was free earlier, yet x waited: memory held by others
                s = max(lo, self.end[p])
                stalls["memory"] = stalls.get("memory", 0.0) + t - s
                t = s
                if t <= lo + _EPS:
                    return
            s = max(lo, self.start[p])
            if t > s:
                stream = self.nodes[p % self.N].stream or "other"
                stalls[stream] = stalls.get(stream, 0.0) + t - s
            t, x = min(t, s), p
