"""Gradients averaged over the ranks, as ``DistributedDataParallel`` averages them.

[Note: data parallel over the process group]
An engine made while a ``torch.distributed`` group is initialised (or given
``process_group=``) is data parallel over it; the group is the one source of rank and world
size, and every budget is per rank. Every rank holds the whole gradient sums and the whole
compute copy, unless ``shard_parameters`` gathers the compute copy per unit and reduce-scatters
the sums instead of this ([Note: gathered units] in ``unit_gather.py``, [Note: sharded gradient
sums] in ``grad_scatter.py``) (each rank shards its optimizer states: [Note: sharded moments], [Note: sharded
master weights], and plans its iterations as such, ``sharding="states"``, or with gathered
units ``sharding="units"``; the page-sharded ZeRO-3 plan, ``"params"``, is not run) and runs forward and backward on its own batch. At the end of the backward that completes
an accumulation step (``accumulation_steps``; every backward by habit with the default 1, as
DDP does, or DDP's ``no_sync`` for the earlier micro-batches) the ranks average their fp32
gradient sums: first they agree which parameters have a gradient on any rank (a parameter
unused on this rank's batch gets a zero sum, as DDP's ``find_unused_parameters`` gives it), then
each sum is scaled by 1 / world size (as DDP's reducer does) and the sums are added over the ranks in batches of
``BATCH_BYTES`` (two in flight: one filled while the other is reduced), in parameter order on
every rank. Every rank then holds the same averaged gradients, so ``p.grad``, clipping by the
global norm, an fp16 overflow (an inf anywhere is an inf in the average), the loss scale and the
update agree on every rank by construction, with nothing more exchanged. Updates during
backward (``overlap_update``) and the lock-free updater are refused: they would update from a
rank's own gradients before the average."""

from __future__ import annotations

from typing import Callable

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.ranks.collectives import BATCH_BYTES, Collectives, Pending
from pagemem.engine.units.bank import ParamBank
from pagemem.errors import InvalidRequest

_HAS_GRAD = (GradState.ACCUMULATING, GradState.SUMMED)
Span = tuple[int, int, int]
"""(parameter, first element, end element) of one parameter's gradient in a batch."""


def batches(sizes: dict[int, int], batch_elems: int) -> list[list[Span]]:
    """Parameters' gradients (``sizes``: parameter -> elements, in the order given) cut into
    batches of at most ``batch_elems`` elements; a gradient larger than a batch spans several."""
    out: list[list[Span]] = [[]]
    room = batch_elems
    for i, n in sizes.items():
        lo = 0
        while lo < n:
            if room == 0:
                out.append([])
                room = batch_elems
            take = min(room, n - lo)
            out[-1].append((i, lo, lo + take))
            lo += take
            room -= take
    return [b for b in out if b]


def _copy_range(pieces: list[tuple[int, torch.Tensor]], lo: int, hi: int, flat: torch.Tensor, into_pieces: bool) -> None:
    """Copy elements ``lo:hi`` of a gradient given as ``(first element, view)`` pieces to
    ``flat`` (``into_pieces``: from ``flat`` into the pieces)."""
    for start, view in pieces:
        a, b = max(lo, start), min(hi, start + view.numel())
        if a < b:
            piece, part = view[a - start:b - start], flat[a - lo:b - lo]
            if into_pieces:
                piece.copy_(part)
            else:
                part.copy_(piece)


def average_gradients(bank: ParamBank, ledger: GradLedger, zero: Callable[[int], None],
                      coll: Collectives, steps: tuple[int, int]) -> None:
    """Average every rank's gradient sums in place (see the Note). ``zero(i)``: give parameter
    ``i`` a zero sum (it has a gradient on another rank only). ``steps``: this rank's updates and
    backwards so far (failed ones too); ranks whose counts differ average batches of different
    steps (a backward that failed on one rank alone, one more on one rank): every rank raises."""
    n = len(bank.records)
    mine = [ledger.state(i) in _HAS_GRAD for i in range(n)]
    top, low = coll.begin("averaging gradients", list(steps) + [int(m) for m in mine])
    if top[:2] != low[:2]:
        coll.fail_out_of_step(f"the ranks are at different steps: updates {low[0]} to {top[0]}, backwards (failed ones "
                              f"too) {low[1]} to {top[1]}; this rank {steps[0]} and {steps[1]} (a backward failed or "
                              "ran on some ranks only, so their batches no longer line up)")
    anywhere = top[2:]  # which parameters have gradients anywhere
    for i in range(n):
        if anywhere[i] and not mine[i]:
            if not bank.is_trainable(i):
                raise InvalidRequest(f"parameter {bank.params[i][0]!r}: has a gradient on another rank but does not "
                                     "require one here: every rank must freeze the same parameters")
            zero(i)
    sizes = {i: bank.params[i][1].numel() for i in range(n) if anywhere[i]}
    if not sizes:
        return
    world = coll.ranks.world_size
    elems = BATCH_BYTES // 4
    todo = batches(sizes, elems)
    bufs = [torch.empty(min(elems, sum(hi - lo for _, lo, hi in b)), dtype=torch.float32, device=coll.ranks.device)
            for b in todo[:2]]
    pending: list[tuple[list[Span], torch.Tensor, Pending] | None] = [None, None]

    def land(slot: int) -> None:
        spans, buf, p = pending[slot]  # type: ignore[misc]
        pending[slot] = None
        coll.wait(p)
        at = 0
        for i, lo, hi in spans:
            with bank.grad_pieces(i, write=True) as pieces:
                _copy_range(pieces, lo, hi, buf[at:at + hi - lo], into_pieces=True)
            at += hi - lo

    try:
        for b, spans in enumerate(todo):
            slot = b % 2
            if pending[slot] is not None:
                land(slot)
            total = sum(hi - lo for _, lo, hi in spans)
            buf = bufs[slot][:total]
            at = 0
            for i, lo, hi in spans:
                with bank.grad_pieces(i, write=False) as pieces:
                    _copy_range(pieces, lo, hi, buf[at:at + hi - lo], into_pieces=False)
                at += hi - lo
            buf.mul_(1.0 / world)  # as DDP scales each gradient before it sums (by the reciprocal)
            pending[slot] = (spans, buf, coll.all_reduce(buf, "averaging gradients"))
        for slot in (len(todo) % 2, (len(todo) - 1) % 2):  # the older batch lands first
            if pending[slot] is not None:
                land(slot)
    finally:  # a failure leaves nothing in flight on this thread's buffers that a later call could see
        coll.settle([p[2] if p is not None else None for p in pending])

