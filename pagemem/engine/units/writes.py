"""Writes to a bound parameter are kept (``Residency``'s, a mixin: these methods share its state):
see [Note: writes to parameters] at ``keep_writes``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch

from pagemem.engine.interrupts import shielded
from pagemem.engine.units.unit import Unit

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank


class KeepsWrites:
    bank: "ParamBank"
    _units: list[Unit]
    _data_taken: set[int]
    _wait_for_updates: Callable[[Iterable[int]], None]
    written: int

    if TYPE_CHECKING:  # Residency's
        def evict(self, layer: Unit) -> None: ...

        def bind(self, li: int) -> None: ...

    @shielded
    def keep_writes(self) -> None:
        """[Note: writes to parameters] Code may write a bound parameter in place (``clamp_``
        under ``no_grad``, ``copy_``, ``load_state_dict``, an initializer, an embedding's
        ``max_norm`` renormalization in forward): that writes the gpu replica of its compute
        copy, which the update would overwrite from the master weights and an eviction would
        drop. So a write is kept: every parameter's version counter is read when it is bound,
        and one that moved has its new value written into its master weights and every copy of
        its compute copy before the unit is evicted, before an update, and before the weights
        are read back. A write through ``p.data`` moves no version counter: a parameter whose
        ``.data`` the guard handed out (outside the engine's calls) is compared with its master
        weights instead. A parameter given other memory (``p.data = t``, ``set_``, a
        parametrization's ``right_inverse``) is found by its storage: bound, it no longer views its
        pages (its values are kept and the unit is bound again); evicted, it no longer holds its
        placeholder (its values are kept when it is bound). Not seen: a write through ``.data``
        inside a module's own forward (the parameter is a plain one there). Call this before
        reading master weights."""
        for layer, u in zip(self.bank.layers, self._units):
            if u.bound and self._keep_writes(layer):
                self.evict(layer)  # a parameter given other memory: a view of its pages again
                self.bind(layer.index)

    @shielded
    def data_taken(self, i: int) -> None:
        """Parameter ``i``'s ``.data`` was handed out: a write through it moves no version
        counter, so its values are compared with its master weights when it is next checked."""
        self._data_taken.add(i)

    def _keep_writes(self, layer: Unit) -> bool:
        """Keep what was written to the unit's bound parameters; True if one of them no longer
        views its pages (``set_``, ``swap_tensors``: the caller rebinds the unit)."""
        u = self._units[layer.index]
        if self.bank.compute_is_master or not u.versions:
            return False  # the parameters are the master pages: nothing to copy
        params = self.bank.params
        replaced = False
        with torch._C.DisableTorchFunctionSubclass():
            for k, i in enumerate(layer.params):
                p = params[i][1]
                moved = p._version != u.versions[k]
                elsewhere = p.numel() > 0 and storage_ptr(p) != u.bound_ptrs.get(i)
                if not moved and not elsewhere and i in self._data_taken:
                    self._wait_for_updates([i])  # an update behind backward changes master, then copy
                    if self.bank.master_sharded(i) and (self.bank.is_trainable(i) or self.bank.gathered):
                        moved = self._sharded_data_moved(i, p)
                    else:
                        unviewed = self.bank.unviewed_value(i, p.dtype)  # not the pages p.data views
                        moved = unviewed is None or not torch.equal(p.data, unviewed.to(p.device))
                self._data_taken.discard(i)
                if moved or elsewhere:
                    self.bank.write_parameter(i, p.data)
                    u.versions[k] = p._version
                    self.written += 1
                    replaced |= elsewhere
        return replaced

    def _sharded_data_moved(self, i: int, p: torch.Tensor) -> bool:
        """Whether a write through parameter ``i``'s ``.data`` changed the elements whose master
        weights this rank holds ([Note: sharded master weights]). ``host_value`` is the compute
        copy there, the very pages ``p.data`` views, so comparing with it would never see a
        write (the update would then overwrite it from the unwritten master share). The share is
        compared with this rank's master share instead; the other elements have no master here
        to compare with (the ranks owning them see the write in theirs), so every copy of the
        compute copy takes the bound values, which the forwards before the next update read."""
        a, b = self.bank.owned(i)
        mine = self.bank.host_state(i, "master")  # empty where this rank owns none of it
        flat = p.data.reshape(-1)[a:b].cpu()
        if not torch.equal(flat, mine.to(p.dtype)):
            return True
        if b - a < p.numel():
            self.bank.write_compute(i, p.data.detach().clone())
        return False


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (what a parameter's ``.data`` views)."""
    return t.untyped_storage().data_ptr()
