"""Checks of the arguments ``PageStore`` calls take: tensor specs, lists of tensors."""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from pagemem.errors import InvalidRequest
from pagemem.store.data import check_dtype
from pagemem.store.tensor import PagedTensor

TensorSpec = tuple[Sequence[int], torch.dtype]

_MAX_BYTES = 1 << 62
"""No tensor may claim more bytes than this (element counts past int64 would wrap in torch)."""


def iterable(value, name: str) -> list:
    try:
        return list(value)
    except TypeError:
        raise InvalidRequest(f"{name}: expected an iterable, got {type(value).__name__}") from None


def tensors_of(value, what: str) -> list[PagedTensor]:
    """One PagedTensor or an iterable of them, as a list; InvalidRequest for anything else."""
    tensors = [value] if isinstance(value, PagedTensor) else iterable(value, "tensors")
    for t in tensors:
        if not isinstance(t, PagedTensor):
            raise InvalidRequest(f"{what}: expected PagedTensors, got {type(t).__name__}")
    return tensors


def check_spec(spec: object) -> tuple[torch.Size, torch.dtype, int]:
    try:
        shape, dtype = spec  # type: ignore[misc]
    except (TypeError, ValueError):
        raise InvalidRequest(f"a tensor spec is (shape, dtype), got {spec!r}") from None
    dtype = check_dtype(dtype)
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidRequest(f"shape must be a sequence of ints, got {shape!r}") from None
    if not all(hasattr(d, "__index__") and not isinstance(d, bool) for d in dims):
        raise InvalidRequest(f"shape must hold non-negative ints, got {shape!r}")
    dims = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in dims):
        raise InvalidRequest(f"shape must hold non-negative ints, got {shape!r}")
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > _MAX_BYTES or any(d >= 1 << 63 for d in dims):
        raise InvalidRequest(f"shape {dims} of {dtype} needs {nbytes} bytes, more than any tier can "
                             f"hold (at most {_MAX_BYTES})")
    return torch.Size(dims), dtype, nbytes
