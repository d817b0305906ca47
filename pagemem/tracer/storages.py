"""Tell storages apart by identity: a serial number per storage, never reused.

[Note: storage identity, not address] The tracer used to key storages by
``untyped_storage().data_ptr()``. On ``meta`` every storage's address is 0, so every saved tensor
looked like every parameter; and on any device an address outlives its storage (the allocator
hands it to the next one). Here a storage is named by its Python object: torch keeps one
``UntypedStorage`` object per storage for exactly as long as the storage lives (views share it,
``.data`` shares it), so the object's identity is the storage's identity on every device. A weak
reference notices when the storage dies, and the serial it had is never handed out again, so a
new storage at a reused address (or a reused ``id``) is never taken for a dead one. Nothing here
keeps a storage alive.
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["StorageIds", "storage_of"]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage, or None for a tensor without one (some subclasses, sparse layouts)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class StorageIds:
    """Serial numbers of live storages: equal for two tensors exactly when they share a storage
    (now), different from every number given to a storage that has died."""

    __slots__ = ("_by_id", "_serials")

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}
        self._serials = itertools.count(1)

    def serial(self, storage: torch.UntypedStorage) -> int:
        """The serial number of ``storage`` (given on first sight)."""
        key = id(storage)
        entry = self._by_id.get(key)
        if entry is not None and entry[0]() is storage:
            return entry[1]
        n = next(self._serials)
        by_id = self._by_id

        def forget(ref: weakref.ref, key: int = key) -> None:  # runs as the storage dies, any thread
            held = by_id.get(key)
            if held is not None and held[0] is ref:
                by_id.pop(key, None)

        by_id[key] = (weakref.ref(storage, forget), n)
        return n

    def of(self, t: torch.Tensor) -> int | None:
        """The serial number of ``t``'s storage, or None if it has none."""
        storage = storage_of(t)
        return None if storage is None else self.serial(storage)

    def __len__(self) -> int:
        """Storages seen that are still alive."""
        return len(self._by_id)
