"""The task queue a plan is made of, and what each task means: the one table of effects that the
planner, the validator, the simulator and the executor all read.

Logical time is the trace's op ids ``0 .. n-1`` plus one virtual op ``n`` ("the end of the
iteration", zero duration, no non-model memory). A task's ``trigger_id`` is the op at which it
may be issued: every task is issued when its trigger op *starts*, except ``release``, which is
issued when its trigger op *finishes*. Memory a task takes counts from its trigger op on; the
memory a ``release`` gives back counts up to and including its trigger op.

Everything is per rank: with ``world_size`` W, each layer's parameters are sharded into W equal
shards and this rank owns one (``Layout``).

**Holdings.** What a task takes, reads, writes and gives back are *holdings*: copies of one layer's
model states on one tier, named ``name@tier`` (``.j`` for page j of a paged holding):

========= ====== ============= ================================================================
holding   scope  pages each    what it is
========= ====== ============= ================================================================
param     page   1             page j of this rank's fp16 parameter shard; home copy on ``cpu``
                               (on ``gpu`` for a layer cached there)
gathered  page   W - 1         the other ranks' copies of parameter page j, on ``gpu`` (W > 1)
fullgrad  group  W x pages     the layer's full gradient buffer on ``gpu`` (W > 1), from the
                               backward compute until ``reduce_scatter`` has consumed it
grad      page   1             page j of this rank's gradient shard, on ``gpu`` or ``cpu``
optim     group  optim pages   fp32 master weights and Adam moments of the shard; home on the
                               optimizer tier (``cpu``, ``nvme``; ``gpu`` when cached)
========= ====== ============= ================================================================

Home copies exist at rest and are never given back; every other holding exists from the task
that takes it to the release that gives it back.

**Effects** (``EFFECTS``). In the holdings, ``T`` is the task's tier and ``home`` the holding's
home tier; a paged holding of a task whose target names no page means every page of the layer
(``.*``). In the tier column, ``home`` means the optimizer states' home tier and ``copy`` any
other. ``when`` is a condition for the row (``W>1``: only with several ranks); ``grads:`` marks
what only a ``produces_grads`` compute takes:

============== ======== ===== ===== ================ ================== ================ ================
operation      target   tier  when  takes at issue   reads              writes           gives back
============== ======== ===== ===== ================ ================== ================ ================
move_to_gpu    param.j  gpu         param@gpu.j      param@home.j
all_gather     param.j  -     W>1   gathered@gpu.j   param@gpu.j
compute        layer    gpu         grads: fullgrad  param@gpu.*,
                                    @gpu (W>1) or    gathered@gpu.*
                                    grad@gpu.* (W=1) (W>1), from trigger
                                                     to ``end_id``
reduce_scatter grad.j   -     W>1   grad@gpu.j       fullgrad@gpu
offload        grad.j   cpu         grad@T.j         grad@gpu.j
offload        optim    home                         optim@cpu          optim@T
move_to_cpu    optim    cpu         optim@cpu        optim@home
update         layer    cpu,        -                grad@T.*, optim@T  optim@T,
                        gpu                                             param@home.*
release        param    gpu                                                              param@gpu.*,
                                                                                         gathered@gpu.*
release        fullgrad gpu   W>1                                                        fullgrad@gpu
release        grad     gpu,                                                             grad@T.*
                        cpu
release        optim    copy                                                             optim@T
============== ======== ===== ===== ================ ================== ================ ================

The other columns of each row: the stream an executor runs it on and what that costs (a
transfer of some pages, an Adam step over the shard's elements, bytes of memory traffic):

============== ======== ========================= =============================================
operation      target   stream                    cost
============== ======== ========================= =============================================
move_to_gpu    param.j  h2d                       h2d: 1 page
all_gather     param.j  network                   network: W - 1 pages
compute        layer    (the model's own ops)     -
reduce_scatter grad.j   network                   network: W - 1 pages
offload        grad.j   d2h                       d2h: 1 page
offload        optim    nvme (the write-back)     nvme_write: the optim pages; at the same time on
                        and io                    io, nvme_host: the optim pages
move_to_cpu    optim    nvme and io               nvme_read: the optim pages; nvme_host on io
update         layer    cpu; compute on the gpu   adam: the shard's elements, then memory: the
                                                  refresh of ``param@home`` (read the fp32 master
                                                  shard, write the parameter shard; none where
                                                  the layer has no separate compute copy)
release        param    none; beside it, compute  window: one, the executor's host time for the
                        (the executor's thread)   window it ends (stage, bind, release), on the
                                                  thread that runs the model
release        other    none (takes no time)      -
============== ======== ========================= =============================================

The table applied to one task of one plan -- which pages of which layer on which tier -- is
``pagemem.sched.holdings.effects``.

**What a task waits for** (``pagemem.sched.deps``, one rule for every row): before it runs, a
task waits for the last task that took or wrote each holding it reads (the move of a page before its
all-gather; the moves and all-gathers of a layer before its compute; the reduce-scatter of a
gradient page before its offload; the offloads and the optimizer fetch before an update; the
update before the write-back); a task that takes a holding waits for the release that last gave
it back; a release waits for every task that took, read or wrote what it gives back since it was
taken (a parameter release for the compute of the window, which finishes with op ``end_id``, and
the moves and all-gathers; a gradient release for its offloads and the update). A holding read
before anything in this iteration wrote it (a home copy) was last written by the previous
iteration: those waits are ``Deps.previous`` (synchronous updates: a layer's moves, and the
compute of a layer cached on the gpu, wait for the last iteration's update of it; an optimizer
fetch for the last write-back). Two waits are on ops, not tasks: ``reduce_scatter`` and
``update`` come after the layer's last gradient access (their trigger is after it), and a
release is issued when its trigger op has finished.

**What a task triggers.** A finished task lets the tasks that wait for it run (``Plan.deps`` in
reverse). A ``compute`` gates the model: op ``trigger_id`` may not start before the compute's
waits are over, and the compute finishes when op ``end_id`` does (its ``produces_grads`` compute
also takes the gradient buffer the backward pass writes). A release lets the memory it gives back
be taken again, in queue order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Operation = Literal["move_to_gpu", "move_to_cpu", "all_gather", "compute", "offload", "release",
                    "reduce_scatter", "update"]
OPERATIONS: tuple[str, ...] = ("move_to_gpu", "move_to_cpu", "all_gather", "compute", "offload",
                               "release", "reduce_scatter", "update")
TargetKind = Literal["param", "grad", "fullgrad", "optim", "layer"]
TIERS: tuple[str, ...] = ("gpu", "cpu", "nvme")
TRANSFERS: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", "network")
RESOURCES: tuple[str, ...] = (*TRANSFERS, "adam", "memory", "nvme_host", "window")
"""What a task's cost is counted in: bytes of a transfer, Adam elements, bytes of memory traffic
(read + written) on the tier the task runs on, disk bytes the host's CPU handles, windows of a
moved layer the executor handles."""
MASTER_BYTES_PER_ELEMENT = 4
"""The fp32 master weights the ``optim`` holding keeps per parameter element."""


@dataclass(frozen=True, slots=True)
class Target:
    """A page (``page`` set) or a whole group of one layer (``page`` None)."""

    kind: TargetKind
    layer: int
    page: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}[{self.layer}]" + ("" if self.page is None else f".{self.page}")


@dataclass(frozen=True, slots=True)
class Task:
    """One entry of the queue: ``{operation, target, trigger_id}``, plus the tier it acts on
    (destination of a move or offload, tier freed by a release, where an update runs)."""

    operation: Operation
    target: Target
    trigger_id: int
    tier: str | None = None
    end_id: int | None = None
    """For ``compute``: the last op of the window; the layer's pages stay resident from
    ``trigger_id`` to the end of op ``end_id``, when the compute finishes."""
    produces_grads: bool = False
    """For ``compute``: the window whose ops write the layer's gradients; it takes their buffer."""

    def __str__(self) -> str:
        where = f" @{self.tier}" if self.tier else ""
        until = f" ..{self.end_id}" if self.end_id is not None else ""
        grads = " +grads" if self.produces_grads else ""
        return f"{self.trigger_id:>6} {self.operation:<14} {self.target}{where}{until}{grads}"

    @property
    def issued_at_end(self) -> bool:
        """True for ``release``, which is issued when its trigger op finishes."""
        eff = EFFECTS.get((self.operation, self.target.kind))
        return eff.issued == "end" if eff is not None else self.operation == "release"


