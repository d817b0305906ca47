"""A short human-readable table of a trace."""

from __future__ import annotations

from pagemem.tracer.records import KINDS, PHASES
from pagemem.tracer.tracedata import Trace
from pagemem.units import format_bytes


def summary(tr: Trace) -> str:
    lines = [f"trace of {tr.meta.get('model', '?')} ({tr.meta.get('source', '?')}), "
             f"fingerprint {tr.fingerprint[:16]}"]
    lines.append(f"{'kind':<16}{'tensors':>9}{'bytes':>14}")
    sizes = tr.bytes_by_kind()
    for kind in KINDS:
        n = sum(1 for t in tr.tensors if t.kind == kind)
        lines.append(f"{kind:<16}{n:>9}{format_bytes(sizes[kind]):>14}")
    lines.append(f"{'phase':<16}{'ops':>9}{'seconds':>14}")
    for phase in PHASES:
        ops = [o for o in tr.ops if o.phase == phase]
        lines.append(f"{phase:<16}{len(ops):>9}{sum(o.duration for o in ops):>14.6f}")
    lines.append(f"layers: {len(tr.layers)}; peak non-model memory: {format_bytes(tr.peak_non_model_bytes)} "
                 f"({tr.meta.get('non_model_memory', '?')}); optimizer: {tr.meta.get('optimizer', '?')}")
    return "\n".join(lines)
