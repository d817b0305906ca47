"""Each parameter's gradient state ([Note: gradient states] in ``engine/gradients/grad_ledger.py``).

The ledger alone takes random moves, legal and illegal, against the table written here again
(the spec); a real small engine takes random sequences of what training loops do to gradients,
and every parameter's state is checked after each against a simple model of the engine's
rules, and the weights against plain PyTorch where the sequence is one it does the same.
"""

from __future__ import annotations

import re
import threading
import shutil
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

import pagemem
from exactness import HP, assert_same, engine_config
from exactness_models import OnBackward
from pagemem.engine.gradients import grad_copies
from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.gradients.grads import GradHandle

S = GradState
NONE, ACC, SUMMED, UPDATING, APPLIED, HANDED = (S.NONE, S.ACCUMULATING, S.SUMMED, S.UPDATING, S.APPLIED,
                                                S.HANDED_OFF)
LEGAL = {
    (NONE, ACC), (NONE, SUMMED),
    (ACC, ACC), (ACC, SUMMED), (ACC, UPDATING), (ACC, NONE), (ACC, HANDED),
    (SUMMED, ACC), (SUMMED, SUMMED), (SUMMED, NONE), (SUMMED, HANDED),
    (UPDATING, APPLIED), (UPDATING, NONE), (UPDATING, SUMMED),
    (APPLIED, SUMMED), (APPLIED, NONE),
    (HANDED, ACC), (HANDED, NONE),
}
"""The legal moves of [Note: gradient states], written again: the spec the ledger is checked against."""
SHOWN = (ACC, SUMMED, UPDATING, APPLIED)


# ---------------------------------------------------------------------------- the ledger alone


class LedgerMachine(RuleBasedStateMachine):
    UNITS = [0, 0, 1, 1, 2]

    def __init__(self) -> None:
        super().__init__()
        self.names = [f"layer{u}.p{i}" for i, u in enumerate(self.UNITS)]
        self.ledger = GradLedger(self.names, self.UNITS)
        self.state = [NONE] * len(self.UNITS)
        self.copying: set[int] = set()

    def illegal(self, i: int, old: GradState, new: GradState):
        return pytest.raises(AssertionError, match=re.escape(f"'{self.names[i]}': {old.value} -> {new.value}"))

    @rule(i=st.integers(0, 4), new=st.sampled_from(list(GradState)))
    def move(self, i, new):
        old = self.state[i]
        if (old, new) in LEGAL:
            assert self.ledger.move(i, new) is old
            self.state[i] = new
        else:
            with self.illegal(i, old, new):
                self.ledger.move(i, new)

    @rule(olds=st.sets(st.sampled_from([s for s in GradState if s is not NONE]), min_size=1),
          new=st.sampled_from(list(GradState)), unit=st.sampled_from([None, 0, 1, 2]))
    def move_all(self, olds, new, unit):
        targets = [i for i, s in enumerate(self.state) if s in olds and (unit is None or self.UNITS[i] == unit)]
        bad = [i for i in targets if (self.state[i], new) not in LEGAL]
        if bad:
            with self.illegal(bad[0], self.state[bad[0]], new):
                self.ledger.move_all(olds, new, unit=unit)
            return  # checked before any move: none was made
        assert self.ledger.move_all(olds, new, unit=unit) == targets
        for i in targets:
            self.state[i] = new

    @rule(i=st.integers(0, 4))
    def copy_started(self, i):
        if i in self.copying:
            with pytest.raises(AssertionError, match="already in flight"):
                self.ledger.copy_started(i)
        else:
            self.ledger.copy_started(i)
            self.copying.add(i)

    @rule(i=st.integers(0, 4))
    def copy_landed(self, i):
        if i not in self.copying:
            with pytest.raises(AssertionError, match="no copy is in flight"):
                self.ledger.copy_landed(i)
        else:
            self.ledger.copy_landed(i)
            self.copying.discard(i)

    @invariant()
    def the_ledger_answers_as_the_model(self):
        assert [self.ledger.state(i) for i in range(len(self.state))] == self.state
        for s in GradState:
            if s is not NONE:
                assert self.ledger.holding(s) == [i for i, x in enumerate(self.state) if x is s]
                assert self.ledger.count(s) == self.state.count(s)
                for u in set(self.UNITS):
                    assert self.ledger.unit_holds(u, s) == any(x is s and self.UNITS[i] == u
                                                               for i, x in enumerate(self.state))
        assert self.ledger.pending() == [i for i, x in enumerate(self.state) if x in SHOWN]
        assert self.ledger.copying() == sorted(self.copying)
        assert self.ledger.copies_in_flight() == len(self.copying)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------------- a real engine


