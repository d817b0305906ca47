"""Stateful test of ``Residency`` over gathered units ([Note: gathered units]): a bank that keeps
rank 0 of 2's shares and no compute copy at rest, a stand-in for the ranks' gather (this rank's
share from its master, the other rank's from the true values), and any sequence of stage / bind /
release / ensure / make room / scope holds / views kept alive / the step's release of everything:
bound parameters hold the true values, unbound ones guarded NaN placeholders, a unit at home holds
no compute copy, every staged gather is landed at most once and never read unlanded, and once
nothing pins them the gpu holds exactly the copies of the units that have one."""

from __future__ import annotations


import torch
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule

from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.unit import Unit, UnitState
from test_engine_residency_machine import ResidencyMachine

PAGE = 16 * 1024


class FakeGather:
    """The ranks' gather on one process: rank 0's share from its master shares (what the real
    gather sends), rank 1's from the true values; ``start`` hands back a handle that lands once."""

    def __init__(self, bank: ParamBank, want: dict[int, torch.Tensor]) -> None:
        self.bank, self.want = bank, want
        self.started = self.landed = 0
        self.unlanded: set[int] = set()

    def __call__(self, layer: Unit) -> None:
        self.start(layer).wait()

    def start(self, layer: Unit):
        self.started += 1
        token = self.started
        self.unlanded.add(token)
        shares = self.bank.every_share()
        values = {}
        for i in layer.params:
            whole = self.want[i].reshape(-1).clone()
            a, b = shares[0].ranges[i]
            whole[a:b] = self.bank.host_state(i, "master")  # this rank's share, as sent
            values[i] = whole
        machine = self

        class Handle:
            done = False

            def wait(self) -> None:
                if self.done:
                    return
                self.done = True
                machine.unlanded.discard(token)
                machine.landed += 1
                for i, v in values.items():
                    layer.compute[machine.bank.position[i]].copy_(v.reshape(machine.bank.params[i][1].shape))

        return Handle()


class GatheredResidencyMachine(ResidencyMachine):
    """``ResidencyMachine``'s rules and invariants over a gathered bank, with its own for where
    the compute copies are (the base's expects a home copy on the cpu)."""

    width = 63  # shares that do not divide evenly

    def make_bank(self) -> ParamBank:
        bank = ParamBank(self.model, self.store, torch.float32, "cpu", unit_bytes=PAGE, ranks=(0, 2), gathered=True)
        self.gather = FakeGather(bank, {i: self.want[n] for i, (n, _) in enumerate(bank.params)})
        bank.gather_unit = self.gather
        return bank

    @rule(u=ResidencyMachine.units)
    def settle(self, u):
        before = self.res.state_of(u % self.n)
        self.res.settle(u % self.n)
        assert self.res.state_of(u % self.n) is before  # gathered units are never kept for good

    @precondition(lambda self: not self.held)
    @rule()
    def step_releases_everything_and_nothing_stays_on_the_gpu_once_unpinned(self):
        self.views.clear()
        self.res.release_all()
        assert all(not u.compute for u in self.bank.layers)
        self.bank.drop_compute(self.bank.layers[0])  # frees copies set aside while pinned
        assert self.res.used_pages == 0
        assert not self.gather.unlanded  # a dropped staged gather was waited for

    @invariant()
    def each_state_holds_the_copies_it_says(self):
        for unit in self.bank.layers:
            if unit.state is UnitState.HOME:
                assert not unit.compute
            else:
                assert unit.state in (UnitState.STAGING, UnitState.BOUND, UnitState.ZOMBIE), unit.state
                assert unit.compute and all(t.tiers == {"gpu"} for t in unit.compute)
            if unit.state is not UnitState.STAGING:
                assert not unit.staged
        # only a staging unit's gather may be under way
        assert len(self.gather.unlanded) <= sum(u.state is UnitState.STAGING for u in self.bank.layers)


GatheredResidencyMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestGatheredResidencyMachine = GatheredResidencyMachine.TestCase
