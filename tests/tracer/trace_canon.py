"""Compare two traces structurally: what a trace on ``meta`` must share with the trace on cpu.

(A uniquely named module rather than ``conftest``, like tracer_helpers.py.)
"""

from __future__ import annotations

from typing import Any

from pagemem.tracer import Trace


def canonical(tr: Trace) -> dict[str, list[tuple[Any, ...]]]:
    """The trace without what may differ between devices: op durations, the device's name, and
    activation bytes (compared with a tolerance by :func:`differences`)."""
    names = [t.name for t in tr.tensors]
    return {
        "ops": [(o.op_id, o.event, o.module, o.phase) for o in tr.ops],
        "tensors": [(t.name, t.kind, t.dtype, t.shape, t.accesses, t.param_id, t.layer,
                     t.nbytes if t.is_model_state else None) for t in tr.tensors],
        "accesses": [(o.op_id, tuple(names[i] for i in tr.accessed_at(o.op_id))) for o in tr.ops],
        "layers": [(lay.name, tuple(names[i] for i in lay.tensor_ids), lay.first_id, lay.nbytes)
                   for lay in tr.layers],
    }


def _close(a: int, b: int, rel: float) -> bool:
    return abs(a - b) <= rel * max(a, b)


def differences(expected: Trace, got: Trace, rel: float = 0.02) -> list[str]:
    """Where ``got`` differs from ``expected``: the first differing entry of each part of
    :func:`canonical`, the total activation bytes and each op's non-model bytes (within ``rel``)."""
    out = []
    a, b = canonical(expected), canonical(got)
    for part in a:
        if a[part] != b[part]:
            pairs = list(zip(a[part], b[part]))
            k = next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs))
            x = a[part][k] if k < len(a[part]) else "<missing>"
            y = b[part][k] if k < len(b[part]) else "<missing>"
            out.append(f"{part}[{k}] ({len(a[part])} vs {len(b[part])} entries): expected {x}, got {y}")
    ea, ga = expected.bytes_by_kind()["activation"], got.bytes_by_kind()["activation"]
    if not _close(ea, ga, rel):
        out.append(f"activation bytes: expected {ea}, got {ga}")
    for x, y in zip(expected.ops, got.ops):
        if not _close(x.non_model_bytes, y.non_model_bytes, rel):
            out.append(f"op {x.op_id} non-model bytes: expected {x.non_model_bytes}, got {y.non_model_bytes}")
            break
    return out


def assert_same_trace(expected: Trace, got: Trace, rel: float = 0.02) -> None:
    diff = differences(expected, got, rel)
    assert not diff, "traces differ:\n  " + "\n  ".join(diff)
