"""The planner: ANGEL-PTM's Algorithm 1, completed.

Per rank, in logical time (the trace's ops, plus op ``n`` for the end of the iteration):

1. **What must be on the GPU.** Each layer's parameters, gathered from all ranks, during each of
   its compute windows; its gradient buffer from the window that starts producing gradients
   until ``reduce_scatter`` has consumed it (W > 1) or the pages are offloaded (W = 1); and the
   non-model memory the trace recorded per op. Its peak is the smallest GPU budget that works
   (``min_gpu_bytes``); below it the planner raises ``InfeasiblePlan``.
2. **Phase 1, prioritized moves.** Every window's parameter pages are first scheduled to move
   at the earliest trigger (0, or just after the layer's previous window). Walking the windows
   in time order, while memory over the current stretch exceeds the budget, the last scheduled
   moves (those of the latest windows) are rolled back onto a wait stack; after each window
   starts, waiting moves are re-issued at that point as far as memory allows.
3. **Phase 2, all-gathers** (W > 1) are advanced from the window start to the earliest trigger,
   no earlier than their page's move, that causes no OOM.
4. **Caching.** While the GPU peak leaves room, layers (earliest first, after AutoHete) keep their
   parameter shard, gradients and optimizer states on the GPU and are updated there.
5. **Gradients, updates and the host tiers** (``host_plan``). After a layer's last gradient
   access: ``reduce_scatter``, the ``offload`` of its gradient shard to CPU (``home_tier="nvme"``:
   to NVMe, fetched back to CPU for the update), the ``update``; with optimizer states on NVMe
   they are fetched to CPU as early as the CPU budget allows and written back after the update;
   an update that streams from NVMe holds at most the layout's ``stream_pages`` on the CPU. With
   parameters homed on NVMe, as many of each window's pages as the CPU budget holds are staged
   there as early as it allows, before they move to the GPU; the others move straight from NVMe.

Every "how much room is there" question is a query on a ``SegmentTimeline`` (O(log n)). How many
pages each kind of task takes, and whether it is issued at its trigger op's start or end, come
from the task table (``pagemem.sched.tasks``); each ``compute`` carries the end of its window and
whether it produces the layer's gradients, and the plan derives from the same table what every
task waits for (``Plan.deps``).
"""

from __future__ import annotations

import bisect
import time
from typing import Mapping

from pagemem.checks import check_choice, check_int
from pagemem.errors import ConfigError
from pagemem.sched.errors import InfeasiblePlan
from pagemem.sched.emit import Decisions, Run, emit
from pagemem.sched.host_plan import HostPlan, Moves, plan_host
from pagemem.sched.layout import SHARDINGS, Layout
from pagemem.sched.plan import HOME_TIERS, Budgets, Plan
from pagemem.sched.holdings import Setting, pages_taken
from pagemem.sched.timeline import TIMELINES
from pagemem.sched.windows import Usage, Window
from pagemem.tracer import Trace
from pagemem.units import parse_size


