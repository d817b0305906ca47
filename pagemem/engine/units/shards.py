"""Which elements of each parameter's Adam moments a rank holds and updates.

[Note: sharded moments]
With several ranks ([Note: data parallel over the process group] in ``ranks/average.py``) each
rank keeps the Adam moments (``exp_avg``, ``exp_avg_sq``: 8 of the 12 bytes per parameter of
fp32 optimizer state) of its share of the elements only, and updates only those: ZeRO stage 1 for
the moments. The gradients are still averaged whole on every rank, so the loss scale's verdict
and the clipping coefficient are computed from whole gradients, as one process computes them;
after the update the ranks all-gather the master weights they updated (``ranks/gather.py``), so
every rank holds the whole fp32 master (and, from it, the compute copy) again. A real all-gather
of the bits, not a sum of zero-padded shares, which would turn a ``-0.0`` into ``0.0``.

The shares: a unit's parameters are laid out as the store lays out its fp32 states
(``store.layout.pack``: back to back, each start aligned to 256 bytes, frozen parameters
included, so that unfreezing one later finds its share already decided); the unit's bytes are
cut into ``world_size`` runs as even as 256-byte boundaries allow (``SHARE_ALIGN``), run
``(rank - unit) mod world_size`` being this rank's, so the remainders spread over the ranks
instead of all falling to the first. A parameter's share is where its bytes meet the rank's run:
one range ``[a, b)`` per parameter per rank (``a == b``: none), the ranges of every rank
partitioning ``[0, n)``. A cut lies a multiple of 256 bytes from a parameter's start: a multiple
of 64 elements, where the fused AdamW kernel gives the bits one call over the whole tensor gives
(``updates/state_pieces.py``), so the sharded update is bit for bit the replicated one. Even
shares matter to what the ranks send: the gathers and reduce-scatters pad every rank's part to
the largest rank's ([Note: sharded gradient sums] in ``ranks/grad_scatter.py``), so runs of whole
pages, on units smaller than a page per rank, made every rank but one send zeros.

[Note: sharded master weights]
The fp32 master weights are sharded the same way (the same ranges: ``ParamBank.is_sharded``)
wherever the compute copy, which every rank still keeps whole, carries the master's value to
the parameter's own dtype: the parameter computes in its own dtype (fp32 throughout, or a bf16
model computing in bf16), and the master is not the compute copy itself (fp32 states on the gpu).
Then every read outside an update -- a parameter between steps, ``model.state_dict()``,
``save_weights``, ``close()``, the replica checks -- is the compute copy, exact and local, and
each rank keeps 4/W bytes of master per parameter instead of 4. After the update each rank casts
its share into its compute copy and the gather (``ranks/gather.py``) sends those shares' fp32
values, which the other ranks write into their compute copies only. Reading the fp32 master of a
parameter that computes in bf16 or fp16 (``engine.state_dict()``: ``master_whole_here``) gathers
it: a collective every rank calls (``MasterGather.whole_masters``). A fp32 model computing in
bf16 (mixed precision) keeps its master whole on every rank: its parameters read between steps
are the fp32 master, which no local copy holds (sharding it would make every such read a
collective). Checkpoints write the master as they write the moments ([Note: sharded
checkpoints]).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemem.store.layout import pack

FP32 = 4
SHARE_ALIGN = 256
"""Bytes every cut between two ranks' shares is a multiple of, from the unit's start (each
parameter starts on such a boundary: ``store.layout.TENSOR_ALIGN``), so 64 fp32 elements."""


@dataclass(frozen=True)
class StateShards:
    """Each parameter's owned element range on ``rank`` of ``world_size`` (see the Note)."""

    rank: int
    world_size: int
    ranges: tuple[tuple[int, int], ...]
    """Per parameter, in index order: ``(a, b)``, the elements ``[a, b)`` this rank owns (a frozen
    parameter's: ``(0, 0)``)."""

    def owned(self, i: int) -> int:
        a, b = self.ranges[i]
        return b - a

    @property
    def owned_elements(self) -> int:
        return sum(b - a for a, b in self.ranges)


