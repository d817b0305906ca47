"""What of each parameter's fp32 states this rank holds where the ranks shard them ([Note:
sharded moments] and [Note: sharded master weights] in ``shards.py``): a part of ``ParamBank``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagemem.engine.units.shards import StateShards, shard_states

if TYPE_CHECKING:
    from torch import nn

    from pagemem.engine.units.unit import Unit
    from pagemem.store import PageStore

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The states sharded over ranks ([Note: sharded moments] in ``units/shards.py``); the master
weights too where ``ParamBank.master_sharded`` says so ([Note: sharded master weights])."""


class ShardedStates:
    """Which elements of each state this rank holds: ``ParamBank``'s methods for its shares."""

    shards: StateShards | None
    gathered: bool
    _master_sharded: tuple[bool, ...]
    _every_share: list[StateShards] | None
    _stale_copies: list[list]
    params: tuple[tuple[str, "nn.Parameter"], ...]
    layers: list["Unit"]
    store: "PageStore"

    if TYPE_CHECKING:
        def compute_dtype_of(self, i: int) -> torch.dtype: ...

    def master_sharded(self, i: int) -> bool:
        """Whether this rank holds only its share (``owned``) of parameter ``i``'s master weights
        ([Note: sharded master weights])."""
        return self._master_sharded[i]

    def is_sharded(self, i: int, kind: str) -> bool:
        """Whether parameter ``i``'s ``kind`` state holds this rank's share only (flat, ``owned``)."""
        return ((kind in MOMENTS and self.shards is not None) or (kind == "master" and self._master_sharded[i])
                or (kind == "grad" and self.gathered and self.shards is not None))  # [Note: sharded gradient sums]

    def master_whole_here(self, i: int) -> bool:
        """Whether ``host_value(i, torch.float32)`` is parameter ``i``'s fp32 master weights: the
        master is whole here, or the compute copy is fp32 (it holds the master's bits)."""
        return not self._master_sharded[i] or self.compute_dtype_of(i) == torch.float32

    def _mine(self, i: int, kind: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (parameter ``i``'s whole ``kind`` state), or this rank's elements of it flat
        where the rank holds a share only."""
        if not self.is_sharded(i, kind):
            return value
        a, b = self.owned(i)
        return value.reshape(-1)[a:b]


    def every_share(self) -> list[StateShards]:
        """Every rank's share, in rank order (this rank's is ``shards``; every rank computes the
        same: ``shard_states`` is a function of the model and the page size)."""
        mine = self.shards
        assert mine is not None, "the states are not sharded"
        if self._every_share is None:
            units = [list(layer.params) for layer in self.layers]
            numels = [p.numel() for _, p in self.params]
            self._every_share = [mine if r == mine.rank else shard_states(
                units, numels, [True] * len(numels), self.store.page_bytes, r, mine.world_size)
                for r in range(mine.world_size)]
        return self._every_share

    def owned(self, i: int) -> tuple[int, int]:
        """The elements ``[a, b)`` of parameter ``i``'s moments this rank holds and updates
        ([Note: sharded moments]; every element with one rank)."""
        return self.shards.ranges[i] if self.shards is not None else (0, self.params[i][1].numel())

    def owned_numel(self, i: int) -> int:
        a, b = self.owned(i)
        return b - a

    def state_shape(self, i: int, kind: str) -> torch.Size:
        """The shape of parameter ``i``'s ``kind`` pages: its own, or flat for a sharded state."""
        if self.is_sharded(i, kind):
            return torch.Size([self.owned_numel(i)])
        return self.params[i][1].shape

    # ------------------------------------------------------------------ gathered compute copies

    def make_compute(self, layer: "Unit") -> None:
        """A gathered unit's whole compute copy, allocated on the gpu tier into ``layer.compute``
        (its values unspecified until gathered: [Note: gathered units] in ``ranks/unit_gather.py``).
        OutOfMemory, changing nothing, when it does not fit."""
        specs = [(tuple(self.params[i][1].shape), self.compute_dtype_of(i)) for i in layer.params]
        made = self.store.allocate_group(specs, tier="gpu")
        if layer.compute and not self.drop_compute(layer):  # a zombie's copy, pinned: freed once unpinned
            self._stale_copies.append(list(layer.compute))
            layer.compute.clear()
        layer.compute.extend(made)

    def drop_compute(self, layer: "Unit") -> bool:
        """Free a gathered unit's compute copy; False (nothing freed) while a view pins any of it.
        Older copies set aside pinned are freed here once nothing pins them."""
        for old in list(self._stale_copies):
            if not any(t.pins for t in old):
                for t in old:
                    t.free()
                self._stale_copies.remove(old)
        if any(t.pins for t in layer.compute):
            return False
        for t in layer.compute:
            t.free()
        layer.compute.clear()
        return True
