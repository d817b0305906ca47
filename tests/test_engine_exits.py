"""Exits through the engine: every ``BaseException`` propagates as itself, after the engine's
bookkeeping is whole, and the engine goes on ([Note: Ctrl-C inside the engine]).

A SIGTERM handler that calls ``sys.exit`` (what schedulers' preemption handlers do) fires at a
chosen point of ``step()`` (a real signal, raised at the n-th Python call inside it, so every
call of the update is a candidate); ``SystemExit``, ``KeyboardInterrupt`` and ``GeneratorExit``
raised by user code the engine calls (an optimizer step hook, the model's forward, an autograd
function's backward); and a real SIGTERM from outside at a random moment of a subprocess that
trains and saves, resumed from its last checkpoint afterwards. The weights must equal plain
PyTorch trained on the batches that counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import pagemem
from exactness_models import OnBackward

D = 64


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(D, D), nn.Tanh())], nn.Linear(D, 1))


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)


def config(path, tier: str, **kw) -> pagemem.EngineConfig:
    if tier == "nvme":
        os.makedirs(path, exist_ok=True)
    store = pagemem.StoreConfig(page_bytes="16KiB", gpu_bytes="256KiB", cpu_bytes="4MiB", gpu_backend="host",
                                nvme_bytes="4MiB" if tier == "nvme" else 0,
                                nvme_path=str(path) if tier == "nvme" else None)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=1e-2, weight_decay=0.1),
                                optimizer_tier=tier, **kw)


class Reference:
    def __init__(self) -> None:
        self.model = make()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    def train(self, i: int) -> None:
        x, y = batch(i)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def differing(engine: pagemem.Engine, ref: Reference) -> list[str]:
    got, want = engine.state_dict(), ref.model.state_dict()
    return [k for k in want if not torch.equal(got[k], want[k])]


class SigtermAt:
    """A real SIGTERM, raised at the ``nth`` Python call made inside the calls it is armed for
    (a profile hook counts them), whose handler (the user's) calls ``sys.exit(143)``."""

    def __init__(self) -> None:
        self.nth, self.calls, self.fired = 0, 0, 0

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            self.calls += 1
            if self.calls == self.nth:
                self.fired += 1
                signal.raise_signal(signal.SIGTERM)

    def run(self, nth: int, fn):
        self.nth, self.calls = nth, 0
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)


@pytest.fixture
def sigterm_exits():
    def handler(signum, frame):
        sys.exit(143)

    old = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, old)


_CALLS: dict[str, int] = {}


def calls_in_a_step(tmp_path, tier: str) -> int:
    """How many Python calls one update makes (its points to land a signal at)."""
    if tier in _CALLS:
        return _CALLS[tier]
    counter = SigtermAt()
    with pagemem.Engine(make(), config(tmp_path / "count", tier)) as engine:
        for i in range(2):
            x, y = batch(i)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            counter.run(-1, engine.step)
    _CALLS[tier] = counter.calls
    return counter.calls


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(where=st.floats(0.0, 1.0), at=st.integers(0, 3))
def test_sigterm_calling_sys_exit_anywhere_in_step_exits_whole(tier, where, at, tmp_path_factory, sigterm_exits):
    """The handler's ``SystemExit(143)`` comes out of ``step()`` as itself (never a PageMemError
    from a cleanup, never a hang); the engine then trains on exactly (a retried ``step()``
    finishes or finds nothing left), saves, and closes."""
    tmp_path = tmp_path_factory.mktemp("exit")
    total = calls_in_a_step(tmp_path, tier)
    nth = max(1, int(where * total * 0.9))  # the steps' call counts vary a little
    term = SigtermAt()
    ref = Reference()
    engine = pagemem.Engine(make(), config(tmp_path / "run", tier))
    try:
        exits = 0
        for i in range(5):
            x, y = batch(i)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            if i == at:
                try:
                    term.run(nth, engine.step)
                except SystemExit as exc:
                    assert exc.code == 143 and term.fired == 1
                    exits += 1
                    engine.step()  # a retry: finishes what is left, or returns False
                else:  # this step made fewer calls than the one counted: the signal never came
                    assert term.fired == 0
            else:
                engine.step()
            ref.train(i)
        assert exits == term.fired
        assert not differing(engine, ref)
        engine.save(str(tmp_path / "ckpt"))
    finally:
        engine.close()
    assert all(type(p) is nn.Parameter for p in engine.module.parameters())


