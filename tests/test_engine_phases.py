"""The engine's phase ([Note: engine phases], ``engine/phase.py``): the table of legal moves, and
a state machine that drives a real engine through random sequences of what a training loop calls.

The table: the one in the Note is the one asserted, every move it lacks raises
``AssertionError`` naming both phases, and each named move makes only the moves it says.

The machine: forward + ``engine.backward``, forward + ``loss.backward()`` by habit, either one
failing part-way (an error or Ctrl-C), a backward whose hook calls what is refused during
backward, ``step()``, ``optimizer.step()``, ``zero_grad`` (the engine's or the optimizer's),
``save``, ``state_dict``, ``close`` (and a new engine after it), over three configurations:
synchronous, updates during backward (a backward that fails after them breaks the engine), and
the lock-free updater (a failed backward breaks it too). After every call the phase, counters
and the guard are as a small model says; each refused call raises the documented error, and no
call ever raises ``AssertionError``.
"""

from __future__ import annotations

import inspect
import re
import shutil
import signal
import tempfile
import warnings
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

import pagemem
from pagemem.engine.updates.lockfree import SHARED_SUMS
from pagemem.engine.phase import BACKWARDS, LEGAL, STEPS, EnginePhase, PhaseMachine
from pagemem.errors import InvalidRequest, StepFailed
from exactness import engine_config
from exactness_models import OnBackward

P = EnginePhase

# ---------------------------------------------------------------------------------- the table


def machine_at(phase: EnginePhase, micro: int = 0) -> PhaseMachine:
    """A machine standing in ``phase`` (``micro`` backwards pending, where the phase allows)."""
    if phase is P.IDLE:
        micro = 0
    elif phase is P.ACCUMULATED:
        micro = max(micro, 1)
    return PhaseMachine(phase, micro, broken="torn" if phase is P.BROKEN else None)


def documented_table() -> dict[EnginePhase, frozenset[EnginePhase]]:
    """The legal moves as the Note writes them (the indented block after "Legal moves")."""
    block = inspect.cleandoc(EnginePhase.__doc__ or "").split("Legal moves", 1)[1].split("::", 1)[1]
    rows: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        if not line.strip():
            if rows:
                break
            continue
        m = re.match(r"\s+([A-Z_]+)\s+->(.*)", line)
        if m:
            current = m.group(1)
            rows[current] = m.group(2)
        else:
            rows[current] += " " + line
    table = {}
    for name, targets in rows.items():
        targets = re.sub(r"\[[^\]]*\]", "", targets).replace("(none)", "")
        table[P[name]] = frozenset(P[t.strip()] for t in targets.split(",") if t.strip())
    return table


def test_the_note_writes_the_table_that_is_asserted():
    assert documented_table() == LEGAL
    assert set(LEGAL) == set(EnginePhase)


@pytest.mark.parametrize("old", list(EnginePhase), ids=lambda p: p.name)
def test_every_move_the_table_lacks_asserts(old):
    for new in EnginePhase:
        m = machine_at(old, micro=2)
        if new in LEGAL[old]:
            continue
        with pytest.raises(AssertionError) as raised:
            m._to(new)
        assert old.name in str(raised.value) and new.name in str(raised.value)
        assert m.now is old  # refused moves change nothing


MOVES: dict[str, Callable[[PhaseMachine], Any]] = {
    "begin_backward": lambda m: m.begin_backward(False),
    "begin_backward(implicit)": lambda m: m.begin_backward(True),
    "end_backward": lambda m: m.end_backward(),
    "abort_backward": lambda m: m.abort_backward(None),
    "abort_backward(broken)": lambda m: m.abort_backward("torn"),
    "begin_step(consume)": lambda m: m.begin_step(True),
    "begin_step": lambda m: m.begin_step(False),
    "end_step": lambda m: m.end_step(True),
    "discard": lambda m: m.discard(),
    "close": lambda m: m.close(),
}
"""Each named move, and where it goes from each phase it is legal in (``micro``: 0 / 2)."""
EXPECTED: dict[str, dict[EnginePhase, tuple[EnginePhase, EnginePhase]]] = {
    "begin_backward": {P.IDLE: (P.BACKWARD,) * 2, P.ACCUMULATED: (P.BACKWARD,) * 2},
    "begin_backward(implicit)": {P.IDLE: (P.BACKWARD_BY_HABIT,) * 2, P.ACCUMULATED: (P.BACKWARD_BY_HABIT,) * 2},
    "end_backward": {p: (P.ACCUMULATED,) * 2 for p in BACKWARDS},
    "abort_backward": {p: (P.IDLE, P.ACCUMULATED) for p in BACKWARDS},
    "abort_backward(broken)": {p: (P.BROKEN,) * 2 for p in BACKWARDS},
    "begin_step(consume)": {P.ACCUMULATED: (P.STEPPING,) * 2},
    "begin_step": {P.IDLE: (P.STEPPING_KEEP,) * 2, P.ACCUMULATED: (P.STEPPING_KEEP,) * 2},
    "end_step": {p: (P.IDLE,) * 2 for p in STEPS},
    "discard": {P.IDLE: (P.IDLE,) * 2, P.ACCUMULATED: (P.IDLE,) * 2, **{p: (p, p) for p in BACKWARDS | STEPS}},
    "close": {p: (P.CLOSED,) * 2 for p in EnginePhase if p not in (P.CLOSED, P.STEPPING_KEEP)},
}