# ---------------------------------------------------------------------------------------- the table

@dataclass(frozen=True, slots=True)
class Hold:
    """A holding in a row of the table: ``name@tier``, per page of the target or one group.

    ``tier`` is a tier, ``"T"`` (the task's tier) or ``"home"``; ``when`` lists conditions that
    must all hold: ``"W>1"``, ``"W=1"``, ``"grads"`` (a compute with ``produces_grads``)."""

    name: str
    tier: str
    paged: bool = True
    when: str = ""


@dataclass(frozen=True, slots=True)
class Effect:
    """One row of the table: what a task of ``operation`` on a ``kind`` target does."""

    operation: str
    kind: str
    tiers: tuple[str | None, ...]
    """Tiers the task may name; ``"home"``: the optimizer states' home tier; ``"copy"``: any other."""
    takes: tuple[Hold, ...] = ()
    """Holdings it creates when issued: the pages it takes."""
    reads: tuple[Hold, ...] = ()
    """Holdings that must be there; it waits for the task that last took or wrote each."""
    writes: tuple[Hold, ...] = ()
    """Holdings it modifies (later readers wait for it; a written copy must go back home)."""
    frees: tuple[Hold, ...] = ()
    """Holdings it gives back once every task that touched them is done (home copies never)."""
    issued: str = "start"
    """``"start"`` or ``"end"`` of the trigger op."""
    when: str = ""
    """Conditions for the operation to exist at all (``"W>1"``)."""
    after_grads: bool = False
    """Must come after the layer's last gradient access."""
    gates_ops: bool = False
    """The model's ops from ``trigger_id`` to ``end_id`` run under it (``compute``)."""
    stream: str | None = None
    gpu_stream: str | None = None
    """The stream when the task's tier is ``gpu``, if not ``stream``."""
    cost: tuple[tuple[str, str], ...] = ()
    """``(resource, unit)`` terms, run one after the other: a transfer (``TRANSFERS``) of a
    holding's pages, ``("adam", "shard")`` (an Adam step over the shard's elements), ``("memory",
    "refresh")`` (the compute copy written from the master weights)."""
    host: tuple[str, str] | None = None
    """A cost on the ``io`` stream at the same time: the CPU's share of a disk transfer
    (``("nvme_host", holding)``: checksums, submission)."""
    executor: tuple[str, str] | None = None
    """A cost on the ``compute`` stream after the trigger op, beside the task: the executor's host
    time on the thread that runs the model (``("window", "window")``: one window of a moved
    layer)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.operation, self.kind

    def stream_for(self, tier: str | None) -> str | None:
        return self.gpu_stream if tier == "gpu" and self.gpu_stream else self.stream


_PARAM = Hold("param", "gpu")
_GATHERED = Hold("gathered", "gpu", when="W>1")
EFFECTS: dict[tuple[str, str], Effect] = {e.key: e for e in (
    Effect("move_to_gpu", "param", ("gpu",), takes=(_PARAM,), reads=(Hold("param", "home"),),
           stream="h2d", cost=(("h2d", "param"),)),
    Effect("all_gather", "param", (None,), takes=(_GATHERED,), reads=(_PARAM,), when="W>1",
           stream="network", cost=(("network", "gathered"),)),
    Effect("compute", "layer", ("gpu",), reads=(_PARAM, _GATHERED),
           takes=(Hold("fullgrad", "gpu", paged=False, when="grads W>1"), Hold("grad", "gpu", when="grads W=1")),
           gates_ops=True),
    Effect("reduce_scatter", "grad", (None,), takes=(Hold("grad", "gpu"),),
           reads=(Hold("fullgrad", "gpu", paged=False),), when="W>1", after_grads=True,
           stream="network", cost=(("network", "gathered"),)),
    Effect("offload", "grad", ("cpu",), takes=(Hold("grad", "T"),), reads=(Hold("grad", "gpu"),),
           stream="d2h", cost=(("d2h", "grad"),)),
    Effect("offload", "optim", ("home",), reads=(Hold("optim", "cpu", paged=False),),
           writes=(Hold("optim", "T", paged=False),), stream="nvme", cost=(("nvme_write", "optim"),),
           host=("nvme_host", "optim")),
    Effect("move_to_cpu", "optim", ("cpu",), takes=(Hold("optim", "cpu", paged=False),),
           reads=(Hold("optim", "home", paged=False),), stream="nvme", cost=(("nvme_read", "optim"),),
           host=("nvme_host", "optim")),
    Effect("update", "layer", ("cpu", "gpu"), reads=(Hold("grad", "T"), Hold("optim", "T", paged=False)),
           writes=(Hold("optim", "T", paged=False), Hold("param", "home")), after_grads=True,
           stream="cpu", gpu_stream="compute", cost=(("adam", "shard"), ("memory", "refresh"))),
    Effect("release", "param", ("gpu",), frees=(_PARAM, _GATHERED), issued="end",
           executor=("window", "window")),
    Effect("release", "fullgrad", ("gpu",), frees=(Hold("fullgrad", "gpu", paged=False),), issued="end",
           when="W>1"),
    Effect("release", "grad", ("gpu", "cpu"), frees=(Hold("grad", "T"),), issued="end"),
    Effect("release", "optim", ("copy",), frees=(Hold("optim", "T", paged=False),), issued="end"),
)}


def effect_of(task: Task) -> Effect | None:
    """The table's row for a task (None: no such operation on such a target)."""
    return EFFECTS.get((task.operation, task.target.kind))
