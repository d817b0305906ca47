"""What the engine refuses in a model: before it takes it over, and once its values came."""

from __future__ import annotations

import torch
from torch import nn

from pagemem.engine.units.guard import GuardedParameter
from pagemem.errors import ConfigError, InvalidRequest


def check_parameters(model: nn.Module) -> None:
    """Refuse parameters the engine cannot train exactly: not floating point of 16 or 32 bits (it
    computes in float32, float16 or bfloat16, and would silently cast a float64 parameter), or
    not contiguous (it keeps parameters contiguous in pages; a channels_last or transposed
    parameter would compute along other kernels than in plain PyTorch)."""
    for name, p in model.named_parameters():
        if isinstance(p, GuardedParameter):
            raise InvalidRequest(f"parameter {name!r} is held by another pagemem.Engine (or by one closed without "
                                 "giving its weights back): close that engine first, or load a checkpoint")
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ConfigError(f"parameter {name!r}: uninitialized (a lazy module): run one forward before making "
                              "the engine")
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"parameter {name!r}: dtype {p.dtype}; the engine trains float32, float16 and bfloat16 "
                              "parameters (convert the model, e.g. model.float())")
        if not p.is_meta and not p.is_contiguous():
            raise ConfigError(f"parameter {name!r}: not contiguous (strides {p.stride()}); the engine keeps parameters "
                              "contiguous, so it would not compute as this model does: make them contiguous first "
                              "(model.to(memory_format=torch.contiguous_format), or p.data = p.data.contiguous())")


def check_no_meta_buffers(model: nn.Module) -> None:
    """A model built on ``meta`` computes its buffers nowhere: one left there (a non-persistent
    one no state dict or checkpoint holds, as a rotary embedding's ``inv_freq``) is refused."""
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ConfigError(f"buffer {name!r} is on 'meta' and nothing gave it a value (non-persistent buffers "
                              "are in no state dict or checkpoint): build the model off 'meta', or set the buffer")
