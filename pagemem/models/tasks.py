"""A learnable synthetic language task, generated on the fly: nothing to download.

Every token has ``branches`` successors (rows of a fixed random table); a sequence starts at a
random token and each next token is one of the current token's successors, uniformly. A model
that learns the table reaches the loss floor ``ln(branches)``, as language has an entropy floor;
``branches=1`` can be learnt to zero. Batch ``step`` of data order ``seed`` is a pure function
of both, so a resumed run sees exactly the batches an uninterrupted one would; with several
ranks each takes its slice of the step's combined batch (:meth:`BranchingTask.batch_at`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagemem.checks import check_int


@dataclass(frozen=True)
class BranchingTask:
    """Shape of the task's batches."""

    vocab: int = 256
    """Token ids used: ``0 .. vocab-1`` (at most the model's vocabulary)."""
    seq: int = 64
    """Tokens a model reads per sequence (each batch holds ``seq + 1``: inputs and targets)."""
    batch: int = 8
    """Sequences per batch."""
    branches: int = 4
    """Successors per token: the loss floor is ``ln(branches)``."""
    seed: int = 0
    """The data order (and, with it, the table)."""

    def __post_init__(self) -> None:
        check_int("vocab", self.vocab, 2, 1 << 24)
        check_int("seq", self.seq, 1, 1 << 20)
        check_int("batch", self.batch, 1, 1 << 20)
        check_int("branches", self.branches, 1, self.vocab)
        check_int("seed", self.seed, 0, 1 << 62)

    @property
    def floor(self) -> float:
        """The least mean cross-entropy a model can reach on this task (nats)."""
        return math.log(self.branches)

    def table(self) -> torch.Tensor:
        """``[branches, vocab]``: row ``j`` maps each token to its ``j``-th successor."""
        return torch.stack([torch.randperm(self.vocab, generator=torch.Generator().manual_seed(7 + 1000 * self.seed + j))
                            for j in range(self.branches)])

    def batch_at(self, step: int, table: torch.Tensor | None = None, rank: int = 0,
                 world_size: int = 1) -> torch.Tensor:
        """Batch ``step``: ``[batch, seq + 1]`` token ids (``table``: :meth:`table`, to reuse it).
        With ``world_size`` ranks ``batch`` is per rank: rank ``rank`` gets its ``batch`` rows of
        the step's combined batch, which is batch ``step`` of this task with ``batch *
        world_size`` sequences in one process."""
        if not 0 <= rank < world_size:
            raise ValueError(f"batch_at: rank {rank} is not in [0, {world_size})")
        table = self.table() if table is None else table
        n = self.batch * world_size
        g = torch.Generator().manual_seed((self.seed << 32) + 10_000 + step)
        x = torch.empty(n, self.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for i in range(self.seq):
            j = torch.randint(0, self.branches, (n,), generator=g)
            x[:, i + 1] = table[j, x[:, i]]
        return x[rank * self.batch:(rank + 1) * self.batch]
