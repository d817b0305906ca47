"""pagemem: paged memory management for training models larger than GPU memory.

The page store (``PageStore``) keeps tensors in fixed-size pages across three tiers (``gpu``,
pinned ``cpu`` memory and ``nvme`` files) and moves them asynchronously. Subpackages:
``pagemem.tracer`` records tensor lifetimes, ``pagemem.sched`` plans task queues from them.
"""

from pagemem.config import StoreConfig
from pagemem.errors import (ConfigError, CorruptCheckpoint, CorruptPage, InvalidRequest, OutOfMemory, PageMemError,
                            RankFailed,
                            StepFailed, StepIOError, TierIOError, TornPage,
                            WeightsNotGivenBack, WrongProcess)
from pagemem.store import Lease, MoveHandle, PagedTensor, PageStore, StoreStats
from pagemem.engine import AdamW, Engine, EngineConfig, decay_groups

__version__ = "0.1.0"

__all__ = [
    "StoreConfig",
    "PageStore",
    "PagedTensor",
    "MoveHandle",
    "Lease",
    "Engine",
    "decay_groups",
    "EngineConfig",
    "AdamW",
    "StoreStats",
    "InvalidRequest",
    "PageMemError",
    "RankFailed",
    "ConfigError",
    "OutOfMemory",
    "CorruptPage",
    "CorruptCheckpoint",
    "TierIOError",
    "TornPage",
    "StepFailed",
    "StepIOError",
    "WeightsNotGivenBack",
    "WrongProcess",
]
