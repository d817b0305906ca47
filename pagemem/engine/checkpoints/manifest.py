"""A checkpoint's manifest: written with its own checksum, and every value validated on reading.

[Note: the manifest is checked]
``manifest.json`` is ``{"version": VERSION, "xxh3": <hex>, "manifest": {...}}``; the checksum is
over the body's canonical JSON (sorted keys, no spaces; Python's floats round-trip exactly), so a
flipped digit in a step count or a learning rate is refused, never loaded. A checksum guards
against damage, not against a writer that means it: every value is then checked for its type and
range (counters are non-negative integers, the loss scale a positive finite number or None,
hyperparameters as ``AdamW`` accepts them, shapes non-negative, dtypes known, every tensor's
bytes within its pages and its pages within its file), so whatever ``read`` returns can be used
without further checks. Any failure is a ``CorruptCheckpoint`` naming the file; a manifest of
another format version is refused (``InvalidRequest``) before its checksum is looked at.
"""

from __future__ import annotations

import json
import math
from typing import Any

import xxhash

from pagemem.engine.updates.adam import AdamW
from pagemem.errors import CorruptCheckpoint, InvalidRequest, PageMemError

VERSION = 2
"""The format version (1: no manifest checksum, not read any more)."""
KINDS = ("master", "exp_avg", "exp_avg_sq", "compute")
"""What a checkpoint holds per parameter: its states, and the compute copy (the only value a
frozen parameter has; the others' is written too, small beside the states)."""
STATES = KINDS[:3]
MOMENTS = ("exp_avg", "exp_avg_sq")
"""The states a sharded checkpoint holds in pieces, one per rank ([Note: sharded checkpoints])."""
COMPUTE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
PARAM_DTYPES = {f"torch.{n}" for n in COMPUTE_DTYPES} | {"torch.float64"}
BUFFER_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1}
MAX_STEP = 2 ** 62


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode(body: dict[str, Any]) -> bytes:
    """The manifest file's bytes for ``body``: its version, its checksum and itself."""
    digest = xxhash.xxh3_64_intdigest(_canonical(body))
    return json.dumps({"version": VERSION, "xxh3": f"{digest:016x}", "manifest": body}).encode()


