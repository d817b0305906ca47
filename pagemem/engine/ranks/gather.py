"""The master weights each rank updated, all-gathered to every rank after the update ([Note:
sharded moments] in ``units/shards.py``).

Every rank knows every rank's share (``shard_states`` is a function of the model and the page
size), so the ranks need exchange nothing but the values: each rank's shares of the updated
parameters, unit by unit, are one sequence (``placed``), zero-padded at the end to the largest
rank's (the shares are even to 64 elements per unit and parameter, and their remainders rotate
over the ranks from unit to unit, so there is little padding); the ``k``-th batch holds elements ``[k E, (k + 1) E)`` of
every rank's sequence (``E``: ``BATCH_BYTES`` of fp32), two batches in flight. What arrives from
the other ranks is written into every copy of the compute copy, cast, and into the master weights
where this rank holds them whole, as the owner's own update wrote its share."""

from __future__ import annotations

import zlib

import torch

from pagemem.engine.ranks.collectives import BATCH_BYTES, Collectives, Pending
from pagemem.engine.units.bank import ParamBank

Segment = tuple[int, int, int]
"""(parameter, first element, end element): a run of one rank's share."""


Placed = tuple[int, int, int, int]
"""(parameter, first element, end element, position): a run of one rank's share and where it
lies in the gathered sequence."""


def placed(bank: ParamBank, params: list[int]) -> tuple[list[list[Placed]], int]:
    """Every rank's runs of ``params`` placed in the sequence the gather sends, and its length:
    each rank's runs back to back, unit by unit, in unit order; the sequence is as long as the
    largest rank's share, the shorter ones zero-padded at the end (``shards.
    unit_gather_elements`` attributes it to the units, what the plan counts)."""
    shares = bank.every_share()
    wanted = set(params)
    out: list[list[Placed]] = [[] for _ in shares]
    ends = [0] * len(shares)
    for layer in bank.layers:
        for i in layer.params:
            if i not in wanted:
                continue
            for r, share in enumerate(shares):
                a, b = share.ranges[i]
                if b > a:
                    out[r].append((i, a, b, ends[r]))
                    ends[r] += b - a
    return out, max(ends)


def _window(seq: list[Placed], lo: int, hi: int) -> list[tuple[Segment, int]]:
    """The parts of a rank's placed runs at positions ``[lo, hi)`` of the sequence, each with
    where it starts in the window."""
    out = []
    for i, a, b, pos in seq:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append(((i, a + s - pos, a + e - pos), s - lo))
        if pos >= hi:
            break
    return out


class MasterGather:
    """After each update: the ranks' updated shares of the master weights to every rank."""

    def __init__(self, bank: ParamBank, coll: Collectives) -> None:
        self.bank = bank
        self.coll = coll
        self.shares = bank.every_share()
        self.gathered_bytes = 0
        """fp32 bytes of master weights this rank received so far."""

    def __call__(self, params: list[int]) -> None:
        """Gather the shares of ``params`` (every rank passes the same list: the parameters the
        step updated, which the averaged gradients make the same everywhere)."""
        bank, coll = self.bank, self.coll
        world, me = coll.ranks.world_size, coll.ranks.rank
        seqs, longest = placed(bank, params)
        if not longest:
            return
        elems = BATCH_BYTES // 4
        n_batches = -(-longest // elems)
        dev = coll.ranks.device
        cache: dict[int, torch.Tensor] = {}

        def master_of(i: int) -> torch.Tensor:
            """Parameter ``i``'s master weights, flat, numbered as the parameter's elements from
            this rank's first on where the rank holds its share only ([Note: sharded master
            weights]), else from 0."""
            if i not in cache:
                cache.clear()
                view = bank.lasting_view("master", i)
                layer, k = bank.where(i)
                cache[i] = view if view is not None else layer.master[k].to_torch().reshape(-1)
            return cache[i]

        def first(i: int) -> int:
            return bank.owned(i)[0] if bank.master_sharded(i) else 0

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
                    mine[at:at + b - a].copy_(master_of(i)[a - first(i):b - first(i)])
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
        return self.whole_states(params, ("exp_avg", "exp_avg_sq"), "reading the optimizer state")

    def whole_masters(self, params: list[int]) -> dict[int, torch.Tensor]:
        """The whole fp32 master weights of ``params``, whose master this rank holds a share of
        only ([Note: sharded master weights]): ``engine.state_dict()`` of a model that computes in
        bf16 or fp16, a collective every rank calls with the same parameters."""
        got = self.whole_states(params, ("master",), "reading the weights")
        return {i: v["master"] for i, v in got.items()}

    def whole_states(self, params: list[int], kinds: tuple[str, ...], what: str) -> dict[int, dict[str, torch.Tensor]]:
        """Each of ``params``' sharded ``kinds`` whole, every rank's share gathered, one
        parameter at a time (what: the operation, in the header every rank checks first)."""
        bank, coll = self.bank, self.coll
        # which parameters, not only how many: ranks reading different ones (a submodule's state_dict
        # per rank) would pair unrelated shares, or buffers of different sizes (gloo aborts on those)
        top, low = coll.begin(what, [len(params), zlib.crc32(repr(list(params)).encode())])
        if top != low:
            coll.fail_out_of_step(f"{what}: the ranks read different parameters ({low[0]} to {top[0]} of them); "
                                  "every rank must read the same ones (the whole model's state_dict(), or the same "
                                  "submodule's, on every rank)")
        dev, out = coll.ranks.device, {}
        n = len(kinds)
        for i in params:
            ranges = [share.ranges[i] for share in self.shares]
            most = max(b - a for a, b in ranges)
            mine = torch.zeros(n * most, dtype=torch.float32)
            a, b = bank.owned(i)
            if b > a:
                for j, kind in enumerate(kinds):
                    mine[j * most:j * most + b - a].copy_(bank.host_state(i, kind))
            outs = [torch.empty(n * most, dtype=torch.float32, device=dev) for _ in ranges]
            coll.wait(coll.all_gather(outs, mine.to(dev), what))
            shape = bank.params[i][1].shape
            whole = {kind: torch.empty(shape.numel(), dtype=torch.float32) for kind in kinds}
            for (a, b), got in zip(ranges, outs):
                got = got.cpu()
                for j, kind in enumerate(kinds):
                    whole[kind][a:b].copy_(got[j * most:j * most + b - a])
            out[i] = {kind: v.reshape(shape) for kind, v in whole.items()}
        return out
