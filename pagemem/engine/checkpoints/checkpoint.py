"""Checkpoints: the whole training state as a directory of raw pages, a checksummed JSON manifest
and checksums.

Layout of ``save(root)``::

    root/latest              the name of the newest durable checkpoint (replaced atomically)
    root/step-00000042/      one checkpoint (a second save at the same step gets a suffix)
        manifest.json        version, checksum, counters, loss scale, optimizer groups, config,
                             params, per-page XXH3 checksums, where each tensor lies; written last
        master.pages         fp32 master weights, page after page as they lie in the store
        exp_avg.pages, exp_avg_sq.pages, compute.pages
        rng.bin              torch's CPU generator state (rank 0's, with several ranks)
        rng-ranks.bin        with several ranks: every rank's CPU generator state, in rank order
        buffers.bin          the model's persistent buffers (BatchNorm statistics, counters)

[Note: atomic and durable] Everything is written into ``step-N.tmp-<random>``, each file
fsynced, the directory fsynced and renamed to ``step-N``, the root fsynced; only then does
``latest`` move (a temporary file, fsync, rename, fsync). A crash at any moment leaves the
previous ``latest`` and its checkpoint intact; a half-written ``.tmp`` directory or
``latest.tmp-*`` file is ignored and removed by the next save. A save that fails (ENOSPC, EIO:
``TierIOError``; a page that does not verify: ``CorruptPage``) removes what it wrote, on every
path, and ``latest`` still names the previous checkpoint. (Only a failed fsync of the root
*after* ``latest`` was renamed is reported with ``latest`` already naming the new checkpoint,
which is then complete and verified.)

[Note: pages copied by the kernel] Pages go into the checkpoint through the store
(``PageStore.export_page``, [Note: exported pages are verified]): an optimizer page that lives
only on NVMe is copied from the page file with ``copy_file_range`` (a buffered copy where the
kernel refuses, as between filesystems), and every page written is read back and must match its
checksum, so a page gone bad on disk fails the save instead of being saved under its old
checksum. Loading checks every file's size, reads and verifies every page, ``rng.bin`` and
``buffers.bin``, and the manifest ([Note: the manifest is checked]). Nothing is pickled.

[Note: a refused load changes nothing] ``load`` refuses what it can before it touches the model
(``latest``, the manifest, the files' sizes); what it finds later (a page that fails its
checksum) closes the new engine and puts the model back exactly as it was: every module's
parameter objects, their values (the very tensors) and classes, and its buffers. Those tensors
are kept referenced for the duration of the load (a model built on ``meta`` holds none).

[Note: precision on load] The config in force (the one given, else the saved one) decides how to
compute: its compute dtype (compute copies and floating buffers are cast to it) and its loss
scaling. The saved loss scale and its count of good steps are kept only when the saved config
scaled the same way (both ``"dynamic"``, or the same static scale); otherwise the scaler starts
as the given config says. From the checkpoint come the values: fp32 master weights, Adam
moments, step counts, ``global_step``, skipped steps, the groups' hyperparameters (learning
rates as a scheduler left them), RNG and buffers.

[Note: checkpoints over ranks] Data parallel ranks hold replicas of every page ([Note: data
parallel over the process group]), so one rank's pages are the whole training state: rank 0
writes the checkpoint (every rank's RNG state gathered to it), the others wait for its verdict,
and the manifest's ``ranks`` records the world size and that layout. Any number of ranks loads
it (one included): every rank reads the same files, rank ``r`` takes the RNG state of saved
rank ``r`` (of ``r`` modulo the saved world size where it had fewer ranks).

[Note: sharded checkpoints] Where the ranks shard the Adam moments ([Note: sharded moments] in
``units/shards.py``), no rank holds them whole, so each rank writes its own share: rank 0 makes
the temporary directory and the two moments' files, sized from every rank's count of pages
(one all-reduce), and each rank writes, verifies and fsyncs its pages into them from its own
first page on (``write_share``), then tells rank 0 where each parameter's share lies. The
manifest's ``ranks.layout`` is ``"sharded"``, and a moment's place is a list of pieces, each
with the element it starts at, that follow one another over the whole parameter. The master
weights are written the same way (``SHARE_KINDS``): each rank its share where they are sharded
([Note: sharded master weights]), rank 0 those every rank holds whole, as one piece; the other
files are rank 0's, as with replicas. A
load reads the pieces back into the whole moment and each loading rank keeps its own share of
it (``ParamBank.set_state``), so a checkpoint saved with N ranks loads with any M, one process
included, and one saved by one process loads sharded. Why not ``torch.distributed.checkpoint``:
the page format with its checksums and atomic publication already carries replicas, and the
shares are ranges of flat pages, which this format describes in a few lines of manifest; DCP
would bring a second format and a second verification path for one tensor kind.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import xxhash
from torch import nn

from pagemem.engine.checkpoints import manifest as mf
from pagemem.engine.checkpoints.ckpt_io import (fsync_dir, file_size, io_errors, read_file, remove, remove_leftovers,
                                    write_durable)
from pagemem.engine.checkpoints.page_files import write_pages
from pagemem.engine.checkpoints.ckpt_state import (buffer_bytes, load_buffers, model_snapshot, restore_model,
                                       persistent_buffers)
from pagemem.errors import ConfigError, CorruptCheckpoint, CorruptPage, InvalidRequest

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank
    from pagemem.engine.config import EngineConfig
    from pagemem.store import PageStore

VERSION = mf.VERSION
KINDS = mf.KINDS
MANIFEST = "manifest.json"
NAME = re.compile(r"step-\d{8,}(-[0-9a-f]{8})?")
"""What ``latest`` may name."""
__all__ = ["VERSION", "KINDS", "Checkpointed", "save", "resolve", "read_manifest", "load", "load_into",
           "saved_groups", "persistent_buffers"]


@dataclass(frozen=True)
class Checkpointed:
    """What a checkpoint reads and writes of an engine, and nothing more (the checkpoint code
    never sees the ``Engine``): the module (its buffers), the config, the bank (the pages and
    each parameter's counts), the store, the device buffers live on, and the counters, loss
    scale and optimizer groups as JSON-ready values, to read and to restore."""

    module: nn.Module
    config: "EngineConfig"
    bank: "ParamBank"
    store: "PageStore"
    device: torch.device
    training_state: Callable[[], dict[str, Any]]
    restore_training_state: Callable[[dict[str, Any]], None]
    loss_scale: Callable[[], float | None]
    rank: int = 0
    """This process's rank ([Note: checkpoints over ranks]): the RNG state it loads."""
    same_on_every_rank: Callable[[list[int]], bool] | None = None
    """With several ranks: True when every rank passed the same values (one collective)."""


# ---------------------------------------------------------------------------------------- save

def _write_files(engine: Checkpointed, tmp: str, state: dict[str, Any], rank_rngs: list[bytes] | None,
                 moments: dict[str, tuple[list, list[int]]] | None = None) -> None:
    """Every file of a checkpoint into the directory ``tmp``, the manifest last (``rank_rngs``:
    every rank's RNG state, [Note: checkpoints over ranks]; ``moments``: the sharded moments'
    places and page checksums, their files already written by every rank, [Note: sharded
    checkpoints])."""
    layout, digests = {}, {}
    for kind in KINDS:
        if moments is not None and kind in moments:
            layout[kind], digests[kind] = moments[kind]
            continue
        layout[kind], digests[kind] = write_pages(engine, kind, os.path.join(tmp, f"{kind}.pages"))
    rng = torch.get_rng_state().numpy().tobytes()
    write_durable(os.path.join(tmp, "rng.bin"), rng)
    buffers, entries = buffer_bytes(engine.module)
    write_durable(os.path.join(tmp, "buffers.bin"), buffers)
    body = {
        "page_bytes": engine.store.page_bytes,
        "state": state,
        "config": engine.config.to_dict(),
        "params": [{"name": n, "shape": list(p.shape), "dtype": str(engine.bank.original_dtype_of(i))}
                   for i, (n, p) in enumerate(engine.bank.params)],
        "tensors": layout,
        "page_digests": digests,
        "rng": {"file": "rng.bin", "xxh3": xxhash.xxh3_64_intdigest(rng), "nbytes": len(rng)},
        "buffers": {"file": "buffers.bin", "xxh3": xxhash.xxh3_64_intdigest(buffers), "nbytes": len(buffers),
                    "entries": entries},
    }
    if rank_rngs is not None:
        joined = b"".join(rank_rngs)
        write_durable(os.path.join(tmp, "rng-ranks.bin"), joined)
        body["ranks"] = {"world_size": len(rank_rngs), "layout": "replicated" if moments is None else "sharded",
                         "rng": {"file": "rng-ranks.bin", "xxh3": xxhash.xxh3_64_intdigest(joined), "nbytes": len(joined)}}
    mf.validate(body)  # what a load would refuse is never written
    write_durable(os.path.join(tmp, MANIFEST), mf.encode(body))


def save(engine: Checkpointed, root: str, keep: int | None = None, rank_rngs: list[bytes] | None = None) -> str:
    """Write a checkpoint of ``engine`` under ``root`` (see the module docs); returns its path.
    ``keep``: then remove all but the newest ``keep`` checkpoints (never the one ``latest``
    names). ``rank_rngs``: every rank's RNG state, written by rank 0 ([Note: checkpoints over
    ranks])."""
    tmp = begin_save(engine, root)
    try:
        return finish_save(engine, root, tmp, keep, rank_rngs)
    except BaseException:
        remove(tmp)
        raise


def begin_save(engine: Checkpointed, root: str) -> str:
    """The new checkpoint's temporary directory under ``root``, made (leftovers of a crashed
    save removed first); ``finish_save`` fills and publishes it."""
    engine.store.synchronize()
    with io_errors("creating", root):
        os.makedirs(root, exist_ok=True)
    remove_leftovers(root)
    name = f"step-{engine.training_state()['global_step']:08d}"
    tmp = os.path.join(root, f"{name}.tmp-{uuid.uuid4().hex[:8]}")
    with io_errors("creating", tmp):
        os.mkdir(tmp)
    return tmp


def finish_save(engine: Checkpointed, root: str, tmp: str, keep: int | None = None,
                rank_rngs: list[bytes] | None = None, moments: dict[str, tuple[list, list[int]]] | None = None
                ) -> str:
    """Write the checkpoint's files into ``tmp`` (``begin_save``'s), rename it to its name and
    point ``latest`` at it ([Note: atomic and durable]); ``moments``: see ``_write_files``. A
    failure removes what it wrote, ``tmp`` included."""
    state = engine.training_state()
    name = f"step-{state['global_step']:08d}"
    final = None
    try:
        _write_files(engine, tmp, state, rank_rngs, moments)
        fsync_dir(tmp)
        final = os.path.join(root, name)
        if os.path.lexists(final):  # saved at this step before (maybe what ``latest`` names): keep it
            final = os.path.join(root, f"{name}-{uuid.uuid4().hex[:8]}")
        with io_errors("renaming", tmp):
            os.rename(tmp, final)
        fsync_dir(root)
        _point_latest(root, os.path.basename(final))
    except BaseException:
        remove(tmp)
        if final is not None and _latest_name(root) != os.path.basename(final):
            remove(final)  # complete, but latest never named it: a failed save leaves nothing
        raise
    if keep is not None:
        prune(root, keep)
    return final


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints under ``root`` (by step, then
    time written), never the one ``latest`` names; returns the paths removed."""
    latest = _latest_name(root)
    done = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step-") and ".tmp" not in name and os.path.isdir(path):
            done.append((int(name[5:13]) if name[5:13].isdigit() else -1, os.stat(path).st_mtime_ns, name))
    done.sort(reverse=True)
    removed = []
    for _, _, name in done[keep:]:
        if name != latest:
            remove(os.path.join(root, name))
            removed.append(os.path.join(root, name))
    return removed


def _point_latest(root: str, name: str) -> None:
    """``root/latest`` names ``name``: a durable temporary file renamed over it."""
    pointer = os.path.join(root, f"latest.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_durable(pointer, name.encode())
        with io_errors("renaming", pointer):
            os.rename(pointer, os.path.join(root, "latest"))
    except BaseException:
        remove(pointer)
        raise
    fsync_dir(root)


def _latest_name(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest"), "rb") as f:
            return f.read(256).decode("ascii", "replace").strip()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------- load

def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself, or the one its ``latest`` points to."""
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        raw = read_file(latest, 256)
        name = raw.decode("ascii", "replace").strip()
        if not NAME.fullmatch(name):
            raise CorruptCheckpoint(latest, f"not a checkpoint name: {name[:64]!r}")
        if not os.path.isfile(os.path.join(path, name, MANIFEST)):
            raise CorruptCheckpoint(latest, f"names {name!r}, which has no {MANIFEST} (a dangling latest)")
        return os.path.join(path, name)
    if os.path.lexists(os.path.join(path, MANIFEST)):
        return path
    raise InvalidRequest(f"{path}: no checkpoint here (neither 'latest' nor '{MANIFEST}')")


def read_manifest(ckpt: str) -> dict[str, Any]:
    """The checkpoint's manifest body, checksum verified and every value validated."""
    path = os.path.join(ckpt, MANIFEST)
    return mf.decode(read_file(path), path)


def check_files(ckpt: str, manifest: dict[str, Any]) -> None:
    """Every file the manifest names is there at its size (CorruptCheckpoint naming it if not)."""
    pb = manifest["page_bytes"]
    for kind in KINDS:
        path = os.path.join(ckpt, f"{kind}.pages")
        want, size = len(manifest["page_digests"][kind]) * pb, file_size(path)
        if size != want:
            raise CorruptCheckpoint(path, f"{size} bytes, the manifest says {want}")
    for what in [manifest["rng"], manifest["buffers"]] + ([manifest["ranks"]["rng"]] if "ranks" in manifest else []):
        path = os.path.join(ckpt, what["file"])
        size = file_size(path)
        if size != what["nbytes"]:
            raise CorruptCheckpoint(path, f"{size} bytes, the manifest says {what['nbytes']}")


def _verified(ckpt: str, what: dict[str, Any]) -> bytes:
    path = os.path.join(ckpt, what["file"])
    data = read_file(path)
    if len(data) != what["nbytes"] or xxhash.xxh3_64_intdigest(data) != what["xxh3"]:
        raise CorruptCheckpoint(path, f"checksum {xxhash.xxh3_64_intdigest(data):#018x}, expected {what['xxh3']:#018x}")
    return data


def saved_config(manifest: dict[str, Any], ckpt: str) -> "EngineConfig":
    """The config the checkpoint was saved with (its store paths must exist here)."""
    from pagemem.engine.config import EngineConfig

    try:
        return EngineConfig.from_dict(manifest["config"])
    except ConfigError as exc:
        raise ConfigError(f"{ckpt}/{MANIFEST}: the saved config: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpoint(os.path.join(ckpt, MANIFEST), f"config: {exc!r}") from None


def saved_groups(manifest: dict[str, Any], model: torch.nn.Module) -> list[dict[str, Any]] | None:
    """The parameter groups the checkpoint was trained with, over ``model``'s parameters (in
    the engine's order: its owning modules'), or None for one group of every parameter."""
    state = manifest["state"]
    group_of = state.get("group_of")
    if group_of is None or (len(state["param_groups"]) == 1 and None not in group_of):
        return None
    from pagemem.engine.units.records import owning_layers

    params = [p for _, p in owning_layers(model)[0]]
    if len(params) != len(group_of):
        raise InvalidRequest("the checkpoint was written for another model (parameters differ)")
    return [{"params": [p for p, g in zip(params, group_of) if g == n]} for n in range(len(state["param_groups"]))]


def load(make: Callable[..., Any], directory: str, model: torch.nn.Module, config: "EngineConfig | None",
         param_groups: Any) -> Any:
    """``Engine.load``: ``make(model, config, _values=, param_groups=)`` (the engine class) over
    ``model``, its states from the checkpoint ``directory`` names (through the engine's
    ``checkpointed()`` handle); a refused load leaves ``model`` as it was ([Note: a refused load
    changes nothing])."""
    from pagemem.engine.units.model_checks import check_no_meta_buffers

    ckpt = resolve(directory)
    manifest = read_manifest(ckpt)
    check_files(ckpt, manifest)
    meta = any(p.is_meta for p in model.parameters())
    if param_groups is None:
        param_groups = saved_groups(manifest, model)
    if config is None:
        config = saved_config(manifest, ckpt)
    before = model_snapshot(model)
    try:
        engine = make(model, config, _values=not meta, param_groups=param_groups)
    except BaseException:
        restore_model(before)
        raise
    try:
        handle = engine.checkpointed()
        digest = xxhash.xxh3_64_intdigest(json.dumps(manifest, sort_keys=True).encode()) >> 1
        if handle.same_on_every_rank is not None and not handle.same_on_every_rank([digest]):
            raise InvalidRequest(f"{ckpt}: the ranks loaded different checkpoints (their manifests differ); every "
                                 "rank must load the same one ([Note: checkpoints over ranks])")
        load_into(handle, ckpt, manifest)
        check_no_meta_buffers(model)
    except BaseException:
        try:
            engine.close()
        finally:
            restore_model(before)
        raise
    return engine


def _bytes_at(raw: np.ndarray, where: dict[str, Any], pb: int) -> np.ndarray:
    """The bytes of one tensor (or piece) the manifest places in a file read whole as ``raw``."""
    chunks, left, lo = [], where["nbytes"], where["offset"]
    for pos in where["pages"]:
        take = min(pb - lo, left)
        chunks.append(raw[pos * pb + lo:pos * pb + lo + take])
        left -= take
        lo = 0
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


def load_into(engine: Checkpointed, ckpt: str, manifest: dict[str, Any]) -> None:
    """Overwrite ``engine``'s states with the checkpoint's, verifying every page and file first
    (the manifest is ``read_manifest``'s, already validated)."""
    params = [(n, list(p.shape)) for n, p in engine.bank.params]
    if [(p["name"], p["shape"]) for p in manifest["params"]] != params:
        raise InvalidRequest(f"{ckpt}: the checkpoint was written for another model (parameters differ)")
    rng = _verified(ckpt, manifest["rng"])
    if "ranks" in manifest:  # [Note: checkpoints over ranks]
        every = _verified(ckpt, manifest["ranks"]["rng"])
        n = manifest["ranks"]["world_size"]
        size = len(every) // n
        r = engine.rank % n
        rng = every[r * size:(r + 1) * size]
    buffers = _verified(ckpt, manifest["buffers"])
    pb = manifest["page_bytes"]
    for kind in KINDS:
        path = os.path.join(ckpt, f"{kind}.pages")
        data = read_file(path)
        digests = manifest["page_digests"][kind]
        if len(data) != len(digests) * pb:
            raise CorruptCheckpoint(path, f"{len(data)} bytes, the manifest says {len(digests) * pb}")
        view = memoryview(data)
        for pos, expected in enumerate(digests):
            actual = xxhash.xxh3_64_intdigest(view[pos * pb:(pos + 1) * pb])
            if actual != expected:
                raise CorruptPage("checkpoint", pos, expected, actual, path)
        raw = np.frombuffer(data, dtype=np.uint8)
        for i, where in enumerate(manifest["tensors"][kind]):
            if where is None or (kind == "compute" and manifest["tensors"]["master"][i] is not None):
                continue  # a state this parameter had no pages for; a compute copy its master sets
            pieces = where["pieces"] if "pieces" in where else [where]  # [Note: sharded checkpoints]
            parts = [_bytes_at(raw, piece, pb) for piece in pieces]
            flat = (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint8)
            dtype = (torch.float32 if kind != "compute" else
                     getattr(torch, mf.saved_compute_dtype(manifest["config"], manifest["params"][i])))
            value = torch.from_numpy(flat.copy()).view(dtype).reshape(engine.bank.params[i][1].shape)
            engine.bank.set_state(i, kind, value)
    torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
    load_buffers(engine.module, buffers, manifest["buffers"]["entries"], engine.device, engine.config.compute_dtype,
                 os.path.join(ckpt, manifest["buffers"]["file"]))
    state = dict(manifest["state"])
    if mf.saved_loss_scale(manifest["config"]) != engine.config.effective_loss_scale:  # [Note: precision on load]
        state["loss_scale"], state["good_steps"] = engine.loss_scale(), 0
    engine.restore_training_state(state)
