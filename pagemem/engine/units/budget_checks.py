"""The gpu budget checked against the model: at construction, that it holds the largest paging
unit; after a traced iteration, that the activations fit beside what must be resident.

[Note: gpu budgets refused early] A budget that cannot work is refused with ``OutOfMemory``
naming the smallest that works (``least_bytes``), not accepted to fail later or run over:
- at construction, before the store is made (nothing allocated, the model untouched), the
  budget must hold the optimizer states kept on the gpu (``optimizer_tier="gpu"``) plus the
  largest unit's compute pages, counted as the bank lays them out. The units themselves depend
  on the budget (merged up to ``unit_cap``), so the least is found by iterating the budget to a
  fixed point: the smallest budget whose own units' need it covers. That is a lower bound
  (``OutOfMemory.least_is_bound``: the message says "at least"): with the plan executor the
  activations beside the units are known only after the first iteration; on demand, an op may
  read several units at once (a tied weight), and one that finds every other resident unit in use
  is refused naming the least that holds them together (``Residency``), a bound again;
- after a traced iteration whose plan finds the gpu too small (``InfeasiblePlan`` on the gpu:
  activations plus the units that must be resident together), iterations with those inputs
  are refused at their forward, where before they ran on demand over the budget. The traced
  iteration itself ran (its activations were unknown before it) and its ``step()`` updates as
  usual; the engine stays open, so ``save()`` and ``close()`` work and the run resumes under a
  larger budget with ``Engine.load(directory, model, config)``. The least named is the plan's
  least for this budget's units; where a budget that size would merge the units otherwise, it
  is a lower bound too (that budget's own first iteration checks again).
"""

from __future__ import annotations

import torch
from torch import nn

from pagemem.config import StoreConfig
from pagemem.engine.config import EngineConfig
from pagemem.engine.units.records import compute_dtype_of, compute_is_master, owning_layers, paging_units
from pagemem.errors import OutOfMemory
from pagemem.sched import InfeasiblePlan
from pagemem.store.layout import pack
from pagemem.engine.units.shards import master_shardable, moment_pages, state_pages
from pagemem.units import format_bytes

_MOST_ROUNDS = 64


UNIT_CAP_MOST = 64 << 20
"""Paging units are merged up to this many bytes at most, whatever the budget: see the Note."""


