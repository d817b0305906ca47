"""A checkpoint written by rank 0 for every rank ([Note: checkpoints over ranks] in
``engine/checkpoints/checkpoint.py``)."""

from __future__ import annotations

import json
import os
import zlib
from typing import Callable, TypeVar

import torch

from pagemem.engine.checkpoints import checkpoint
from pagemem.engine.ranks.collectives import Collectives
from pagemem.errors import InvalidRequest

T = TypeVar("T")


def gather_rngs(coll: Collectives) -> list[bytes]:
    """Every rank's CPU generator state, in rank order, on every rank (one all-reduce)."""
    mine = torch.get_rng_state()
    rows = torch.zeros(coll.ranks.world_size, mine.numel(), dtype=torch.int32, device=coll.ranks.device)
    rows[coll.ranks.rank] = mine.to(torch.int32)
    coll.reduce_now(rows, "gathering every rank's RNG state")
    return [bytes(r.to(torch.uint8).cpu().numpy().tobytes()) for r in rows]


def by_rank_zero(coll: Collectives, what: str, where: str, write: Callable[[], T]) -> T:
    """``write()`` on rank 0 alone; every rank returns its result (JSON-ready) or raises its
    failure (on the others as ``InvalidRequest`` naming rank 0's error)."""
    result, error = None, None
    if coll.ranks.rank == 0:
        try:
            result = write()
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised here
            error = exc
    verdict = json.loads(coll.broadcast_bytes(
        json.dumps({"result": result, "error": None if error is None else f"{type(error).__name__}: {error}"}).encode()
        if coll.ranks.rank == 0 else None, 0, f"rank 0's verdict on {what}"))
    if error is not None:
        raise error
    if verdict["error"] is not None:
        raise InvalidRequest(f"{what}: rank 0 could not write under {where!r}: {verdict['error']}")
    return verdict["result"]


def save_over_ranks(engine: checkpoint.Checkpointed, coll: Collectives, root: str, keep: int | None,
                    step: int, refused: Exception | None = None) -> str:
    """Rank 0 writes the checkpoint, every rank returns its path or raises its failure.
    ``refused``: why this rank cannot save (every rank then raises, the ranks still in step)."""
    where = zlib.crc32(os.path.abspath(root).encode())
    (top_step, top_refused, top_where), (low_step, _, low_where) = coll.begin(
        "saving a checkpoint", [step, int(refused is not None), where])
    if refused is not None:
        raise refused
    if top_refused:
        raise InvalidRequest("save: another rank cannot save now (see its error); nothing was written")
    if top_step != low_step:
        raise InvalidRequest(f"save: ranks called save() at different steps (this rank at global_step {step}, "
                             f"others from {low_step} to {top_step}); every rank must save at the same step")
    if top_where != low_where:
        raise InvalidRequest(f"save: ranks called save() with different directories (this rank {root!r}); rank 0 "
                             "writes for every rank: pass the same directory, on a filesystem every rank sees")
    rngs = gather_rngs(coll)
    return by_rank_zero(coll, "save", root, lambda: checkpoint.save(engine, root, keep, rank_rngs=rngs))
