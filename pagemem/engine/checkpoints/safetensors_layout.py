"""Weights as safetensors files in Hugging Face's layout: where they are and how they are named.

A model's weights are one ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors``
with ``model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard and whose
``metadata.total_size`` counts their bytes. Reading (``find_weights``) and writing
(``safetensors_save.py``) agree on these names here; every bad input raises a ``ConfigError``
naming the path.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from pagemem.errors import ConfigError

SINGLE = "model.safetensors"
"""The one file of a model whose weights are not sharded."""
INDEX = "model.safetensors.index.json"
"""The index of a sharded model: ``{"metadata": {"total_size": N}, "weight_map": {key: shard}}``."""
SHARD = re.compile(r"model-(\d{5,})-of-(\d{5,})\.safetensors")
"""A shard's name."""


def shard_name(k: int, n: int) -> str:
    """The name of shard ``k`` (from 1) of ``n``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files a path names: ``files`` (absolute paths, each once), and for a
    sharded layout the index's ``weight_map`` (key -> one of ``files``) and the index's path."""

    path: str
    files: tuple[str, ...]
    weight_map: dict[str, str] | None = None
    index: str | None = None


def find_weights(path: str | os.PathLike) -> WeightFiles:
    """The weights ``path`` names: a ``.safetensors`` file, an index JSON, or a directory holding
    ``model.safetensors`` (preferred, as Hugging Face prefers it) or ``model.safetensors.index.json``."""
    where = os.fspath(path)
    if not os.path.exists(where):
        raise ConfigError(f"values: {where} does not exist (a .safetensors file, or a directory with {SINGLE} "
                          f"or {INDEX})")
    if os.path.isdir(where):
        single, index = os.path.join(where, SINGLE), os.path.join(where, INDEX)
        if os.path.isfile(single):
            return WeightFiles(where, (os.path.abspath(single),))
        if os.path.isfile(index):
            return read_index(index)
        raise ConfigError(f"values: {where} holds neither {SINGLE} nor {INDEX} (safetensors weights in "
                          "Hugging Face's layout)")
    if where.endswith(".json"):
        return read_index(where)
    return WeightFiles(where, (os.path.abspath(where),))


def read_index(index: str) -> WeightFiles:
    """A sharded layout's index, checked: a JSON object whose ``weight_map`` maps each key to a
    shard file beside the index, every shard there."""
    try:
        with open(index, "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"values: {index}: not a readable JSON index ({exc})") from None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ConfigError(f"values: {index}: no \"weight_map\" object of tensor names to shard files")
    folder = os.path.dirname(os.path.abspath(index))
    out: dict[str, str] = {}
    for key, shard in weight_map.items():
        if not shard or os.path.basename(shard) != shard or shard in (".", ".."):
            raise ConfigError(f"values: {index}: {key!r} lies in {shard!r}, not a file name beside the index")
        out[key] = os.path.join(folder, shard)
    files = tuple(dict.fromkeys(out.values()))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(f"values: {index} names {len(missing)} shard(s) that are not there: "
                          + ", ".join(os.path.basename(f) for f in missing[:4]) + (", ..." if len(missing) > 4 else ""))
    return WeightFiles(index, files, out, index)


def index_body(weight_map: dict[str, str], total_size: int) -> bytes:
    """The index JSON of a sharded layout (keys in the order given)."""
    return (json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n").encode()


def split_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive entries (by their byte sizes) grouped into shards of at most ``max_shard_bytes``
    (an entry larger than that is a shard of its own); returns each shard's entry positions."""
    shards: list[list[int]] = []
    size = 0
    for pos, n in enumerate(sizes):
        if shards and size + n <= max_shard_bytes:
            shards[-1].append(pos)
            size += n
        else:
            shards.append([pos])
            size = n
    return shards
