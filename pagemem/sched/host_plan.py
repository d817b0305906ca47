"""Step 5 of the planner: the cpu and nvme tiers.

Given what the gpu steps decided -- which layers are cached on the gpu, at which op each run of a
window's parameter pages moves to the gpu, at which op each layer's gradients are offloaded and
applied -- this step counts the host tiers over logical time and places the tasks that only they
constrain:

- **At rest.** The home copies: parameter shards on ``home_tier`` and optimizer states on the
  optimizer tier, for every layer not cached on the gpu.
- **What must be there.** During op ``r`` of each updated layer, its gradient shard and (states
  on nvme) its optimizer states on the cpu, as they are held there: a streamed update (states or
  gradients on nvme) holds no more than the layer's ``update_pages`` at once ([Note: a streamed
  update] in ``tasks.py``; ``Setting.held_pages``); with ``home_tier="nvme"``, its gradient shard
  on nvme too (offloaded there, fetched back for the update, both given back at the end of op
  ``r``). The peak of each timeline is the smallest budget of its tier that works; below it
  ``InfeasiblePlan`` names the tier and that figure.
- **As much as the cpu budget allows, as early as it allows.** With ``home_tier="nvme"``, each
  run of a window's pages is staged on the cpu, as many of its pages as fit from the run's move to
  the window's last move (in window order, after the previous staged copy of the layer is given
  back), as early as they fit; the others move to the gpu straight from nvme ([Note: staging is
  optional] in ``tasks.py``). Then each optimizer-state fetch from nvme (in update order), as
  early as it fits, no later than its update.

[Note: when a staged copy is given back] A window's staged cpu copy (``move_to_cpu param.j``,
per run of pages moved together) is given back by one ``release param @cpu`` at the end of the
op of the window's last ``move_to_gpu``: once every page has its gpu copy under way, not at the
window's end, so the cpu holds a window's pages no longer than its moves need them. (The release
waits for those moves to finish: the executor frees the pages when the copies have landed.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pagemem.sched.errors import InfeasiblePlan
from pagemem.sched.holdings import Setting, pages_taken
from pagemem.sched.plan import Budgets


@dataclass(frozen=True)
class Moves:
    """The runs of one window's pages moved to the gpu: ``(lo, hi, trigger)`` each."""

    window: int
    layer: int
    runs: tuple[tuple[int, int, int], ...]


