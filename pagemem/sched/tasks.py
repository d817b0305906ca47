"""The task queue a plan is made of, and what each task means: the one table of effects that the
planner, the validator, the simulator and the executor all read.

Logical time is the trace's op ids ``0 .. n-1`` plus one virtual op ``n`` ("the end of the
iteration", zero duration, no non-model memory). A task's ``trigger_id`` is the op at which it
may be issued: every task is issued when its trigger op *starts*, except ``release``, which is
issued when its trigger op *finishes*. Memory a task takes counts from its trigger op on; the
memory a ``release`` gives back counts up to and including its trigger op.

Everything is per rank: with ``world_size`` W, each layer's parameters are sharded into W equal
shards and this rank owns one (``Layout``, ``sharding="params"``: ZeRO-3). With
``sharding="states"`` (ZeRO-1) every rank holds the whole parameters and gradients and a share of
the optimizer states: the rows of one rank apply, plus the two ``R>1`` rows below.

**Holdings.** What a task takes, reads, writes and gives back are *holdings*: copies of one layer's
model states on one tier, named ``name@tier`` (``.j`` for page j of a paged holding):

========= ====== ============= ================================================================
holding   scope  pages each    what it is
========= ====== ============= ================================================================
param     page   1             page j of this rank's fp16 parameter shard (the compute copy);
                               home copy on the plan's ``home_tier`` (``cpu`` or ``nvme``; on
                               ``gpu`` for a layer cached there)
gathered  page   W - 1         the other ranks' copies of parameter page j, on ``gpu`` (W > 1)
fullgrad  group  W x pages     the layer's full gradient buffer on ``gpu`` (W > 1), from the
                               backward compute until ``reduce_scatter`` has consumed it
grad      page   1             page j of this rank's gradient shard, on ``gpu``, ``cpu`` or
                               ``nvme`` (no home copy: taken in backward, given back after the
                               update)
optim     group  optim pages   fp32 master weights and Adam moments of the shard; home on the
                               optimizer tier (``cpu``, ``nvme``; ``gpu`` when cached)
========= ====== ============= ================================================================

Home copies exist at rest and are never given back; every other holding exists from the task
that takes it to the release that gives it back.

[Note: a streamed update] A layer not cached on the gpu whose optimizer states rest on ``nvme``,
or whose gradients go through it (``H=nvme``), is updated *streamed*: the runtime brings what
rests on nvme through the cpu a piece at a time, so its update needs at most the layer's
``stream_pages`` (``LayerLayout.update_pages``: what an engine says its largest parameter's
states and gradient sums take; by default the whole layer's ``grad`` and ``optim`` pages) on the
cpu at once, not every page of both. The holdings keep their names and the rows below are those
of an update that is not streamed; only what the cpu copies *occupy* changes
(``Setting.held_pages``, the one place this rule lives): the cpu copy of the streamed states
(``optim@cpu``) and then the streamed gradient pages (``grad@cpu.0``, ``.1``, ...) fill the
stream in that order, each occupying what is left of it (a page beyond it occupies none). A
transfer still moves every page (the costs below count ``pages``, not what is held).

**Effects** (``EFFECTS``). In the holdings, ``T`` is the task's tier and ``home`` the holding's
home tier; a paged holding of a task whose target names no page means every page of the layer
(``.*``). In the tier column, ``home`` means the optimizer states' home tier and ``copy`` any
other. ``when`` is a condition (for the row, or for the holding or cost term it follows): ``W>1``
or ``W=1`` (the parameters sharded over several ranks, or not), ``R>1`` (several ranks that
shard the optimizer states only), ``T=gpu`` (the task's tier is ``gpu``), ``H=nvme``
(the layer's parameters are homed on ``nvme``), ``F=nvme`` (the task copies from ``nvme``:
its ``source``); ``grads:`` marks what only a ``produces_grads`` compute takes; in the holdings,
``F`` is the tier the task copies from (its ``source``, else ``cpu``):

============== ======== ===== ====== ================ ================== ================ ================
operation      target   tier  when   takes at issue   reads              writes           gives back
============== ======== ===== ====== ================ ================== ================ ================
move_to_gpu    param.j  gpu          param@gpu.j      param@F.j (C),
                                                      optim@home (U)
move_to_cpu    param.j  cpu   H=nvme param@cpu.j      param@home.j
all_gather     param.j  -     W>1    gathered@gpu.j   param@gpu.j
compute        layer    gpu          grads: fullgrad  param@gpu.*,
                                     @gpu (W>1) or    gathered@gpu.*
                                     grad@gpu.* (W=1) (W>1), from trigger
                                                      to ``end_id``
reduce_scatter grad.j   -     W>1    grad@gpu.j       fullgrad@gpu
offload        grad.j   cpu,         grad@T.j         grad@gpu.j
                        nvme
move_to_cpu    grad     cpu          grad@cpu.*       grad@nvme.*
offload        optim    home                          optim@cpu          optim@T
move_to_cpu    optim    cpu          optim@cpu        optim@home
update         layer    cpu,         -                grad@T.*, optim@T  optim@T,
                        gpu                                              param@home.*
release        param    gpu,                                                              param@T.*,
                        cpu                                                               gathered@gpu.*
                                                                                          (T=gpu, W>1)
release        fullgrad gpu   W>1                                                         fullgrad@gpu
release        grad     gpu,                                                              grad@T.*
                        cpu,
                        nvme
release        optim    copy                                                              optim@T
all_reduce     grad     gpu,  R>1,                    grad@T.*           grad@T.*
                        cpu   U
all_gather     optim    gpu,  R>1                     optim@T            param@home.*
                        cpu
============== ======== ===== ====== ================ ================== ================ ================

**States sharded only** (``R>1``: several ranks, ``Layout.sharding="states"``, where ``W>1`` and
its rows do not hold and ``W=1``'s do): ``all_reduce grad`` averages the layer's gradient sums
over the ranks where the update reads them (after their offload, or their fetch from nvme); the
update steps this rank's share of the elements (``shard_elements``); ``all_gather optim`` then
sends that share of the updated weights to every rank, which writes what it receives into its
compute copy (``param@home``), before the states go back home.

**Units gathered** (``U``: several ranks, ``Layout.sharding="units"``, what an engine with
``shard_parameters`` runs; ``C``: not so, a compute copy at rest): the ``R>1`` rows' layout (whole
parameters and gradient sums per layer, each rank's share of the optimizer states) without a
compute copy at rest: ``param`` has no home (``Setting.home`` is None but for a layer cached on
the gpu), so ``move_to_gpu param.j`` reads the optimizer states at home (the rank's master
share) instead of a home copy and its first page carries the layer's all-gather (every rank's
share of the compute copy, padded to the largest: ``LayerLayout.unit_gather_bytes``), the update
refreshes no compute copy, ``all_reduce grad`` reduce-scatters the sums into this rank's share
(``gather_elements`` fp32 elements per rank) and no ``all_gather optim`` follows. Only with
``home_tier="cpu"``, and no layer is cached on the gpu (its copy would be stale after the
update: the engine evicts every gathered unit at the step).

**Homes on nvme** (issue 31; the plan's ``home_tier``, ``Setting.home_tier``). With
``home_tier="nvme"`` a layer's compute copy and gradients rest on ``nvme`` and the ``cpu`` tier
is a working set the plan stages them through. New rows: ``move_to_cpu param.j`` stages page j of
the compute copy from its nvme home into cpu memory ahead of the window's ``move_to_gpu`` (only
where ``H=nvme``); ``move_to_cpu grad`` brings the layer's gradient shard back from nvme for the
update on the cpu. Changed rows: ``move_to_gpu`` reads ``param@cpu`` -- for a cpu home that is
the home copy, as before; for an nvme home the staged copy, which must be there -- or, with
``source="nvme"`` (a *direct* move: ``F=nvme``), the home copy on nvme itself (see the Note
below); ``release
param`` may name tier ``cpu`` and then gives back the staged copy only (the gathered pages and
the executor's window time only where ``T=gpu``); ``offload grad`` may name tier ``nvme`` (the
gradient page goes through the host to disk); ``release grad`` may name tier ``nvme``; the
``update`` of a layer homed on nvme writes its refreshed compute copy to disk (the write is
counted in its cost). Rows and conditions for ``home_tier="cpu"`` are those of before: such plans
are unchanged.

[Note: staging is optional] A runtime copies a page between nvme and the gpu through transfer
buffers of its own, outside the cpu budget (pagemem's store bounces each page through a pinned
staging page), so a page homed on nvme needs no cpu page to reach the gpu: staging it
(``move_to_cpu param.j``) only lets its move read memory instead of the disk. A plan stages as
many of a window's pages as the cpu budget holds and moves the others directly
(``move_to_gpu param.j`` with ``source="nvme"``, which reads the home copy on nvme, costs a disk
read before the h2d copy and runs on the ``nvme`` stream); the cpu a plan needs for parameters
homed on nvme is then nothing, and its least cpu budget is what its updates hold at once.

The other columns of each row: the stream an executor runs it on and what that costs (a
transfer of some pages, an Adam step over the shard's elements, bytes of memory traffic); a
``T=``/``H=``/``F=`` condition before a term limits it to such tasks:

============== ======== ========================= =============================================
operation      target   stream                    cost
============== ======== ========================= =============================================
move_to_gpu    param.j  h2d; F=nvme: nvme and io  U: first all_gather: the layer's share on page 0
                                                  (``unit``); h2d: 1 page; F=nvme: first
                                                  nvme_read: 1 page, and nvme_host on io
move_to_cpu    param.j  nvme and io               nvme_read: 1 page; nvme_host on io
all_gather     param.j  network                   all_gather: 1 page per rank, over W ranks (the
                                                  collective's time: ``pagemem.sched.network``)
compute        layer    (the model's own ops)     -
reduce_scatter grad.j   network                   reduce_scatter: 1 page per rank, over W ranks
offload        grad.j   d2h; T=nvme: nvme and io  d2h: 1 page; T=nvme: then nvme_write: 1 page,
                                                  and nvme_host on io
move_to_cpu    grad     nvme and io               nvme_read: the layer's grad pages; nvme_host
                                                  on io
offload        optim    nvme (the write-back)     nvme_write: the optim pages; at the same time on
                        and io                    io, nvme_host: the optim pages
move_to_cpu    optim    nvme and io               nvme_read: the optim pages; nvme_host on io
update         layer    cpu; compute on the gpu   adam: the shard's elements, then memory: the
                                                  refresh of ``param@home`` (read the fp32 master
                                                  shard, write the parameter shard; none where
                                                  the layer has no separate compute copy); H=nvme:
                                                  then nvme_write: the param pages (the refreshed
                                                  copy goes home), and nvme_host on io
release        param    none; beside it, compute  T=gpu: window: one, the executor's host time for
                        (the executor's thread)   the window it ends (stage, bind, release), on the
                                                  thread that runs the model
release        other    none (takes no time)      -
all_reduce     grad     network                   R>1: all_reduce: the layer's fp32 gradient sums,
                                                  every element (``elements``); U: reduce_scatter:
                                                  this rank's share (``grad_share``)
all_gather     optim    network                   all_gather: this rank's fp32 share of the updated
                                                  weights, padded to the largest rank's
                                                  (``gather_elements``)
============== ======== ========================= =============================================

[Note: a disk write on the task's stream] ``offload grad.j @nvme`` runs its d2h copy and its disk
write one after the other on the ``nvme`` stream (a direct ``move_to_gpu`` its disk read and its
h2d copy) (the disk is the scarcer engine; the d2h engine
is not marked busy meanwhile), and an update's write of the refreshed compute copy to nvme runs
on the update's own stream after its Adam step: the simulator charges each byte once, where the
task runs.

The table applied to one task of one plan -- which pages of which layer on which tier -- is
``pagemem.sched.holdings.effects``.

**What a task waits for** (``pagemem.sched.deps``, one rule for every row): before it runs, a
task waits for the last task that took or wrote each holding it reads (the move of a page before its
all-gather; the staging of a page on the cpu before its move to the gpu (nvme homes); the moves
and all-gathers of a layer before its compute; the reduce-scatter of a gradient page before its
offload; the offloads (through nvme: the gradient fetch) and the optimizer fetch before an
update; the update before the write-back); a task that takes a holding waits for the release
that last gave it back (a window's staging for the release of the layer's previous staged copy);
a release waits for every task that took, read or wrote what it gives back since it was taken (a
parameter release for the compute of the window, which finishes with op ``end_id``, and the moves
and all-gathers; the release of a staged copy for its staging and the moves that read it; a
gradient release for its offloads, fetch and the update). A holding read before anything in this
iteration wrote it (a home copy) was last written by the previous iteration: those waits are
``Deps.previous`` (synchronous updates: a layer's moves (nvme homes: its stagings), and the
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

from pagemem.sched.network import COLLECTIVES

Operation = Literal["move_to_gpu", "move_to_cpu", "all_gather", "compute", "offload", "release",
                    "reduce_scatter", "update", "all_reduce"]
OPERATIONS: tuple[str, ...] = ("move_to_gpu", "move_to_cpu", "all_gather", "compute", "offload",
                               "release", "reduce_scatter", "update", "all_reduce")
TargetKind = Literal["param", "grad", "fullgrad", "optim", "layer"]
TIERS: tuple[str, ...] = ("gpu", "cpu", "nvme")
TRANSFERS: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", "network")
"""What ``Plan.bytes_moved`` counts: bytes of each copy, and ``network``, the bytes a rank sends
in its collectives (``network.bus_bytes``: ``W - 1`` pages for a page's all-gather)."""
RESOURCES: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", *COLLECTIVES, "adam", "memory", "nvme_host",
                              "window")
