"""The gpu arena's size: the pages a planned iteration needs, or the whole budget (warm-up and
demand paging). See [Note: the gpu budget] in ``pager.py``."""

from __future__ import annotations

from typing import Callable

from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.residency import Residency
from pagemem.errors import InvalidRequest, OutOfMemory


class ArenaSizer:
    def __init__(self, bank: ParamBank, residency: Residency, warn: Callable[[str, str], None]) -> None:
        self.bank = bank
        self.residency = residency
        self.store = bank.store
        self._gpu = self.store.tier("gpu")
        self._warn = warn
        self.resizes = 0

    def size(self, pages: int) -> None:
        """Give the gpu arena ``pages`` slots, after sending every unit home (and the optimizer
        states a plan kept on the gpu: the next plan places them again). A unit still pinned (a
        tensor derived from its old view is alive) leaves the arena as it is, with a warning."""
        gpu = self._gpu
        if gpu.capacity == pages:
            return
        self.residency.release_all()
        for u in range(len(self.bank.layers)):
            self.bank.place_states(u, None)
        self.bank.drop_lasting_views("gpu")
        try:
            self.store.resize("gpu", pages)
        except (InvalidRequest, OutOfMemory) as exc:
            self._warn("resize", f"pagemem: the gpu arena stays at {gpu.capacity} pages, not {pages} ({exc})")
            return
        self.resizes += 1