class Net(nn.Module):
    """Three paging units (each layer is larger than the unit cap); a backward that fails does so
    after the last layer handed its gradients off."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 128)
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 128)

    def forward(self, x):
        return self.c(OnBackward.apply(torch.tanh(self.b(torch.tanh(self.a(x))))))


_g = torch.Generator().manual_seed(5)
X = [torch.randn(4, 128, generator=_g) for _ in range(8)]
LAST = (4, 5)
"""``c.weight``, ``c.bias``: the gradients a failing backward hands off before it fails."""


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def loss_of(run, model, s):
    return run(X[s % len(X)]).pow(2).mean()


class Refused(Exception):
    """The model says the engine raises ``kind`` here, having done what the model did so far;
    ``clean``: having changed nothing at all."""

    def __init__(self, kind: type[BaseException], clean: bool = False) -> None:
        super().__init__(kind.__name__)
        self.kind, self.clean = kind, clean


HANDLE = "handle"


class EngineMachine(RuleBasedStateMachine):
    """Random training-loop moves on a real engine. The model below is the engine's rules for
    gradients, written plainly: ``state`` per parameter, ``grad`` (what ``p.grad`` holds: None,
    our handle, or a tensor assigned by hand), the handles put up, and the counters that decide
    which backward updates during backward. ``comparable`` turns false where the engine knowingly
    differs from plain PyTorch: it refused something after changing what ``p.grad`` shows, or a
    documented limit of ``overlap_update``."""

    overlap = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pagemem-ledger-")
        grad_copies.DEFER_ON_HOST = True  # copies land only when waited for: every reader must wait
        OnBackward.pending.clear()
        self.engine: pagemem.Engine | None = None

    @initialize(acc=st.sampled_from([1, 2]), warm=st.booleans())
    def make_engine(self, acc, warm):
        self.acc = acc
        self.model = make()
        self.engine = pagemem.Engine(self.model, engine_config(make(), loss_of, self.dir, accumulation_steps=acc,
                                                               overlap_update=self.overlap))
        self.params = [p for _, p in self.engine.bank.params]
        units = self.engine.bank.layer_of
        assert len(set(units)) == 3 and units[LAST[0]] == units[LAST[1]] and units.count(units[LAST[0]]) == 2
        self.ref = make()
        self.ref_params = list(self.ref.parameters())
        self.opt = torch.optim.AdamW(self.ref_params, fused=True, **HP)
        n = len(self.params)
        self.state = [NONE] * n
        self.grad: list = [None] * n
        self.up: set[int] = set()
        self.micro, self.per_step, self.fires_known, self.expected_known = 0, None, False, False
        self.deferred = False  # a loss.backward() that failed: the engine aborts it at its next call
        self.before: list[GradState] = []
        """Each parameter's state when the running (or failed, not yet found) backward began."""
        self.failed = self.broken = False
        self.comparable = True
        self.batch = 0
        if warm:  # one step done: the next step's last backward updates during it (overlap_update)
            for _ in range(acc):
                self.backward(habit=False, fail=False)
            self.engine_step()

    def teardown(self) -> None:
        try:
            if self.engine is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    try:
                        self.usable()  # the engine's state_dict aborts a failed loss.backward() first
                    except Refused:
                        self.broken = True
                    if self.comparable and not self.broken and self.holds(UPDATING):
                        self.optimizer_step()  # applied during backward: plain PyTorch's step() does it
                    if self.comparable and not self.broken:
                        assert_same({k: v.detach().clone() for k, v in self.ref.state_dict().items()},
                                    self.engine.state_dict())
                    self.engine.close()
        finally:
            grad_copies.DEFER_ON_HOST = False
            OnBackward.pending.clear()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the model

    def holds(self, *states: GradState) -> list[int]:
        return [i for i, s in enumerate(self.state) if s in states]

    def to(self, i: int, new: GradState) -> None:
        assert (self.state[i], new) in LEGAL, (i, self.state[i], new)
        self.state[i] = new

    def all_to(self, olds: tuple, new: GradState) -> None:
        for i in self.holds(*olds):
            self.to(i, new)

    def usable(self) -> None:
        """Every engine call first aborts a backward by habit that failed."""
        if self.deferred:
            self.deferred = False
            self.abort()
            if self.broken:
                raise Refused(pagemem.StepFailed)

    def abort(self) -> None:
        """The failed backward is undone: every state back to what it was before it, the
        earlier backwards' count kept, their handles up again (every p.grad set meanwhile goes)."""
        for i, old in enumerate(self.before):
            if self.state[i] is not old:
                self.to(i, old)
        self.grad = [None] * len(self.grad)
        self.show()

    def take_back(self) -> None:
        dropped = [i for i in sorted(self.up) if self.grad[i] is None]
        assigned = [i for i, g in enumerate(self.grad) if isinstance(g, torch.Tensor)]
        self.grad = [None] * len(self.grad)
        self.up.clear()
        if dropped:
            if any(self.state[i] is UPDATING for i in dropped):
                raise Refused(pagemem.InvalidRequest)  # applied during backward: step() first
            for i in dropped:
                if self.state[i] is not NONE:
                    self.to(i, NONE)
            if not self.holds(ACC, SUMMED) and self.holds(APPLIED):
                self.comparable = False  # the applied ones go too, while plain PyTorch keeps them
                self.all_to((APPLIED,), NONE)
        for i in assigned:
            if self.state[i] is UPDATING:
                raise Refused(pagemem.InvalidRequest)
            self.to(i, SUMMED)

    def show(self) -> list[int]:
        pending = self.holds(*SHOWN)
        for i in pending:
            if i not in self.up:
                self.up.add(i)
                self.grad[i] = HANDLE
            elif self.grad[i] is None:
                self.grad[i] = HANDLE
        return pending

    def model_backward(self, habit: bool, fail: bool) -> None:
        self.usable()
        if self.holds(UPDATING):  # the last backward of a step already updated: step() first
            raise Refused(pagemem.InvalidRequest, clean=True)
        self.take_back()
        if self.holds(APPLIED):  # applied by optimizer.step(), not in pages: zero_grad() first
            self.show()  # refused, nothing began: the handles go back up
            raise Refused(pagemem.InvalidRequest)
        self.before = list(self.state)
        per_step = self.per_step if self.per_step is not None else (None if habit else self.acc)
        final = per_step is not None and self.micro + 1 == per_step
        early = final and self.fires_known and self.overlap
        for i in (LAST if fail else range(len(self.state))):
            self.to(i, ACC)
            if early:
                self.to(i, UPDATING)
        if fail:
            self.failed = True
            if self.expected_known:  # the last unit handed off as much as in the last backward: final
                self.all_to((ACC,), SUMMED)
            if habit:
                self.deferred = True
            else:
                self.abort()
            return
        self.all_to((ACC,), SUMMED)
        self.fires_known |= final
        self.expected_known = True
        self.micro += 1
        self.show()

    def update(self, consume: bool) -> None:
        self.take_back()
        if consume:
            self.all_to((ACC, SUMMED, UPDATING), NONE)
        else:
            if self.holds(APPLIED):
                self.comparable = False  # plain PyTorch steps them again; they are not in pages
            self.all_to((APPLIED,), NONE)
            self.all_to((UPDATING,), APPLIED)
            self.show()
        if self.micro:
            self.per_step = self.micro
        self.micro = 0

    def run(self, model_step, engine_step, raises: type[BaseException] | None = None) -> bool:
        """The model's move, then the engine's; True when the engine raised nothing."""
        expected = raises
        try:
            model_step()
        except Refused as r:
            expected = r.kind
            self.broken |= r.kind is pagemem.StepFailed
            self.comparable &= r.clean
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if expected is None:
                engine_step()
                return True
            with pytest.raises(expected):
                engine_step()
        return False

    # ------------------------------------------------------------------ the moves

    @precondition(lambda self: not self.broken)
    @rule(habit=st.booleans(), fail=st.booleans())
    def backward(self, habit, fail):
        s = self.batch
        self.batch += 1
        engine, model = self.engine, self.model
        self.failed = False

        def go():
            OnBackward.pending[:] = [RuntimeError("backward failed")] if fail else []
            loss = loss_of(engine, model, s)
            loss.backward() if habit else engine.backward(loss)

        try:
            ok = self.run(lambda: self.model_backward(habit, fail), go, RuntimeError if fail else None)
        finally:
            OnBackward.pending.clear()
        if ok:
            loss_of(self.ref, self.ref, s).backward()
            assert self.engine.bank.copies.in_flight() == 0  # every sum whole once backward returns
        # failed: as if the batch was skipped, the step's earlier backwards kept (the reference saw none of it)

    @precondition(lambda self: not self.broken)
    @rule()
    def engine_step(self):
        updates = []

        def model():
            self.usable()
            if self.micro >= self.acc:
                updates.append(True)
                self.update(consume=True)

        if self.run(model, self.engine.step) and updates:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    @precondition(lambda self: not self.broken)
    @rule()
    def optimizer_step(self):
        def model():
            self.usable()
            self.update(consume=False)

        if self.run(model, self.engine.optimizer.step):
            self.opt.step()

    @precondition(lambda self: not self.broken)
    @rule(how=st.sampled_from(["optimizer", "engine", "model"]))
    def zero_grad(self, how):
        def model():
            if how == "model":  # no engine call: the engine sees it at its next one
                self.grad = [None] * len(self.grad)  # torch's zero_grad sets every p.grad to None
                # after a failed loss.backward() the engine puts the earlier backwards' handles up
                # again at its next call: what was set to None meanwhile is not seen (see below)
                self.comparable &= not self.deferred
                return
            self.usable()  # the engine finds a failed loss.backward() before p.grad is set to None
            self.grad = [None] * len(self.grad)
            try:
                self.take_back()
            except Refused:  # nothing was discarded: the handles go back up
                self.show()
                raise
            if not self.show():
                self.micro = 0

        call = {"optimizer": self.engine.optimizer.zero_grad, "engine": self.engine.zero_grad,
                "model": self.model.zero_grad}[how]
        if self.run(model, call):
            self.ref.zero_grad(set_to_none=True)

    @precondition(lambda self: not self.broken)
    @rule(i=st.integers(0, 5))
    def grad_set_to_none(self, i):
        # after a failed loss.backward() the handles are down until the engine finds it, then go up
        # again: what code set meanwhile cannot be told from autograd's leftovers, and goes
        self.comparable &= not self.deferred
        self.grad[i] = None
        self.params[i].grad = None
        self.ref_params[i].grad = None

    @precondition(lambda self: not self.broken)
    @rule(i=st.integers(0, 5), value=st.sampled_from([0.0, 1e-3, -2e-3]))
    def grad_assigned_by_hand(self, i, value):
        self.comparable &= not self.deferred  # (as grad_set_to_none)
        shape = self.ref_params[i].shape
        self.grad[i] = torch.full(shape, value)
        self.params[i].grad = torch.full(shape, value)
        self.ref_params[i].grad = torch.full(shape, value)

    @precondition(lambda self: self.broken)
    @rule()
    def a_torn_step_refuses_everything(self):
        for call in (lambda: self.engine(X[0]), self.engine.step, self.engine.zero_grad, self.engine.optimizer.step,
                     lambda: self.engine.backward(loss_of(self.engine, self.model, 0))):
            with pytest.raises(pagemem.StepFailed, match="load the last checkpoint"):
                call()

    # ------------------------------------------------------------------ what is checked

    @invariant()
    def every_gradient_state_is_the_models(self):
        if self.engine is None or self.broken:
            return
        got = [self.engine.ledger.state(i) for i in range(len(self.params))]
        assert got == self.state, (got, self.state)
        with torch._C.DisableTorchFunctionSubclass():
            shown = [p.grad for p in self.params]
        for i, (g, want) in enumerate(zip(shown, self.grad)):
            if want is None:
                assert g is None, i
            elif want is HANDLE:
                assert isinstance(g, GradHandle), i
            else:
                assert g is not None and not isinstance(g, GradHandle), i


