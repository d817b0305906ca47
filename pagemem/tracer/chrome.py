"""Export a trace in the Chrome trace-event format (opens in Perfetto or chrome://tracing).

One track per phase with an ``X`` slice per op (laid end to end by duration; the slice's args
hold the op id, the non-model bytes and what it accessed), and counters for the non-model bytes
and the gradient and activation bytes alive by lifetime (first to last access).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagemem.tracer.tracedata import Trace

_TID = {"forward": 1, "backward": 2, "step": 3}


def chrome_events(tr: Trace) -> dict[str, Any]:
    model = tr.meta.get("model", "model")
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"pagemem trace: {model}"}},
    ]
    for phase, tid in _TID.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": phase}})
    # Bytes alive by lifetime: +nbytes at first access, -nbytes after the last.
    delta = {"grad": [0] * (len(tr.ops) + 1), "activation": [0] * (len(tr.ops) + 1)}
    for t in tr.tensors:
        if t.kind in delta and t.accesses:
            delta[t.kind][t.accesses[0]] += t.nbytes
            delta[t.kind][t.accesses[-1] + 1] -= t.nbytes
    live = dict.fromkeys(delta, 0)
    ts = 0.0
    for op in tr.ops:
        for kind in live:
            live[kind] += delta[kind][op.op_id]
        acc = tr.accessed_at(op.op_id)
        events.append({
            "name": f"{op.event} {op.module or '<model>'}", "cat": op.phase, "ph": "X", "pid": 1,
            "tid": _TID[op.phase], "ts": ts * 1e6, "dur": op.duration * 1e6,
            "args": {"op_id": op.op_id, "non_model_bytes": op.non_model_bytes,
                     "accessed": [tr.tensors[t].name for t in acc[:64]], "n_accessed": len(acc)},
        })
        events.append({"name": "memory (MiB)", "ph": "C", "pid": 1, "ts": ts * 1e6, "args": {
            "non_model": op.non_model_bytes / 2**20,
            "grads_alive": live["grad"] / 2**20,
            "activations_alive": live["activation"] / 2**20,
        }})
        ts += op.duration
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"fingerprint": tr.fingerprint, **{k: str(v) for k, v in tr.meta.items()}}}


def write_chrome(tr: Trace, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_events(tr), f, separators=(",", ":"))