"""What a task's cost is counted in: bytes of a copy, bytes per rank of a collective (its time
is ``pagemem.sched.network``'s: not linear in the bytes), Adam elements, bytes of memory traffic
(read + written) on the tier the task runs on, disk bytes the host's CPU handles, windows of a
moved layer the executor handles."""
MASTER_BYTES_PER_ELEMENT = 4
"""The fp32 master weights the ``optim`` holding keeps per parameter element."""
GRAD_SUM_BYTES_PER_ELEMENT = 4
"""The fp32 gradient sums an ``all_reduce`` averages, per parameter element."""


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
    source: str | None = None
    """For ``move_to_gpu``: the tier it copies from where not the cpu (``"nvme"``: a page homed
    there that the plan did not stage, read straight from its home; [Note: staging is optional])."""

    def __str__(self) -> str:
        where = f" @{self.tier}" if self.tier else ""
        until = f" ..{self.end_id}" if self.end_id is not None else ""
        grads = " +grads" if self.produces_grads else ""
        source = f" from {self.source}" if self.source else ""
        return f"{self.trigger_id:>6} {self.operation:<14} {self.target}{where}{until}{grads}{source}"

    @property
    def issued_at_end(self) -> bool:
        """True for ``release``, which is issued when its trigger op finishes."""
        eff = EFFECTS.get((self.operation, self.target.kind))
        return eff.issued == "end" if eff is not None else self.operation == "release"


