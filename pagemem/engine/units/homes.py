"""Where each unit's compute copy and gradient sums live at rest: the cpu, or nvme.

[Note: homes on nvme]
A model whose training state does not fit in host memory keeps everything on nvme: the fp32
master weights and moments (``optimizer_tier="nvme"``), and the compute copy and the fp32
gradient sums too (``home_tier="nvme"``). The cpu tier is then a *working set*, not a home:
- the forward and backward copy each unit's compute pages nvme -> gpu (through the store's
  staging pages, or from a cpu copy a plan staged ahead);
- each gradient is written into its nvme sums when autograd hands it off (added to them after
  the first backward of a step);
- ``step()`` streams the update: parameters go through the cpu a batch at a time, their states
  and gradient sums moved in, updated, written back behind the next batch (``update.py``), so
  the cpu holds one batch, not the model.
The least working set is the largest parameter's states and gradient sums, which must be on the
cpu at once during its update (``host_need``); a budget below it is refused at construction
naming it. Plans count the same: the layout the engine hands the planner gives each unit's
update that many cpu pages (``ParamBank.stream_pages``, ``LayerLayout.stream_pages``, one count:
``records.streamed_pages``), and the pages a forward or backward reads from nvme need no cpu
page (a plan stages on the cpu only as many as fit: [Note: staging is optional] in
``pagemem/sched/tasks.py``): with everything on nvme the planner's least cpu budget is the
engine's, where no two units' updates fall at one op of the trace.

``home_tier="auto"`` (the default) keeps the homes on the cpu where the cpu budget holds them
with the optimizer states it must hold (and the update's working set), and moves them to nvme
where it does not and nvme has room. The choice is fixed at construction and shown in
``Engine.stats()["home_tier"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pagemem.engine.config import EngineConfig
from pagemem.engine.units.records import (compute_dtype_of, compute_is_master, owning_layers, paging_units,
                                          streamed_pages)
from pagemem.errors import OutOfMemory
from pagemem.store.layout import pack
from pagemem.engine.units.shards import LOCAL_BUFFERS, local_buffer_pages, master_shardable, moment_pages, state_pages
from pagemem.units import format_bytes

HOME_TIERS = ("auto", "cpu", "nvme")


@dataclass(frozen=True)
class HostNeed:
    """Pages the model's states take, by kind, as the bank lays them out (see ``bank.py``)."""

    compute: int
    """Compute copies, each unit on fresh pages (none where the compute copy is the master)."""
    states: int
    """fp32 master weights (where they are not the compute copy) and two moments, chained."""
    grads: int
    """fp32 gradient sums, chained."""
    unit_update: int
    """The most pages one parameter's states and gradient sums take together (what its update
    needs on the cpu at once when they live on nvme)."""
    unit_name: str
    """That parameter's name."""
    unit_states: int = 0
    """The most pages one unit's optimizer states take on pages of their own (``states_apart``:
    the lock-free updater reads one unit's states while it updates the one before)."""


def host_need(model: nn.Module, config: EngineConfig, unit_cap: int, ranks: tuple[int, int] = (0, 1)) -> HostNeed:
    """What the model's states take, counted as the bank will lay them out (works on ``meta``);
    ``ranks``: ``(rank, world_size)`` the moments are sharded over ([Note: sharded moments])."""
    pb = config.store.page_bytes
    params, modules = owning_layers(model)
    dtypes = [compute_dtype_of(config.compute_dtype, p.dtype) for _, p in params]
    nbytes = [p.numel() * d.itemsize for (_, p), d in zip(params, dtypes)]
    units = paging_units(modules, nbytes, unit_cap)
    is_master = compute_is_master(dtypes, config.optimizer_tier)
    fp32 = [p.numel() * 4 for _, p in params]
    trained = [i for i, (_, p) in enumerate(params) if p.requires_grad]
    gathered = config.shard_parameters and ranks[1] > 1  # no compute copy at rest ([Note: gathered units])
    compute = 0 if is_master or gathered else sum(pack([nbytes[i] for i in idx], pb).pages for _, idx in units)
    is_trained = set(trained)
    order = [i for _, idx in units for i in idx if i in is_trained]
    kinds = 2 if is_master else 3
    moments = moment_pages([idx for _, idx in units], [p.numel() for _, p in params],
                           [p.requires_grad for _, p in params], pb, ranks)
    masters = 0 if is_master else state_pages(  # a gathered bank keeps a master share of frozen ones too
        [idx for _, idx in units], [p.numel() for _, p in params], [p.requires_grad or gathered for _, p in params], pb, ranks,
        master_shardable(dtypes, [p.dtype for _, p in params], is_master, gathered))  # [Note: sharded master weights]
    states = masters + 2 * moments
    grads = pack([fp32[i] for i in order], pb).pages
    if gathered:  # [Note: sharded gradient sums]: shares, and the local buffers of the units in flight
        grads = state_pages([idx for _, idx in units], [p.numel() for _, p in params],
                            [p.requires_grad for _, p in params], pb, ranks, [True] * len(params))
        grads += sum(sorted((local_buffer_pages(idx, [p.numel() for _, p in params], pb, ranks)
                             for _, idx in units), reverse=True)[:LOCAL_BUFFERS])
    best, name = 0, ""
    for i in trained:  # its states and gradient sums
        pages = streamed_pages(params[i][1].numel(), kinds + 1, pb)
        if pages > best:
            best, name = pages, params[i][0]
    apart = max((kinds * pack(sizes, pb).pages for _, idx in units
                 if (sizes := [fp32[i] for i in idx if params[i][1].requires_grad])), default=0)
    return HostNeed(compute, states, grads, best, name, apart)


