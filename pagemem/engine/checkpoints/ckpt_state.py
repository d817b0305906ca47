"""The parts of a checkpoint that live in the model, not in pages: persistent buffers as raw
bytes, and a snapshot that puts a model back as it was when a load is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagemem.errors import CorruptCheckpoint, InvalidRequest


def persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(state-dict key, module, buffer name) of every buffer ``model.state_dict()`` holds."""
    out = []
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, module, bname))
    return out


def buffer_bytes(model: nn.Module) -> tuple[bytes, list[dict[str, Any]]]:
    """The model's persistent buffers (BatchNorm statistics, counters) as raw bytes, and where
    each lies: nothing is pickled."""
    chunks, entries, offset = [], [], 0
    for key, module, bname in persistent_buffers(model):
        b = module._buffers[bname].detach().cpu().contiguous()
        data = b.reshape(-1).view(torch.uint8).numpy().tobytes() if b.numel() else b""
        entries.append({"name": key, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape),
                        "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    return b"".join(chunks), entries


def load_buffers(model: nn.Module, data: bytes, entries: list[dict[str, Any]], device: torch.device,
                 compute_dtype: torch.dtype | None, path: str) -> None:
    """Set ``model``'s buffers from ``data`` (verified) as ``entries`` lay them out, on ``device``;
    floating ones in ``compute_dtype`` ([Note: precision on load])."""
    where = {key: (module, bname) for key, module, bname in persistent_buffers(model)}
    for e in entries:
        if e["name"] not in where:
            raise InvalidRequest(f"{path}: the checkpoint has a buffer {e['name']!r} this model does not")
        if e["offset"] + e["nbytes"] > len(data):
            raise CorruptCheckpoint(path, f"buffer {e['name']!r} lies past the end of the file")
        module, bname = where[e["name"]]
        dtype = getattr(torch, e["dtype"])
        raw = bytearray(data[e["offset"]:e["offset"] + e["nbytes"]])
        value = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(e["shape"])
        module._buffers[bname] = value.to(engine_dtype(value, compute_dtype)).to(device)


def engine_dtype(value: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the engine keeps a buffer in: floating ones in the compute dtype asked for, else
    their own ([Note: compute dtypes])."""
    return compute_dtype if value.is_floating_point() and compute_dtype is not None else value.dtype


@dataclass
class ModelSnapshot:
    """What a model held before a load: each module's parameter objects with their tensors and
    classes, and its buffers."""

    params: list[tuple[nn.Module, str, nn.Parameter, torch.Tensor, type]]
    buffers: list[tuple[nn.Module, str, torch.Tensor | None]]


def model_snapshot(model: nn.Module) -> ModelSnapshot:
    params, buffers = [], []
    with torch._C.DisableTorchFunctionSubclass():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    params.append((module, name, p, p.data, type(p)))
            buffers.extend((module, name, b) for name, b in module._buffers.items())
    return ModelSnapshot(params, buffers)


def restore_model(snap: ModelSnapshot) -> None:
    """Put every module's parameters (objects, values, classes) and buffers back as ``snap``
    found them."""
    for module, name, p, data, cls in snap.params:
        module._parameters[name] = p
        with torch._C.DisableTorchFunctionSubclass():
            p.data = data
        p.__class__ = cls
    for module, name, b in snap.buffers:
        module._buffers[name] = b