def plan(trace: Trace, budgets: "Budgets | Mapping[str, int | str]", world_size: int = 1,
         optimizer_tier: str = "cpu", page_bytes: int | str = "4MiB", *, cache_optimizer: bool = True,
         timeline: str = "segment", cached_state_pages: Mapping[int, int] | None = None,
         layout: Layout | None = None, home_tier: str = "cpu", sharding: str = "params") -> Plan:
    """Plan one training iteration of ``trace`` on each of ``world_size`` ranks.

    ``budgets`` are per rank (``{"gpu": "8GiB", "cpu": "64GiB", "nvme": "1TiB"}``);
    ``optimizer_tier`` is where optimizer states live (``"cpu"`` or ``"nvme"``), except for layers
    the planner caches on the gpu when ``cache_optimizer`` and the budget allow; ``home_tier`` is
    where the other layers' parameters (compute copies) and gradients rest (``"cpu"``, or
    ``"nvme"``: staged through the cpu, whose budget is then a working set).
    ``cached_state_pages``: per layer, the gpu pages its optimizer states take where the executor
    keeps a cached layer's states (default: the layout's ``pages_when_cached``; an engine that
    keeps gradient sums beside them, or each kind on fresh pages, says more). ``layout``: the
    pages of every layer as the caller lays them out (default ``Layout.from_trace``): one per
    trace layer, in order, with this ``page_bytes``, ``world_size`` and ``sharding``.
    ``sharding``: what the ranks shard (``layout.SHARDINGS``): ``"params"`` (ZeRO-3: every
    state, all-gathers before compute, reduce-scatters after) or ``"states"`` (ZeRO-1: the
    optimizer states only; an all-reduce of the gradients before each update and an all-gather of
    the updated share after). Raises
    ``InfeasiblePlan`` (with ``min_gpu_bytes``; its ``tier`` and ``min_bytes`` name the budget
    that is too small and what it needs) when no plan fits, ``ConfigError`` for bad input.
    """
    t0 = time.perf_counter()
    planner = _checked(trace, budgets, world_size, optimizer_tier, page_bytes, timeline, layout, home_tier, sharding)
    for layer, pages in (cached_state_pages or {}).items():
        check_int(f"cached_state_pages[{layer!r}]", pages, 0)
    result = planner.run(cache_optimizer, cached_state_pages or {})
    result.planning_seconds = time.perf_counter() - t0
    return result


def least_gpu_bytes(trace: Trace, world_size: int = 1, page_bytes: int | str = "4MiB") -> int:
    """The smallest per-rank gpu budget (pages and non-model memory) with which ``plan`` finds a
    plan for ``trace``: what ``InfeasiblePlan.min_gpu_bytes`` reports, without planning."""
    planner = _checked(trace, {"gpu": 1 << 62, "cpu": 1 << 62}, world_size, "cpu", page_bytes, "segment")
    planner._mandatory_gpu()
    return planner.min_gpu


def least_cpu_bytes(trace: Trace, world_size: int = 1, optimizer_tier: str = "cpu", page_bytes: int | str = "4MiB",
                    *, home_tier: str = "cpu", gpu_bytes: int | str | None = None, cache_optimizer: bool = True,
                    cached_state_pages: Mapping[int, int] | None = None, layout: Layout | None = None) -> int:
    """The smallest per-rank cpu budget with which ``plan`` (same arguments) finds a plan for
    ``trace`` with a gpu budget of ``gpu_bytes`` (default ``least_gpu_bytes``, the tightest):
    what ``InfeasiblePlan.min_bytes`` reports for the cpu, without placing any task. With
    ``home_tier="nvme"`` it is the working set: what the updates hold at once (parameter pages need
    none: those the cpu cannot hold move straight from nvme), each streamed update no more than
    its layer's ``stream_pages`` (``layout=``). (It depends on the gpu budget: a roomier gpu
    caches layers.)"""
    gpu = least_gpu_bytes(trace, world_size, page_bytes) if gpu_bytes is None else gpu_bytes
    big = 1 << 62
    planner = _checked(trace, {"gpu": gpu, "cpu": big, "nvme": big}, world_size, optimizer_tier, page_bytes,
                       "segment", layout, home_tier)
    return planner.host_step(cache_optimizer, cached_state_pages or {})[1].cpu_need


