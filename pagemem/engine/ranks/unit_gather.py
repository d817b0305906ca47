"""A unit's whole compute copy gathered from every rank's share when it is fetched.

[Note: gathered units]
With ``EngineConfig.shard_parameters`` (several ranks, ZeRO stage 3 for the parameters) a rank
keeps no compute copy at rest: its share of each unit's compute copy is its share of the fp32
master ([Note: sharded master weights] in ``units/shards.py``; with gathered units every
master apart from its compute copy is sharded, a fp32 model computing in bf16 included), cast to
the dtype it computes in (frozen parameters and states on the gpu are refused when the engine is
made: ``shards.check_gatherable``). When the residency fetches a unit
(``Residency.bind``/``ensure``) the bank allocates the unit's whole compute copy on the gpu tier
(``ParamBank.make_compute``), and ``UnitGather`` fills it: one header (the unit's index: ranks
fetching different units raise ``RankFailed`` together instead of pairing unrelated buffers),
then one all-gather of every rank's share of the unit, the bytes of the cast values as sent (so
a bf16 model's gathered copy holds the bits each owner's cast gives), each rank's contribution
zero-padded to the largest rank's share of that unit. Evicting the unit frees the copy
(``ParamBank.drop_compute``); a tensor derived from a view that pins it makes it a zombie, as a
replica is. Nothing is written back: an update changes only the masters, whose shares are the
compute copy's next values, so the ranks need no gather after the update, and a step evicts
every resident unit first (its copy would be stale). A write to a resident parameter
(``p.data.mul_``, ``load_state_dict``) is kept as with sharded masters (each rank takes the
elements it owns into its master share), which is exact when every rank writes the same values.

Every fetch is a collective: every rank must fetch the same units in the same order. The plan
and the demand path do (every rank runs the same model on batches of the same shapes); a read
of a parameter outside forward and backward on some ranks only (a rank-0 ``print(p)``) meets
the others' next operation and every rank raises ``RankFailed`` naming the operations. Reading
a parameter's value whole off the gpu (``model.state_dict()``, ``close()``, ``save_weights``)
gathers its fp32 master (``whole_master``), also a collective every rank makes.

Staged: where the plan moves a unit to the gpu ahead of its compute (``Residency.stage`` at its
``move_to_gpu``), the gather starts there (``UnitGather.start``: the header at once, the
all-gather on the collectives' thread while the model computes) and lands at the unit's bind;
every rank follows the same plan, so every rank starts the same gathers in the same order. A
staged gather the residency drops before its bind (evicted to make room, or by the step, whose
update would make it stale) was a collective every rank made: it is waited for and thrown away.
The demand path (the first iteration, an iteration off its plan) gathers at each unit's use.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagemem.engine.ranks.collectives import Collectives
from pagemem.engine.ranks.gather import MasterGather
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.unit import Unit


class StagedGather:
    """A unit's gather under way (``UnitGather.start``): ``wait()`` lands it, once; a failure is
    raised by the first ``wait()`` and again by every later one."""

    def __init__(self, land: "Callable[[], None] | None") -> None:
        self._land = land
        self._error: BaseException | None = None

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
        land, self._land = self._land, None
        if land is None:
            return
        try:
            land()
        except BaseException as exc:
            self._error = exc
            raise


class UnitGather:
    """Fills a gathered unit's compute copy from every rank's master share (see the Note)."""

    def __init__(self, bank: ParamBank, coll: Collectives, masters: MasterGather) -> None:
        self.bank = bank
        self.coll = coll
        self.masters = masters
        self.shares = bank.every_share()
        self.gathers = 0
        """Units gathered so far."""
        self.unit_gathers = [0] * len(bank.layers)
        """How many times each unit was gathered."""
        self.received_bytes = 0
        """Bytes of other ranks' shares written into this rank's gathered copies."""
        self.ready: Callable[[], list[int]] | None = None
        """Flags this rank's header carries (per unit: its gradients are ready to reduce-scatter,
        ``GradScatter.ready_flags``), set by the engine."""
        self.agreed: Callable[[list[int]], None] | None = None
        """Called with the flags' minimum over the ranks once the gather is issued (what every
        rank has ready: ``GradScatter.issue_agreed``), set by the engine."""

    def _share_bytes(self, layer: Unit, rank: int) -> list[tuple[int, int, int, int]]:
        """``rank``'s share of the unit: ``(parameter, first element, end element, byte offset)``
        per parameter it owns part of, back to back in parameter order."""
        out, at = [], 0
        for i in layer.params:
            a, b = self.shares[rank].ranges[i]
            if b > a:
                out.append((i, a, b, at))
                at += (b - a) * self.bank.compute_dtype_of(i).itemsize
        return out

    def __call__(self, layer: Unit) -> None:
        """Fill ``layer.compute`` (allocated whole on the gpu) with every rank's share, now."""
        self.start(layer).wait()

    def start(self, layer: Unit) -> "StagedGather":
        """Begin filling ``layer.compute``: the header now, the all-gather on the collectives'
        thread; ``wait()`` on what it returns writes what arrived (a staged fetch: the plan's
        ``move_to_gpu`` of the unit, waited for at its compute)."""
        bank, coll = self.bank, self.coll
        world, me = coll.ranks.world_size, coll.ranks.rank
        ready = self.ready() if self.ready is not None else []
        top, low = coll.begin("gathering a unit", [layer.index] + ready)
        if top[0] != low[0]:
            coll.fail_out_of_step(f"the ranks fetch different units (unit {low[0]} to unit {top[0]}; this rank unit "
                                  f"{layer.index}, {layer.name!r}); "
                                  "every rank must run the same modules in the same order, and read parameters "
                                  "outside forward and backward on every rank alike")
        runs = [self._share_bytes(layer, r) for r in range(world)]
        ends = [(run[-1][3] + (run[-1][2] - run[-1][1]) * bank.compute_dtype_of(run[-1][0]).itemsize) if run else 0
                for run in runs]
        longest = max(ends)
        self.gathers += 1
        self.unit_gathers[layer.index] += 1
        if not longest:
            if self.agreed is not None:
                self.agreed(low[1:])
            return StagedGather(None)
        mine = torch.zeros(longest, dtype=torch.uint8)
        for i, a, b, at in runs[me]:
            value = bank.host_state(i, "master").to(bank.compute_dtype_of(i))
            mine[at:at + value.numel() * value.element_size()].copy_(value.view(torch.uint8))
        dev = coll.ranks.device
        outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
        pending = coll.all_gather(outs, mine.to(dev), "gathering a unit")
        if self.agreed is not None:  # after the gather on the collectives' thread, on every rank alike
            self.agreed(low[1:])

        def land() -> None:
            coll.wait(pending)
            items = []
            for r in range(world):
                got = outs[r] if r != me else mine
                for i, a, b, at in runs[r]:
                    dtype = bank.compute_dtype_of(i)
                    value = got[at:at + (b - a) * dtype.itemsize].to("cpu").view(dtype)
                    items.append((layer.compute[bank.position[i]], value, a))
                    if r != me:
                        self.received_bytes += value.numel() * dtype.itemsize
            bank.store.write_many(items)

        return StagedGather(land)

    def whole_master(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole fp32 master, flat (a collective every rank makes)."""
        return self.masters.whole_masters([i])[i].reshape(-1)
