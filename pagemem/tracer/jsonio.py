"""The versioned JSON file of a trace.

Layout (version 1)::

    {"format": "pagemem-trace", "version": 1, "meta": {...},
     "tensors": {"columns": [...], "rows": [[...], ...]},
     "ops": {"columns": [...], "rows": [...]},
     "layers": {"columns": [...], "rows": [...]}}

Columnar rows keep a 100-layer trace small; ``first_id``/``end_id`` are not stored (they are the
ends of ``accesses``). Floats are written with ``repr`` precision, so a round trip is exact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from pagemem.tracer.errors import TraceError
from pagemem.tracer.records import Layer, OpRecord, TensorRecord
from pagemem.tracer.tracedata import Trace

FORMAT = "pagemem-trace"
VERSION = 1
TENSOR_COLUMNS = ("tensor_id", "name", "kind", "dtype", "shape", "nbytes", "accesses",
                  "cpu_time", "gpu_time", "param_id", "layer")
OP_COLUMNS = ("op_id", "event", "module", "phase", "duration", "non_model_bytes", "cpu_time", "gpu_time")
LAYER_COLUMNS = ("index", "name", "tensor_ids", "first_id", "nbytes")


def to_dict(tr: Trace) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": dict(tr.meta),
        "tensors": {"columns": list(TENSOR_COLUMNS), "rows": [
            [t.tensor_id, t.name, t.kind, t.dtype, list(t.shape), t.nbytes, list(t.accesses),
             t.cpu_time, t.gpu_time, t.param_id, t.layer] for t in tr.tensors]},
        "ops": {"columns": list(OP_COLUMNS), "rows": [
            [o.op_id, o.event, o.module, o.phase, o.duration, o.non_model_bytes, o.cpu_time,
             o.gpu_time] for o in tr.ops]},
        "layers": {"columns": list(LAYER_COLUMNS), "rows": [
            [lay.index, lay.name, list(lay.tensor_ids), lay.first_id, lay.nbytes] for lay in tr.layers]},
    }


def from_dict(data: Mapping[str, Any]) -> Trace:
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise TraceError(f"not a pagemem trace: expected \"format\": {FORMAT!r}")
    version = data.get("version")
    if version != VERSION:
        raise TraceError(f"unsupported pagemem trace version {version!r}; this pagemem reads version {VERSION}")
    try:
        tensors = tuple(
            TensorRecord(int(r[0]), str(r[1]), r[2], str(r[3]), tuple(int(d) for d in r[4]), int(r[5]),
                         tuple(int(a) for a in r[6]), _opt_float(r[7]), _opt_float(r[8]),
                         _opt_int(r[9]), _opt_int(r[10]))
            for r in _rows(data, "tensors", TENSOR_COLUMNS))
        ops = tuple(
            OpRecord(int(r[0]), r[1], str(r[2]), r[3], float(r[4]), int(r[5]), _opt_float(r[6]),
                     _opt_float(r[7]))
            for r in _rows(data, "ops", OP_COLUMNS))
        layers = tuple(
            Layer(int(r[0]), str(r[1]), tuple(int(t) for t in r[2]), _opt_int(r[3]), int(r[4]))
            for r in _rows(data, "layers", LAYER_COLUMNS))
        meta = data["meta"]
        if not isinstance(meta, dict):
            raise TypeError("meta is not an object")
    except TraceError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise TraceError(f"malformed pagemem trace: {e}") from None
    return Trace(tensors, ops, layers, meta)


def _rows(data: Mapping[str, Any], section: str, columns: tuple[str, ...]) -> list[list[Any]]:
    block = data.get(section)
    if not isinstance(block, Mapping) or tuple(block.get("columns", ())) != columns:
        raise TraceError(f"malformed pagemem trace: section {section!r} must have columns {list(columns)}")
    rows = block.get("rows")
    if not isinstance(rows, list) or any(not isinstance(r, list) or len(r) != len(columns) for r in rows):
        raise TraceError(f"malformed pagemem trace: section {section!r} rows must be lists of {len(columns)}")
    return rows


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def save(tr: Trace, path: str | os.PathLike) -> None:
    text = json.dumps(to_dict(tr), separators=(",", ":"), allow_nan=False)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> Trace:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{os.fspath(path)}: not a JSON file ({e})") from None
    return from_dict(data)
