"""The records a :class:`~pagemem.tracer.Trace` is made of: tensors, operations and layers.

Logical time: operations are numbered ``0 .. len(trace.ops) - 1`` in the order the tracer saw
them, and every id a record holds (``accesses``, ``first_id``, ``end_id``, ``Layer.first_id``)
is an op id in that one space. "Tensor T is accessed at op k" means T must be resident while op k
runs; op k runs from the moment the tracer saw it until the next op (see :class:`OpRecord`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["param", "grad", "activation", "optimizer_state"]
Phase = Literal["forward", "backward", "step"]
Event = Literal["forward_pre", "forward_post", "backward_pre", "backward_post", "grad_ready", "step"]

KINDS: tuple[str, ...] = ("param", "grad", "activation", "optimizer_state")
MODEL_STATE_KINDS: frozenset[str] = frozenset({"param", "grad", "optimizer_state"})
PHASES: tuple[str, ...] = ("forward", "backward", "step")
EVENTS: tuple[str, ...] = ("forward_pre", "forward_post", "backward_pre", "backward_post", "grad_ready", "step")


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor's lifetime within the traced iteration.

    ``accesses`` lists, in increasing order and without repeats, every op at which the tensor is
    read or written; ``first_id``/``end_id`` are its first and last entries (``None`` for a tensor
    the iteration never touched, such as the gradient of an unused parameter).
    """

    tensor_id: int
    """Index of this record in ``Trace.tensors``."""
    name: str
    """Parameter name (``blocks.0.attn.qkv.weight``); ``<param>.grad``; ``<param>.<state key>``
    for optimizer states; ``<module>@<op>.<k>`` for the k-th activation first saved at op ``op``."""
    kind: Kind
    dtype: str
    """``torch`` dtype name without the ``torch.`` prefix, e.g. ``"float16"``."""
    shape: tuple[int, ...]
    nbytes: int
    """Bytes the tensor occupies. For an activation, the bytes of the storage it keeps alive,
    which exceed ``prod(shape) * itemsize`` when autograd saved a view (``q``, ``k``, ``v`` of a
    fused QKV output are one activation holding all three)."""
    accesses: tuple[int, ...]
    cpu_time: float | None
    """Host seconds of the operation producing the tensor, ``None`` when not measured."""
    gpu_time: float | None
    """Device seconds (CUDA events) of that operation; ``None`` without CUDA."""
    param_id: int | None = None
    """For a gradient or optimizer state: ``tensor_id`` of its parameter."""
    layer: int | None = None
    """For a parameter, gradient or optimizer state: index into ``Trace.layers``."""

    @property
    def first_id(self) -> int | None:
        """Op id of the first access, or ``None`` if never accessed."""
        return self.accesses[0] if self.accesses else None

    @property
    def end_id(self) -> int | None:
        """Op id of the last access, or ``None`` if never accessed."""
        return self.accesses[-1] if self.accesses else None

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return getattr(torch, self.dtype)

    @property
    def is_model_state(self) -> bool:
        """True for parameters, gradients and optimizer states (PatrickStar's "model data")."""
        return self.kind in MODEL_STATE_KINDS


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One point where the tracer saw the iteration, and the work that ran until the next one.

    ``duration`` is the time from this op to the next (the module's compute for a
    ``forward_pre``; the glue code after it for a ``forward_post``), so the durations add up to
    the iteration. It is the measured GPU time when CUDA events were recorded, else the measured
    host time, else (synthetic traces, a modelled optimizer step) an estimate.
    """

    op_id: int
    event: Event
    module: str
    """Module path (``""`` is the root module); the parameter name for ``grad_ready``;
    ``"optimizer"`` for ``step``."""
    phase: Phase
    """``forward``; ``backward`` (including forward recomputation under activation
    checkpointing, whose ``forward_pre``/``forward_post`` ops run inside backward); ``step``."""
    duration: float
    non_model_bytes: int
    """Most non-model memory (everything but parameters, gradients and optimizer states) live
    during the op. How it is measured is in ``Trace.meta["non_model_memory"]``."""
    cpu_time: float | None = None
    """Measured host seconds; ``None`` if not measured."""
    gpu_time: float | None = None
    """Measured (CUDA events) or, in a synthetic trace, estimated device seconds; else ``None``."""


@dataclass(frozen=True, slots=True)
class Layer:
    """Parameters the scheduler moves as one unit, e.g. a transformer block."""

    index: int
    """Position in ``Trace.layers`` (order of first use in forward)."""
    name: str
    """Module path of the layer (``blocks.3``, ``wte``)."""
    tensor_ids: tuple[int, ...]
    """``tensor_id`` of its parameters; each parameter belongs to exactly one layer."""
    first_id: int | None
    """Op id of the first access to any of its parameters (``None`` if never used)."""
    nbytes: int
    """Bytes of its parameters."""
