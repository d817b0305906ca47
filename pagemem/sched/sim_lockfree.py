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
iteration; a fixed point settles how much of a pass falls in one iteration. Staleness is
predicted as the iterations one pass spans, less the one the compute side is in: a unit's
parameters lag by about that much at an iteration's start. What this leaves out: contention
that slows both sides beyond their own costs (memory bandwidth, a lock), and the drain of
published values into the compute pages (a copy per updated parameter on the compute side).
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
                       max_staleness: int | None = None) -> LockFreePrediction:
    """Predict an iteration of ``plan`` with the lock-free updater (see the Note); with
    ``max_staleness`` (``EngineConfig.effective_max_staleness``) the compute side waits where a
    pass spans more than ``max_staleness + 1`` iterations, so an iteration takes at least
    ``pass / (max_staleness + 1)`` (the steady state: the engine's first ``synchronous_steps``
    are not modelled)."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan: expected a pagemem.sched.Plan, got {type(plan).__name__}")
    if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise ConfigError(f"max_staleness: must be None or an integer >= 0, got {max_staleness!r}")
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
    if max_staleness is not None:
        t = max(t, pass_time / (max_staleness + 1))
    staleness = max(0.0, pass_time / t - 1.0) if t else 0.0
    return LockFreePrediction(t, pass_time, busy, staleness, side)