def shard_states(units: list[list[int]], numels: list[int], trainable: list[bool], page_bytes: int,
                 rank: int, world_size: int) -> StateShards:
    """The ranges ``rank`` owns (``units``: each unit's parameter indices, in unit order)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    ranges = [(0, 0)] * len(numels)
    for u, idx in enumerate(units):
        members = [i for i in idx if trainable[i]]
        if not members:
            continue
        layout = pack([FP32 * numels[i] for i in members], page_bytes)
        run = (rank - u) % world_size

        def cut(k: int) -> int:  # where run k starts (run world_size: the end)
            return layout.end if k == world_size else k * layout.end // world_size // SHARE_ALIGN * SHARE_ALIGN
        lo, hi = cut(run), cut(run + 1)
        for i, start, size in zip(members, layout.starts, layout.sizes):
            a = min(max(lo - start, 0), size)
            b = min(max(hi - start, 0), size)
            ranges[i] = (a // FP32, b // FP32) if b > a else (0, 0)
    return StateShards(rank, world_size, tuple(ranges))


def moment_pages(units: list[list[int]], numels: list[int], trained: list[bool], page_bytes: int,
                 ranks: tuple[int, int] = (0, 1)) -> int:
    """Pages one moment (``exp_avg`` or ``exp_avg_sq``) of the trained parameters takes on
    ``ranks[0]`` of ``ranks[1]`` ranks, chained as the bank allocates it (each trained parameter
    whole with one rank, its share flat with several): what the budget checks count."""
    return state_pages(units, numels, trained, page_bytes, ranks, [True] * len(numels))


def state_pages(units: list[list[int]], numels: list[int], trained: list[bool], page_bytes: int,
                ranks: tuple[int, int], sharded: list[bool]) -> int:
    """Pages one fp32 state of the trained parameters takes on ``ranks[0]`` of ``ranks[1]``
    ranks, chained as the bank allocates it: parameter ``i`` whole, or (``sharded[i]``, with
    several ranks) its share flat, none where the share is empty."""
    share = shard_states(units, numels, [True] * len(numels), page_bytes, *ranks) if ranks[1] > 1 else None
    sizes = []
    for idx in units:
        for i in idx:
            if not trained[i]:
                continue
            n = share.owned(i) if share is not None and sharded[i] else numels[i]
            if n or not (share is not None and sharded[i]):
                sizes.append(FP32 * n)
    return pack(sizes, page_bytes).pages if sizes else 0


LOCAL_BUFFERS = 3
"""Units whose local gradient buffers a gathered bank counts at once ([Note: sharded gradient
sums] in ``ranks/grad_scatter.py``): two reduce-scatters in flight and the unit accumulating
(the largest three: a tied embedding's lives through the backward)."""


def local_buffer_pages(unit: list[int], numels: list[int], page_bytes: int, ranks: tuple[int, int]) -> int:
    """Pages one unit's local gradient buffer takes: ``world_size`` chunks, each the largest
    rank's share of the unit's elements (``ranks/grad_scatter.py``)."""
    world = ranks[1]
    idx = [sorted(unit)]
    most = max(sum(shard_states(idx, numels, [True] * len(numels), page_bytes, r, world).owned(i) for i in unit)
               for r in range(world))
    return -(-(world * most * FP32) // page_bytes)


def master_shardable(compute_dtypes: list, own_dtypes: list, compute_is_master: bool,
                     gathered: bool = False) -> list[bool]:
    """Per parameter: whether its master weights may be sharded ([Note: sharded master
    weights]): it computes in its own dtype, so the compute copy every rank keeps whole holds
    the master cast to that dtype, and the master is not the compute copy itself. With
    ``gathered`` compute copies ([Note: gathered units] in ``ranks/unit_gather.py``) every master
    apart from its compute copy: every whole read gathers anyway."""
    return [not compute_is_master and (gathered or c == o) for c, o in zip(compute_dtypes, own_dtypes)]


def unit_gather_elements(units: list[list[int]], shares: list[StateShards]) -> list[int]:
    """Per unit: its part of what each rank contributes to the all-gather of the updated weights
    (``ranks/gather.py``): every rank sends as many elements as the rank with the largest share
    holds, so a unit's part is that rank's share of it (the parts add up to what is sent)."""
    totals = [sum(share.owned(i) for idx in units for i in idx) for share in shares]
    largest = shares[totals.index(max(totals))]
    return [sum(largest.owned(i) for i in idx) for idx in units]


def check_gatherable(compute_is_master: bool) -> None:
    """Refuse a model whose compute copy cannot be sharded as its master is ([Note: gathered
    units] in ``ranks/unit_gather.py``): each rank's share of a compute copy is its share of the
    fp32 master, cast (a frozen parameter gets a master share for it), so the master must be
    apart from the compute copy (optimizer states off the gpu)."""
    from pagemem.errors import ConfigError

    if compute_is_master:
        raise ConfigError("shard_parameters: needs the optimizer states off the gpu (optimizer_tier 'cpu' or "
                          "'nvme'): with fp32 states on the gpu the compute copy is the master itself")
