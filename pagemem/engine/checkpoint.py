"""Checkpoints: the whole training state as a directory of raw pages, a JSON manifest and checksums.

Layout of ``save(root)``::

    root/latest              the name of the newest durable checkpoint (replaced atomically)
    root/step-00000042/      one checkpoint (a second save at the same step gets a suffix)
        manifest.json        version, counters, loss scale, optimizer groups, config, params,
                             per-page XXH3 checksums, where each tensor lies; written last
        master.pages         fp32 master weights, page after page as they lie in the store
        exp_avg.pages, exp_avg_sq.pages
        rng.bin              torch's CPU generator state (and CUDA's, when present)
        buffers.bin          the model's persistent buffers (BatchNorm statistics, counters)

[Note: atomic and durable] Everything is written into ``step-N.tmp-<random>``, each file
fsynced, the directory fsynced and renamed to ``step-N``, the root fsynced; only then does
``latest`` move (a temporary file, fsync, rename, fsync). A crash at any moment leaves the
previous ``latest`` and its checkpoint intact; a half-written ``.tmp`` directory is ignored and
removed by the next save.

[Note: pages copied by the kernel] Pages go into the checkpoint through the store
(``PageStore.export_page``): an optimizer page that lives only on NVMe is copied from the page
file with ``copy_file_range`` (never read through Python), its checksum the one the tier
recorded when it wrote the page; pages in memory are written from their buffers and checksummed
on the way. Loading reads and verifies every page. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from pagemem.errors import CorruptPage, InvalidRequest

if TYPE_CHECKING:
    from pagemem.engine.engine import Engine

VERSION = 1
KINDS = ("master", "exp_avg", "exp_avg_sq", "compute")
"""What a checkpoint holds per parameter: its states, and the compute copy (the only value a
frozen parameter has; the others' is written too, small beside the states)."""


def _write_durable(path: str, data: bytes | str) -> None:
    """Write ``data`` to a new file at ``path`` and make it durable before returning."""
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_pages(engine: "Engine", kind: str, path: str) -> tuple[list[dict], list[int | None]]:
    """Write every page holding a ``kind`` tensor into ``path``; return where each tensor lies
    (page positions in the file, offset, bytes) and each page's checksum."""
    store, bank = engine.store, engine.bank
    pb = store.page_bytes
    order: dict[int, int] = {}
    tensors = []
    for i in range(len(bank.params)):
        layer, k = bank.where(i)
        t = getattr(layer, kind)[k]
        if t is None:  # a frozen parameter's states (see [Note: frozen parameters])
            tensors.append(None)
            continue
        extents = t.extents()
        for page_id, _lo, _hi in extents:
            order.setdefault(page_id, len(order))
        tensors.append({"pages": [order[p] for p, _, _ in extents], "offset": extents[0][1] if extents else 0,
                        "nbytes": t.nbytes})
    digests: list[int | None] = [None] * len(order)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(order) * pb)
        for page_id, pos in order.items():
            digests[pos] = store.export_page(page_id, fd, pos * pb)
        os.fsync(fd)
    finally:
        os.close(fd)
    return tensors, digests


def save(engine: "Engine", root: str) -> str:
    """Write a checkpoint of ``engine`` under ``root`` (see the module docs); returns its path."""
    engine.store.synchronize()
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # leftovers of a save that crashed
        if ".tmp-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    name = f"step-{engine.global_step:08d}"
    tmp = os.path.join(root, f"{name}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    layout = {}
    digests = {}
    for kind in KINDS:
        layout[kind], digests[kind] = _write_pages(engine, kind, os.path.join(tmp, f"{kind}.pages"))
    rng = torch.get_rng_state().numpy().tobytes()
    _write_durable(os.path.join(tmp, "rng.bin"), rng)
    buffers, entries = _buffer_bytes(engine.module)
    _write_durable(os.path.join(tmp, "buffers.bin"), buffers)
    manifest = {
        "version": VERSION,
        "page_bytes": engine.store.page_bytes,
        "state": engine.training_state(),
        "config": engine.config.to_dict(),
        "params": [{"name": n, "shape": list(p.shape), "dtype": str(engine.bank.original_dtype_of(i))}
                   for i, (n, p) in enumerate(engine.bank.params)],
        "tensors": layout,
        "page_digests": digests,
        "rng": {"file": "rng.bin", "xxh3": xxhash.xxh3_64_intdigest(rng)},
        "buffers": {"file": "buffers.bin", "xxh3": xxhash.xxh3_64_intdigest(buffers), "entries": entries},
    }
    _write_durable(os.path.join(tmp, "manifest.json"), json.dumps(manifest))
    _fsync_dir(tmp)
    final = os.path.join(root, name)
    if os.path.exists(final):  # saved at this step before (maybe what ``latest`` names): keep it
        name = f"{name}-{uuid.uuid4().hex[:8]}"
        final = os.path.join(root, name)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f"latest.tmp-{uuid.uuid4().hex[:8]}")
    _write_durable(pointer, name)
    os.rename(pointer, os.path.join(root, "latest"))
    _fsync_dir(root)
    return final


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself, or the one its ``latest`` points to."""
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        if "/" in name or name.startswith("."):
            raise InvalidRequest(f"{latest}: not a checkpoint name: {name!r}")
        return os.path.join(path, name)
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    raise InvalidRequest(f"{path}: no checkpoint here (neither 'latest' nor 'manifest.json')")


def read_manifest(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("version") != VERSION:
        raise InvalidRequest(f"{ckpt}: checkpoint version {manifest.get('version')!r}, this pagemem reads {VERSION}")
    return manifest


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(state-dict key, module, buffer name) of every buffer ``model.state_dict()`` holds."""
    out = []
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, module, bname))
    return out


