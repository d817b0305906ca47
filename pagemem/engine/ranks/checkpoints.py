"""A checkpoint written for every rank: by rank 0, with each rank's share of sharded moments
written by that rank ([Note: checkpoints over ranks] and [Note: sharded checkpoints] in
``engine/checkpoints/checkpoint.py``)."""

from __future__ import annotations

import json
import os
import zlib
from typing import Callable, TypeVar

import torch

from pagemem.engine.checkpoints import checkpoint, page_files
from pagemem.engine.checkpoints.ckpt_io import remove
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
    if engine.bank.shards is None:
        return by_rank_zero(coll, "save", root, lambda: checkpoint.save(engine, root, keep, rank_rngs=rngs))
    return _save_sharded(engine, coll, root, keep, rngs)


def _error(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _save_sharded(engine: checkpoint.Checkpointed, coll: Collectives, root: str, keep: int | None,
                  rngs: list[bytes]) -> str:
    """[Note: sharded checkpoints] Rank 0 makes the directory and the moments' files, sized from
    every rank's count of pages; each rank writes its share into them from its own page on;
    rank 0 writes the rest and publishes the checkpoint. Every rank takes part in every
    collective whatever fails, so a rank whose disk fails leaves the others in step."""
    world, me = coll.ranks.world_size, coll.ranks.rank
    counts = torch.zeros(len(page_files.SHARE_KINDS) * world, dtype=torch.int64, device=coll.ranks.device)
    for k, kind in enumerate(page_files.SHARE_KINDS):
        counts[k * world + me] = page_files.share_pages(engine, kind)
    coll.reduce_now(counts, "counting every rank's pages of the moments")
    per_rank = [[int(x) for x in counts[k * world:(k + 1) * world]] for k in range(len(page_files.SHARE_KINDS))]
    tmp, error = None, None
    if me == 0:
        try:
            tmp = checkpoint.begin_save(engine, root)
            page_files.create_share_files(tmp, {kind: sum(per_rank[k]) for k, kind in enumerate(page_files.SHARE_KINDS)},
                                          engine.store.page_bytes)
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
            error = exc
    said = json.loads(coll.broadcast_bytes(json.dumps({"tmp": tmp, "error": _error(error)}).encode()
                                           if me == 0 else None, 0, "rank 0's checkpoint directory"))
    if said["error"] is not None:
        if tmp is not None:
            remove(tmp)
        if error is not None:
            raise error
        raise InvalidRequest(f"save: rank 0 could not write under {root!r}: {said['error']}")
    tmp = said["tmp"]
    try:
        return _write_and_publish(engine, coll, root, keep, rngs, tmp, per_rank)
    except BaseException:
        if me == 0:
            remove(tmp)  # a peer failed or died part-way: nothing of this save stays (gone once published)
        raise


def _write_and_publish(engine: checkpoint.Checkpointed, coll: Collectives, root: str, keep: int | None,
                       rngs: list[bytes], tmp: str, per_rank: list[list[int]]) -> str:
    """``_save_sharded``'s second half: every rank's share into ``tmp``, then rank 0 publishes."""
    world, me = coll.ranks.world_size, coll.ranks.rank
    part, mine = None, None
    try:
        part = {kind: page_files.write_share(engine, tmp, kind, sum(per_rank[k][:me])) for k, kind in enumerate(page_files.SHARE_KINDS)}
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
        mine = exc
    parts = [json.loads(coll.broadcast_bytes(json.dumps({"part": part, "error": _error(mine)}).encode()
                                             if r == me else None, r, f"rank {r}'s share of the moments"))
             for r in range(world)]
    failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"] is not None]

    def publish() -> str:
        if failed:
            remove(tmp)
            raise InvalidRequest(f"save: a rank could not write its share of the moments ({'; '.join(failed)}); "
                                 "nothing was published, latest is unchanged")
        moments = {kind: page_files.merge_shares([(p["part"][kind][0], p["part"][kind][1]) for p in parts])
                   for kind in page_files.SHARE_KINDS}
        return checkpoint.finish_save(engine, root, tmp, keep, rngs, moments)

    try:
        return by_rank_zero(coll, "save", root, publish)
    except Exception:
        if mine is not None:
            raise mine from None
        raise