@pytest.mark.parametrize("move", list(MOVES))
def test_each_named_move_goes_where_the_note_says_and_asserts_elsewhere(move):
    for old in EnginePhase:
        for micro in (0, 2):
            m = machine_at(old, micro)
            before = m.micro
            if old not in EXPECTED[move]:
                with pytest.raises(AssertionError) as raised:
                    MOVES[move](m)
                assert old.name in str(raised.value)
                assert m.now is old
                continue
            MOVES[move](m)
            assert m.now is EXPECTED[move][old][micro > 0], (move, old, micro)
            assert m.now is old or m.now in LEGAL[old]
            if move == "end_backward":
                assert m.micro == before + 1
            elif move == "abort_backward":  # undone: the earlier backwards count
                assert m.micro == before
            elif move in ("end_step", "discard", "abort_backward(broken)"):
                assert m.micro == 0


def test_leaving_a_step_goes_back_only_from_its_own_phase():
    for consume, phase in ((True, P.STEPPING), (False, P.STEPPING_KEEP)):
        for micro in (0, 2):
            m = machine_at(phase, micro)
            m.leave_step(consume)  # it raised or never ran: back where it began
            assert m.now is (P.ACCUMULATED if micro else P.IDLE) and m.micro == micro
        for other in EnginePhase:
            if other is not phase:
                m = machine_at(other, 2)
                m.leave_step(consume)  # the update landed (or was never this one's): nothing moves
                assert m.now is other


def test_counters_and_reason_follow_the_moves():
    m = PhaseMachine()
    m.begin_backward(False)
    m.end_backward()
    m.begin_backward(True)
    m.end_backward()
    assert (m.now, m.micro) == (P.ACCUMULATED, 2)
    m.begin_step(True)
    m.end_step(taken=True)
    assert (m.now, m.micro, m.per_step, m.taken) == (P.IDLE, 0, 2, True)
    m.begin_step(False)
    m.end_step(taken=False)  # nothing pending: the count of a step stays
    assert (m.per_step, m.taken) == (2, False)
    m.begin_backward(False)
    m.end_backward()
    m.begin_backward(False)
    assert m.abort_backward(None) == 1  # undone: the earlier backward counts
    assert (m.now, m.micro, m.broken) == (P.ACCUMULATED, 1, None)
    m.begin_backward(True)
    assert m.abort_backward("torn") == 0  # the undo failed: nothing counts
    assert (m.now, m.micro, m.broken) == (P.BROKEN, 0, "torn")
    with pytest.raises(StepFailed, match="step: torn"):
        m.require_usable("step")
    m.close()
    with pytest.raises(InvalidRequest, match="save: this engine is closed"):
        m.require_usable("save")
    with pytest.raises(AssertionError):
        PhaseMachine(P.IDLE, micro=1)  # a machine that contradicts itself is refused too


# ---------------------------------------------------------------------------------- Ctrl-C at a move

@pytest.mark.parametrize("habit", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_ctrl_c_held_while_a_backward_begins_aborts_it(habit, tmp_path, monkeypatch):
    """A real SIGINT inside the shielded start of a backward is raised once the phase has moved:
    the backward is aborted as one that failed (found at the next call, by habit), never left
    running (every later backward was refused, or ran unstarted)."""
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss_of, tmp_path)) as engine:
        real = engine.gradients.begin_backward

        def interrupted() -> None:
            monkeypatch.setattr(engine.gradients, "begin_backward", real)
            signal.raise_signal(signal.SIGINT)
            real()

        engine.backward(loss_of(engine, model, 0))
        engine.step()
        monkeypatch.setattr(engine.gradients, "begin_backward", interrupted)
        loss = loss_of(engine, model, 1)
        with pytest.raises(KeyboardInterrupt):
            loss.backward() if habit else engine.backward(loss)
        assert engine.phase.now is (P.BACKWARD_BY_HABIT if habit else P.IDLE)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = loss_of(engine, model, 2)  # finds a backward by habit that raised
        assert sum("the last loss.backward() raised" in str(w.message) for w in seen) == habit
        assert (engine.phase.now, engine.failed_backwards, engine.guard._calls) == (P.IDLE, 1, 0)
        loss.backward() if habit else engine.backward(loss)
        assert (engine.phase.now, engine.phase.micro) == (P.ACCUMULATED, 1)
        assert engine.step() and engine.global_step == 2