def _checked(trace, budgets, world_size, optimizer_tier, page_bytes, timeline, layout=None,
             home_tier="cpu", sharding="params") -> "_Planner":
    """A planner for validated arguments; ConfigError naming the first bad one."""
    if not isinstance(trace, Trace):
        raise ConfigError(f"trace: expected a pagemem.tracer.Trace, got {type(trace).__name__}")
    b = Budgets.parse(budgets)
    check_int("world_size", world_size, 1, 65536)
    check_choice("optimizer_tier", optimizer_tier, ("cpu", "nvme"))
    check_choice("home_tier", home_tier, HOME_TIERS)
    pb = parse_size(page_bytes, "page_bytes")
    if pb <= 0 or pb % 4096:
        raise ConfigError(f"page_bytes: must be a positive multiple of 4096 bytes, got {pb}")
    if timeline not in TIMELINES:
        raise ConfigError(f"timeline: must be one of {sorted(TIMELINES)}, got {timeline!r}")
    check_choice("sharding", sharding, SHARDINGS)
    if sharding == "units" and home_tier != "cpu":
        raise ConfigError(f"home_tier: must be 'cpu' with sharding 'units' (no compute copy at rest to home), "
                          f"got {home_tier!r}")
    if layout is not None:
        if isinstance(layout, Layout) and layout.sharding != sharding:
            raise ConfigError(f"layout: made for sharding {layout.sharding!r}, planning for {sharding!r}")
        if not isinstance(layout, Layout):
            raise ConfigError(f"layout: expected a pagemem.sched.Layout, got {type(layout).__name__}")
        if (layout.page_bytes, layout.world_size) != (pb, world_size):
            raise ConfigError(f"layout: made for {layout.page_bytes}-byte pages and world size {layout.world_size}, "
                              f"planning for {pb} and {world_size}")
        if [l.index for l in layout.layers] != [l.index for l in trace.layers]:
            raise ConfigError("layout: must have one layer per trace layer, in order")
    return _Planner(trace, b, world_size, optimizer_tier, pb, TIMELINES[timeline], layout, home_tier, sharding)


