"""The master weights each rank updated, all-gathered to every rank after the update ([Note:
sharded moments] in ``units/shards.py``).

Every rank knows every rank's share (``shard_states`` is a function of the model and the page
size), so the ranks need exchange nothing but the values: each rank's share of the updated
parameters, in parameter order, is one sequence of elements; the ``k``-th batch holds elements
``[k E, (k + 1) E)`` of every rank's sequence (``E``: ``BATCH_BYTES`` of fp32), zero-padded to
one size where a rank's sequence is shorter (the shares are even to a page per unit, so there
is little padding), two batches in flight. What arrives from the other ranks is written into
the master weights and, cast, into every copy of the compute copy, as the owner's own update
wrote its share."""

from __future__ import annotations

import torch

from pagemem.engine.ranks.collectives import BATCH_BYTES, Collectives, Pending
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.shards import StateShards, shard_states

Segment = tuple[int, int, int]
"""(parameter, first element, end element): a run of one rank's share."""


def every_share(bank: ParamBank) -> list[StateShards]:
    """Every rank's share, in rank order (this rank's is ``bank.shards``)."""
    mine = bank.shards
    assert mine is not None
    units = [list(layer.params) for layer in bank.layers]
    numels = [p.numel() for _, p in bank.params]
    return [mine if r == mine.rank else shard_states(units, numels, [True] * len(numels), bank.store.page_bytes, r,
                                                      mine.world_size)
            for r in range(mine.world_size)]


def _window(seq: list[Segment], lo: int, hi: int) -> list[tuple[Segment, int]]:
    """The parts of a share's sequence ``seq`` at its elements ``[lo, hi)``, each with where it
    starts in the window."""
    out, at = [], 0
    for i, a, b in seq:
        n = b - a
        s, e = max(lo, at), min(hi, at + n)
        if s < e:
            out.append(((i, a + s - at, a + e - at), s - lo))
        at += n
        if at >= hi:
            break
    return out


class MasterGather:
    """After each update: the ranks' updated shares of the master weights to every rank."""

    def __init__(self, bank: ParamBank, coll: Collectives) -> None:
        self.bank = bank
        self.coll = coll
        self.shares = every_share(bank)
        self.gathered_bytes = 0
        """fp32 bytes of master weights this rank received so far."""

    def __call__(self, params: list[int]) -> None:
        """Gather the shares of ``params`` (every rank passes the same list: the parameters the
        step updated, which the averaged gradients make the same everywhere)."""
        bank, coll = self.bank, self.coll
        world, me = coll.ranks.world_size, coll.ranks.rank
        seqs = [[(i, *share.ranges[i]) for i in params if share.owned(i)] for share in self.shares]
        longest = max(sum(b - a for _, a, b in seq) for seq in seqs)
        if not longest:
            return
        elems = BATCH_BYTES // 4
        n_batches = -(-longest // elems)
        dev = coll.ranks.device
        cache: dict[int, torch.Tensor] = {}

        def master_of(i: int) -> torch.Tensor:
            if i not in cache:
                cache.clear()
                view = bank.lasting_view("master", i)
                layer, k = bank.where(i)
                cache[i] = view if view is not None else layer.master[k].to_torch().reshape(-1)
            return cache[i]

        pending: list[tuple[int, list[torch.Tensor], Pending] | None] = [None, None]

        def land(slot: int) -> None:
            k, outs, p = pending[slot]  # type: ignore[misc]
            pending[slot] = None
            coll.wait(p)
            ranges = []
            for r in range(world):
                if r == me:
                    continue
                got = outs[r].cpu()
                ranges += [(i, got[at:at + b - a], a) for (i, a, b), at in _window(seqs[r], k * elems, (k + 1) * elems)]
            bank.write_master_ranges(ranges)
            self.gathered_bytes += sum(v.numel() * 4 for _, v, _ in ranges)

        try:
            for k in range(n_batches):
                slot = k % 2
                if pending[slot] is not None:
                    land(slot)
                size = min(elems, longest - k * elems)  # the same on every rank
                mine = torch.zeros(size, dtype=torch.float32)
                for (i, a, b), at in _window(seqs[me], k * elems, (k + 1) * elems):
                    mine[at:at + b - a].copy_(master_of(i)[a:b])
                mine = mine.to(dev)
                outs = [torch.empty(size, dtype=torch.float32, device=dev) for _ in range(world)]
                pending[slot] = (k, outs, coll.all_gather(outs, mine, "gathering the updated master weights"))
            for slot in (n_batches % 2, (n_batches - 1) % 2):  # the older batch lands first
                if pending[slot] is not None:
                    land(slot)
        finally:  # nothing left in flight on these buffers
            coll.settle([p[2] if p is not None else None for p in pending])

    def whole_moments(self, params: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """The whole Adam moments of ``params`` (each rank's share gathered, one parameter at a
        time): ``optimizer.state_dict()`` with sharded moments, a collective every rank calls
        with the same parameters (as FSDP's full optimizer state dict is)."""
        bank, coll = self.bank, self.coll
        coll.begin("reading the optimizer state", [len(params)])
        dev, out = coll.ranks.device, {}
        for i in params:
            ranges = [share.ranges[i] for share in self.shares]
            most = max(b - a for a, b in ranges)
            mine = torch.zeros(2 * most, dtype=torch.float32)
            a, b = bank.owned(i)
            if b > a:
                mine[:b - a].copy_(bank.host_state(i, "exp_avg"))
                mine[most:most + b - a].copy_(bank.host_state(i, "exp_avg_sq"))
            outs = [torch.empty(2 * most, dtype=torch.float32, device=dev) for _ in ranges]
            coll.wait(coll.all_gather(outs, mine.to(dev), "gathering the optimizer state"))
            shape = bank.params[i][1].shape
            whole = {kind: torch.empty(shape.numel(), dtype=torch.float32) for kind in ("exp_avg", "exp_avg_sq")}
            for (a, b), got in zip(ranges, outs):
                got = got.cpu()
                whole["exp_avg"][a:b].copy_(got[:b - a])
                whole["exp_avg_sq"][a:b].copy_(got[most:most + b - a])
            out[i] = {kind: v.reshape(shape) for kind, v in whole.items()}
        return out