def decode(raw: bytes, path: str) -> dict[str, Any]:
    """The body of the manifest file ``path`` whose bytes are ``raw``, checksum verified and
    every value validated (see the Note)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(path, f"not a JSON manifest ({exc})") from None
    if not isinstance(doc, dict) or "version" not in doc:
        raise CorruptCheckpoint(path, "not a manifest (no version)")
    version = doc["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpoint(path, f"version: not an integer: {version!r}")
    if version != VERSION:
        raise InvalidRequest(f"{path}: checkpoint format version {version}; this pagemem reads version {VERSION} "
                             f"only ({'an older' if version < VERSION else 'a newer'} pagemem wrote it)")
    body, digest = doc.get("manifest"), doc.get("xxh3")
    if not isinstance(body, dict) or not isinstance(digest, str):
        raise CorruptCheckpoint(path, "the manifest or its checksum is missing")
    actual = f"{xxhash.xxh3_64_intdigest(_canonical(body)):016x}"
    if actual != digest:
        raise CorruptCheckpoint(path, f"manifest checksum {actual}, expected {digest}")
    try:
        validate(body)
    except PageMemError as exc:
        raise CorruptCheckpoint(path, str(exc)) from None
    return body


class _Bad(PageMemError):
    """A value out of range (becomes a CorruptCheckpoint naming the file)."""


def _need(ok: bool, field: str, what: str, value: Any) -> None:
    if not ok:
        text = repr(value)
        raise _Bad(f"{field}: must be {what}, got {text[:80] + '...' if len(text) > 80 else text}")


def _int(value: Any, field: str, lo: int = 0, hi: int = MAX_STEP) -> int:
    _need(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi, field,
          f"an integer in [{lo}, {hi}]", value)
    return value


def _real(value: Any, field: str, positive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    _need(ok and (value > 0 if positive else value >= 0), field,
          "a positive finite number" if positive else "a finite number >= 0", value)
    return value


def _dict(value: Any, field: str, keys: tuple[str, ...]) -> dict[str, Any]:
    _need(isinstance(value, dict) and all(k in value for k in keys), field, f"an object with {', '.join(keys)}",
          value)
    return value


def _list(value: Any, field: str, n: int | None = None) -> list[Any]:
    _need(isinstance(value, list) and (n is None or len(value) == n), field,
          "a list" if n is None else f"a list of {n}", value)
    return value


def saved_loss_scale(config: dict[str, Any]) -> Any:
    """The loss scaling a saved config meant (its ``"default"`` resolved by its compute dtype, as
    ``EngineConfig.effective_loss_scale`` does)."""
    scale = config["loss_scale"]
    if scale == "default":
        return "dynamic" if config["compute_dtype"] == "float16" else None
    return scale


def saved_compute_dtype(config: dict[str, Any], param: dict[str, Any]) -> str:
    """The name of the dtype a saved parameter's compute copy was in ([Note: compute dtypes]):
    the saved config's, or the parameter's own where it asked for none."""
    return config["compute_dtype"] or param["dtype"].removeprefix("torch.")


def validate(m: dict[str, Any]) -> None:
    """Raise (a PageMemError) unless every value of the manifest body ``m`` is in range."""
    _dict(m, "manifest", ("page_bytes", "state", "config", "params", "tensors", "page_digests", "rng", "buffers"))
    pb = _int(m["page_bytes"], "page_bytes", 4096, 2 ** 40)
    _need(pb % 4096 == 0, "page_bytes", "a multiple of 4096", pb)
    config = _dict(m["config"], "config", ("store", "optimizer", "compute_dtype", "loss_scale"))
    _need(config["compute_dtype"] is None or config["compute_dtype"] in COMPUTE_DTYPES, "config.compute_dtype",
          "null, float32, float16 or bfloat16", config["compute_dtype"])
    scale = saved_loss_scale(config)
    if scale is not None and scale != "dynamic":
        _real(scale, "config.loss_scale", positive=True)
    params = _list(m["params"], "params")
    sizes = []
    for i, p in enumerate(params):
        _dict(p, f"params[{i}]", ("name", "shape", "dtype"))
        _need(isinstance(p["name"], str) and p["name"] != "", f"params[{i}].name", "a name", p["name"])
        shape = [_int(d, f"params[{i}].shape", 0, 2 ** 40) for d in _list(p["shape"], f"params[{i}].shape")]
        _need(p["dtype"] in PARAM_DTYPES, f"params[{i}].dtype", "a floating dtype", p["dtype"])
        sizes.append(math.prod(shape))
    _check_state(m["state"], len(params), scale)
    sharded = isinstance(m.get("ranks"), dict) and m["ranks"].get("layout") == "sharded"
    tensors = _dict(m["tensors"], "tensors", KINDS)
    digests = _dict(m["page_digests"], "page_digests", KINDS)
    for kind in KINDS:
        _list(tensors[kind], f"tensors.{kind}", len(params))
    for kind in KINDS:
        pages = len(_list(digests[kind], f"page_digests.{kind}"))
        for d in digests[kind]:
            _int(d, f"page_digests.{kind}", 0, 2 ** 64 - 1)
        for i, where in enumerate(tensors[kind]):
            itemsize = 4
            if kind == "compute":
                name = saved_compute_dtype(config, params[i])
                _need(name in COMPUTE_DTYPES, f"params[{i}].dtype", "float32, float16 or bfloat16 (the compute "
                      "copy's dtype where config.compute_dtype is null)", params[i]["dtype"])
                itemsize = COMPUTE_DTYPES[name]
            frozen = tensors["exp_avg"][i] is None
            if where is None:  # a frozen parameter has no moments, and a master only where it is the compute copy;
                # a compute copy its master sets may be left out (sharded parameters keep none at rest)
                _need(frozen and kind != "compute" or kind == "compute" and tensors["master"][i] is not None,
                      f"tensors.{kind}[{i}]", "where the tensor lies (a trainable parameter has every state)", where)
                continue
            _need(kind in ("compute", "master") or not frozen, f"tensors.{kind}[{i}]", "null (a frozen parameter)",
                  where)
            if sharded and (kind in MOMENTS or kind == "master" and "pieces" in where):
                _pieces(where, f"tensors.{kind}[{i}]", pb, pages, sizes[i] * itemsize)
            else:
                _extent(where, f"tensors.{kind}[{i}]", pb, pages, sizes[i] * itemsize)
    for name in ("rng", "buffers"):
        f = _dict(m[name], name, ("file", "xxh3", "nbytes"))
        _need(f["file"] == f"{name}.bin", f"{name}.file", f"{name}.bin", f["file"])
        _int(f["xxh3"], f"{name}.xxh3", 0, 2 ** 64 - 1)
        _int(f["nbytes"], f"{name}.nbytes", 0, 2 ** 48)
    _check_buffers(m["buffers"])
    if "ranks" in m:  # written by rank 0 of several ([Note: checkpoints over ranks])
        ranks = _dict(m["ranks"], "ranks", ("world_size", "layout", "rng"))
        n = _int(ranks["world_size"], "ranks.world_size", 2, 1 << 20)
        _need(ranks["layout"] in ("replicated", "sharded"), "ranks.layout", "'replicated' or 'sharded'", ranks["layout"])
        f = _dict(ranks["rng"], "ranks.rng", ("file", "xxh3", "nbytes"))
        _need(f["file"] == "rng-ranks.bin", "ranks.rng.file", "rng-ranks.bin", f["file"])
        _int(f["xxh3"], "ranks.rng.xxh3", 0, 2 ** 64 - 1)
        _need(_int(f["nbytes"], "ranks.rng.nbytes", 0, 2 ** 48) % n == 0, "ranks.rng.nbytes",
              "a multiple of ranks.world_size", f["nbytes"])


def _pieces(where: Any, field: str, pb: int, pages: int, nbytes: int) -> None:
    """A sharded moment's place ([Note: sharded checkpoints]): pieces, each an ``_extent`` with the
    element it starts at, that follow one another from element 0 to the end."""
    pieces = _list(_dict(where, field, ("pieces",))["pieces"], f"{field}.pieces")
    at = 0
    for n, piece in enumerate(pieces):
        name = f"{field}.pieces[{n}]"
        _dict(piece, name, ("pages", "offset", "nbytes", "start"))
        _need(piece["start"] == at // 4, f"{name}.start", f"{at // 4} (where the previous piece ends)", piece["start"])
        size = _int(piece["nbytes"], f"{name}.nbytes", 4, nbytes - at)
        _need(size % 4 == 0, f"{name}.nbytes", "a multiple of 4", size)
        _extent(piece, name, pb, pages, size)
        at += size
    _need(at == nbytes, f"{field}.pieces", f"pieces of {nbytes} bytes in all", at)


def _extent(where: Any, field: str, pb: int, pages: int, nbytes: int) -> None:
    """A tensor's place: ``nbytes`` from ``offset`` of the first of ``pages`` (positions in its
    file, of ``pages`` pages), every page needed and no more."""
    _dict(where, field, ("pages", "offset", "nbytes"))
    _need(where["nbytes"] == nbytes, f"{field}.nbytes", f"{nbytes} (the shape's bytes)", where["nbytes"])
    offset = _int(where["offset"], f"{field}.offset", 0, pb - 1)
    positions = [_int(p, f"{field}.pages", 0, pages - 1) for p in _list(where["pages"], f"{field}.pages")]
    need = -(-(offset + nbytes) // pb) if nbytes else len(positions)
    _need(len(positions) == need and len(positions) <= 1 + (offset + nbytes) // pb, f"{field}.pages",
          f"{need} page positions", positions)


def _check_state(state: Any, n: int, scale: Any) -> None:
    s = _dict(state, "state", ("global_step", "steps", "skipped_steps", "loss_scale", "good_steps",
                               "param_groups", "group_of"))
    _int(s["global_step"], "state.global_step")
    for i, k in enumerate(_list(s["steps"], "state.steps", n)):  # may exceed global_step: a loaded optimizer state
        _int(k, f"state.steps[{i}]")
    _int(s["skipped_steps"], "state.skipped_steps")
    _int(s["good_steps"], "state.good_steps", 0, 1999)
    if scale is None:
        _need(s["loss_scale"] is None, "state.loss_scale", "null (no loss scaling configured)", s["loss_scale"])
    else:
        _real(s["loss_scale"], "state.loss_scale", positive=True)
        _need(scale == "dynamic" or s["loss_scale"] == scale, "state.loss_scale", f"the static scale {scale}",
              s["loss_scale"])
    groups = _list(s["param_groups"], "state.param_groups")
    _need(len(groups) >= 1, "state.param_groups", "at least one group", groups)
    for g, group in enumerate(groups):
        field = f"state.param_groups[{g}]"
        _dict(group, field, ("lr", "betas", "eps", "weight_decay"))
        try:
            AdamW.from_group(group)
        except (PageMemError, TypeError) as exc:
            raise _Bad(f"{field}: {exc}") from None
        for key, v in group.items():  # what schedulers and torch add (initial_lr, foreach, ...)
            if key != "betas":
                _need(v is None or isinstance(v, (bool, str)) or (isinstance(v, (int, float)) and math.isfinite(v)),
                      f"{field}.{key}", "a finite number, a flag, a string or null", v)
    for i, g in enumerate(_list(s["group_of"], "state.group_of", n)):
        if g is not None:
            _int(g, f"state.group_of[{i}]", 0, len(groups) - 1)


def _check_buffers(buffers: dict[str, Any]) -> None:
    total = buffers["nbytes"]
    for i, e in enumerate(_list(buffers["entries"] if "entries" in buffers else None, "buffers.entries")):
        field = f"buffers.entries[{i}]"
        _dict(e, field, ("name", "dtype", "shape", "offset", "nbytes"))
        _need(isinstance(e["name"], str) and e["name"] != "", f"{field}.name", "a name", e["name"])
        _need(e["dtype"] in BUFFER_DTYPES, f"{field}.dtype", "a known dtype", e["dtype"])
        shape = [_int(d, f"{field}.shape", 0, 2 ** 40) for d in _list(e["shape"], f"{field}.shape")]
        _need(e["nbytes"] == math.prod(shape) * BUFFER_DTYPES[e["dtype"]], f"{field}.nbytes", "the shape's bytes",
              e["nbytes"])
        _int(e["offset"], f"{field}.offset", 0, total - e["nbytes"])
