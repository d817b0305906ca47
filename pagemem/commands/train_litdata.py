"""LitGPT's pretraining data: a directory litdata's ``optimize`` wrote with ``TokensLoader``,
read by memory map without litdata.

[Note: litdata's token chunks] The directory holds ``index.json`` and its chunk files.
``index.json`` is ``{"chunks": [...], "config": {...}}``; each chunk is ``{"filename",
"chunk_size" (items, here documents), "dim" (tokens), "chunk_bytes"}``; the config's
``data_format`` is ``["no_header_tensor:K"]`` (one 1-D tensor per item, ``K`` indexing litdata's
table of torch dtypes: 11 uint8, 12 int8, 13/14 int16, 15/16 int32, 17/18 int64), and
``compression`` and ``encryption`` are unset (a compressed chunk cannot be mapped). A chunk file
is a uint32 item count, ``chunk_size + 1`` uint32 byte offsets (absolute: the first is the header's
size, the last the file's), then the items' tokens end to end, ``dim`` of them. The stream is the
chunks' tokens in the index's order; LitGPT's layout puts ``train/`` and ``val/`` directories
(each such a directory) under one, and ``val/`` is then the validation part. Everything the
index says is checked against the files before a step runs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from pagemem.errors import ConfigError

INDEX = "index.json"
DTYPES = {11: np.uint8, 12: np.int8, 13: np.int16, 14: np.int16, 15: np.int32, 16: np.int32, 17: np.int64,
          18: np.int64}
"""litdata's dtype indices (its ``_TORCH_DTYPES_MAPPING``) that hold token ids."""


def is_litdata(path: str) -> bool:
    """Whether ``path`` is litdata's layout (an ``index.json``, or ``train/index.json``)."""
    return os.path.isfile(os.path.join(path, INDEX)) or os.path.isfile(os.path.join(path, "train", INDEX))


def litdata_streams(path: str) -> tuple[Any, Any | None]:
    """The training tokens and, where ``path`` has ``val/``, the validation tokens."""
    if not os.path.isdir(path):
        raise ConfigError(f"data.path: {path} is not a directory (litdata's layout: index.json and chunk files)")
    if os.path.isfile(os.path.join(path, INDEX)):
        return read_stream(path), None
    if not os.path.isfile(os.path.join(path, "train", INDEX)):
        raise ConfigError(f"data.path: {path} has no index.json (litdata's layout: index.json and chunk-*.bin files, "
                          "or train/ and val/ directories holding them)")
    val = os.path.join(path, "val")
    return read_stream(os.path.join(path, "train")), read_stream(val) if os.path.isfile(os.path.join(val, INDEX)) else None


def read_stream(directory: str) -> "TokenChain":
    """One litdata directory's tokens, every chunk checked and mapped (see the Note)."""
    index_path = os.path.join(directory, INDEX)
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"data.path: cannot read {index_path} ({exc}); write the data again") from None
    if not isinstance(index, dict) or not isinstance(index.get("chunks"), list) or not isinstance(
            index.get("config"), dict):
        raise ConfigError(f"data.path: {index_path} is not a litdata index (no chunks and config)")
    dtype = _dtype(index["config"], index_path)
    parts = [_chunk(directory, c, dtype, index_path) for c in index["chunks"]]
    parts = [p for p in parts if len(p)]
    if not parts:
        raise ConfigError(f"data.path: {index_path} lists no tokens")
    return TokenChain(parts)


def _dtype(config: dict[str, Any], where: str) -> Any:
    if config.get("compression"):
        raise ConfigError(f"data.path: {where}'s chunks are compressed ({config['compression']}), which cannot be "
                          "read by memory map; optimize them again without compression")
    if config.get("encryption"):
        raise ConfigError(f"data.path: {where}'s chunks are encrypted; give them decrypted")
    fmt = config.get("data_format")
    kind, _, k = (fmt[0] if isinstance(fmt, list) and len(fmt) == 1 and isinstance(fmt[0], str) else "").partition(":")
    if kind != "no_header_tensor" or not k.isdigit() or int(k) not in DTYPES:
        raise ConfigError(f"data.path: {where} holds items of {fmt!r}, not token ids written with TokensLoader "
                          "(data_format no_header_tensor of an integer dtype)")
    return np.dtype(DTYPES[int(k)])


def _chunk(directory: str, chunk: Any, dtype: Any, where: str) -> Any:
    ok = isinstance(chunk, dict) and isinstance(chunk.get("filename"), str) and all(
        isinstance(chunk.get(k), int) and not isinstance(chunk.get(k), bool) and chunk[k] >= 0
        for k in ("chunk_size", "dim"))
    name = chunk.get("filename") if isinstance(chunk, dict) else None
    if not ok or os.path.basename(name) != name or name in (".", ".."):
        raise ConfigError(f"data.path: {where} has a chunk entry litdata's TokensLoader cannot read: {chunk!r}")
    path = os.path.join(directory, name)
    header = (chunk["chunk_size"] + 2) * 4
    want = header + chunk["dim"] * dtype.itemsize
    try:
        size = os.path.getsize(path)
        if size < want:
            raise ConfigError(f"data.path: {path} is {size} bytes, shorter than the {want} its index says (a "
                              "truncated chunk); write the data again")
        with open(path, "rb") as f:
            head = f.read(header)
    except OSError as exc:
        raise ConfigError(f"data.path: cannot read {path}, a chunk {where} lists ({exc.strerror})") from None
    words = np.frombuffer(head[:len(head) // 4 * 4], dtype="<u4")
    if len(words) < 2 or words[0] != chunk["chunk_size"] or words[1] != header or words[-1] != want:
        raise ConfigError(f"data.path: {path}'s header does not match its index ({chunk['chunk_size']} items, "
                          f"{chunk['dim']} tokens): not the chunk the index describes")
    if chunk["dim"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=header, shape=(chunk["dim"],))


class TokenChain:
    """Token arrays read as one stream; a slice is a view of it, ``numpy.asarray`` reads it."""

    def __init__(self, parts: list[Any], start: int = 0, stop: int | None = None,
                 ends: Any | None = None) -> None:
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts]) if ends is None else ends
        self.start = start
        self.stop = int(self.ends[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, s: slice) -> "TokenChain":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("TokenChain takes contiguous slices only")
        a, b, _ = s.indices(len(self))
        return TokenChain(self.parts, self.start + a, self.start + max(a, b), self.ends)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = []
        first = int(np.searchsorted(self.ends, self.start, side="right"))
        at = self.start
        for i in range(first, len(self.parts)):
            if at >= self.stop:
                break
            begin = int(self.ends[i - 1]) if i else 0
            out.append(np.asarray(self.parts[i][at - begin:min(self.stop, int(self.ends[i])) - begin]))
            at = int(self.ends[i])
        joined = np.concatenate(out) if out else np.zeros(0, dtype=self.parts[0].dtype)
        return joined.astype(dtype) if dtype is not None else joined
