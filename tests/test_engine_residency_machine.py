"""Stateful test of ``Residency``: any sequence of stage / bind / release / ensure / make room /
scope holds / views kept alive leaves every unit in a legal state, its parameters either the
true values (bound) or NaN placeholders behind the guard (not bound), and held units bound."""

from __future__ import annotations

import threading

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn

import pagemem
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.guard import Guard, GuardedParameter
from pagemem.engine.units.residency import Residency
from pagemem.engine.units.unit import UnitState
from pagemem.engine.units.scopes import Scopes
from pagemem.errors import OutOfMemory

PAGE = 16 * 1024


class Held:
    """Stands for the op clock's events: hold and let go of units directly."""


class ResidencyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(*(nn.Linear(32, self.width) for _ in range(5)))
        self.want = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        cfg = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=4 * PAGE, cpu_bytes=64 * PAGE)
        self.store = pagemem.PageStore(cfg)
        self.bank = self.make_bank()
        self.scopes = Scopes(self.bank.layers)
        self.guard = Guard(self.bank.params, self._fetch, threading.RLock(),
                           resident=lambda i: self.bank.layers[self.bank.layer_of[i]].bound)
        self.res = Residency(self.bank, self.guard)
        self.n = len(self.bank.layers)
        self.views: list[torch.Tensor] = []
        self.held: list[int] = []

    width = 64

    def make_bank(self) -> ParamBank:
        return ParamBank(self.model, self.store, torch.float32, "cpu", unit_bytes=PAGE)

    def _fetch(self, i: int) -> None:
        self.res.ensure([self.bank.layer_of[i]])

    def teardown(self) -> None:
        self.views.clear()
        self.res.release_all()
        self.store.close()

    units = st.integers(0, 4)

    @rule(u=units, action=st.sampled_from(["stage", "bind", "ensure"]))
    def bring(self, u, action):
        """Stage, bind or ensure a unit; no room is an allowed outcome (OutOfMemory changes nothing)."""
        u %= self.n
        call = {"stage": lambda: self.res.stage(u), "bind": lambda: self.res.bind(u),
                "ensure": lambda: self.res.ensure([u])}[action]
        try:
            call()
        except OutOfMemory:
            pass

    @rule(u=units)
    def settle(self, u):
        """A unit the plan keeps on the gpu for good: its gpu copy becomes the only one."""
        self.res.settle(u % self.n)

    @rule(u=units)
    def release(self, u):
        self.res.release(u % self.n)

    @rule()
    def make_room(self):
        self.res.make_room([], self.res.budget_bytes)

    @rule(u=units)
    def keep_a_view(self, u):
        """A tensor derived from a bound parameter outlives its binding (autograd saved it)."""
        u %= self.n
        if self.res.is_bound(u):
            p = self.bank.params[self.bank.layers[u].params[0]][1]
            with torch._C.DisableTorchFunctionSubclass():
                self.views.append(p.data[:1])

    @rule()
    def drop_views(self):
        self.views.clear()

    @precondition(lambda self: len(self.held) < 2)
    @rule(u=units)
    def hold(self, u):
        u %= self.n
        try:
            self.res.ensure([u])
        except OutOfMemory:
            return
        self.scopes._open_forward(len(self.held), (u,), False)
        self.held.append(u)

    @precondition(lambda self: self.held)
    @rule()
    def let_go(self):
        self.held.pop()
        self.scopes._close_forward(len(self.held))

    @rule()
    def release_all(self):
        if not self.held:
            self.res.release_all()

    @invariant()
    def parameters_are_true_values_or_guarded_nan(self):
        for i, (name, p) in enumerate(self.bank.params):
            u = self.bank.layer_of[i]
            with torch._C.DisableTorchFunctionSubclass():
                data = p.data
            if self.res.is_bound(u):
                assert type(p) is nn.Parameter or isinstance(p, GuardedParameter)
                assert torch.equal(data, self.want[name]), name
            else:
                assert isinstance(p, GuardedParameter), name
                assert data.isnan().all(), name

    @invariant()
    def held_units_stay_bound_and_the_gpu_holds_its_pages(self):
        for u in self.held:
            assert self.res.is_bound(u)
        assert self.res.used_pages <= self.store.tier("gpu").capacity
        for u in range(self.n):
            assert self.res.state_of(u) in UnitState

    @invariant()
    def each_state_holds_the_copies_it_says(self):
        """[Note: unit states]: where a unit's compute pages are follows from its state."""
        for unit in self.bank.layers:
            tiers = set().union(*(t.tiers for t in unit.compute))
            if unit.state in (UnitState.KEPT, UnitState.PARKED):
                assert tiers == {"gpu"}, (unit.state, tiers)
            elif unit.state is UnitState.HOME:
                assert tiers == {"cpu"}, (unit.state, tiers)
            else:  # a replica beside the home copy (staging: part of one)
                assert "cpu" in tiers, (unit.state, tiers)
            assert unit.bound == (unit.state in (UnitState.BOUND, UnitState.KEPT))
            assert unit.holds >= 0 and unit.soft_holds >= 0

    @invariant()
    def a_read_of_an_evicted_parameter_fetches_it(self):
        name, p = self.bank.params[0]
        if not self.res.is_bound(0) and not self.held:
            try:
                assert torch.equal((p * 1).detach(), self.want[name])
            except OutOfMemory:
                pass


ResidencyMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestResidencyMachine = ResidencyMachine.TestCase
