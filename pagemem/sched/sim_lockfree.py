"""The simulator's lock-free mode: the iteration when the update runs behind the compute.

[Note: simulating the lock-free updater]
With ``EngineConfig(lock_free=True)`` no move of the next iteration waits for an update, and
the optimizer-state traffic leaves the iteration: the updating thread walks every unit over and
over, fetching its states, updating, writing them back. ``simulate_lock_free`` models that in
two parts, each from the same task table and cost functions the synchronous simulation reads:

- the *compute side*: the plan without its update tasks (``update``, ``move_to_cpu`` and
  ``offload`` of ``optim``, their releases), simulated as usual. Layers cached on the gpu keep
  their updates (they are stepped in place);
- the *updating thread*: one pass over every unit costs, per stream, the sum of those tasks'
  seconds; the streams pipeline across units, so a pass takes the busiest stream's total. The
  thread takes one AdamW step per iteration a unit's sums hold ([Note: one step per iteration]
  in ``engine/updates/lockfree.py``), so its ``cpu`` work is every iteration's, while its transfers
  (``nvme``, and their ``io`` share) are one pass's, however many iterations that pass spans.

Where the profile's ``shared_processor`` puts a stream of the updating thread on the processor
that computes (the host stand-in), that work per iteration is added to the compute side's
iteration; a fixed point settles how much of a pass falls in one iteration.

[Note: the updating thread's rules, simulated]
How many iterations one pass spans is not the ratio of the two sides' times: it follows from the
engine's rules, which ``_follow`` replays unit by unit in time (``engine/updates/lockfree.py``):
- a unit's sums cannot be taken while they hold gradients of the iteration not yet submitted:
  from the backward's first gradient of the unit (``fresh``: that op's share of the compute
  side's time) until ``step()``; a pass skips such a unit (its states stay fetched);
- a pass is the units ready when it starts, in reverse; the next unit's read is queued before
  the current one's update, its write-back after it, one disk serving both in order (as the
  capped tier does: ``tiers/io/throttle.py``); the pass ends when its write-backs have landed;
- an update of a unit whose sums hold ``k`` iterations takes ``k`` AdamW steps, but reads and
  writes the states once;
- an iteration starts when no unit lacks more than ``max_staleness`` submitted iterations;
- with a bound ``b >= 1`` a unit's states are written back after every ``b + 1``-th update of
  it, staggered by the unit's index, and kept in cpu memory between ([Note: a fetch serves the
  bound's updates] in ``lockfree.py``).
Why the last rule: an update taken during an iteration holds at most ``b`` iterations if the
compute is not to wait (the oldest must be in before the next iteration starts, and the
iteration in progress is not takeable yet), so without it a pass spans at most ``b``
iterations without a wait, not ``b + 1``: at ``max_staleness=1`` every unit was read and
written once per iteration, or the compute waited at ``step()`` while an update of two
iterations ran. The first model (an iteration of at least ``pass / (b + 1)``) predicted 53 ms
where that engine took 77; this replay, without the rule (``keep=False``), gives 79 for the
same costs (BENCHMARKS.md, issue 33). Staleness is the mean lag units have when an iteration
starts, over the replayed steady state.

[Note: the drain, simulated] The compute side writes each published update into the buffered
parameters before the next iteration starts (``LockFreeUpdater._write``: the unit's values
predicted past its lag and written through the store, a packed write: [Note: an update
published packed] in ``lockfree_thread.py``): ``drain_seconds`` per update, on the
compute side, is charged at the start of the iteration that finds it published. It is a
measured per-update cost, not fitted: the engine counts it (``stats()["staleness"]``:
``drain_s`` / ``drained``, wall seconds of the compute thread in ``_write``), as a trace times
ops; 0 charges nothing (the model before issue 33's last session). What this still leaves out:
contention that slows both sides beyond their own costs (memory bandwidth, the GIL the two
threads share in the engine, a lock), and the lock-free hand-off's own bookkeeping per gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagemem.errors import ConfigError
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.holdings import Setting, costs, host_cost
from pagemem.sched.plan import Plan
from pagemem.sched.sim_result import SimResult
from pagemem.sched.simulate import simulate
from pagemem.sched.tasks import effect_of
from pagemem.tracer import Trace


@dataclass(frozen=True)
class LockFreePrediction:
    """``simulate_lock_free``'s answer (seconds)."""

    iteration_time: float
    update_pass_time: float
    """One pass of the updating thread over every unit."""
    pass_busy: dict[str, float]
    """Seconds of that pass per stream."""
    staleness: float
    """Iterations a unit's parameters are predicted to lag at an iteration's start."""
    compute_side: SimResult
    """The iteration without the update's tasks."""


