"""``Engine.save_weights``: the model's current weights as safetensors files in Hugging Face's
layout (``safetensors_layout.py``), for ``from_pretrained``, ``Engine(values=)`` or any reader.

[Note: weights files]
The keys are those ``model.state_dict()`` has, in its order (the engine's state-dict hooks name
them), each tensor once: a parameter from its fp32 master weights cast to the dtype it came with
(``ParamBank.host_value``: what ``close()`` gives back), a persistent buffer as the module holds
it; a tensor reached under several names (tied weights) goes under the first, as
``save_pretrained`` keeps ``transformer.wte.weight`` of GPT-2's tied pair. The entries are cut, in
order, into shards of at most ``max_shard_bytes`` (one larger tensor is a shard of its own), and
one shard at a time is read from the pages and written (``safetensors.torch.save_file`` takes a
dict per file): host memory holds at most one shard's values. One shard is ``model.safetensors``;
several are ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``.

[Note: weights written atomically] Every file is written and fsynced into a hidden temporary
directory inside the target (``.save_weights.tmp-<random>``), then moved into place: a single
file by one rename over the old one; shards after the old index and ``model.safetensors`` are
removed (so old and new shards never look like one set), the new index last, as the set's
commit. Stale files of the other layout go after. A failure while writing removes the temporary
directory and leaves the files that were there untouched; a crash leaves only the hidden
directory, which the next save removes. Nothing else in the directory (``config.json``) is touched.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from pagemem.engine.checkpoints.ckpt_io import fsync_dir, fsync_file, io_errors, remove, write_durable
from pagemem.engine.checkpoints.safetensors_layout import INDEX, SHARD, SINGLE, index_body, shard_name, split_shards
from pagemem.errors import InvalidRequest, TierIOError

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank

DEFAULT_MAX_SHARD_BYTES = 2 << 30
"""2 GiB: the host memory a save may hold (one shard's values). Hugging Face's default is larger
(50 GB in transformers 5), which would hold that much of the model at once."""
TMP_PREFIX = ".save_weights.tmp-"


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the files: its key, its bytes, and how to read its value onto the host."""

    key: str
    nbytes: int
    read: Callable[[], torch.Tensor]


def weight_entries(module: nn.Module, bank: "ParamBank") -> list[WeightEntry]:
    """The tensors to write, in ``module.state_dict()``'s order, each once (see [Note: weights files])."""
    index = {id(p): i for i, (_, p) in enumerate(bank.params)}
    seen: set[int] = set()
    out = []
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise InvalidRequest(f"save_weights: model.state_dict()[{key!r}] is a {type(value).__name__}; "
                                 "safetensors files hold tensors only")
        if id(value) in seen:
            continue
        seen.add(id(value))
        i = index.get(id(value))
        if i is not None:
            dtype = bank.original_dtype_of(i)
            out.append(WeightEntry(key, value.numel() * dtype.itemsize,
                                   lambda i=i, dtype=dtype: bank.host_value(i, dtype)))
        else:
            buffer = value.detach()
            out.append(WeightEntry(key, buffer.numel() * buffer.element_size(),
                                   lambda b=buffer: b.to("cpu", copy=True).contiguous()))
    return out


def save_weights(entries: list[WeightEntry], directory: str | os.PathLike, max_shard_bytes: int) -> list[str]:
    """Write ``entries`` into ``directory`` (made if missing) in Hugging Face's layout, atomically
    ([Note: weights written atomically]); returns the paths of the files written, the index last."""
    root = os.fspath(directory)
    with io_errors("creating", root):
        os.makedirs(root, exist_ok=True)
    _remove_leftovers(root)
    shards = split_shards([e.nbytes for e in entries], max_shard_bytes) if entries else [[]]
    names = [SINGLE] if len(shards) == 1 else [shard_name(k + 1, len(shards)) for k in range(len(shards))]
    tmp = os.path.join(root, f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}")
    try:
        with io_errors("creating", tmp):
            os.mkdir(tmp)
        weight_map: dict[str, str] = {}
        for name, shard in zip(names, shards):
            write_shard(os.path.join(tmp, name), {entries[pos].key: entries[pos].read() for pos in shard})
            weight_map.update({entries[pos].key: name for pos in shard})
        if len(names) > 1:
            write_durable(os.path.join(tmp, INDEX), index_body(weight_map, sum(e.nbytes for e in entries)))
            names.append(INDEX)
        fsync_dir(tmp)
        _move_in(root, tmp, names)
    finally:
        remove(tmp)
    return [os.path.join(root, n) for n in names]


def write_shard(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file at ``path``, fsynced (TierIOError naming it when that fails)."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as exc:
        raise TierIOError(f"save_weights: writing {path} failed ({exc})", errno.EIO) from None
    fsync_file(path)


def _move_in(root: str, tmp: str, names: list[str]) -> None:
    """The written files from ``tmp`` into ``root``: one rename commits a single file, the index
    the shards; then the other layout's stale files go."""
    keep = set(names)
    if len(names) > 1:
        _unlink(os.path.join(root, INDEX))
        _unlink(os.path.join(root, SINGLE))
        fsync_dir(root)
    for name in names:
        with io_errors("renaming", os.path.join(tmp, name)):
            os.rename(os.path.join(tmp, name), os.path.join(root, name))
    fsync_dir(root)
    stale = [n for n in os.listdir(root) if n not in keep and (n == INDEX or SHARD.fullmatch(n))]
    for name in stale:
        _unlink(os.path.join(root, name))
    if stale:
        fsync_dir(root)


def _unlink(path: str) -> None:
    with io_errors("removing", path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _remove_leftovers(root: str) -> None:
    """What saves that crashed left in ``root`` (their hidden temporary directories)."""
    for name in os.listdir(root):
        if name.startswith(TMP_PREFIX):
            remove(os.path.join(root, name))