ENGINE_SETTINGS = settings(max_examples=25, stateful_step_count=20, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow])


class SyncMachine(EngineMachine):
    overlap = False


class OverlapMachine(EngineMachine):
    overlap = True


TestSyncMachine = SyncMachine.TestCase
TestSyncMachine.settings = ENGINE_SETTINGS
TestOverlapMachine = OverlapMachine.TestCase
TestOverlapMachine.settings = ENGINE_SETTINGS


# ---------------------------------------------------------------------------- lock-free


def test_lock_free_gradients_are_summed_handed_off_and_taken(tmp_path, monkeypatch):
    """With ``lock_free`` a backward's gradients are the iteration's (``SUMMED``), ``step()`` hands
    them off, a backward before the updating thread took them adds to the same sums (the next
    iteration's), and the thread's taking them leaves none: two steps each."""
    from pagemem.engine.updates import lockfree

    gate = threading.Event()
    monkeypatch.setattr(lockfree, "SEAM", lambda where: gate.wait(30) if where == "take" else None)
    model = make()
    # the updating thread never waited for (the lock-free default waits in its first steps)
    with pagemem.Engine(model, engine_config(make(), loss_of, tmp_path, lock_free=True, max_staleness=None,
                                             synchronous_steps=0)) as engine:
        states = lambda: {engine.ledger.state(i) for i in range(len(engine.bank.params))}  # noqa: E731
        engine.backward(loss_of(engine, model, 0))
        assert states() == {SUMMED} and engine.gradients_pending
        engine.step()
        assert states() == {HANDED}  # the updating thread waits before taking any
        engine.backward(loss_of(engine, model, 1))
        assert states() == {SUMMED}
        with pytest.raises(pagemem.InvalidRequest, match="lock_free"):
            engine.zero_grad()
        engine.step()
        gate.set()
        engine.state_dict()  # drains
        assert states() == {NONE} and not engine.gradients_pending
        assert {int(s["step"]) for s in engine.optimizer.state_dict()["state"].values()} == {2}


def test_lock_free_step_from_inside_a_backward_is_refused(tmp_path):
    """``engine.step()`` from a hook in the middle of a backward, while a unit's sums are being
    added to, cannot hand them to the updating thread, which takes whole iterations only (as
    ``optimizer.step()`` during backward, it is refused)."""
    def one_unit():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))

    def loss(run, model, s):
        return run(X[s][:, :16]).pow(2).mean()

    model = one_unit()
    with pagemem.Engine(model, engine_config(one_unit(), loss, tmp_path, lock_free=True)) as engine:
        assert len(set(engine.bank.layer_of)) == 1
        engine.backward(loss(engine, model, 0))  # whole: the unit is final once all its gradients came
        def step_in_backward(module, args, out):  # between the last layer's gradients and the first's
            args[0].register_hook(lambda g: engine.step())

        model[2].register_forward_hook(step_in_backward)
        with pytest.raises(pagemem.InvalidRequest, match="called during backward"):
            engine.backward(loss(engine, model, 1))