def _updater_task(task) -> bool:
    return (task.operation == "update" and task.tier != "gpu") or (
        task.target.kind == "optim" and task.operation in ("move_to_cpu", "offload", "release"))


def simulate_lock_free(plan: Plan, trace: Trace, profile: HardwareProfile,
                       max_staleness: int | None = None, drain_seconds: float = 0.0) -> LockFreePrediction:
    """Predict an iteration of ``plan`` with the lock-free updater (see the Notes): the compute
    side and the updating thread's pass costed from the plan's tasks, then the engine's rules
    replayed unit by unit with ``max_staleness`` (``EngineConfig.effective_max_staleness``; the
    steady state: the engine's first ``synchronous_steps`` are not modelled). ``drain_seconds``:
    the compute side's seconds per published update it writes ([Note: the drain, simulated])."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan: expected a pagemem.sched.Plan, got {type(plan).__name__}")
    if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise ConfigError(f"max_staleness: must be None or an integer >= 0, got {max_staleness!r}")
    if isinstance(drain_seconds, bool) or not isinstance(drain_seconds, (int, float)) or not drain_seconds >= 0:
        raise ConfigError(f"drain_seconds: must be a number >= 0, got {drain_seconds!r}")
    mine = [t for t in plan.tasks if _updater_task(t)]
    side = simulate(dataclasses.replace(plan, tasks=[t for t in plan.tasks if not _updater_task(t)]), trace, profile)
    setting = Setting.of(plan)
    busy: dict[str, float] = {}
    for task in mine:
        effect = effect_of(task)
        stream = effect.stream_of(task) if effect is not None else None
        seconds = sum(profile.seconds(resource, amount, task.tier, plan.world_size)
                      for resource, amount in costs(task, setting) if amount)
        if stream and seconds:
            busy[stream] = busy.get(stream, 0.0) + seconds
        host = host_cost(task, setting)
        if host and host[1]:
            busy["io"] = busy.get("io", 0.0) + profile.seconds(host[0], host[1], task.tier, plan.world_size)
    pass_time = max(busy.values(), default=0.0)
    shared = set(profile.shared_processor)
    every_iteration = busy.get("cpu", 0.0) if "cpu" in shared else 0.0
    per_pass = sum(s for stream, s in busy.items() if stream in shared and stream != "cpu")
    t = side.iteration_time + every_iteration
    for _ in range(64):  # how much of a pass falls in one iteration, and the iteration it makes
        share = min(1.0, t / pass_time) if pass_time else 0.0
        new = side.iteration_time + every_iteration + per_pass * share
        if abs(new - t) <= 1e-9 * max(1.0, t):
            break
        t = new
    units = _units(mine, plan, trace, profile, setting, t)
    if not units or pass_time <= 0 or t <= 0:
        return LockFreePrediction(t, pass_time, busy, 0.0, side)
    t, staleness = _follow(units, t, max_staleness, drain=drain_seconds)
    return LockFreePrediction(t, pass_time, busy, staleness, side)


@dataclass(frozen=True)
class _Unit:
    """One unit as the updating thread sees it (seconds)."""

    layer: int
    read: float
    """Its states in from the disk."""
    write: float
    """And back."""
    step: float
    """The updating thread's time per AdamW step of it."""
    fixed: float
    """The updating thread's time per update besides the steps (its share of the disk's host work)."""
    fresh: float
    """Into an iteration, when the backward first adds to its sums."""


def _units(mine: list, plan: Plan, trace: Trace, profile: HardwareProfile, setting: Setting,
           iteration: float) -> list[_Unit]:
    """The updater's tasks by unit, in the order the updating thread walks them (reverse)."""
    per: dict[int, dict[str, float]] = {}
    for task in mine:
        cost = per.setdefault(task.target.layer, {"read": 0.0, "write": 0.0, "step": 0.0, "fixed": 0.0})
        seconds = sum(profile.seconds(resource, amount, task.tier, plan.world_size)
                      for resource, amount in costs(task, setting) if amount)
        key = {"move_to_cpu": "read", "offload": "write", "update": "step"}.get(task.operation)
        if key is not None:
            cost[key] += seconds
        host = host_cost(task, setting)
        if host and host[1]:
            cost["fixed"] += profile.seconds(host[0], host[1], task.tier, plan.world_size)
    durations = [op.duration for op in trace.ops]
    total = sum(durations) or 1.0
    before = [0.0]
    for d in durations:
        before.append(before[-1] + d)
    first_grad: dict[int, int] = {}
    for tensor in trace.tensors:
        if tensor.kind == "grad" and tensor.layer is not None and tensor.accesses:
            first_grad[tensor.layer] = min(first_grad.get(tensor.layer, len(durations)), min(tensor.accesses))
    return [_Unit(layer, c["read"], c["write"], c["step"], c["fixed"],
                  iteration * before[first_grad.get(layer, len(durations))] / total)
            for layer, c in sorted(per.items(), reverse=True)]