def unit_cap(store: StoreConfig) -> int:
    """The byte cap paging units are merged up to under ``store``'s gpu budget."""
    # [Note: how far units merge]
    # Merging lets a LayerNorm travel with its neighbours and a block's small layers cost one
    # move; a sixteenth of the budget keeps a unit small beside it. But on a large GPU a
    # sixteenth is gigabytes: the first GPU run (an H200, an 84 GiB budget) merged a whole
    # 1.3B GPT into one unit, which the warm-up, keeping only what running modules hold,
    # copied in whole at every op (778 GB in one iteration), and which no plan can overlap
    # with compute. Past 64 MiB a move's fixed cost is nothing beside its copy (about 1.2 ms at
    # PCIe 5's 53 GB/s), so units merge no further than that.
    return max(store.page_bytes, min(store.pages("gpu") * store.page_bytes // 16, UNIT_CAP_MOST))  # type: ignore[operator]


def _units(model: nn.Module, dtype: torch.dtype | None, cap: int) -> tuple[list, list[tuple[str, list[int]]], list[int]]:
    params, modules = owning_layers(model)
    nbytes = [p.numel() * compute_dtype_of(dtype, p.dtype).itemsize for _, p in params]
    return params, paging_units(modules, nbytes, cap), nbytes


def _need(model: nn.Module, config: EngineConfig, cap: int, ranks: tuple[int, int] = (0, 1)) -> tuple[int, int, str]:
    """Gpu pages that must fit with units merged up to ``cap``: (states kept there, the largest
    unit's compute pages, its name); ``ranks``: the moments' sharding ([Note: sharded moments])."""
    pb = config.store.page_bytes
    params, units, nbytes = _units(model, config.compute_dtype, cap)
    master_is_compute = compute_is_master((compute_dtype_of(config.compute_dtype, p.dtype) for _, p in params),
                                          config.optimizer_tier)
    largest, name = 0, ""
    if not master_is_compute:
        for unit, idx in units:
            pages = pack([nbytes[i] for i in idx], pb).pages
            if pages > largest:
                largest, name = pages, unit
    static = 0
    if config.optimizer_tier == "gpu":  # master, two moments and gradient sums, each kind chained
        order = [i for _, idx in units for i in idx]
        fp32 = [params[i][1].numel() * 4 for i in order]
        trained = [b for b, i in zip(fp32, order) if params[i][1].requires_grad]
        moments = moment_pages([idx for _, idx in units], [p.numel() for _, p in params],
                               [p.requires_grad for _, p in params], pb, ranks)
        dtypes = [compute_dtype_of(config.compute_dtype, p.dtype) for _, p in params]
        masters = pack(fp32, pb).pages if master_is_compute else state_pages(
            [idx for _, idx in units], [p.numel() for _, p in params], [p.requires_grad for _, p in params], pb,
            ranks, master_shardable(dtypes, [p.dtype for _, p in params], master_is_compute))
        static = masters + 2 * moments + pack(trained, pb).pages
    return static, largest, name


def check_units_fit(model: nn.Module, config: EngineConfig, ranks: tuple[int, int] = (0, 1)) -> None:
    """Raise OutOfMemory (naming the least budget) unless the gpu budget holds the states kept
    there and the largest paging unit (see the Note). Changes nothing. ``ranks``: ``(rank,
    world_size)`` the moments are sharded over."""
    store = config.store
    pb, have = store.page_bytes, store.pages("gpu")
    static, largest, name = _need(model, config, unit_cap(store), ranks)
    if static + largest <= have:
        return
    least = 0
    for _ in range(_MOST_ROUNDS):  # the least budget whose own units fit in it
        s, l, _n = _need(model, config, max(pb, least // 16), ranks)  # type: ignore[operator]
        if (s + l) * pb <= least:  # type: ignore[operator]
            break
        least = (s + l) * pb  # type: ignore[operator]
    kept = f" beside the optimizer states kept there ({static} pages)" if static else ""
    unit = f"the largest paging unit ({name!r}, {largest} pages)" if largest else "nothing more"
    later = (" (the first iteration's plan checks the activations beside it, and may ask for more)"
             if config.executor == "plan" else " (an op that reads several units at once, a tied weight, may need more)")
    raise OutOfMemory("gpu", static + largest, have, pb, f"gpu_bytes: {unit}{kept}{later}", least_bytes=least,
                      least_is_bound=True)


def refusal(exc: InfeasiblePlan, model: nn.Module, units: list[tuple[str, list[int]]], dtype: torch.dtype | None,
            store: StoreConfig, static_pages: int) -> OutOfMemory:
    """The error refusing iterations whose plan found the gpu budget too small (see the Note)."""
    pb = store.page_bytes
    least = -(-(exc.min_gpu_bytes + static_pages * pb) // pb) * pb  # type: ignore[operator]
    have = store.pages("gpu")
    bigger = StoreConfig(page_bytes=pb, gpu_bytes=least)
    same = [idx for _, idx in _units(model, dtype, unit_cap(bigger))[1]] == [idx for _, idx in units]
    caveat = "" if same else (" (at least: a budget that size merges the paging units otherwise, and its "
                              "first iteration checks again)")
    what = (f"gpu_bytes: the traced iteration's activations and the units resident beside them need "
            f"{format_bytes(exc.min_gpu_bytes)} at op {exc.op_id}; iterations with these inputs are refused "
            f"(save() and load with a larger budget){caveat}")
    return OutOfMemory("gpu", -(-least // pb), have, pb, what, least_bytes=least,  # type: ignore[operator]
                       least_is_bound=not same)
