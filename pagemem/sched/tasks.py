"""The task queue a plan is made of, and what each task means.

Logical time is the trace's op ids ``0 .. n-1`` plus one virtual op ``n`` ("the end of the
iteration", zero duration, no non-model memory). A task's ``trigger_id`` is the op at which it
may be issued: every task is issued when its trigger op *starts*, except ``release``, which is
issued when its trigger op *finishes*. Memory a task allocates counts from its trigger op on; the
memory a ``release`` frees counts up to and including its trigger op.

Everything is per rank: with ``world_size`` W, each layer's parameters are sharded into W equal
shards and this rank owns one (``Layout``).

Pages and groups (``Target``):

- ``param`` page ``j`` of layer L: page j of this rank's fp16 parameter shard. Its home copy
  lives on ``cpu`` (on ``gpu`` for a layer whose optimizer states are cached there).
- ``grad`` page ``j`` of layer L: page j of this rank's gradient shard; exists only between the
  backward pass and the update.
- ``fullgrad`` of layer L (W > 1 only): the layer's full gradient buffer on ``gpu``, W pages per
  shard page, from the layer's backward compute until ``reduce_scatter`` has consumed it.
- ``optim`` of layer L (whole group): this rank's fp32 master weights and Adam moments for the
  layer's shard; home on the optimizer tier (``cpu`` or ``nvme``, or ``gpu`` when cached).
- ``layer`` L: the layer as a unit of compute.

Operations:

============== ================ ================================================================
operation      target           effect
============== ================ ================================================================
move_to_gpu    param page       copy cpu -> gpu (+1 gpu page); the cpu copy stays valid
move_to_cpu    optim group      copy nvme -> cpu (+pages on cpu) before a cpu update
all_gather     param page       needs the page on gpu; gathers the other ranks' copies of it
                                (+(W-1) gpu pages)
compute        layer            the layer's parameters are used from this op until the window
                                ends (every op the trace says accesses them needs every page of
                                the layer on gpu, gathered when W > 1); a compute in the
                                backward window that produces the layer's gradients allocates
                                its gradient buffer (``fullgrad``, or the ``grad`` pages when W=1)
reduce_scatter grad page        needs the layer's ``fullgrad``; creates the grad page on gpu
offload        grad page        copy gpu -> ``tier`` (cpu) (+1 page there)
offload        optim group      write the cpu copy back to ``tier`` (nvme) after the update
update         layer            Adam step of the layer's shard on ``tier`` (cpu or gpu): needs
                                its grad pages and optim group there; writes the param pages
release        any              frees the target's copies on ``tier`` other than its home copy
                                (for a param page on gpu: the page and what was gathered)
============== ================ ================================================================
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

    def __str__(self) -> str:
        where = f" @{self.tier}" if self.tier else ""
        return f"{self.trigger_id:>6} {self.operation:<14} {self.target}{where}"

    @property
    def issued_at_end(self) -> bool:
        """True for ``release``, which is issued when its trigger op finishes."""
        return self.operation == "release"