def test_a_held_sigterm_runs_the_users_handler_once_the_call_is_whole(tmp_path, sigterm_exits):
    """The user's handler stays theirs: wrapped while the engine is open, given back at close."""
    with pagemem.Engine(make(), config(tmp_path, "cpu")) as engine:
        assert signal.getsignal(signal.SIGTERM).inner is sigterm_exits
        x, y = batch(0)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        with pytest.raises(SystemExit):
            SigtermAt().run(200, engine.step)  # well inside the update (of ~580 calls)
        assert engine.global_step == 1 and not engine.gradients_pending  # the step landed first
    handler = signal.getsignal(signal.SIGTERM)  # given back when no other engine is open (others may be)
    assert handler is sigterm_exits or handler.inner is sigterm_exits
    with pytest.raises(SystemExit):  # outside the engine the handler runs at once
        signal.raise_signal(signal.SIGTERM)


EXITS = [SystemExit(3), KeyboardInterrupt(), GeneratorExit()]


@pytest.mark.parametrize("exc", EXITS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("where", ["step pre-hook", "step post-hook", "forward", "backward"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_an_exit_raised_by_user_code_inside_a_call_propagates_as_itself(exc, where, tier, tmp_path):
    """User code the engine runs raises a BaseException: it comes out as itself, the engine's
    state is whole, and training goes on exactly (the batch skipped, or the step retried)."""
    ref = Reference()
    model = make()
    armed = {"on": False}

    def maybe_raise(*_a, **_k):
        if armed["on"]:
            armed["on"] = False
            raise exc

    if where == "forward":
        model[2].register_forward_pre_hook(maybe_raise)
    with pagemem.Engine(model, config(tmp_path, tier)) as engine:
        if where == "step pre-hook":
            engine.optimizer.register_step_pre_hook(maybe_raise)
        elif where == "step post-hook":
            engine.optimizer.register_step_post_hook(maybe_raise)
        for i in range(4):
            armed["on"] = i == 2
            x, y = batch(i)
            try:
                out = engine(x)
                if where == "backward":
                    OnBackward.pending[:] = [maybe_raise]
                    out = OnBackward.apply(out)
                engine.backward(nn.functional.mse_loss(out, y))
                engine.step()
            except BaseException as got:
                assert got is exc
                if where in ("forward", "backward"):
                    engine.zero_grad()  # the batch is skipped
                    continue
                if where == "step pre-hook":
                    assert engine.step()  # nothing was updated: the retry updates
            ref.train(i)
        assert not differing(engine, ref)


# ---------------------------------------------------------------- a real SIGTERM from outside

_TRAINER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import torch
    from torch import nn
    import pagemem
    from test_engine_exits import batch, config, make

    work, steps, delay, handler = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    if handler == "exit":
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    ckpt = os.path.join(work, "ckpt")
    model = make()
    if os.path.exists(os.path.join(ckpt, "latest")):
        engine = pagemem.Engine.load(ckpt, model)
    else:
        engine = pagemem.Engine(model, config(os.path.join(work, "nvme"), "nvme"))
    if delay >= 0:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    while engine.global_step < steps:
        x, y = batch(engine.global_step)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.save(ckpt, keep=2)
    torch.save(engine.state_dict(), os.path.join(work, "final.pt"))
    engine.close()
""")


@pytest.mark.parametrize("handler,seed", [("exit", 0)] + [pytest.param(h, s, marks=pytest.mark.slow)
                                                          for h in ("exit", "default") for s in range(4)
                                                          if (h, s) != ("exit", 0)])
def test_a_sigterm_from_outside_exits_and_the_run_resumes_exactly(handler, seed, tmp_path):
    """Killed by SIGTERM at a random moment (its handler calling ``sys.exit(143)``, or none):
    the process exits with 143 (or -SIGTERM) and never hangs; resumed from its last checkpoint
    it ends with the weights of an uninterrupted run."""
    import random

    steps = 8
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER.format(tests=os.path.dirname(__file__)))
    delay = random.Random(seed).uniform(0.5, 4.0)
    first = subprocess.run([sys.executable, str(script), str(tmp_path), str(steps), str(delay), handler],
                           timeout=300, capture_output=True, text=True)
    assert first.returncode in (0, 143, -signal.SIGTERM), first.stderr[-3000:]
    if first.returncode == 143:
        assert "Traceback" not in first.stderr or "SystemExit" in first.stderr, first.stderr[-3000:]
    second = subprocess.run([sys.executable, str(script), str(tmp_path), str(steps), "-1", handler],
                            timeout=300, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    ref = Reference()
    for i in range(steps):
        ref.train(i)
    got = torch.load(tmp_path / "final.pt")
    want = ref.model.state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


# ---------------------------------------------------------------- handlers that call the engine

@pytest.mark.parametrize("call", ["optimizer.state_dict", "model.state_dict", "save"])
def test_a_handler_calling_the_engine_inside_a_state_dict_waits_for_it(call, tmp_path):
    """A SIGUSR1 handler that checkpoints lands while the main thread is itself inside
    ``optimizer.state_dict()``: held until that call is whole (it would deadlock on the store's
    own read otherwise)."""
    model = make()
    ran: list = []
    engine = pagemem.Engine(model, config(tmp_path, "cpu"))
    actions = {"optimizer.state_dict": lambda: engine.optimizer.state_dict(),
               "model.state_dict": lambda: model.state_dict(), "save": lambda: engine.save(str(tmp_path / "c"))}

    def handler(signum, frame):
        actions[call]()
        ran.append(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        for i in range(2):
            x, y = batch(i)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        hits = 0
        for nth in (20, 60, 120, 240):
            def fire(frame, event, arg, nth=nth, box=[0]):
                if event == "call":
                    box[0] += 1
                    if box[0] == nth:
                        signal.raise_signal(signal.SIGUSR1)
            sys.setprofile(fire)
            try:
                engine.optimizer.state_dict()
            finally:
                sys.setprofile(None)
            hits += 1
        assert len(ran) == hits
    finally:
        signal.signal(signal.SIGUSR1, old)
        engine.close()


@pytest.mark.parametrize("call", ["save", "state_dict", "stats"])
def test_a_handler_calling_the_engine_as_a_backward_by_habit_ends(call, tmp_path):
    """The signal lands as ``loss.backward()``'s end callback is entered: the handler's call must
    not take that live backward for one that raised (it did: the batch was dropped, then
    ``AssertionError``); training stays exact."""
    model = make()
    ref = Reference()
    engine = pagemem.Engine(model, config(tmp_path, "cpu"))
    outcomes: list = []
    actions = {"save": lambda: engine.save(str(tmp_path / "c")), "state_dict": engine.state_dict,
               "stats": engine.stats}

    def handler(signum, frame):
        try:
            actions[call]()
            outcomes.append("ran")
        except pagemem.PageMemError as e:  # a clear refusal is fine; a wrong abort is not
            outcomes.append(type(e).__name__)

    armed = [False]

    def fire(frame, event, arg):
        if armed[0] and event == "call" and frame.f_code.co_name == "_end_implicit_backward":
            armed[0] = False
            signal.raise_signal(signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        for i in range(4):
            x, y = batch(i)
            loss = nn.functional.mse_loss(engine(x), y)
            armed[0] = i == 2
            sys.setprofile(fire)
            try:
                loss.backward()
            finally:
                sys.setprofile(None)
            engine.step()
            ref.train(i)
        assert outcomes and engine.stats()["failed_backwards"] == 0
        assert not differing(engine, ref)
    finally:
        signal.signal(signal.SIGUSR1, old)
        engine.close()
