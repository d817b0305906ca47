"""The optimizer-state model used when no optimizer step is traced, and by synthetic traces.

Mixed-precision Adam, as in ANGEL-PTM Table 1: for a half-precision (float16 / bfloat16)
parameter an fp32 master copy plus fp32 ``exp_avg`` and ``exp_avg_sq`` (12 bytes per element);
for a parameter of any other floating dtype ``exp_avg`` and ``exp_avg_sq`` in that dtype (the
parameter is its own master copy), which is exactly what ``torch.optim.Adam``/``AdamW`` keep
apart from their scalar ``step`` counter. ``"master_adam"`` keeps the fp32 master copy for every
dtype (what :class:`pagemem.Engine` keeps: its compute copy is separate even in float32).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagemem.errors import ConfigError

OPTIMIZER_MODELS: tuple[str, ...] = ("adam", "master_adam", "none")
HALF_DTYPES = frozenset({"float16", "bfloat16"})


class StateShape(NamedTuple):
    """One optimizer state of one parameter."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``"float16"``, ``"int64"`` ...)."""
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"dtype: {dtype!r} is not a torch dtype")
    return value.itemsize


def modelled_states(model: str, dtype: str, shape: tuple[int, ...]) -> list[StateShape]:
    """States ``model`` (``"adam"`` or ``"none"``) keeps for one parameter."""
    if model == "none":
        return []
    if model not in ("adam", "master_adam"):
        raise ConfigError(f"optimizer_model: must be one of {OPTIMIZER_MODELS}, got {model!r}")
    numel = math.prod(shape)
    if dtype in HALF_DTYPES or model == "master_adam":
        keys, state_dtype = ("master", "exp_avg", "exp_avg_sq"), "float32"
    else:
        keys, state_dtype = ("exp_avg", "exp_avg_sq"), dtype
    size = itemsize(state_dtype) * numel
    return [StateShape(k, state_dtype, shape, size) for k in keys]
