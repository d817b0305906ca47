"""Step 5 of the planner: the cpu and nvme tiers.

Given what the gpu steps decided -- which layers are cached on the gpu, at which op each run of a
window's parameter pages moves to the gpu, at which op each layer's gradients are offloaded and
applied -- this step counts the host tiers over logical time and places the tasks that only they
constrain:

- **At rest.** The home copies: parameter shards on ``home_tier`` and optimizer states on the
  optimizer tier, for every layer not cached on the gpu.
- **What must be there.** During op ``r`` of each updated layer, its gradient shard and (states
  on nvme) its optimizer states on the cpu; with ``home_tier="nvme"``, its gradient shard on nvme
  too (offloaded there, fetched back for the update, both given back at the end of op ``r``),
  and each window's parameter pages staged on the cpu from the op that moves them to the gpu until
  the window's last move (see the Note). The peak of each timeline is the smallest budget of
  its tier that works; below it ``InfeasiblePlan`` names the tier and that figure.
- **As early as the cpu budget allows.** Each staging starts as early as the cpu budget allows
  (in window order, after the previous staged copy of the layer is given back), then each
  optimizer-state fetch from nvme (in update order), each no later than the move it feeds.

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
    """Per window (nvme homes): ``(lo, hi, trigger)`` of each ``move_to_cpu param`` run."""
    unstage: dict[int, int] = field(default_factory=dict)
    """Per window (nvme homes): the op at whose end its staged copy is given back."""
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
    # what must be there during op r of each update
    order = sorted((updates[l.index], l.index) for l in host if l.index in updates)
    grad_tier = "nvme" if home == "nvme" else "cpu"
    for r, layer in order:
        pages = layout.layers[layer].param_pages
        cpu.add(r, r + 1, pages * taken("offload", "grad", layer, "cpu"))  # the gradient shard
        if grad_tier == "nvme":  # offloaded to nvme, fetched back for the update
            nvme.add(r, r + 1, pages * taken("offload", "grad", layer, "nvme"))
        if opt == "nvme":  # fetched no later than the update
            cpu.add(r, r + 1, taken("move_to_cpu", "optim", layer, "cpu"))
    # what must be there for each window's moves: its pages staged from their move to its last
    staged: list[tuple[int, int, int, int, int, int]] = []  # (window, bytes a page, lo, hi, move, earliest)
    if home == "nvme":
        given_back: dict[int, int] = {}  # layer -> the op at whose end its last staged copy went
        for mv in moves:
            if mv.layer in cached or not mv.runs:
                continue
            last = max(m for _, _, m in mv.runs)
            page = taken("move_to_cpu", "param", mv.layer, "cpu")
            earliest = given_back.get(mv.layer, -1) + 1
            for lo, hi, m in mv.runs:
                cpu.add(m, last + 1, (hi - lo) * page)
                staged.append((mv.window, page, lo, hi, m, earliest))
            out.unstage[mv.window] = last
            given_back[mv.layer] = last
    out.cpu_need = need = cpu.max(0, n + 1)
    if need > budgets.cpu:
        at = cpu.last_above(0, n + 1, need - 1)
        what = ("staged parameter pages, gradients and optimizer states" if home == "nvme"
                else "parameter shards, offloaded gradients and optimizer states")
        raise InfeasiblePlan("cpu", need, budgets.cpu, min_gpu, at, what)
    out.nvme_need = nvme.max(0, n + 1)
    if out.nvme_need > budgets.nvme:
        at = next(t for t in range(n + 1) if nvme.max(t, t + 1) == out.nvme_need)
        what = "parameter shards, gradients and optimizer states" if home == "nvme" else "optimizer states"
        raise InfeasiblePlan("nvme", out.nvme_need, budgets.nvme, min_gpu, at, what)
    # as early as the cpu budget allows: stagings in window order, then optimizer-state fetches
    for w, page, lo, hi, m, earliest in staged:
        size = (hi - lo) * page
        f = _earliest(cpu, earliest, m, budgets.cpu - size)
        cpu.add(f, m, size)
        out.stage.setdefault(w, []).append((lo, hi, f))
    if opt == "nvme":
        for r, layer in order:
            size = taken("move_to_cpu", "optim", layer, "cpu")
            f = _earliest(cpu, 0, r, budgets.cpu - size)
            cpu.add(f, r, size)
            out.fetch[layer] = f
    out.cpu_peak = cpu.max(0, n + 1)
    return out


def _earliest(tl, lo: int, hi: int, limit: int) -> int:
    """The earliest op in ``[lo, hi]`` from which every value up to ``hi`` stays within ``limit``."""
    idx = tl.last_above(lo, hi, limit)
    return idx + 1 if idx >= 0 else lo
