"""The engine: trains an unmodified model whose states live in the page store (``engine.py``),
the model's states in pages (``bank.py``), and the optimizer step over optimizer pages
(``adam.py``: fused AdamW on worker threads, one torch thread each)."""

from pagemem.engine.adam import (AdamW, Chunk, CpuAdam, PagedOptimizer, StepResult, clip_coefficient,
                                 fused_step, sumsq, total_sumsq)
from pagemem.engine.adam_threads import WorkerDied
from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.engine.groups import decay_groups

__all__ = [
    "AdamW",
    "Chunk",
    "CpuAdam",
    "Engine",
    "EngineConfig",
    "decay_groups",
    "PagedOptimizer",
    "StepResult",
    "WorkerDied",
    "clip_coefficient",
    "fused_step",
    "sumsq",
    "total_sumsq",
]
