"""How the parameters reach the gpu in each iteration: traced warm-up, the plan, or on demand.

Per iteration (one forward and its backward), chosen at the forward call from the inputs'
shapes, dtypes and the other arguments (the *signature*):

- **warm-up**: no plan yet for this signature. The iteration runs under the tracer
  (``pagemem.tracer.Recording`` on the engine's own op clock, so the trace numbers ops as later
  iterations will) with demand paging that keeps the gpu pages plus the non-model bytes recorded
  so far within the budget. At the end of its backward the scheduler plans the trace
  (``pagemem.sched.plan``) and the plan is compiled for the engine's units (``executor.py``).
- **plan**: the executor follows the plan's queue. If an op differs from the trace
  (data-dependent control flow), the rest of the iteration is paged on demand, reserving the
  trace's largest non-model bytes, and the plan is dropped: the next iteration with this
  signature is traced and planned again (a *re-plan*, counted, with a warning the first time).
  A signature that left its plan ``MAX_DIVERGENCES`` times is paged on demand from then on.
- **demand**: no plan can be made (the scheduler finds none for the cpu or nvme budget, or
  ``EngineConfig.executor`` is ``"demand"``), or a forward without gradients (evaluation):
  demand paging. Where the plan finds the *gpu* budget too small, iterations with those inputs
  are refused instead (``OutOfMemory``, [Note: gpu budgets refused early] in ``budget_checks.py``).

Plans are kept per signature (the last ``MAX_PLANS``), so alternating sequence lengths are
traced once each.

[Note: the gpu budget] ``StoreConfig.gpu_bytes`` is the budget for pages *and* non-model memory
(activations, autograd's gradients, temporaries), which come from two pools: the store's gpu
arena, and the allocator (CUDA's caching allocator; host memory for the stand-in). So the engine
sizes the arena from the plan and leaves the rest of the budget to the allocator:
- a plan is made with the trace's largest non-model bytes reserved at every op (one pool cannot
  lend the other what it does not use at an op: ``Trace.with_non_model_peak_reserved``), and its
  planned iterations run with an arena of the pages kept on the gpu at rest (optimizer states
  there) plus the most pages the plan holds at once; the arena is resized
  (``PageStore.resize``) between iterations, after every unit went home, when the next one
  needs another size;
- warm-up (and demand paging without a plan) runs with the arena at the whole budget, since
  the non-model bytes are not known yet: demand paging keeps the pages in use plus the non-model
  bytes within the budget, but on CUDA the arena's idle pages are allocated all the same, so
  that one iteration needs headroom beside the budget for its activations.
The measured peak (``stats()["gpu_peak_bytes"]``) is, per op, the arena sized from a plan (else
the pages in use) plus the non-model bytes: recorded by the tracer in warm-up, the trace's in a
planned iteration, the reserve on demand. On CUDA the tracer reads the non-model bytes from the
caching allocator's peak per op less the arena (which torch allocated); that path has not run yet.
"""

from __future__ import annotations

import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagemem.engine.paging.arena import ArenaSizer
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.budget_checks import refusal
from pagemem.engine.paging.executor import (Executor, ExecutorTotals, PlanMismatch, Schedule, sharding_of,
                                           unit_layout)
from pagemem.engine.units.guard import Guard
from pagemem.engine.units.residency import Residency
from pagemem.engine.paging.peaks import PeakMeter
from pagemem.engine.paging.saved import SavedTensorHooks
from pagemem.engine.units.scopes import Scopes
from pagemem.errors import OutOfMemory, warn
from pagemem.sched import InfeasiblePlan, Plan, plan, validate
from pagemem.tracer import Op, OpClock, Recording, Trace, TraceError, TraceOptions

MAX_PLANS = 8
MAX_DIVERGENCES = 3


def signature(args: tuple, kwargs: dict) -> tuple:
    """What must match for an iteration to follow a plan made for another one."""
    def key(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype), str(v.device), v.requires_grad)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return tuple(key(x) for x in v)
        if isinstance(v, dict):
            return tuple((str(k), key(x)) for k, x in v.items())
        return type(v).__qualname__
    return key(args), key(kwargs)