# ---------------------------------------------------------------------------------------- the table

@dataclass(frozen=True, slots=True)
class Hold:
    """A holding in a row of the table: ``name@tier``, per page of the target or one group.

    ``tier`` is a tier, ``"T"`` (the task's tier), ``"home"`` or ``"F"`` (the tier the task copies
    from: its ``source``, else ``cpu``); ``when`` lists conditions that must all hold: ``"W>1"``,
    ``"W=1"``, ``"R>1"``, ``"U"``, ``"C"``, ``"D"`` (``R>1`` or ``U``), ``"grads"`` (a compute with ``produces_grads``), ``"T=<tier>"`` (the task's tier),
    ``"H=<tier>"`` (the layer's parameters' home tier), ``"F=<tier>"`` (the tier it copies from)."""

    name: str
    tier: str
    paged: bool = True
    when: str = ""


class Term(tuple):
    """One cost term: the pair ``(resource, unit)``, counted only where ``when`` holds (the
    conditions of ``Hold.when``; ``""``: always). [Note: a term is still a pair] Readers that
    take a term apart as ``resource, unit`` keep working; the condition rides along."""

    when: str

    def __new__(cls, resource: str, unit: str, when: str = "") -> "Term":
        term = super().__new__(cls, (resource, unit))
        term.when = when
        return term

    def __repr__(self) -> str:
        return f"Term({self[0]!r}, {self[1]!r}" + (f", when={self.when!r})" if self.when else ")")