# ---------------------------------------------------------------------------------- the machine

D = 16


class Net(nn.Module):
    """Three layers; backward reaches ``OnBackward`` after the last layer's gradients were handed off."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)

    def forward(self, x):
        return self.c(OnBackward.apply(torch.tanh(self.b(torch.tanh(self.a(x))))))


def make() -> Net:
    torch.manual_seed(0)
    return Net()


_g = torch.Generator().manual_seed(5)
X = [torch.randn(4, D, generator=_g) for _ in range(4)]


def loss_of(run, model, s: int) -> torch.Tensor:
    return run(X[s % len(X)]).pow(2).mean()


class Refused(Exception):
    """What a call was expected to raise: ``kind`` whose message holds ``says``."""


class EnginePhases(RuleBasedStateMachine):
    """The model: ``phase`` (``BACKWARD_BY_HABIT`` only for a backward by habit that raised and
    no call has found yet), ``micro``, ``steps``, ``failed``; with lock_free, ``fresh``
    (gradients since the last update); with updates during backward, ``early`` (the last
    backward updated during it; no update since), ``gone`` (an ``optimizer.step()`` kept none
    of those gradients), ``taught`` (a last backward of a step ended: the next one updates early)
    and ``per_step``."""

    kind = "sync"
    """``sync``, ``overlap`` (updates during backward) or ``lock_free``: one machine each."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pagemem-phases-")
        self.engine: pagemem.Engine | None = None

    @initialize(accumulation=st.sampled_from([1, 2]))
    def open(self, accumulation: int) -> None:
        self.accumulation = accumulation
        extra: dict[str, Any] = {"overlap_update": True} if self.kind == "overlap" else {}
        if self.kind == "lock_free":
            extra["lock_free"] = True
        self.cfg = engine_config(make(), loss_of, self.dir, "cpu", accumulation_steps=accumulation, **extra)
        self._new_engine()

    def _new_engine(self) -> None:
        self.model = make()
        self.engine = pagemem.Engine(self.model, self.cfg)
        self.phase, self.micro, self.steps, self.failed = P.IDLE, 0, 0, 0
        self.fresh = self.early = self.gone = self.taught = False
        self.unfound = False
        """A failed backward by habit not found yet, whose gradients are still in the sums (lock_free)."""
        self.per_step: int | None = None
        self.batch = 0

    # ---------------------------------------------------------------- the model's moves

    def _found(self) -> bool:
        """A call that checks the engine is usable: a backward by habit that raised is aborted
        (with a warning). Returns whether one was."""
        if self.phase is not P.BACKWARD_BY_HABIT:
            return False
        self._failed_backward()
        return True

    def _failed_backward(self) -> None:
        """Undone ([Note: a failed backward is undone]): as before it began, its failure counted."""
        self.failed += 1
        self.phase = P.ACCUMULATED if self.micro else P.IDLE
        self.unfound = False

    def _refusal(self) -> tuple[type, str] | None:
        """What every usable-checked call raises now (after ``_found``)."""
        if self.phase is P.CLOSED:
            return InvalidRequest, "this engine is closed"
        if self.phase is P.BROKEN:
            return StepFailed, "load the last checkpoint"
        return None

    def _final(self, habit: bool) -> bool:
        """The backward about to start is the last of its step ([Note: which backward is the
        last of a step])."""
        per_step = self.per_step if self.per_step is not None else (None if habit else self.accumulation)
        return per_step is not None and self.micro + 1 == per_step

    def _updated(self) -> None:
        if self.micro:
            self.per_step = self.micro
        self.micro, self.steps = 0, self.steps + 1
        self.phase = P.IDLE
        self.fresh = False

    def call(self, fn: Callable[[], Any], refused: tuple[type, str] | None, found: bool = False) -> Any:
        """``fn()``, which must raise ``refused`` (its type exactly, its message holding the
        text) or succeed; ``found``: it aborts a backward by habit that raised, with a warning.
        An AssertionError is never expected."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                out = fn()
            except AssertionError:
                raise
            except (InvalidRequest, StepFailed) as exc:
                if refused is None:
                    raise
                assert type(exc) is refused[0] and refused[1] in str(exc), (type(exc), str(exc), refused)
                out = Refused
            else:
                assert refused is None, f"{refused} was not raised"
        notes = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)
                 and "the last loss.backward() raised" in str(w.message)]
        assert bool(notes) == found, (notes, found)
        return out

    # ---------------------------------------------------------------- rules

    def _forward(self) -> torch.Tensor | None:
        """The forward of the next batch; None if it was refused (as expected)."""
        found = self._found()
        refused = self._refusal()
        self.batch += 1
        out = self.call(lambda: loss_of(self.engine, self.model, self.batch), refused, found)
        return None if out is Refused else out

    def _begin_refusal(self) -> tuple[type, str] | None:
        """What starting a backward raises, before any move (updates during backward)."""
        if self.early:
            return InvalidRequest, "the previous backward was the last of a step"
        if self.gone:
            return InvalidRequest, "their gradients are gone"
        return None

    @rule(habit=st.booleans())
    def train(self, habit: bool) -> None:
        loss = self._forward()
        if loss is None:
            return
        refused = self._begin_refusal()
        final = self._final(habit)
        self.call(loss.backward if habit else lambda: self.engine.backward(loss), refused)
        if refused is None:
            self.micro += 1
            self.phase = P.ACCUMULATED
            self.fresh = self.kind == "lock_free"
            if self.kind == "overlap" and final:
                self.early, self.taught = self.taught, True

    @rule(habit=st.booleans(), ctrl_c=st.booleans())
    def backward_fails(self, habit: bool, ctrl_c: bool) -> None:
        loss = self._forward()
        if loss is None:
            return
        refused = self._begin_refusal()
        if refused is not None:  # refused at its start: the failure below never comes
            self.call(loss.backward if habit else lambda: self.engine.backward(loss), refused)
            return
        exc = KeyboardInterrupt() if ctrl_c else RuntimeError("backward failed")

        def fail() -> None:
            raise exc

        OnBackward.pending[:] = [fail]
        try:
            loss.backward() if habit else self.engine.backward(loss)
            raise AssertionError("the backward did not fail")
        except (RuntimeError, KeyboardInterrupt) as raised:
            assert raised is exc, raised
        finally:
            OnBackward.pending.clear()
        # the failed backward handed off the last layer's gradients (and, the last of a step,
        # updated it) before it raised; undone once the engine found it: fresh and early stay
        if habit:
            self.phase = P.BACKWARD_BY_HABIT  # found by the next call
            self.unfound = self.kind == "lock_free"
            return
        assert any("pagemem: the failed backward was undone" in n for n in exc.__notes__), exc.__notes__
        self._failed_backward()

    @rule(habit=st.booleans(), what=st.sampled_from(["backward", "optimizer.step", "step", "close"]))
    def misuse_during_backward(self, habit: bool, what: str) -> None:
        """A hook of the backward calls what is refused while a backward runs; the backward goes
        on and ends as any other."""
        loss = self._forward()
        if loss is None or self._begin_refusal() is not None:
            return
        final = self._final(habit)
        engine, got = self.engine, []

        def misuse() -> None:
            try:
                if what == "backward":
                    engine.backward(torch.ones((), requires_grad=True))
                elif what == "optimizer.step":
                    engine.optimizer.step()
                elif what == "step":
                    got.append(engine.step())
                else:
                    engine.close()
            except InvalidRequest as exc:
                got.append(exc)

        OnBackward.pending[:] = [misuse]
        try:
            self.call(loss.backward if habit else lambda: self.engine.backward(loss), None)
        finally:
            OnBackward.pending.clear()
        says = {"backward": "backward: called while another backward through this engine runs",
                "optimizer.step": "optimizer.step(): called during backward",
                "step": "step(): called during backward", "close": "close: called during backward"}[what]
        if what == "step" and self.micro < self.accumulation:
            assert got == [False], got  # between accumulation boundaries step() only says so
        else:
            assert len(got) == 1 and isinstance(got[0], InvalidRequest) and says in str(got[0]), got
        self.micro += 1
        self.phase = P.ACCUMULATED
        self.fresh = self.kind == "lock_free"
        if self.kind == "overlap" and final:
            self.early, self.taught = self.taught, True

    @rule()
    def step(self) -> None:
        found = self._found()
        refused = self._refusal()
        out = self.call(self.engine.step, refused, found)
        if refused is not None:
            return
        if self.micro < self.accumulation:
            assert out is False
            return
        assert out is True
        self.early = False
        self._updated()

    @rule()
    def optimizer_step(self) -> None:
        found = self._found()
        refused = self._refusal()
        self.call(self.engine.optimizer.step, refused, found)
        if refused is None:
            self.gone, self.early = self.early, False
            self._updated()

    @rule(through=st.sampled_from(["engine", "optimizer"]))
    def zero_grad(self, through: str) -> None:
        found = self._found()
        refused = self._refusal()
        if refused is None and self.kind == "lock_free" and self.fresh:
            refused = InvalidRequest, SHARED_SUMS
        elif refused is None and self.early:
            refused = InvalidRequest, "already applied during backward"
        self.call(self.engine.zero_grad if through == "engine" else self.engine.optimizer.zero_grad, refused, found)
        if refused is None:
            self.micro, self.phase, self.gone = 0, P.IDLE, False

    @rule()
    def save(self) -> None:
        found = self._found()
        refused = self._refusal()
        if refused is None and self.kind == "lock_free" and self.fresh:
            refused = InvalidRequest, "save: call step() first"
        elif refused is None and self.micro:
            refused = InvalidRequest, "save: gradients of an unfinished accumulation are not saved"
        self.call(lambda: self.engine.save(f"{self.dir}/ckpt", keep=1), refused, found)

    @rule()
    def state_dict(self) -> None:
        found = self._found()
        refused = self._refusal()
        if refused is None and self.kind == "lock_free" and self.fresh:
            refused = InvalidRequest, "with lock_free, the weights are whole between step() and the next backward"
        out = self.call(self.engine.state_dict, refused, found)
        if refused is None:
            assert set(out) == set(self.model.state_dict())

    @rule(then=st.lists(st.sampled_from(["forward", "backward", "step", "optimizer.step", "zero_grad",
                                         "optimizer.zero_grad", "save", "state_dict", "close"]), max_size=4))
    def close_and_open_another(self, then: list[str]) -> None:
        """``close()`` from wherever the engine stands (a backward by habit that raised goes with
        it, unfound); every call after it is refused (a second close does nothing); then a new
        engine."""
        e = self.engine
        self.call(e.close, None)
        self.phase = P.CLOSED
        self.the_engine_stands_where_the_model_says()
        calls = {"forward": lambda: e(X[0]), "backward": lambda: e.backward(torch.ones((), requires_grad=True)),
                 "step": e.step, "optimizer.step": e.optimizer.step, "zero_grad": e.zero_grad,
                 "optimizer.zero_grad": e.optimizer.zero_grad, "save": lambda: e.save(f"{self.dir}/ckpt"),
                 "state_dict": e.state_dict, "close": e.close}
        for what in then:
            self.call(calls[what], None if what == "close" else (InvalidRequest, "this engine is closed"))
        self.the_engine_stands_where_the_model_says()
        self._new_engine()

    # ---------------------------------------------------------------- checks

    @invariant()
    def the_engine_stands_where_the_model_says(self) -> None:
        if self.engine is None:
            return
        e = self.engine
        event(self.phase.name)
        assert e.phase.now is self.phase, (e.phase, self.phase)
        assert (e.phase.micro, e.global_step, e.failed_backwards) == (self.micro, self.steps, self.failed)
        if self.phase is not P.CLOSED:
            assert (e.phase.broken is not None) == (self.phase is P.BROKEN)
            assert e.gradients_pending == (self.micro > 0 or self.fresh or self.unfound)
            # a backward holds the guard until it ends or is found failed, never longer
            assert e.guard._calls == (1 if self.phase is P.BACKWARD_BY_HABIT else 0)
        if self.kind == "overlap" and self.phase not in (P.CLOSED, P.BROKEN, P.BACKWARD_BY_HABIT):
            assert e.updater.updated_during_backward() == self.early

    def teardown(self) -> None:
        OnBackward.pending.clear()
        try:
            if self.engine is not None:
                self.engine.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class OverlapPhases(EnginePhases):
    kind = "overlap"


class LockFreePhases(EnginePhases):
    kind = "lock_free"


SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestSyncPhases = EnginePhases.TestCase
TestSyncPhases.settings = SETTINGS
TestOverlapPhases = OverlapPhases.TestCase
TestOverlapPhases.settings = SETTINGS
TestLockFreePhases = LockFreePhases.TestCase
TestLockFreePhases.settings = SETTINGS