@dataclass
class SignatureRecord:
    """What the engine knows of the iterations with one input signature (see the module docs)."""

    next: str = "trace"
    """How the next such iteration runs: ``trace`` (warm-up), ``plan`` or ``demand``."""
    schedule: Schedule | None = None
    reserve: int = 0
    """The traced iteration's largest non-model bytes (what demand paging keeps free)."""
    arena_pages: int = 0
    """The gpu arena its planned iterations need."""
    divergences: int = 0
    """Planned iterations that left the plan."""
    digest: int = 0
    """A digest of the plan's tasks and the reserve, which ranks compare ([Note: ranks page alike])."""


class Pager:
    def __init__(self, model: nn.Module, bank: ParamBank, clock: OpClock, optimizer_tier: str,
                 executor: str, guard: Guard | None = None,
                 wait_for_updates: Callable[[Iterable[int]], None] | None = None, world_size: int = 1) -> None:
        """``wait_for_updates(params)``: updates of ``params`` running behind backward have
        landed once it returns (see ``Residency``). ``world_size``: the data-parallel ranks its
        plans are for (the plan's ``states`` sharding: [Note: data parallel over the process
        group])."""
        self.model = model
        self.world_size = world_size
        self.bank = bank
        self.clock = clock
        self.scopes = Scopes(bank.layers)
        self.residency = Residency(bank, guard, wait_for_updates)
        self.store = bank.store
        self._gpu = self.store.tier("gpu")
        self._page_bytes = self.store.page_bytes
        self._budget_pages = self.residency.budget_bytes // self._page_bytes
        self.use_plans = executor == "plan"
        self.plan_tier = optimizer_tier if optimizer_tier in ("cpu", "nvme") else "cpu"
        # pages on the gpu at rest (optimizer states kept there): not the plan's to use, nor in
        # its trace (a plan would count them again, or cache them on the gpu a second time)
        self.static_gpu_pages = self.residency.used_pages
        self.trace_options = TraceOptions(optimizer_model="none" if optimizer_tier == "gpu" else "master_adam")
        self.arena = ArenaSizer(bank, self.residency, self._warn)
        self.records: OrderedDict[tuple, SignatureRecord] = OrderedDict()
        """One record per input signature, the last ``MAX_PLANS`` used."""
        self.iterations: Counter = Counter()
        """Iterations per mode: ``traced``, ``planned``, ``left_plan``, ``demand``."""
        self.replans = 0
        self.mode = "demand"
        self.last_plan: Plan | None = None
        self.last_trace: Trace | None = None
        """The last warm-up's trace (``last_plan`` was made from it, when there is one)."""
        self.plan_note: str | None = None
        """Why the last trace has no plan, if it has none."""
        self.last_divergence: dict[str, Any] | None = None
        """Where the last iteration that left its plan left it (``Executor.divergence``)."""
        self.peaks = PeakMeter(self._gpu, self._page_bytes, self._budget_pages)
        """The measured gpu peak per mode (see the Note)."""
        self.saved = SavedTensorHooks(bank, self.residency, lambda: self._recording, self._resident_for_backward)
        """Autograd's saved-tensor hooks while the engine runs (``saved.py``)."""
        self._sig: tuple | None = None
        self._recording: Recording | None = None
        self._executor: Executor | None = None
        self.executor_totals = ExecutorTotals()
        self._reserve = 0
        self._op_pages: list[int] = []
        self._warned: set[str] = set()
        self.refusals: dict[tuple, OutOfMemory] = {}
        """Input signatures refused: their traced iteration found the gpu budget too small."""
        self.agree: Callable[[list[int]], bool] | None = None
        """With gathered units, whether every rank gives the same values (a collective every rank
        makes, set by the engine): [Note: ranks page alike]."""
        clock.subscribe(self._on_op)

    def forget_plans(self) -> None:
        """Every signature is traced and planned again (the model's ops changed: a parameter was
        frozen or unfrozen)."""
        self.records.clear()
        self.refusals.clear()

    # ------------------------------------------------------------------ iterations

    def begin(self, args: tuple, kwargs: dict) -> None:
        """A forward call starts an iteration: choose how it is paged (see the module docs)."""
        self._abandon()
        self.clock.reset()
        self._executor = None
        sig = signature(args, kwargs)
        self._sig = sig
        if not torch.is_grad_enabled() or not self.use_plans:
            self._start_demand(reserve=0)
            return
        if self.agree is not None and not self._alike(sig):
            self.iterations["unalike"] += 1
            self._start_demand(reserve=self.residency.budget_bytes)  # only what scopes hold: alike on every rank
            return
        if sig in self.refusals:  # the gpu budget is too small for these inputs
            raise self.refusals[sig].with_traceback(None)
        rec = self.records.get(sig)
        if rec is not None and rec.next != "trace":
            self.records.move_to_end(sig)
            if rec.next == "demand" or rec.schedule is None:
                self._start_demand(reserve=rec.reserve)
                return
            self.arena.size(rec.arena_pages)
            self.mode = "plan"
            self._executor = Executor(rec.schedule, self.residency, self.executor_totals)
            self._executor.begin()
            self.iterations["planned"] += 1
            return
        if self.iterations["traced"]:
            self.replans += 1
            self._warn("replan", "pagemem: this iteration differs from the traced ones (other input shapes, "
                                 "or data-dependent control flow): it is traced and planned again. "
                                 "Results are unaffected; engine.stats()['replans'] counts these.")
        self.arena.size(self._budget_pages)
        self.mode = "warmup"
        self.residency.new_iteration()
        self._op_pages = []
        cuda = self._gpu.device if self.store.cuda else None  # non-model bytes from the allocator there
        with self.residency.guard.passthrough():  # it maps where parameters are: not their values
            self._recording = Recording(self.model, self.clock, layers=self.bank.units,
                                        param_nbytes=self.bank.param_nbytes, options=self.trace_options,
                                        cuda_device=cuda, device_model_bytes=self._gpu.capacity * self._page_bytes)

    def _alike(self, sig: tuple) -> bool:
        """[Note: ranks page alike] With gathered units ([Note: gathered units] in
        ``ranks/unit_gather.py``) every fetch is a collective, so every rank must fetch the same
        units in the same order: the ranks must page each iteration alike. A rank's choice (its
        record of these inputs, its plan) follows its own inputs, whose shapes may differ from
        another rank's (each rank padding its batch to its own longest sequence), so before
        each training iteration the ranks compare the digest of their inputs' signature, the way
        each would page it and a digest of the plan (and reserve) it would follow. Alike (the same
        plan on every rank): paged as one process pages it; data-dependent control flow can give
        ranks with alike inputs unalike traces, hence plans, which the digest finds. Not alike: every rank pages
        this iteration on demand keeping only what open module scopes hold (each unit fetched
        at its module's use and given back when no scope holds it), which depends on the modules
        run, not on activation sizes, so every rank fetches alike; nothing is traced or
        recorded, so the records stay alike too. Costs one small collective per iteration, and
        unalike iterations give up the plan's prefetches (``iterations["unalike"]`` counts
        them)."""
        rec = self.records.get(sig)
        way = 3 if sig in self.refusals else 0 if rec is None else {"trace": 0, "plan": 1, "demand": 2}[rec.next]
        assert self.agree is not None
        return self.agree([zlib.crc32(repr(sig).encode()), way, rec.digest if rec is not None else 0])

    def _start_demand(self, reserve: int) -> None:
        self.mode = "demand"
        self._reserve = reserve
        self.residency.new_iteration()
        self.iterations["demand"] += 1

    def end_backward(self) -> None:
        """The iteration's backward is over: plan a warm-up's trace; drop a plan that was left."""
        self.clock.close()  # the last op ends: its releases run
        if self.mode == "warmup" and self._recording is not None:
            recording, self._recording = self._recording, None
            try:
                trace = recording.finish()
            except TraceError as exc:
                self._warn("trace", f"pagemem: the warm-up iteration could not be traced ({exc}); "
                                    "it will be traced again")
                return
            for op_id, pages in enumerate(self._op_pages[:len(trace.ops)]):
                self.peaks.op("warmup", pages, trace.ops[op_id].non_model_bytes)
            self.iterations["traced"] += 1
            self.last_trace = trace
            rec = self.records.setdefault(self._sig, SignatureRecord())
            self.records.move_to_end(self._sig)
            rec.reserve = max((op.non_model_bytes for op in trace.ops), default=0)
            rec.schedule, rec.arena_pages = self._plan(trace)
            rec.next = "plan" if rec.schedule is not None else "demand"
            if self.agree is not None:  # data-dependent control flow gives ranks with alike inputs unalike plans
                tasks = [str(t) for t in self.last_plan.tasks] if rec.schedule is not None and self.last_plan else []
                rec.digest = zlib.crc32(repr((rec.reserve, tasks)).encode())
            while len(self.records) > MAX_PLANS:
                self.records.popitem(last=False)
        elif self.mode == "plan" and self._executor is not None:
            ex = self._executor
            ex.finish()
            if ex.diverged:
                self.iterations["left_plan"] += 1
                self.last_divergence = ex.divergence()
                rec = self.records[self._sig]
                rec.divergences += 1
                rec.schedule, rec.next = None, "trace"
                if rec.divergences >= MAX_DIVERGENCES:
                    rec.next = "demand"
                    self._warn("diverge", f"pagemem: iterations with these inputs left their plan "
                                          f"{MAX_DIVERGENCES} times (data-dependent control flow?); "
                                          "they are paged on demand from now on")

    def _plan(self, trace) -> tuple[Schedule | None, int]:
        """The trace's plan compiled for the engine's units, and the arena its iterations need
        (None, 0 where no plan fits: those iterations are paged on demand)."""
        s = self.store
        pb = s.page_bytes
        gpu = self.residency.budget_bytes - self.static_gpu_pages * pb
        budgets = {"gpu": gpu, "cpu": s.tier("cpu").capacity * pb, "nvme": s.tier("nvme").capacity * pb}
        W = self.world_size
        sharding = "params" if W == 1 else sharding_of(self.bank)
        if self.bank.gathered and sharding == "states":  # homes on nvme: the "states" plan keeps a whole
            # compute copy at home, which a gathered bank does not ([Note: gathered units]): the home
            # tier's budget is given those pages on top
            budgets[self.bank.home_tier] += sum(self.bank.compute_pages(li) for li in range(len(self.bank.layers))) * pb
        try:  # the non-model peak reserved at every op (see the Note)
            # the pages are counted once, by the engine, from its units (see executor.unit_layout)
            p = plan(trace.with_non_model_peak_reserved(), budgets, world_size=W, optimizer_tier=self.plan_tier,
                     page_bytes=pb, layout=unit_layout(trace, self.bank, pb, W), home_tier=self.bank.home_tier,
                     sharding=sharding)
            schedule = Schedule.compile(p, trace, self.bank)
        except InfeasiblePlan as exc:
            self.plan_note = str(exc)
            if exc.tier == "gpu":  # [Note: gpu budgets refused early]
                self.refusals[self._sig] = refusal(exc, self.model, self.bank.units, self.bank.compute_dtype,
                                                   s.config, self.static_gpu_pages)
                self.plan_note = str(self.refusals[self._sig])
                return None, 0
            self._warn("noplan", f"pagemem: no plan fits this iteration ({exc}); it is paged on demand")
            return None, 0
        except PlanMismatch as exc:
            self.plan_note = str(exc)
            self._warn("noplan", f"pagemem: no plan fits this iteration ({exc}); it is paged on demand")
            return None, 0
        report = validate(p, trace)
        # the validated timeline counts cached units' states at what the engine keeps on the gpu
        # (the layout's cached pages), so the arena is the most model bytes it holds at once
        model_bytes = int((report.timeline["gpu"] - report.non_model).max(initial=0))
        arena = self.static_gpu_pages + -(-model_bytes // pb)
        self.last_plan, self.plan_note = p, None
        return schedule, arena

    # ------------------------------------------------------------------ ops

    def _on_op(self, op_id: int, edge: str, op: Op) -> None:
        # the units of a module about to read its parameters (what scopes hold and demand fetches)
        units = (self.residency.units_of(op.params)
                 if edge == "start" and op.params and op.event in ("forward_pre", "backward_pre") else [])
        if edge == "start":
            self.scopes.on_op(op, units)
        ex = self._executor
        if self.mode == "plan" and ex is not None:
            ex.on_op(op_id, edge, op)
            if not ex.diverged:
                if edge == "start" and ex.n_ops == op_id + 1:  # an op of the plan ran its actions
                    self.peaks.op("plan", self.residency.used_pages, ex.schedule.non_model[op_id])
                return
            if edge == "start" and ex.diverged_at == op_id:  # left the plan here: on demand from now on
                self._reserve = max(ex.schedule.non_model, default=0)
        if edge != "start" or op.event == "step":
            return
        res = self.residency
        reserve = self._recording.live_bytes if self._recording is not None else self._reserve
        # warm-up keeps only what open scopes hold (its non-model peak is known only once it ends)
        res.make_room(units, res.budget_bytes if self.mode == "warmup" else reserve)
        if units:
            res.ensure(units, reserve, stage_next=self.mode != "warmup")
        if self.mode == "warmup":
            self._op_pages.append(res.used_pages)
        else:
            self.peaks.op(self.mode, res.used_pages, reserve)

    # ------------------------------------------------------------------ unforeseen reads

    def fetch_unforeseen(self, i: int) -> None:
        """Parameter ``i`` is read where no scope holds it (see [Note: evicted parameters])."""
        self._make_resident(i, grads=False)

    def _resident_for_backward(self, i: int, grads: bool) -> None:
        """Autograd unpacks a saved parameter: resident, under the clock's lock as every hook."""
        with self.clock.lock:
            self._make_resident(i, grads)

    def _make_resident(self, i: int, grads: bool) -> None:
        u = self.bank.layer_of[i]
        if self.mode == "plan" and self._executor is not None and not self._executor.diverged:
            self.residency.bind(u)
        else:
            reserve = self._recording.live_bytes if self._recording is not None else self._reserve
            self.residency.ensure([u], reserve)
        if self._recording is not None:
            self._recording.touch_params((i,), grads=grads)

    # ------------------------------------------------------------------ the rest

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def _abandon(self) -> None:
        self.scopes.clear()
        if self._recording is not None:
            self._recording.abandon()
            self._recording = None

    def stats(self) -> dict[str, Any]:
        res = self.residency
        p = self.last_plan
        return {
            "mode": self.mode,
            "iterations": dict(self.iterations),
            "replans": self.replans,
            **self.peaks.stats(),
            "gpu_arena_bytes": self._gpu.capacity * self._page_bytes,
            "arena_resizes": self.arena.resizes,
            "fetches": res.fetches, "prefetches": res.prefetches, "evictions": res.evictions,
            "misses": res.misses, "host_stages": res.host_stages, "gpu_wait_seconds": res.wait_seconds,
            "executor_seconds": self.executor_totals.seconds, "executor_releases": self.executor_totals.releases,
            "plan": None if p is None else {
                "tasks": len(p.tasks), "counts": dict(p.counts()), "cached_layers": len(p.cached_layers),
                "predicted_gpu_peak_bytes": p.predicted_peak["gpu"], "min_gpu_bytes": p.min_gpu_bytes,
                "planning_seconds": p.planning_seconds},
            "plan_note": self.plan_note,
            "left_plan_at": self.last_divergence,
        }

    def close(self) -> None:
        self._abandon()
        self.residency.release_all()