@dataclass
class HostPlan:
    """What step 5 decided, and what it counted."""

    fetch: dict[int, int] = field(default_factory=dict)
    """Per layer whose optimizer states are on nvme: the trigger of their fetch to the cpu."""
    stage: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Per window that stages any (nvme homes): ``(lo, hi, trigger)`` of each ``move_to_cpu
    param`` run; its other pages move to the gpu straight from nvme."""
    unstage: dict[int, int] = field(default_factory=dict)
    """Per window that stages any (nvme homes): the op at whose end its staged copy is given back."""
    cpu_need: int = 0
    """The smallest cpu budget that works: the peak of what must be there."""
    nvme_need: int = 0
    cpu_peak: int = 0
    """The cpu peak with the stagings and fetches placed."""


def plan_host(setting: Setting, budgets: Budgets, n: int, timeline: Callable, cached: set[int],
              updates: Mapping[int, int], moves: Sequence[Moves], min_gpu: int) -> HostPlan:
    """Count the cpu and nvme tiers and place stagings and fetches (see the module docs).
    ``updates``: per updated layer, the op ``r`` of its offload and update; ``moves``: per
    window, in time order, its runs of pages moved to the gpu; ``timeline``: the class of
    timeline to count with. Raises ``InfeasiblePlan`` for a cpu or nvme budget below its need."""
    layout, pb = setting.layout, setting.layout.page_bytes
    home, opt = setting.home_tier, setting.optimizer_tier
    host = [l for l in layout.layers if l.index not in cached]
    out = HostPlan()

    def taken(op: str, kind: str, layer: int, tier: str) -> int:
        return pages_taken(op, kind, setting, layer, tier=tier).get(tier, 0) * pb

    # at rest
    cpu_base = nvme_base = 0
    for lay in host:
        for name in ("param", "optim"):
            pages = lay.param_pages if name == "param" else lay.optim_pages
            if setting.home(name, lay.index) == "cpu":
                cpu_base += pages * pb
            elif setting.home(name, lay.index) == "nvme":
                nvme_base += pages * pb
    cpu = timeline([cpu_base] * (n + 1))
    nvme = timeline([nvme_base] * (n + 1))
    # what must be there during op r of each update, as the cpu holds it
    order = sorted((updates[l.index], l.index) for l in host if l.index in updates)
    for r, layer in order:
        cpu.add(r, r + 1, setting.group_pages("grad", "cpu", layer) * pb)  # the gradient shard
        if home == "nvme":  # offloaded to nvme, fetched back for the update
            nvme.add(r, r + 1, layout.layers[layer].param_pages * taken("offload", "grad", layer, "nvme"))
        if opt == "nvme":  # fetched no later than the update
            cpu.add(r, r + 1, taken("move_to_cpu", "optim", layer, "cpu"))
    out.cpu_need = need = cpu.max(0, n + 1)
    if need > budgets.cpu:
        at = cpu.last_above(0, n + 1, need - 1)
        what = ("gradients and optimizer states an update holds on the cpu" if home == "nvme"
                else "parameter shards, offloaded gradients and optimizer states")
        raise InfeasiblePlan("cpu", need, budgets.cpu, min_gpu, at, what)
    out.nvme_need = nvme.max(0, n + 1)
    if out.nvme_need > budgets.nvme:
        at = next(t for t in range(n + 1) if nvme.max(t, t + 1) == out.nvme_need)
        what = "parameter shards, gradients and optimizer states" if home == "nvme" else "optimizer states"
        raise InfeasiblePlan("nvme", out.nvme_need, budgets.nvme, min_gpu, at, what)
    if home == "nvme":
        _stage(out, cpu, budgets.cpu, moves, cached, taken)
    if opt == "nvme":  # each fetch as early as the cpu allows
        for r, layer in order:
            size = taken("move_to_cpu", "optim", layer, "cpu")
            f = _earliest(cpu, 0, r, budgets.cpu - size)
            cpu.add(f, r, size)
            out.fetch[layer] = f
    out.cpu_peak = cpu.max(0, n + 1)
    return out


def _stage(out: HostPlan, cpu, budget: int, moves: Sequence[Moves], cached: set[int], taken: Callable) -> None:
    """Stage as many of each run's pages as the cpu holds from its move to the window's last, each
    as early as it fits, in window order (see the module docs); fills ``out.stage`` and
    ``out.unstage`` for the windows that stage any."""
    given_back: dict[int, int] = {}  # layer -> the op at whose end its last staged copy went
    for mv in moves:
        if mv.layer in cached or not mv.runs:
            continue
        last = max(m for _, _, m in mv.runs)
        page = taken("move_to_cpu", "param", mv.layer, "cpu")
        earliest = given_back.get(mv.layer, -1) + 1
        runs = []
        for lo, hi, m in mv.runs:
            room = budget - cpu.max(m, last + 1)
            count = min(hi - lo, room // page) if room > 0 and page else 0
            if count <= 0:
                continue  # moved straight from nvme
            size = count * page
            f = _earliest(cpu, earliest, m, budget - size)
            cpu.add(f, last + 1, size)
            runs.append((lo, lo + count, f))
        if runs:
            out.stage[mv.window] = runs
            out.unstage[mv.window] = last
            given_back[mv.layer] = last


def _earliest(tl, lo: int, hi: int, limit: int) -> int:
    """The earliest op in ``[lo, hi]`` from which every value up to ``hi`` stays within ``limit``."""
    idx = tl.last_above(lo, hi, limit)
    return idx + 1 if idx >= 0 else lo
