"""The page store: tensors in fixed-size pages across tiers, moved asynchronously."""

from pagemem.store.handle import MoveHandle
from pagemem.store.lease import Lease
from pagemem.store.stats import MoveSpan, MoveStats, StoreStats, TierStats
from pagemem.store.store import PageStore
from pagemem.store.tensor import PagedTensor

__all__ = ["PageStore", "PagedTensor", "MoveHandle", "Lease", "StoreStats", "TierStats", "MoveStats", "MoveSpan"]