def _follow(units: list[_Unit], iteration: float, bound: int | None, steps: int = 64,
            keep: bool = True, drain: float = 0.0) -> tuple[float, float]:
    """Replay the compute side (``iteration`` seconds of work per step) against the updating
    thread's rules ([Note: the updating thread's rules, simulated]) for ``steps`` steps; returns
    the mean iteration (start to start) and the mean lag at an iteration's start, both over the
    second half. ``keep=False``: every update writes its states back (the engine before [Note: a
    fetch serves the bound's updates]). ``drain``: seconds per published update, on the compute side
    at the start of the iteration that finds it ([Note: the drain, simulated])."""
    n = len(units)
    published = [0]  # updates published and not yet drained
    untaken, lag = [0] * n, [0] * n
    on_cpu = [False] * n
    served: list[int | None] = [None] * n  # updates since the states were read (the engine's _since_read)
    clock = {"now": 0.0, "disk": 0.0}
    starts: list[float] = []
    seen: list[float] = []
    window = [0.0, -1.0]  # the iteration in progress: [start, step()] (-1: none yet)

    def fresh(u: int) -> bool:
        return window[1] < 0 and clock["now"] >= window[0] + units[u].fresh

    def disk(seconds: float) -> float:
        start = max(clock["now"], clock["disk"])
        clock["disk"] = start + seconds
        return clock["disk"]

    def compute():
        for _ in range(steps):
            yield lambda: bound is None or max(lag) <= bound  # the drain writes what is published
            starts.append(clock["now"])
            seen.append(sum(lag) / n)
            window[:] = [clock["now"], -1.0]
            drained, published[0] = published[0], 0
            yield clock["now"] + iteration + drained * drain
            window[1] = clock["now"]
            for u in range(n):
                untaken[u] += 1
                lag[u] += 1

    def updater():
        while True:
            yield lambda: any(untaken[u] and not fresh(u) for u in range(n))
            order = [u for u in range(n) if untaken[u] and not fresh(u)]
            landed = [0.0] * n

            def fetch(u: int) -> None:
                landed[u] = clock["now"] if on_cpu[u] or not units[u].read else disk(units[u].read)
                on_cpu[u] = True

            writebacks = []
            fetch(order[0])
            for i, u in enumerate(order):
                if i + 1 < len(order):
                    fetch(order[i + 1])
                yield landed[u]
                if fresh(u):  # its states stay fetched, for the next pass
                    continue
                k, untaken[u] = untaken[u], 0
                yield clock["now"] + k * units[u].step + units[u].fixed
                lag[u] -= k  # published
                published[0] += 1
                if not (units[u].read or units[u].write):
                    continue
                if keep and bound:  # [Note: a fetch serves the bound's updates]: LockFreeUpdater._keeps
                    count = (units[u].layer % (bound + 1) if served[u] is None else served[u]) + 1
                    served[u] = 0 if count > bound else count
                    if count <= bound:
                        continue
                writebacks.append(disk(units[u].write))
                on_cpu[u] = False
            yield max(writebacks, default=clock["now"])

    _run_processes([compute(), updater()], clock, stop=lambda: len(starts) >= steps)
    half = len(starts) // 2
    span = (starts[-1] - starts[half]) / max(1, len(starts) - 1 - half)
    return span, sum(seen[half:]) / max(1, len(seen) - half)


def _run_processes(procs: list, clock: dict, stop) -> None:
    """A two-process event loop: each process yields a time to sleep until, or a condition
    (a callable) to wait for; conditions are checked again whenever a process acts."""
    waits: list = [None] * len(procs)
    for i, p in enumerate(procs):
        waits[i] = next(p)
    while not stop():
        progressed = False
        for i, p in enumerate(procs):
            w = waits[i]
            if callable(w) and w() or not callable(w) and w <= clock["now"]:
                waits[i] = next(p)
                progressed = True
        if progressed:
            continue
        times = [w for w in waits if not callable(w)]
        if not times:
            raise RuntimeError("the lock-free replay deadlocked")  # every process waits for a condition
        clock["now"] = max(clock["now"], min(times))
