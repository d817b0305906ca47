"""Run a plan's task queue on a model of the hardware, in wall time: a discrete-event simulation.

>>> s = simulate(p, trace, HardwareProfile.a100_server())
>>> s.iteration_time, s.gpu_idle_fraction, s.busy["nvme"], s.stalls
>>> s.to_chrome("timeline.json")            # one track per stream; opens in Perfetto

What each task does -- its stream, its cost, the memory it takes and gives back, what it waits
for -- is read off the task table of :mod:`pagemem.sched.tasks`; this module adds the hardware
(seconds per unit of cost) and the model's ops.

**Streams.** Each runs its tasks one at a time, in queue order:

========  ===========================================  =========================================
stream    tasks                                        seconds per task
========  ===========================================  =========================================
compute   the trace's ops in order; ``update`` of      ``op.duration * compute_scale`` (ops of
          layers cached on the gpu (GPU Adam kernels   the ``step`` phase take 0: the queue's
          share the GPU, so they run here, before the  updates replace them); shard elements /
          op that triggers them); the executor's host  ``gpu_adam_elements_per_s`` + refresh
          time for each window of a moved layer, after bytes / ``hbm_bytes_per_s``;
          the op that ends it (the thread that runs    ``window_host_seconds`` per window
          the model runs it)
h2d       ``move_to_gpu``                              page bytes / ``h2d_bytes_per_s``
d2h       ``offload`` of a gradient page to the cpu    page bytes / ``d2h_bytes_per_s``
network   ``all_gather``, ``reduce_scatter``           a collective of one page per rank over W
                                                       ranks on ``ceil(W / ranks_per_server)``
                                                       servers: ``pagemem.sched.network`` (ring
                                                       or tree, NVLink and the servers' NICs)
nvme      ``move_to_cpu`` (read: optimizer states;     bytes / the rank's share of the server's
          with parameters homed on nvme, a parameter   SSD read / write bandwidth (a gradient
          page staged, a layer's gradients fetched),   page to nvme: its d2h time, then its
          ``offload`` of optimizer states (write-back) write)
          and of a gradient page to nvme
io        the CPU's share of each of those (checksums, bytes / the rank's share of
          submission), beside the transfer; the task  ``nvme_host_bytes_per_s``
          is done when both are
cpu       ``update`` on cpu                            shard elements / the rank's share of the
                                                       server's CPU Adam rate + refresh bytes /
                                                       its share of ``host_memory_bytes_per_s``
                                                       (parameters homed on nvme: + the param
                                                       bytes written, at the SSD write share)
========  ===========================================  =========================================

An update's refresh is the compute copy written from the new master weights: 4 bytes read and
the parameter shard's bytes written per element (none where the parameters are the master).

Streams the profile names in ``shared_processor`` are one processor: at most one of them runs
at a time (the host stand-in, whose compute, copies and CPU Adam share the same cores); the
others are separate engines that overlap freely.

Every transfer moves whole pages, as ``Plan.bytes_moved`` counts them. ``release`` and the
``compute`` markers take no time and run on no stream.

**When a task starts.** When (1) it is issued: the compute stream has *reached* its trigger op
(the previous op finished and the op's memory is reserved, see below) -- or, for ``release``,
the trigger op has finished; (2) the memory it allocates has been granted (below); (3) the tasks
it waits for (``pagemem.sched.deps``: e.g. ``all_gather`` after its page's ``move_to_gpu``,
``update`` after the layer's offloads and ``move_to_cpu``, a release after everything that
touched what it gives back; across iterations a layer's moves after the last iteration's update)
have finished; (4) its stream is free and it is next in the stream's order. The op that starts a
``compute`` window waits for what that compute waits for (the window's moves and all-gathers);
waiting for a compute means waiting for the last op of its window, or, for the gradient buffer
it takes, for the reservation of its first op.

**Memory in wall time.** The gpu and cpu tiers are accounted in bytes against the plan's
budgets, starting from the state at rest (parameter shards on the plan's ``home_tier``,
optimizer states on their tier, cached layers on gpu; what rests on nvme is not accounted here:
the planner and the validator count it). Allocations are those of ``pagemem.sched.tasks``: ``move_to_gpu``
+1 page, ``all_gather`` +(W-1) pages, the gradient-producing ``compute`` its gradient buffer,
``reduce_scatter`` +1 page, gradient ``offload`` +1 cpu page, ``move_to_cpu`` the optimizer
pages (a staged parameter page, a layer's gradient pages) on cpu; a ``release`` frees what those allocated once everything that touched it is done.
When the compute stream reaches op t it *reserves* op t's memory: its non-model bytes (replacing
op t-1's) and any gradient buffer its ``compute`` task allocates. A task's memory is taken when
it is issued, not when its stream gets to it (a runtime reserves the destination pages, then
queues the copy), and each tier grants requests strictly in queue order: a request that does not
fit waits until releases make room, and every later request on that tier waits behind it. That
is the order the planner and the validator count memory in, so a plan the validator accepts
cannot deadlock here; a stuck queue (a broken plan) raises :class:`SimulationDeadlock` naming
what each stream and tier waits for.

**What is reported.** Iterations are simulated until the last two take the same time and no
stream has more work per iteration than that (at least ``iterations``, at most
``max_iterations``; ``steady`` says which), plus one more to time the last. Iteration k lasts from the start of its first op that uses parameters (the op synchronous
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

from pagemem.checks import check_int
from pagemem.errors import ConfigError
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.plan import Plan
from pagemem.sched.sim_engine import Engine
from pagemem.sched.sim_graph import build
from pagemem.sched.sim_result import STREAMS, SimEvent, SimResult, SimulationDeadlock, SimulationError
from pagemem.tracer import Trace

__all__ = ["simulate", "SimResult", "SimEvent", "SimulationDeadlock", "SimulationError", "STREAMS"]


def simulate(plan: Plan, trace: Trace, profile: HardwareProfile, iterations: int = 2, *,
             max_iterations: int = 32) -> SimResult:
    """Simulate training iterations of ``plan`` (made from ``trace``) on ``profile``, with
    synchronous updates, and report the last one (see the module docs).

    At least ``iterations`` iterations are simulated; while the last two take different times,
    or a stream's work exceeds the period (the first iterations fill the streams' backlogs), the
    run is repeated with twice as many, up to ``max_iterations``; ``SimResult.steady`` says
    whether it settled. Raises
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
    nodes = build(plan, trace, profile)
    k = iterations
    while True:
        result = Engine(plan, nodes, profile, k + 1).run(k)
        if result.steady or k >= max_iterations:
            return result
        k = min(2 * k, max_iterations)
