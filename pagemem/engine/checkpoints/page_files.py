"""A checkpoint's page files: every page holding one kind of tensor written into a file, each
verified, whole (one process, or rank 0) or a rank's share of a sharded state ([Note: sharded
checkpoints] in ``checkpoint.py``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from pagemem.engine.checkpoints.ckpt_io import io_errors

if TYPE_CHECKING:
    from pagemem.engine.checkpoints.checkpoint import Checkpointed


def write_pages(engine: Checkpointed, kind: str, path: str, base: int | None = None,
                only: Callable[[int], bool] | None = None) -> tuple[list[dict | None], list[int]]:
    """Write every page holding a ``kind`` tensor into ``path``, each verified; return where each
    tensor lies (page positions in the file, offset, bytes) and each page's checksum. ``base``:
    into the existing file ``path``, from its page ``base`` on (a rank's share of sharded states:
    [Note: sharded checkpoints]); else a new file of these pages alone. ``only``: the parameters
    whose tensors to write (default: all)."""
    store, bank = engine.store, engine.bank
    pb = store.page_bytes
    order: dict[int, int] = {}
    tensors: list[dict | None] = []
    for i in range(len(bank.params)):
        layer, k = bank.where(i)
        # no compute copy at rest with sharded parameters: the master sets it ([Note: gathered units])
        t = None if kind == "compute" and bank.gathered else getattr(layer, kind)[k]
        if t is None or (only is not None and not only(i)):  # a frozen parameter's states (see [Note: frozen parameters])
            tensors.append(None)
            continue
        extents = t.extents()
        for page_id, _lo, _hi in extents:
            order.setdefault(page_id, len(order))
        at = base or 0
        tensors.append({"pages": [at + order[p] for p, _, _ in extents], "offset": extents[0][1] if extents else 0,
                        "nbytes": t.nbytes})
    digests = [0] * len(order)
    with io_errors("writing", path):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if base is None else 0), 0o600)
        try:
            if base is None:
                os.ftruncate(fd, len(order) * pb)
            for page_id, pos in order.items():
                digests[pos] = store.export_page(page_id, fd, ((base or 0) + pos) * pb, path)
            os.fsync(fd)
        finally:
            os.close(fd)
    return tensors, digests


# ------------------------------------------------------------ sharded states, rank by rank

SHARE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The states each rank writes its share of in a sharded checkpoint ([Note: sharded checkpoints])."""


def _in_share(engine: Checkpointed, kind: str) -> Callable[[int], bool]:
    """Which parameters' ``kind`` tensors this rank writes in a sharded checkpoint: its shares,
    and on rank 0 the master weights every rank holds whole."""
    bank = engine.bank
    return lambda i: bank.is_sharded(i, kind) or engine.rank == 0


def share_pages(engine: Checkpointed, kind: str) -> int:
    """Pages this rank's share of the sharded state ``kind`` takes in a checkpoint ([Note:
    sharded checkpoints])."""
    pages = set()
    mine = _in_share(engine, kind)
    for i in range(len(engine.bank.params)):
        layer, k = engine.bank.where(i)
        t = getattr(layer, kind)[k]
        if t is not None and mine(i):
            pages.update(p for p, _, _ in t.extents())
    return len(pages)


def create_share_files(tmp: str, pages: dict[str, int], page_bytes: int) -> None:
    """The sharded moments' files in ``tmp``, of ``pages[kind]`` pages each (every rank's share),
    for the ranks to fill (rank 0 makes them: [Note: sharded checkpoints])."""
    for kind, n in pages.items():
        path = os.path.join(tmp, f"{kind}.pages")
        with io_errors("creating", path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, n * page_bytes)
            finally:
                os.close(fd)


def write_share(engine: Checkpointed, tmp: str, kind: str, base: int) -> tuple[list[dict | None], list[int]]:
    """This rank's share of the sharded moment ``kind`` into its file in ``tmp`` from page
    ``base`` on, verified and fsynced: where each parameter's share lies (with ``start``, its
    first element) and the pages' checksums."""
    bank = engine.bank
    places, digests = write_pages(engine, kind, os.path.join(tmp, f"{kind}.pages"), base, _in_share(engine, kind))
    return [None if w is None else {**w, "start": bank.owned(i)[0] if bank.is_sharded(i, kind) else 0}
            for i, w in enumerate(places)], digests


def merge_shares(parts: list[tuple[list[dict | None], list[int]]]) -> tuple[list[dict | None], list[int]]:
    """Every rank's ``write_share`` of one moment (in rank order, their pages in that order in
    the file) as the manifest's entries: per parameter, its pieces in element order."""
    n = len(parts[0][0])
    places: list[dict | None] = []
    for i in range(n):
        pieces = sorted((w for rank_places, _ in parts if (w := rank_places[i]) is not None), key=lambda w: w["start"])
        places.append({"pieces": pieces} if pieces else None)
    return places, [d for _, digests in parts for d in digests]
