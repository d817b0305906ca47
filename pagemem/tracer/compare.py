"""Whether a plan made from one trace still holds for another (e.g. after control flow changed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagemem.errors import ConfigError
from pagemem.tracer.records import MODEL_STATE_KINDS

if TYPE_CHECKING:
    from pagemem.tracer.tracedata import Trace


@dataclass(frozen=True)
class TraceComparison:
    """Result of ``planned.compare(observed)``."""

    same_access_order: bool
    """Equal fingerprints: same ops, same tensors accessed at each, same model-state shapes."""
    first_divergent_op: int | None
    """First op id where the two differ (``None`` when the order is the same)."""
    reason: str
    """Why the plan does not hold, in words (``""`` when it does)."""
    non_model_ratio: float
    """Largest ``observed / planned`` non-model bytes over the ops (1.0 when equal; only
    meaningful when the access order is the same, ``nan`` otherwise)."""
    holds: bool
    """Same access order and no op needs more than ``(1 + tolerance)`` times the planned
    non-model memory."""


def compare_traces(planned: "Trace", observed: "Trace", tolerance: float) -> TraceComparison:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ConfigError(f"tolerance: must be a finite number >= 0, got {tolerance!r}")
    if planned.fingerprint != observed.fingerprint:
        return TraceComparison(False, _divergence(planned, observed), _why(planned, observed), math.nan, False)
    ratio, worst = 1.0, None
    for a, b in zip(planned.ops, observed.ops):
        if b.non_model_bytes > a.non_model_bytes:
            r = b.non_model_bytes / a.non_model_bytes if a.non_model_bytes else math.inf
            if r > ratio:
                ratio, worst = r, a.op_id
    holds = ratio <= 1.0 + tolerance
    reason = "" if holds else (
        f"op {worst} ({planned.ops[worst].event} {planned.ops[worst].module!r}) needs "
        f"{observed.ops[worst].non_model_bytes} non-model bytes, planned "
        f"{planned.ops[worst].non_model_bytes}")
    return TraceComparison(True, None, reason, ratio, holds)


def _divergence(a: "Trace", b: "Trace") -> int:
    for k, (x, y) in enumerate(zip(a.op_signatures, b.op_signatures)):
        if x != y:
            return k
    return min(len(a.ops), len(b.ops))


def _why(a: "Trace", b: "Trace") -> str:
    def states(tr: "Trace") -> dict[str, tuple[str, tuple[int, ...]]]:
        return {t.name: (t.dtype, t.shape) for t in tr.tensors if t.kind in MODEL_STATE_KINDS}

    sa, sb = states(a), states(b)
    if sa != sb:
        diff = sorted(set(sa.items()) ^ set(sb.items()))[:3]
        return f"model states differ (e.g. {', '.join(n for n, _ in diff)})"
    k = _divergence(a, b)
    if k >= min(len(a.ops), len(b.ops)):
        return f"one trace stops after {k} ops, the other has {max(len(a.ops), len(b.ops))}"
    oa, ob = a.ops[k], b.ops[k]
    if (oa.event, oa.module, oa.phase) != (ob.event, ob.module, ob.phase):
        return (f"op {k} is {oa.event} {oa.module!r} in one trace and {ob.event} {ob.module!r} "
                "in the other")
    return f"op {k} ({oa.event} {oa.module!r}) accesses different tensors"