@dataclass(frozen=True, slots=True)
class Effect:
    """One row of the table: what a task of ``operation`` on a ``kind`` target does."""

    operation: str
    kind: str
    tiers: tuple[str | None, ...]
    """Tiers the task may name; ``"home"``: the optimizer states' home tier; ``"copy"``: any other."""
    sources: tuple[str, ...] = ()
    """Tiers other than the cpu a task may name as its ``source`` (none: it names none)."""
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
    """Conditions for the operation to exist at all (``"W>1"``, ``"H=nvme"``)."""
    after_grads: bool = False
    """Must come after the layer's last gradient access."""
    gates_ops: bool = False
    """The model's ops from ``trigger_id`` to ``end_id`` run under it (``compute``)."""
    paged: bool = False
    """Its target names one page (``param.j``): one task per page of the layer."""
    stream: str | None = None
    stream_on: tuple[tuple[str, str], ...] = ()
    """``(tier, stream)``: the stream for a task on that tier, where not ``stream``."""
    stream_from: tuple[tuple[str, str], ...] = ()
    """``(source, stream)``: the stream for a task copying from that tier (before ``stream_on``)."""
    cost: tuple[tuple[str, str], ...] = ()
    """``(resource, unit)`` terms (``Term``: with a condition), run one after the other: a copy
    of a holding's pages, a collective (``network.COLLECTIVES``) of a holding's pages per rank,
    ``("adam", "shard")`` (an Adam step over the shard's elements), ``("memory", "refresh")``
    (the compute copy written from the master weights)."""
    host: tuple[str, str] | None = None
    """A cost on the ``io`` stream at the same time: the CPU's share of a disk transfer
    (``("nvme_host", holding)``: checksums, submission; a ``Term`` with its condition)."""
    executor: tuple[str, str] | None = None
    """A cost on the ``compute`` stream after the trigger op, beside the task: the executor's host
    time on the thread that runs the model (``("window", "window")``: one window of a moved
    layer; a ``Term`` with its condition)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.operation, self.kind

    @property
    def gpu_stream(self) -> str | None:
        """The stream when the task's tier is ``gpu``, if not ``stream``."""
        return dict(self.stream_on).get("gpu")

    def stream_for(self, tier: str | None) -> str | None:
        for on, stream in self.stream_on:
            if on == tier:
                return stream
        return self.stream

    def stream_of(self, task: "Task") -> str | None:
        """The stream ``task`` runs on: by its ``source``, else by its tier."""
        for source, stream in self.stream_from:
            if source == task.source:
                return stream
        return self.stream_for(task.tier)