class _Planner:
    def __init__(self, trace: Trace, budgets: Budgets, world_size: int, optimizer_tier: str,
                 page_bytes: int, timeline_cls, layout: Layout | None = None, home_tier: str = "cpu",
                 sharding: str = "params") -> None:
        self.trace = trace
        self.b = budgets
        self.W = world_size
        self.opt_tier = optimizer_tier
        self.home_tier = home_tier
        self.pb = page_bytes
        self.Timeline = timeline_cls
        self.layout = layout if layout is not None else Layout.from_trace(trace, world_size, page_bytes, sharding)
        self.usage = Usage.from_trace(trace)
        self.setting = Setting(self.layout, frozenset(), optimizer_tier, home_tier)
        self.n = len(trace.ops)
        self.wins: list[Window] = self.usage.all_windows()
        # lower bound of each window's move trigger: just after the layer's previous window
        last_end: dict[int, int] = {}
        self.lower = []
        for w in self.wins:
            self.lower.append(last_end.get(w.layer, -1) + 1)
            last_end[w.layer] = w.end
        # where each layer's gradients are reduced, offloaded and applied
        self.r = {g.layer: g.last + 1 for g in self.usage.grads if g is not None}

    def taken(self, operation: str, kind: str, layer: int, tier: str = "gpu", **kw) -> int:
        """Pages on ``tier`` one such task takes (the task table's ``takes``)."""
        return pages_taken(operation, kind, self.setting, layer, tier=tier, **kw).get(tier, 0)

    # ------------------------------------------------------------------ driver

    def run(self, cache_optimizer: bool, cached_state_pages: Mapping[int, int] | None = None) -> Plan:
        gathers, host = self.host_step(cache_optimizer, cached_state_pages or {})
        tasks = emit(Decisions(self.n, self.layout, self.usage, self.wins, self.runs, gathers, self.cached,
                               self.r, host, self.opt_tier, self.home_tier))
        peaks = {"gpu": self.gpu.max(0, self.n + 1), "cpu": host.cpu_peak, "nvme": host.nvme_need}
        return Plan(tasks, self.layout, self.b, self.W, self.opt_tier, self.n, tuple(sorted(self.cached)),
                    self.min_gpu, peaks, self.trace.fingerprint,
                    tuple(op.non_model_bytes for op in self.trace.ops),
                    meta={"windows": len(self.wins), "timeline": self.Timeline.__name__}, home_tier=self.home_tier)

    def host_step(self, cache_optimizer: bool, cached_state_pages: Mapping[int, int]) -> tuple[dict, HostPlan]:
        """Steps 1 to 5: the all-gathers' triggers and what the host tiers step decided."""
        self._mandatory_gpu()
        self._phase1()
        gathers = self._phase2() if self.layout.shards_params else {}
        # a gathered layer (``units``) is gathered again after every update: none stays on the gpu
        cache = cache_optimizer and not self.layout.gathers_units
        self.cached = set(self._cache(cached_state_pages) if cache else [])
        by_window: dict[int, list[tuple[int, int, int]]] = {}
        for run in self.runs:
            by_window.setdefault(run.w, []).append((run.lo, run.hi, run.m))
        moves = [Moves(w, self.wins[w].layer, tuple(by_window[w])) for w in sorted(by_window)]
        host = plan_host(Setting(self.layout, frozenset(self.cached), self.opt_tier, self.home_tier), self.b,
                         self.n, self.Timeline, self.cached, self.r, moves, self.min_gpu)
        return gathers, host

    # ------------------------------------------------------------------ step 1: what must be there

    def _mandatory_gpu(self) -> None:
        n, pb = self.n, self.pb
        base = [op.non_model_bytes for op in self.trace.ops] + [0]
        self.gpu = tl = self.Timeline(base)
        for w in self.wins:  # every page moved and gathered
            per_page = self.taken("move_to_gpu", "param", w.layer) + self.taken("all_gather", "param", w.layer)
            tl.add(w.start, w.end + 1, self.layout.layers[w.layer].param_pages * per_page * pb)
        for g in self.usage.grads:
            if g is None:
                continue
            start = self.usage.windows[g.layer][g.window].start
            r = self.r[g.layer]
            tl.add(start, r + 1, self.taken("compute", "layer", g.layer, produces_grads=True) * pb)
            # the gradient shard reduce_scatter creates (W > 1), offloaded during op r
            shard = self.layout.layers[g.layer].param_pages * self.taken("reduce_scatter", "grad", g.layer)
            tl.add(r, r + 1, shard * pb)
        self.min_gpu = tl.max(0, n + 1)
        if self.min_gpu > self.b.gpu:
            at = tl.last_above(0, n + 1, self.min_gpu - 1)
            op = self.trace.ops[at] if at < n else None
            where = f"{op.phase} of {op.module or 'the model'}" if op else "the end of the iteration"
            raise InfeasiblePlan("gpu", self.min_gpu, self.b.gpu, self.min_gpu, at,
                                 f"{where}: non-model memory plus the layers that must be resident")

    # ------------------------------------------------------------------ step 2: phase 1

    def _prefetch_add(self, run: Run, sign: int) -> None:
        start = self.wins[run.w].start
        if run.m < start:
            self.gpu.add(run.m, start, sign * (run.hi - run.lo) * self.move_bytes)

    def _phase1(self) -> None:
        """Algorithm 1, phase 1, on runs of pages (one timeline update per run, not per page)."""
        self.move_bytes = self.taken("move_to_gpu", "param", 0) * self.pb if self.layout.layers else self.pb
        wins, lower, pb, budget, tl = self.wins, self.lower, self.move_bytes, self.b.gpu, self.gpu
        pages = [self.layout.layers[w.layer].param_pages for w in wins]
        runs: list[Run] = []
        for i, w in enumerate(wins):
            run = Run(i, 0, pages[i], min(lower[i], w.start))
            self._prefetch_add(run, +1)
            runs.append(run)
        keys = [r.w for r in runs]  # runs stay sorted by window index
        wait: list[list[int]] = []  # [window, lo, hi]; top = earliest window
        bounds = [0] + [w.start for w in wins] + [self.n + 1]
        for seg in range(len(bounds) - 1):
            lo, hi = bounds[seg], bounds[seg + 1]
            if lo >= hi:
                continue
            started = seg  # windows 0 .. seg-1 have started by op lo
            # roll back the latest moves while this stretch is over budget
            while True:
                p = tl.last_above(lo, hi, budget)  # the latest op of this stretch over budget
                if p < 0:
                    break
                over = tl.max(p, p + 1) - budget
                k = len(runs) - 1  # the last scheduled move that holds memory at op p
                while k >= 0 and (runs[k].w < started or runs[k].m > p):
                    k -= 1
                if k < 0:
                    raise AssertionError("phase 1 found nothing to roll back though the mandatory memory fits")
                run = runs[k]
                take = min(run.hi - run.lo, -(-over // pb))
                self._prefetch_add(Run(run.w, run.hi - take, run.hi, run.m), -1)
                wait.append([run.w, run.hi - take, run.hi])
                run.hi -= take
                if run.hi == run.lo:
                    del runs[k]
                    del keys[k]
            wait.sort(key=lambda e: -e[0])  # pop() gives the earliest window
            # re-issue waiting moves from here while they fit
            while wait:
                wi, plo, phi = wait[-1]
                t = max(lo, lower[wi])
                start = wins[wi].start
                if t >= start:  # no time left to prefetch: it moves when its window starts
                    wait.pop()
                    self._insert(runs, keys, Run(wi, plo, phi, start))
                    continue
                room = budget - tl.max(t, start)
                k = min(phi - plo, room // pb) if room > 0 else 0
                if k == 0:
                    break
                run = Run(wi, plo, plo + k, t)
                self._prefetch_add(run, +1)
                self._insert(runs, keys, run)
                if plo + k == phi:
                    wait.pop()
                else:
                    wait[-1][1] = plo + k
        for wi, plo, phi in wait:  # still waiting at the end: moved when their window starts
            self._insert(runs, keys, Run(wi, plo, phi, wins[wi].start))
        self.runs = runs

    @staticmethod
    def _insert(runs: list[Run], keys: list[int], run: Run) -> None:
        i = bisect.bisect_right(keys, run.w)
        runs.insert(i, run)
        keys.insert(i, run.w)

    # ------------------------------------------------------------------ step 3: phase 2

    def _phase2(self) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
        """Advance all-gathers: per (window, run start) a list of (lo, hi, trigger)."""
        extra = self.taken("all_gather", "param", 0) * self.pb
        budget, tl = self.b.gpu, self.gpu
        out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for run in self.runs:
            start = self.wins[run.w].start
            pieces = []
            lo, hi = run.lo, run.hi
            while lo < hi:
                if run.m >= start:
                    pieces.append((lo, hi, start))
                    break
                count = hi - lo
                idx = tl.last_above(run.m, start, budget - extra * count)
                g = idx + 1 if idx >= 0 else run.m
                if g < start:
                    tl.add(g, start, extra * count)
                    pieces.append((lo, hi, g))
                    break
                # not even one op early for all of them: advance as many as fit just before start
                room = budget - tl.max(start - 1, start)
                fit = min(count - 1, room // extra) if room > 0 else 0
                if fit <= 0:
                    pieces.append((lo, hi, start))
                    break
                hi_part = lo + fit
                idx = tl.last_above(run.m, start, budget - extra * fit)
                g = idx + 1 if idx >= 0 else run.m
                tl.add(g, start, extra * fit)
                pieces.append((lo, hi_part, g))
                lo = hi_part
            out[(run.w, run.lo)] = pieces
        return out

    # ------------------------------------------------------------------ step 4: caching

    def _cache(self, state_pages: Mapping[int, int]) -> list[int]:
        """Keep layers' model states on the gpu, earliest layers first, while the peak allows
        (a layer's optimizer states counted at ``state_pages``, default its ``optim_pages``)."""
        tl, pb, n = self.gpu, self.pb, self.n
        cached = []
        by_layer: dict[int, list[Run]] = {}
        for run in self.runs:
            by_layer.setdefault(self.wins[run.w].layer, []).append(run)
        for lay in self.layout.layers:
            if lay.index not in self.r:  # no gradients: nothing to update
                continue
            persistent = (lay.param_pages + state_pages.get(lay.index, lay.pages_when_cached)) * pb
            changes = [(0, n + 1, persistent)]
            for run in by_layer.get(lay.index, []):
                start = self.wins[run.w].start
                if run.m < start:  # its prefetch is no longer needed
                    changes.append((run.m, start, -(run.hi - run.lo) * pb))
            for w in self.usage.windows[lay.index]:  # the gathered pages include the resident shard
                changes.append((w.start, w.end + 1, -lay.param_pages * pb))
            for lo, hi, v in changes:
                tl.add(lo, hi, v)
            if tl.max(0, n + 1) <= self.b.gpu:
                cached.append(lay.index)
                for run in by_layer.get(lay.index, []):
                    run.m = self.wins[run.w].start  # no move: the shard is already there
            else:
                for lo, hi, v in changes:
                    tl.add(lo, hi, -v)
                break
        return cached
