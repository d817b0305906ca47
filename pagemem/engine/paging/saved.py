"""Autograd's saved parameters kept as references, fetched again when backward needs them.

While the engine runs a forward (and a backward, for recomputations), autograd's saved-tensor
hooks are the engine's: a saved tensor that is a resident parameter's data (or a view of it, by
its storage) is kept as ``SavedParam`` (which parameter, and the view's size, stride and offset),
not as page memory that may be evicted before backward; unpacking makes the unit resident again
and rebuilds the view. Anything else goes to the tracer during warm-up, or is kept as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.residency import Residency
from pagemem.process import current_pid, require_owner
from pagemem.tracer import Recording, SavedTensor


class SavedParam:
    """What autograd keeps for a saved parameter (or a view of one): where to find it again."""

    __slots__ = ("index", "size", "stride", "offset", "version")

    def __init__(self, index: int, t: torch.Tensor, version: int) -> None:
        self.index, self.size, self.stride, self.offset = index, t.size(), t.stride(), t.storage_offset()
        self.version = version
        """The parameter's version counter when saved: autograd's check that nothing wrote it
        in place before backward needs it."""


class SavedTensorHooks:
    """``pack`` and ``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, bank: ParamBank, residency: Residency, recording: Callable[[], Recording | None],
                 make_resident: Callable[[int, bool], None]) -> None:
        """``recording()``: the warm-up's recording, if one runs; ``make_resident(i, grads)``:
        bring parameter ``i``'s unit to the gpu as the iteration's mode does."""
        self.bank = bank
        self.residency = residency
        self._recording = recording
        self._make_resident = make_resident
        self.owner_pid = current_pid()

    def pack(self, t: torch.Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            ptr = None
        i = self.residency.param_at(ptr) if ptr is not None else None
        recording = self._recording()
        if i is not None and t.dtype == self.bank.params[i][1].dtype:
            if recording is not None:
                recording.touch_params((i,))
            with torch._C.DisableTorchFunctionSubclass():
                version = self.bank.params[i][1]._version
            return SavedParam(i, t, version)
        if recording is not None:
            return recording.pack(t)
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        # a backward through the engine's graph in a forked child: refused before any fetch
        require_owner("backward through the engine's model", self.owner_pid)
        if isinstance(saved, SavedTensor):
            return saved.unpack()
        if not isinstance(saved, SavedParam):
            return saved
        name, p = self.bank.params[saved.index]
        with torch._C.DisableTorchFunctionSubclass():
            version = p._version
        if version != saved.version:  # as autograd checks a tensor it saved
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: parameter {name!r} is at version {version}; expected version "
                               f"{saved.version} instead")
        self._make_resident(saved.index, True)
        with torch._C.DisableTorchFunctionSubclass():  # the engine's own read: not .data handed to code
            base = p.data
        return base.as_strided(saved.size, saved.stride, saved.offset)