def _buffer_bytes(model: torch.nn.Module) -> tuple[bytes, list[dict[str, Any]]]:
    """The model's persistent buffers (BatchNorm statistics, counters) as raw bytes, and where
    each lies: nothing is pickled."""
    chunks, entries, offset = [], [], 0
    for key, module, bname in persistent_buffers(model):
        b = module._buffers[bname].detach().cpu().contiguous()
        data = b.reshape(-1).view(torch.uint8).numpy().tobytes() if b.numel() else b""
        entries.append({"name": key, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape),
                        "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    return b"".join(chunks), entries


def _load_buffers(engine: "Engine", ckpt: str, manifest: dict[str, Any]) -> None:
    saved = manifest.get("buffers")
    if saved is None:  # written before buffers were saved
        return
    with open(os.path.join(ckpt, saved["file"]), "rb") as f:
        data = f.read()
    if xxhash.xxh3_64_intdigest(data) != saved["xxh3"]:
        raise CorruptPage("checkpoint", 0, saved["xxh3"], xxhash.xxh3_64_intdigest(data), f"{ckpt}/{saved['file']}")
    where = {key: (module, bname) for key, module, bname in persistent_buffers(engine.module)}
    for e in saved["entries"]:
        if e["name"] not in where:
            raise InvalidRequest(f"{ckpt}: the checkpoint has a buffer {e['name']!r} this model does not")
        module, bname = where[e["name"]]
        dtype = getattr(torch, e["dtype"])
        raw = bytearray(data[e["offset"]:e["offset"] + e["nbytes"]])
        value = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(e["shape"])
        module._buffers[bname] = value.to(engine.device)


def saved_groups(manifest: dict[str, Any], model: torch.nn.Module) -> list[dict[str, Any]] | None:
    """The parameter groups the checkpoint was trained with, over ``model``'s parameters (in
    the engine's order: its owning modules'), or None for one group of every parameter."""
    state = manifest["state"]
    group_of = state.get("group_of")
    if group_of is None or (len(state["param_groups"]) == 1 and None not in group_of):
        return None
    from pagemem.engine.records import owning_layers

    params = [p for _, p in owning_layers(model)[0]]
    if len(params) != len(group_of):
        raise InvalidRequest("the checkpoint was written for another model (parameters differ)")
    return [{"params": [p for p, g in zip(params, group_of) if g == n]} for n in range(len(state["param_groups"]))]


def load_into(engine: "Engine", ckpt: str, manifest: dict[str, Any]) -> None:
    """Overwrite ``engine``'s states with the checkpoint's, verifying every page."""
    params = [(n, list(p.shape)) for n, p in engine.bank.params]
    if [(p["name"], p["shape"]) for p in manifest["params"]] != params:
        raise InvalidRequest(f"{ckpt}: the checkpoint was written for another model (parameters differ)")
    pb = manifest["page_bytes"]
    for kind in KINDS:
        with open(os.path.join(ckpt, f"{kind}.pages"), "rb") as f:
            data = f.read()
        for pos, expected in enumerate(manifest["page_digests"][kind]):
            actual = xxhash.xxh3_64_intdigest(data[pos * pb:(pos + 1) * pb])
            if expected is not None and actual != expected:
                raise CorruptPage("checkpoint", pos, expected, actual, f"{ckpt}/{kind}.pages")
        raw = np.frombuffer(data, dtype=np.uint8)
        for i, where in enumerate(manifest["tensors"][kind]):
            if where is None or (kind == "compute" and manifest["tensors"]["master"][i] is not None):
                continue  # a state this parameter had no pages for; a compute copy its master sets
            chunks, left, lo = [], where["nbytes"], where["offset"]
            for pos in where["pages"]:
                take = min(pb - lo, left)
                chunks.append(raw[pos * pb + lo:pos * pb + lo + take])
                left -= take
                lo = 0
            flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
            dtype = torch.float32 if kind != "compute" else getattr(torch, manifest["config"]["compute_dtype"])
            value = torch.from_numpy(flat.copy()).view(dtype).reshape(engine.bank.params[i][1].shape)
            engine.bank.set_state(i, kind, value)
    with open(os.path.join(ckpt, manifest["rng"]["file"]), "rb") as f:
        rng = f.read()
    if xxhash.xxh3_64_intdigest(rng) != manifest["rng"]["xxh3"]:
        raise CorruptPage("checkpoint", 0, manifest["rng"]["xxh3"], xxhash.xxh3_64_intdigest(rng), f"{ckpt}/rng.bin")
    torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
    _load_buffers(engine, ckpt, manifest)
    engine.restore_training_state(manifest["state"])
