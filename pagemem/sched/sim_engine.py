"""The discrete-event engine of :mod:`pagemem.sched.simulate`: instances of the graph's nodes, one
set per iteration, run on their streams as dependencies, memory and queue order allow."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Mapping

from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.plan import Plan
from pagemem.sched.sim_graph import Node
from pagemem.sched.sim_result import STREAMS, TIERS, SimEvent, SimResult, SimulationDeadlock, SimulationError
from pagemem.units import format_bytes

_EPS = 1e-12


class Engine:
    """Instances of the graph's nodes, one set per iteration: instance ``x = k * N + i`` is node
    ``i`` of iteration ``k``, and ``x`` is also its place in queue order."""

    def __init__(self, plan: Plan, nodes: list[Node], profile: HardwareProfile, K: int) -> None:
        self.plan, self.nodes, self.profile, self.K = plan, nodes, profile, K
        N = self.N = len(nodes)
        total = N * K
        self.budget = {t: plan.budgets[t] for t in TIERS}
        self.used = self._at_rest()
        for t in TIERS:
            if self.used[t] > self.budget[t]:
                raise SimulationError(f"the state at rest needs {format_bytes(self.used[t])} on {t}, "
                                      f"over its budget of {format_bytes(self.budget[t])}")
        self.peak = dict(self.used)
        self.memory: list[tuple[float, int, int]] = [(0.0, self.used["gpu"], self.used["cpu"])]
        self.rev: list[list[tuple[int, int]]] = [[] for _ in range(N)]
        pending_all = [0] * N
        pending_first = [0] * N
        for i, nd in enumerate(nodes):
            for j, off in nd.deps:
                self.rev[j].append((i, off))
                pending_all[i] += 1
                if off == 0:
                    pending_first[i] += 1
        self.pending = pending_first + pending_all * (K - 1)
        self.start = [-1.0] * total
        self.end = [-1.0] * total
        self.dep_ready = [0.0] * total
        self.binder = [-1] * total  # the instance whose finishing let this one start
        self.granted = [-1.0] * total
        self.grant_binder = [-1] * total
        # each stream runs its nodes in queue order; each tier grants its allocations in queue order
        self.order = {s: [i for i, nd in enumerate(nodes) if nd.stream == s] for s in STREAMS}
        self.head = dict.fromkeys(STREAMS, 0)
        self.busy_until = dict.fromkeys(STREAMS, 0.0)
        self.last_on = dict.fromkeys(STREAMS, -1)
        self.running: dict[str, int | None] = dict.fromkeys(STREAMS, None)
        # streams that are one processor run one task at a time between them (HardwareProfile)
        self.shared = frozenset(profile.shared_processor)
        self.processor_free_at = 0.0
        self.processor_last = -1
        self.alloc_order = {t: [i for i, nd in enumerate(nodes) if nd.alloc.get(t, 0) > 0] for t in TIERS}
        self.alloc_next = dict.fromkeys(TIERS, 0)
        self.releases: deque[int] = deque(x for x in range(N) if nodes[x].stream is None and pending_first[x] == 0)
        self.heap: list[tuple[float, int, int]] = []
        self.now = 0.0
        self.done = 0
        self.last_freer = -1
        self.events: list[SimEvent] = []

    def _at_rest(self) -> dict[str, int]:
        p, pb = self.plan, self.plan.page_bytes
        used = dict.fromkeys(TIERS, 0)
        for lay in p.layout.layers:
            if lay.index in p.cached_layers:
                used["gpu"] += (lay.param_pages + lay.optim_pages) * pb
                continue
            if p.home_tier == "cpu":  # nvme homes: the cpu holds only what the queue stages there
                used["cpu"] += lay.param_pages * pb
            if p.optimizer_tier == "cpu":
                used["cpu"] += lay.optim_pages * pb
        return used

    # ---------------------------------------------------------------- state changes

    def _mem(self, delta: Mapping[str, int], sign: int) -> None:
        for t, b in delta.items():
            if b:
                self.used[t] += sign * b
                if self.used[t] > self.peak[t]:
                    self.peak[t] = self.used[t]
        self.memory.append((self.now, self.used["gpu"], self.used["cpu"]))

    def _finish(self, x: int) -> None:
        N, nd = self.N, self.nodes[x % self.N]
        self.end[x] = self.now
        self.done += 1
        if nd.stream is not None:
            self.running[nd.stream] = None
            self.head[nd.stream] += 1
            self.busy_until[nd.stream] = self.now
            self.last_on[nd.stream] = x
            if nd.stream in self.shared:
                self.processor_free_at, self.processor_last = self.now, x
        k, i = divmod(x, N)
        for d, off in self.rev[i]:
            kd = k - off
            if kd >= self.K:
                continue
            y = kd * N + d
            self.pending[y] -= 1
            if self.pending[y] == 0:
                self.dep_ready[y] = self.now
                self.binder[y] = x
                if self.nodes[d].stream is None:
                    self.releases.append(y)

    def _begin(self, x: int, binder: int) -> None:
        nd = self.nodes[x % self.N]
        self.start[x] = self.now
        self.binder[x] = binder
        shrink = {t: b for t, b in nd.alloc.items() if b < 0}
        if shrink:  # a reservation smaller than the one before frees memory
            self._mem(shrink, +1)
            self.last_freer = x
        if nd.stream is not None:
            self.running[nd.stream] = x
        if nd.duration > 0:
            heapq.heappush(self.heap, (self.now + nd.duration, x, x))
        else:
            self._finish(x)

    def _release(self, x: int) -> None:
        nd = self.nodes[x % self.N]
        self.start[x] = self.now
        if any(nd.free.values()):
            self._mem(nd.free, -1)
            self.last_freer = x
        self._finish(x)

    def _at(self, order: list[int], pos: int) -> int | None:
        if not order:
            return None
        k, i = divmod(pos, len(order))
        return None if k >= self.K else k * self.N + order[i]

    def _issued(self, x: int) -> bool:
        iss = self.nodes[x % self.N].issue
        if iss is None:
            return True
        k = x // self.N + iss[1]
        return k < 0 or self.end[k * self.N + iss[0]] >= 0

    def _grant(self) -> bool:
        """Give memory to the next allocations, in queue order per tier, while it fits."""
        changed = False
        for t in TIERS:
            while True:
                x = self._at(self.alloc_order[t], self.alloc_next[t])
                if x is None or not self._issued(x):
                    break
                need = self.nodes[x % self.N].alloc[t]
                if self.used[t] + need > self.budget[t]:
                    break
                self._mem({t: need}, +1)
                self.granted[x] = self.now
                self.grant_binder[x] = self.last_freer
                self.alloc_next[t] += 1
                changed = True
        return changed

    def _step(self) -> None:
        """Start everything that can start now."""
        changed = True
        while changed:
            changed = False
            while self.releases:
                self._release(self.releases.popleft())
                changed = True
            changed |= self._grant()
            for s in STREAMS:
                if self.running[s] is not None:
                    continue
                x = self._at(self.order[s], self.head[s])
                if x is None or self.pending[x] or (self._allocates(x) and self.granted[x] < 0):
                    continue
                on_processor = s in self.shared
                if on_processor and any(self.running[o] is not None for o in self.shared):
                    continue  # the processor is busy with another stream's task
                ready = max(self.dep_ready[x], self.busy_until[s])
                if self.granted[x] > ready + _EPS:
                    binder = self.grant_binder[x]  # it waited for memory
                elif on_processor and self.processor_free_at > ready + _EPS:
                    binder = self.processor_last  # it waited for the processor
                elif self.dep_ready[x] >= self.busy_until[s] and self.binder[x] >= 0:
                    binder = self.binder[x]
                else:
                    binder = self.last_on[s]
                self._begin(x, binder)
                changed = True

    def _allocates(self, x: int) -> bool:
        return any(b > 0 for b in self.nodes[x % self.N].alloc.values())

    def run(self, iterations: int) -> SimResult:
        self._step()
        while self.heap:
            t, _, x = heapq.heappop(self.heap)
            self.now = t
            self._finish(x)
            self._step()
        if self.done < self.N * self.K:
            self._deadlock()
        return self._result(iterations)

    # ---------------------------------------------------------------- reporting

    def _describe(self, x: int) -> str:
        k, i = divmod(x, self.N)
        return f"{self.nodes[i].name} (iteration {k})"

    def _deadlock(self) -> None:
        blocked = []
        unfinished = [x for x in range(self.N * self.K) if self.end[x] < 0]
        for t in TIERS:
            x = self._at(self.alloc_order[t], self.alloc_next[t])
            if x is not None and self._issued(x):
                need = self.nodes[x % self.N].alloc[t]
                blocked.append(f"{t} memory: {self._describe(x)} needs {format_bytes(need)}, "
                               f"{format_bytes(self.budget[t] - self.used[t])} free of {format_bytes(self.budget[t])}")
        for s in STREAMS:
            x = self._at(self.order[s], self.head[s])
            if x is None or self.end[x] >= 0:
                continue
            nd = self.nodes[x % self.N]
            k = x // self.N
            waits = [self._describe((k + off) * self.N + j) for j, off in nd.deps
                     if k + off >= 0 and self.end[(k + off) * self.N + j] < 0]
            if waits:
                why = "waits for " + ", ".join(waits[:3]) + (f" and {len(waits) - 3} more" if len(waits) > 3 else "")
            else:
                why = "waits for its memory"
            blocked.append(f"{s}: {self._describe(x)} {why}")
        raise SimulationDeadlock(self.now, unfinished[0] // self.N, blocked)

    def _result(self, iterations: int) -> SimResult:
        N, nodes = self.N, self.nodes
        first = next(i for i, nd in enumerate(nodes) if nd.iteration_start)
        starts = [self.start[k * N + first] for k in range(self.K)]
        periods = tuple(b - a for a, b in zip(starts, starts[1:]))
        last = iterations - 1
        busy = dict.fromkeys(STREAMS, 0.0)
        for i, nd in enumerate(nodes):
            if nd.stream is not None:
                busy[nd.stream] += nd.duration
        stalls: dict[str, float] = {}
        comp = self.order["compute"]
        seq = [last * N + i for i in comp] + [(last + 1) * N + i for i in comp]
        lo_i = seq.index(last * N + first)
        hi_i = seq.index((last + 1) * N + first)
        for a, b in zip(seq[lo_i:hi_i], seq[lo_i + 1:hi_i + 1]):
            gap = self.start[b] - self.end[a]
            if gap > _EPS:
                self._charge(b, self.end[a], stalls)
        events = []
        for x in range(iterations * N):
            nd = nodes[x % N]
            if nd.export:
                events.append(SimEvent(nd.stream or "", nd.name, x // N, self.start[x], self.end[x]))
        # equal periods are not enough: while a stream has more work per iteration than the
        # period, its backlog still grows, and the period will too
        steady = (len(periods) >= 2 and abs(periods[-1] - periods[-2]) <= 1e-9 * periods[-1]
                  and max(busy.values()) <= periods[last] * (1 + 1e-9))
        return SimResult(periods[last], busy, stalls, dict(self.peak), periods, self.plan.world_size,
                         self.profile, steady, tuple(events), tuple(self.memory))

    def _charge(self, x: int, lo: float, stalls: dict[str, float]) -> None:
        """Charge the wait before ``x`` back to ``lo`` along the chain of what it waited for."""
        t = self.start[x]
        while t > lo + _EPS:
            p = self.binder[x]
            if p < 0:
                stalls["other"] = stalls.get("other", 0.0) + t - lo
                return
            if self.end[p] < t - _EPS:  # it was free earlier, yet x waited: memory held by others
                s = max(lo, self.end[p])
                stalls["memory"] = stalls.get("memory", 0.0) + t - s
                t = s
                if t <= lo + _EPS:
                    return
            s = max(lo, self.start[p])
            if t > s:
                stream = self.nodes[p % self.N].stream or "other"
                stalls[stream] = stalls.get(stream, 0.0) + t - s
            t, x = min(t, s), p