def working_set(need: HostNeed, optimizer_tier: str, home_tier: str, lock_free: bool = False) -> int:
    """Cpu pages the update needs at once beyond what lives on the cpu (see the Note): the
    largest parameter's states and sums streamed by ``step()``, or with the lock-free updater
    two units' states (the one it updates and the next, read meanwhile)."""
    if optimizer_tier == "gpu":
        return 0
    if lock_free and optimizer_tier == "nvme":
        return 2 * need.unit_states
    if optimizer_tier == "nvme" or home_tier == "nvme":
        return need.unit_update
    return 0


def cpu_pages(need: HostNeed, optimizer_tier: str, home_tier: str, lock_free: bool = False) -> int:
    """Cpu pages the engine needs with these homes: what lives there plus the working set."""
    at_rest = need.states if optimizer_tier == "cpu" else 0
    if home_tier == "cpu":
        at_rest += need.compute + (need.grads if optimizer_tier != "gpu" else 0)
    return at_rest + working_set(need, optimizer_tier, home_tier, lock_free)


def nvme_pages(need: HostNeed, optimizer_tier: str, home_tier: str) -> int:
    pages = need.states if optimizer_tier == "nvme" else 0
    if home_tier == "nvme":
        pages += need.compute + (need.grads if optimizer_tier != "gpu" else 0)
    return pages


def choose_home_tier(model: nn.Module, config: EngineConfig, unit_cap: int, ranks: tuple[int, int] = (0, 1)) -> str:
    """The home tier for ``config.home_tier`` (resolving ``"auto"``, see the Note); raises
    ``OutOfMemory`` naming the tier and the least budget that works, before anything is made.
    ``ranks``: as ``host_need``'s."""
    store = config.store
    pb = store.page_bytes
    have_cpu, have_nvme = store.pages("cpu"), store.pages("nvme")
    need = host_need(model, config, unit_cap, ranks)
    asked = config.home_tier
    tiers = ("cpu", "nvme") if asked == "auto" else (asked,)
    if config.optimizer_tier == "gpu" and asked == "auto":
        tiers = ("cpu",)  # gradient sums live beside the states, on the gpu: only compute copies are homed
    lock_free = config.lock_free
    for tier in tiers:
        if tier == "nvme" and not have_nvme:
            continue
        if (cpu_pages(need, config.optimizer_tier, tier, lock_free) <= have_cpu
                and nvme_pages(need, config.optimizer_tier, tier) <= have_nvme):
            return tier
    # nothing fits: name the least that works for the home the budgets come closest to
    tier = tiers[-1] if have_nvme or asked == "nvme" else "cpu"
    cpu_least = cpu_pages(need, config.optimizer_tier, tier, lock_free)
    if cpu_least > have_cpu:
        what = (f"cpu_bytes: with home_tier={tier!r} and optimizer_tier={config.optimizer_tier!r} the cpu holds "
                + _describe(need, config.optimizer_tier, tier, pb, lock_free))
        raise OutOfMemory("cpu", cpu_least, have_cpu, pb, what, least_bytes=cpu_least * pb)
    nvme_least = nvme_pages(need, config.optimizer_tier, tier)
    raise OutOfMemory("nvme", nvme_least, have_nvme, pb,
                      f"nvme_bytes: with home_tier={tier!r} and optimizer_tier={config.optimizer_tier!r} nvme holds "
                      f"{format_bytes(nvme_least * pb)} of training state", least_bytes=nvme_least * pb)


def _describe(need: HostNeed, optimizer_tier: str, home_tier: str, pb: int, lock_free: bool) -> str:
    parts = []
    if optimizer_tier == "cpu":
        parts.append(f"optimizer states {format_bytes(need.states * pb)}")
    if home_tier == "cpu":
        parts.append(f"compute copies {format_bytes(need.compute * pb)}")
        if optimizer_tier != "gpu":
            parts.append(f"gradient sums {format_bytes(need.grads * pb)}")
    ws = working_set(need, optimizer_tier, home_tier, lock_free)
    if ws:
        whose = ("two units' optimizer states (the lock-free updater's)" if lock_free and optimizer_tier == "nvme"
                 else f"{need.unit_name!r}'s states and gradient sums")
        parts.append(f"the update's working set {format_bytes(ws * pb)} ({whose})")
    more = "" if home_tier == "nvme" else " (home_tier='nvme' keeps compute copies and gradient sums on nvme)"
    return ", ".join(parts) + more
