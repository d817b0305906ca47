"""What the bank holds, record by record: one ``ParamRecord`` per parameter (its unit is a
``Unit``, ``unit.py``), and how a model's modules become units."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from pagemem.ownership import owning_modules
from pagemem.store.layout import pack


def compute_dtype_of(asked: torch.dtype | None, held: torch.dtype) -> torch.dtype:
    """[Note: compute dtypes] The dtype a parameter computes in: ``EngineConfig.compute_dtype``
    where the user asked for one (every floating parameter and buffer is cast to it, as
    ``model.to(dtype)`` casts them), else the dtype the parameter holds (None, the default: a
    bf16 parameter among fp32 ones stays bf16, a float64 buffer stays float64, as in plain
    PyTorch). Whatever it computes in, a trained parameter's update runs on fp32 master weights
    and moments (mixed precision: for a bf16 or fp16 parameter this is more precise than plain
    PyTorch's AdamW over the parameter itself, and not bit-identical to it)."""
    return asked if asked is not None else held


def compute_is_master(compute_dtypes: Iterable[torch.dtype], optimizer_tier: str) -> bool:
    """[Note: the compute copy is the master] (``ParamBank``): every parameter computes in fp32
    and the optimizer states are on the gpu."""
    return optimizer_tier == "gpu" and all(d == torch.float32 for d in compute_dtypes)


@dataclass
class ParamRecord:
    """[Note: parameter records] One parameter of the model, as the engine holds it: its name, the
    ``nn.Parameter`` (whose identity never changes), its unit and position there (its pages are
    ``unit.compute[position]``, ``unit.master[position]``, ...), the dtype it came with and the one
    it computes in, the bytes it takes in its unit's pages, whether it trains (see [Note: frozen
    parameters]) and how many updates it has had. The bank owns the record; the updater counts
    ``steps`` through ``ParamBank.count_step``; residency is per unit (``Unit``, ``unit.py``).
    ``ParamBank.params``, ``layer_of``, ``position`` and ``param_nbytes`` are read-only views of
    the records, for the hot paths."""

    index: int
    name: str
    param: nn.Parameter
    unit: int
    position: int
    original_dtype: torch.dtype
    trainable: bool
    compute_dtype: torch.dtype
    """What its compute copy holds ([Note: compute dtypes])."""
    nbytes: int
    """Bytes its compute copy occupies in its unit's pages (start to the next tensor's start): per
    unit they add up to what the unit's pages hold, as plans count it (0 where the compute copy is
    the master)."""
    steps: int = 0
    """AdamW's update count (torch's ``state['step']``)."""
    group: int | None = None
    """Its group in ``engine.optimizer.param_groups`` (None: in none, never updated)."""
    requires_grad: bool = False
    """``requires_grad`` as the engine last saw it (at construction, then at each iteration's
    start): its hand-off hooks are installed when this is set and it is in a group."""

    @property
    def hooked(self) -> bool:
        return self.requires_grad and self.group is not None


def owning_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, list[int]]]]:
    """The model's distinct parameters, and the modules (name, parameter indices) owning them,
    in module order (a tied parameter belongs to its first owner: ``owning_modules``)."""
    params: list[tuple[str, nn.Parameter]] = []
    modules = []
    for mname, module, own in owning_modules(model):
        names = {id(p): n for n, p in module.named_parameters(recurse=False)}
        modules.append((mname, list(range(len(params), len(params) + len(own)))))
        params.extend((f"{mname}.{names[id(p)]}" if mname else names[id(p)], p) for p in own)
    return params, modules


MODULES_PER_UNIT_MOST = 8
"""Modules merged into one paging unit at most (see ``paging_units``)."""


def paging_units(modules: list[tuple[str, list[int]]], nbytes: list[int], cap: int) -> list[tuple[str, list[int]]]:
    """Consecutive modules merged into paging units of at most ``cap`` bytes and
    ``MODULES_PER_UNIT_MOST`` modules (a module larger than ``cap`` is a unit of its own): a
    LayerNorm travels with its neighbours instead of taking a page of its own, and a block's
    small layers cost one move. The warm-up keeps only what running modules hold, so it fetches
    a unit once per module of it that runs: the module bound keeps that to a few times the
    unit's bytes (unbounded, 200 small blocks merged into one unit moved 870 times the model in
    one warm-up). The warm-up trace is recorded over these units, so the scheduler's layers are
    exactly them."""
    units: list[tuple[str, list[int]]] = []
    size = members = 0
    for name, idx in modules:
        b = sum(nbytes[i] for i in idx)
        if units and size + b <= cap and members < MODULES_PER_UNIT_MOST:
            units[-1][1].extend(idx)
            size += b
            members += 1
            continue
        units.append((name, list(idx)))
        size, members = b, 1
    return units


def grad_tier_beside(state_tier: str, home_tier: str = "cpu") -> str:
    """Where fp32 gradient sums live beside optimizer states on ``state_tier``: on the gpu with
    states there (a GPU's fused AdamW needs all its tensors on the device), else at the units'
    home (``home_tier``: the cpu, or nvme: [Note: homes on nvme] in ``homes.py``)."""
    return "gpu" if state_tier == "gpu" else home_tier


def streamed_pages(numel: int, kinds: int, page_bytes: int) -> int:
    """Cpu pages one parameter of ``numel`` elements takes at once while its update brings
    ``kinds`` fp32 arrays of it from nvme (master weights, moments, gradient sums: [Note: homes
    on nvme] in ``homes.py``): each array is chained after another one's, so it may start
    mid-page and take one page more than its bytes. The one count of it: the engine's least cpu
    budget (``homes.host_need``) and the planner's (``ParamBank.stream_pages``) both use it."""
    return kinds * (pack([numel * 4], page_bytes).pages + 1) if kinds else 0


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with one element of memory, NaN: evicted parameters
    keep their shape and dtype for code that reads them, and a read that slips past the guard
    computes NaN, never a plausible value (see [Note: evicted parameters] in ``guard.py``)."""
    if not len(shape):  # its own element: a 0-dim tensor can be written in place
        return torch.full((), float("nan"), dtype=dtype, device=device)
    return _nan(dtype, device).expand(shape)  # stride 0: in-place writes to it are refused


@functools.lru_cache(maxsize=None)
def _nan(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One NaN element per dtype and device, shared by the placeholders (one per eviction was
    a tensor allocation per parameter per eviction)."""
    return torch.full((), float("nan"), dtype=dtype, device=device)
