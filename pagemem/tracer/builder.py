"""Turn a :class:`~pagemem.tracer.recorder.Recorder` plus tensor metadata into a :class:`Trace`.

Shared by the live tracer and the synthetic builder, so both number tensors the same way:
parameters first (registration order), then their gradients, then optimizer states (per
parameter, in the optimizer's key order), then activations (in the order they were saved).

``cpu_time`` / ``gpu_time`` of a tensor are those of the op producing it: for a gradient or an
activation the op of its first access (the backward or forward compute that writes it); for a
parameter or an optimizer state the optimizer ``step`` that updates it, pro-rated by the
parameter's share of the elements that step updates (``None`` when there is no measured step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from pagemem.tracer.layers import assign_layers
from pagemem.tracer.recorder import Recorder
from pagemem.tracer.records import Layer, OpRecord, TensorRecord
from pagemem.tracer.tracedata import Trace


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    requires_grad: bool


@dataclass
class StateSpec:
    param: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    accesses: list[int]


def build_trace(rec: Recorder, params: Sequence[ParamSpec], states: Sequence[StateSpec],
                candidates: Sequence[tuple[str, Sequence[int]]], meta: dict[str, Any],
                durations: Sequence[float], cpu_times: Sequence[float | None],
                gpu_times: Sequence[float | None]) -> Trace:
    """Assemble the trace. ``durations``/``cpu_times``/``gpu_times`` are per op."""
    n_ops = rec.n_ops
    ops = tuple(
        OpRecord(op, rec.op_event[op], rec.op_module[op], rec.op_phase[op], float(durations[op]),
                 int(rec.op_non_model[op]), cpu_times[op], gpu_times[op])
        for op in range(n_ops)
    )

    module_start: dict[str, int] = {}
    for op in range(n_ops):
        if rec.op_event[op] == "forward_pre":
            module_start.setdefault(rec.op_module[op], op)
    groups = assign_layers(candidates, len(params), module_start)
    first = [acc[0] if acc else None for acc in rec.param_acc]
    keyed = []
    for rank, (name, idx) in enumerate(groups):
        starts = [first[i] for i in idx if first[i] is not None]
        keyed.append(((min(starts) if starts else math.inf, rank), name, idx))
    keyed.sort(key=lambda k: k[0])
    layer_of = [0] * len(params)
    layers = []
    for li, (_, name, idx) in enumerate(keyed):
        for i in idx:
            layer_of[i] = li
        starts = [first[i] for i in idx if first[i] is not None]
        layers.append(Layer(li, name, tuple(idx), min(starts) if starts else None,
                            sum(params[i].nbytes for i in idx)))

    # Share of each measured step op that produced parameter i (pro-rated by elements).
    step_share: dict[int, tuple[int, float]] = {}
    step_elems: dict[int, int] = {}
    for i, p in enumerate(params):
        steps = [op for op in rec.param_acc[i] if rec.op_event[op] == "step"]
        if steps:
            step_elems[steps[-1]] = step_elems.get(steps[-1], 0) + math.prod(p.shape)
            step_share[i] = (steps[-1], math.prod(p.shape))

    def produced_by_step(i: int) -> tuple[float | None, float | None]:
        if i not in step_share:
            return None, None
        op, elems = step_share[i]
        frac = elems / step_elems[op] if step_elems[op] else 0.0
        c, g = cpu_times[op], gpu_times[op]
        return (None if c is None else c * frac), (None if g is None else g * frac)

    def produced_at(acc: Sequence[int]) -> tuple[float | None, float | None]:
        return (cpu_times[acc[0]], gpu_times[acc[0]]) if acc else (None, None)

    tensors: list[TensorRecord] = []
    for i, p in enumerate(params):
        c, g = produced_by_step(i)
        tensors.append(TensorRecord(i, p.name, "param", p.dtype, p.shape, p.nbytes,
                                    tuple(rec.param_acc[i]), c, g, None, layer_of[i]))
    for i, p in enumerate(params):
        acc = rec.grad_acc[i]
        if acc is None:
            continue
        c, g = produced_at(acc)
        tensors.append(TensorRecord(len(tensors), f"{p.name}.grad", "grad", p.dtype, p.shape,
                                    p.nbytes, tuple(acc), c, g, i, layer_of[i]))
    for s in states:
        c, g = produced_by_step(s.param)
        tensors.append(TensorRecord(len(tensors), f"{params[s.param].name}.{s.key}",
                                    "optimizer_state", s.dtype, s.shape, s.nbytes,
                                    tuple(sorted(set(s.accesses))), c, g, s.param,
                                    layer_of[s.param]))
    for a in rec.acts:
        c, g = produced_at(a.accesses)
        tensors.append(TensorRecord(len(tensors), a.name, "activation", a.dtype, a.shape,
                                    a.nbytes, tuple(a.accesses), c, g))
    return Trace(tuple(tensors), ops, tuple(layers), meta)