_PARAM = Hold("param", "gpu")
_GATHERED = Hold("gathered", "gpu", when="W>1")
_NVME = "H=nvme"
EFFECTS: dict[tuple[str, str], Effect] = {e.key: e for e in (
    Effect("move_to_gpu", "param", ("gpu",), takes=(_PARAM,),
           reads=(Hold("param", "F", when="C"), Hold("optim", "home", paged=False, when="U")), paged=True,
           sources=("nvme",), stream="h2d", stream_from=(("nvme", "nvme"),),
           cost=(Term("all_gather", "unit", "U"), Term("nvme_read", "param", "F=nvme"), ("h2d", "param")),
           host=Term("nvme_host", "param", "F=nvme")),
    Effect("move_to_cpu", "param", ("cpu",), takes=(Hold("param", "cpu"),), reads=(Hold("param", "home"),),
           when=_NVME, paged=True, stream="nvme", cost=(("nvme_read", "param"),), host=("nvme_host", "param")),
    Effect("all_gather", "param", (None,), takes=(_GATHERED,), reads=(_PARAM,), when="W>1", paged=True,
           stream="network", cost=(("all_gather", "param"),)),
    Effect("compute", "layer", ("gpu",), reads=(_PARAM, _GATHERED),
           takes=(Hold("fullgrad", "gpu", paged=False, when="grads W>1"), Hold("grad", "gpu", when="grads W=1")),
           gates_ops=True),
    Effect("reduce_scatter", "grad", (None,), takes=(Hold("grad", "gpu"),),
           reads=(Hold("fullgrad", "gpu", paged=False),), when="W>1", after_grads=True, paged=True,
           stream="network", cost=(("reduce_scatter", "grad"),)),
    Effect("offload", "grad", ("cpu", "nvme"), takes=(Hold("grad", "T"),), reads=(Hold("grad", "gpu"),), paged=True,
           stream="d2h", stream_on=(("nvme", "nvme"),),
           cost=(("d2h", "grad"), Term("nvme_write", "grad", "T=nvme")), host=Term("nvme_host", "grad", "T=nvme")),
    Effect("move_to_cpu", "grad", ("cpu",), takes=(Hold("grad", "cpu"),), reads=(Hold("grad", "nvme"),),
           stream="nvme", cost=(("nvme_read", "grad"),), host=("nvme_host", "grad")),
    Effect("offload", "optim", ("home",), reads=(Hold("optim", "cpu", paged=False),),
           writes=(Hold("optim", "T", paged=False),), stream="nvme", cost=(("nvme_write", "optim"),),
           host=("nvme_host", "optim")),
    Effect("move_to_cpu", "optim", ("cpu",), takes=(Hold("optim", "cpu", paged=False),),
           reads=(Hold("optim", "home", paged=False),), stream="nvme", cost=(("nvme_read", "optim"),),
           host=("nvme_host", "optim")),
    Effect("update", "layer", ("cpu", "gpu"), reads=(Hold("grad", "T"), Hold("optim", "T", paged=False)),
           writes=(Hold("optim", "T", paged=False), Hold("param", "home")), after_grads=True,
           stream="cpu", stream_on=(("gpu", "compute"),),
           cost=(("adam", "shard"), ("memory", "refresh"), Term("nvme_write", "param", _NVME)),
           host=Term("nvme_host", "param", _NVME)),
    Effect("all_reduce", "grad", ("gpu", "cpu"), reads=(Hold("grad", "T"),), writes=(Hold("grad", "T"),),
           when="D", after_grads=True, stream="network",
           cost=(Term("all_reduce", "sums", "R>1"), Term("reduce_scatter", "grad_share", "U"))),
    Effect("all_gather", "optim", ("gpu", "cpu"), reads=(Hold("optim", "T", paged=False),),
           writes=(Hold("param", "home"),), when="R>1", after_grads=True, stream="network",
           cost=(("all_gather", "master"),)),
    Effect("release", "param", ("gpu", "cpu"), frees=(Hold("param", "T"), Hold("gathered", "gpu", when="W>1 T=gpu")),
           issued="end", executor=Term("window", "window", "T=gpu")),
    Effect("release", "fullgrad", ("gpu",), frees=(Hold("fullgrad", "gpu", paged=False),), issued="end",
           when="W>1"),
    Effect("release", "grad", ("gpu", "cpu", "nvme"), frees=(Hold("grad", "T"),), issued="end"),
    Effect("release", "optim", ("copy",), frees=(Hold("optim", "T", paged=False),), issued="end"),
)}


def effect_of(task: Task) -> Effect | None:
    """The table's row for a task (None: no such operation on such a target)."""
    return EFFECTS.get((task.operation, task.target.kind))
