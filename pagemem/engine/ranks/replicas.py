"""Every rank's replica starts from rank 0's values, and its buffers follow rank 0's.

[Note: replicas agree as DDP makes them]
``DistributedDataParallel`` broadcasts rank 0's parameters and buffers when it is made, and rank
0's buffers before every forward that will synchronise gradients (one under autograd, outside
``no_sync``), so ranks that initialised their models differently (no common seed) still train
one model, and BatchNorm's running statistics are rank 0's on every rank. The engine does the
same: once it has taken the parameters into pages, every rank hashes each parameter's value
(its fp32 master weights, or a frozen parameter's compute copy) and the ranks compare the hashes
in one collective; only parameters that differ anywhere are broadcast from rank 0 (in batches of
``BATCH_BYTES``), so ranks that agree (a common seed, a checkpoint, a weights file) write
nothing. Buffers are broadcast whole (they are small) when the engine is made, and before each
forward under autograd whose backward ends an accumulation step (when the gradients are averaged,
[Note: data parallel over the process group])."""

from __future__ import annotations

import zlib

import torch
import xxhash
from torch import nn

from pagemem.engine.ranks.collectives import BATCH_BYTES, Collectives
from pagemem.engine.units.bank import ParamBank
from pagemem.errors import InvalidRequest


def _digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) >> 1  # an int64


def agree_on_values(bank: ParamBank, coll: Collectives) -> int:
    """Parameters that differ from rank 0's anywhere take rank 0's values; returns how many did."""
    n = len(bank.records)
    mine = [_digest(bank.host_value(i, torch.float32)) for i in range(n)]
    top, low = coll.begin("comparing every rank's parameter values", mine)
    differ = [i for i in range(n) if top[i] != low[i]]
    elems = BATCH_BYTES // 4
    batch: list[int] = []
    for i in differ + [None]:  # type: ignore[list-item]
        size = sum(bank.params[j][1].numel() for j in batch)
        if batch and (i is None or size + bank.params[i][1].numel() > elems):
            _broadcast_params(bank, coll, batch, size)
            batch = []
        if i is not None:
            batch.append(i)
    return len(differ)


def agree_on_module_values(model: nn.Module, coll: Collectives) -> int:
    """The module's own parameters that differ from rank 0's anywhere take rank 0's values,
    before the engine takes them into pages: an engine whose ranks keep shares of every value
    (``shard_parameters``, [Note: gathered units] in ``unit_gather.py``) holds no rank's whole
    value afterwards to compare or send. Parameters on meta (no values yet) are left alone: each
    element then takes its owner's first value, one model on every rank. Returns how many took
    rank 0's values."""
    params = [p for _, p in model.named_parameters()]
    real = [p for p in params if not p.is_meta]
    mine = [_digest(p.detach().cpu()) for p in real]
    top, low = coll.begin("comparing every rank's parameter values", mine)
    differ = [p for p, a, b in zip(real, top, low) if a != b]
    with torch.no_grad():
        for p in differ:
            t = p.detach().to(coll.ranks.device).contiguous()
            coll.broadcast(t, 0, "rank 0's parameter values")
            if coll.ranks.rank != 0:
                p.copy_(t.to(p.device))
    return len(differ)


def _broadcast_params(bank: ParamBank, coll: Collectives, params: list[int], size: int) -> None:
    buf = torch.empty(size, dtype=torch.float32)
    if coll.ranks.rank == 0:
        torch.cat([bank.host_value(i, torch.float32).reshape(-1) for i in params], out=buf)
    t = buf.to(coll.ranks.device)
    coll.broadcast(t, 0, "rank 0's parameter values")
    if coll.ranks.rank == 0:
        return
    at = 0
    for i in params:
        shape = bank.params[i][1].shape
        value = t[at:at + shape.numel()].cpu().reshape(shape)
        at += shape.numel()
        bank.set_state(i, "master" if bank.is_trainable(i) else "compute", value)


def sync_buffers(module: nn.Module, coll: Collectives) -> None:
    """Every buffer of ``module`` takes rank 0's value (one broadcast of their bytes, each buffer
    at an offset aligned to 16 bytes, so any dtype can view its slice); ranks whose buffers differ
    in number, shape or dtype refuse alike."""
    bufs = [b for b in module.buffers() if b is not None and not b.is_meta]
    if not bufs:
        return
    layout = zlib.crc32(repr([(tuple(b.shape), str(b.dtype)) for b in bufs]).encode())
    top, low = coll.begin("rank 0's buffers", [len(bufs), layout])
    if top != low:  # the ranks are in step (the header matched): every rank refuses alike
        raise InvalidRequest(f"buffers: the ranks' models hold different buffers (in number, shape or dtype; this "
                             f"rank {len(bufs)}): every rank must hold the same buffers to take rank 0's")
    offsets, at = [], 0
    for b in bufs:
        offsets.append(at)
        at = -(-(at + b.numel() * b.element_size()) // 16) * 16
    with torch.no_grad():
        flat = torch.zeros(at, dtype=torch.uint8, device=coll.ranks.device)
        for b, off in zip(bufs, offsets):
            n = b.numel() * b.element_size()
            flat[off:off + n].copy_(b.detach().contiguous().reshape(-1).view(torch.uint8).to(flat.device))
        coll.broadcast(flat, 0, "rank 0's buffers")
        if coll.ranks.rank == 0:
            return
        for b, off in zip(bufs, offsets):
            n = b.numel() * b.element_size()
            b.copy_(flat[off:off + n].to(b.device).view(b.dtype).reshape(b.shape))
