"""The :class:`Trace`: what one training iteration did to every tensor, in logical time."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

from pagemem.tracer.errors import TraceError
from pagemem.tracer.records import EVENTS, KINDS, MODEL_STATE_KINDS, PHASES, Layer, OpRecord, TensorRecord

if TYPE_CHECKING:
    from pagemem.tracer.compare import TraceComparison


@dataclass(frozen=True)
class Trace:
    """Tensors, operations and layers of one traced (or synthesised) training iteration.

    ``ops[k].op_id == k`` and ``tensors[t].tensor_id == t``; every op id in a record refers to
    ``ops``. Built by :func:`pagemem.tracer.trace` or :func:`pagemem.tracer.synthetic_transformer`,
    or read back with :meth:`load`. Validated at construction (a bad file raises
    :class:`TraceError`).
    """

    tensors: tuple[TensorRecord, ...]
    ops: tuple[OpRecord, ...]
    layers: tuple[Layer, ...]
    meta: Mapping[str, Any]
    """How the trace was made: ``source`` (``"trace"``/``"synthetic"``), ``model``, ``device``,
    ``optimizer`` (``"traced <class>"``, ``"modelled adam"``, ``"none"``), ``non_model_memory``
    (``"saved_tensors"``, ``"cuda_allocator"``, ``"synthetic"``), and the configuration."""

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Trace(source={self.meta.get('source')!r}, model={self.meta.get('model')!r}, "
                f"ops={len(self.ops)}, tensors={len(self.tensors)}, layers={len(self.layers)}, "
                f"fingerprint={self.fingerprint[:16]!r})")

    def __post_init__(self) -> None:
        _validate(self)

    # ---- lookups ---------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorRecord:
        """The record named ``name`` (raises ``KeyError`` naming it if absent)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this trace") from None

    @cached_property
    def _accessed(self) -> tuple[tuple[int, ...], ...]:
        per_op: list[list[int]] = [[] for _ in self.ops]
        for t in self.tensors:
            for op in t.accesses:
                per_op[op].append(t.tensor_id)
        return tuple(tuple(x) for x in per_op)

    def accessed_at(self, op_id: int) -> tuple[int, ...]:
        """``tensor_id`` of every tensor accessed at op ``op_id``, in increasing order."""
        return self._accessed[op_id]

    @cached_property
    def _by_layer(self) -> tuple[tuple[TensorRecord, ...], ...]:
        groups: list[list[TensorRecord]] = [[] for _ in self.layers]
        for t in self.tensors:
            if t.layer is not None:
                groups[t.layer].append(t)
        return tuple(tuple(g) for g in groups)

    def layer_tensors(self, index: int) -> tuple[TensorRecord, ...]:
        """Parameters, gradients and optimizer states of layer ``index`` (what moves with it)."""
        return self._by_layer[index]

    def of_kind(self, kind: str) -> tuple[TensorRecord, ...]:
        """Records of one kind (``"param"``, ``"grad"``, ``"activation"``, ``"optimizer_state"``)."""
        if kind not in KINDS:
            raise KeyError(f"unknown kind {kind!r}; one of {KINDS}")
        return tuple(t for t in self.tensors if t.kind == kind)

    def bytes_by_kind(self) -> dict[str, int]:
        """Total bytes per kind (each activation counted once, whatever its lifetime)."""
        out = dict.fromkeys(KINDS, 0)
        for t in self.tensors:
            out[t.kind] += t.nbytes
        return out

    @property
    def peak_non_model_bytes(self) -> int:
        """Largest ``non_model_bytes`` of any op."""
        return max((op.non_model_bytes for op in self.ops), default=0)

    def with_non_model_peak_reserved(self) -> "Trace":
        """This trace with every op's ``non_model_bytes`` at the peak: what a plan needs when
        non-model memory comes from a pool of its own (the caching allocator) beside a page
        arena of fixed size, so that neither can lend the other what it does not use at an op."""
        peak = self.peak_non_model_bytes
        return dataclasses.replace(self, ops=tuple(dataclasses.replace(op, non_model_bytes=peak) for op in self.ops))

    @property
    def iteration_seconds(self) -> float:
        """Sum of op durations."""
        return math.fsum(op.duration for op in self.ops)

    # ---- identity of the access order ------------------------------------------------------
    @cached_property
    def op_signatures(self) -> tuple[str, ...]:
        """Per op: its event, module, phase and the names of the tensors accessed there."""
        names = [f"{t.kind}:{t.name}" for t in self.tensors]
        return tuple(
            f"{op.event}|{op.module}|{op.phase}|" + ",".join(sorted(names[t] for t in acc))
            for op, acc in zip(self.ops, self._accessed)
        )

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the access order: the op sequence, which tensors each op accesses, and the
        name, dtype and shape of every parameter, gradient and optimizer state. Equal for two
        traces with the same access order; durations and memory sizes of activations (which
        follow the batch) are not part of it, :meth:`compare` checks those."""
        h = hashlib.sha256(b"pagemem-trace-fingerprint/1\n")
        for t in self.tensors:
            if t.kind in MODEL_STATE_KINDS:
                h.update(f"{t.kind}:{t.name}:{t.dtype}:{list(t.shape)}\n".encode())
        for sig in self.op_signatures:
            h.update(sig.encode())
            h.update(b"\n")
        return h.hexdigest()[:32]

    def compare(self, other: "Trace", tolerance: float = 0.05) -> "TraceComparison":
        """Does a plan made from this trace still hold for ``other``? See
        :class:`pagemem.tracer.compare.TraceComparison`."""
        from pagemem.tracer.compare import compare_traces

        return compare_traces(self, other, tolerance)

    # ---- files -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the versioned JSON form (``"format": "pagemem-trace"``, ``"version": 1``)."""
        from pagemem.tracer.jsonio import save

        save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        """Read a file written by :meth:`save`; an unknown format or version raises TraceError."""
        from pagemem.tracer.jsonio import load

        return load(path)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form :meth:`save` writes."""
        from pagemem.tracer.jsonio import to_dict

        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Trace":
        from pagemem.tracer.jsonio import from_dict

        return from_dict(data)

    def to_chrome(self, path: str | os.PathLike) -> None:
        """Write a Chrome trace-event JSON file (open it in https://ui.perfetto.dev)."""
        from pagemem.tracer.chrome import write_chrome

        write_chrome(self, path)

    def summary(self) -> str:
        """A short table: bytes per kind, ops per phase, layers, peak non-model memory."""
        from pagemem.tracer.summary import summary

        return summary(self)


def _fail(msg: str) -> None:
    raise TraceError(f"invalid trace: {msg}")


def _validate(tr: Trace) -> None:
    if not isinstance(tr.tensors, tuple) or not isinstance(tr.ops, tuple) or not isinstance(tr.layers, tuple):
        _fail("tensors, ops and layers must be tuples")
    n_ops = len(tr.ops)
    for k, op in enumerate(tr.ops):
        if op.op_id != k:
            _fail(f"ops[{k}] has op_id {op.op_id}")
        if op.event not in EVENTS or op.phase not in PHASES:
            _fail(f"op {k}: unknown event {op.event!r} or phase {op.phase!r}")
        if not (math.isfinite(op.duration) and op.duration >= 0):
            _fail(f"op {k}: duration {op.duration!r} is not a finite number >= 0")
        if op.non_model_bytes < 0:
            _fail(f"op {k}: negative non_model_bytes")
    params = set()
    for i, t in enumerate(tr.tensors):
        if t.tensor_id != i:
            _fail(f"tensors[{i}] has tensor_id {t.tensor_id}")
        if t.kind not in KINDS:
            _fail(f"tensor {i}: unknown kind {t.kind!r}")
        if t.nbytes < 0 or any(d < 0 for d in t.shape):
            _fail(f"tensor {i} ({t.name}): negative size")
        prev = -1
        for a in t.accesses:
            if not (isinstance(a, int) and prev < a < n_ops):
                _fail(f"tensor {i} ({t.name}): accesses must increase within [0, {n_ops}), got {t.accesses[:8]}...")
            prev = a
        if t.kind == "param":
            params.add(i)
        elif t.kind in MODEL_STATE_KINDS:
            if t.param_id is None or t.param_id not in params:
                _fail(f"tensor {i} ({t.name}): param_id {t.param_id} is not a parameter listed before it")
        if t.kind in MODEL_STATE_KINDS and (t.layer is None or not 0 <= t.layer < len(tr.layers)):
            _fail(f"tensor {i} ({t.name}): layer {t.layer} out of range")
    if len(tr._by_name) != len(tr.tensors):
        _fail("tensor names are not unique")
    owner: dict[int, int] = {}
    for li, layer in enumerate(tr.layers):
        if layer.index != li:
            _fail(f"layers[{li}] has index {layer.index}")
        for t in layer.tensor_ids:
            if t not in params:
                _fail(f"layer {layer.name!r} lists tensor {t}, which is not a parameter")
            if t in owner:
                _fail(f"parameter {t} is in layers {owner[t]} and {li}")
            owner[t] = li
            if tr.tensors[t].layer != li:
                _fail(f"parameter {t} says layer {tr.tensors[t].layer}, layer {li} lists it")
    if len(owner) != len(params):
        _fail("some parameters belong to no layer")
