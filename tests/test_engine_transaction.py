"""A step is a transaction ([Note: a step is a transaction] in ``engine/updates/update.py``; a
backward's side: [Note: a failed backward is undone] in ``engine/updates/backward_undo.py``).

A forward, backward or update that fails part-way leaves the engine where plain PyTorch
training that skipped the failed batch would be, or lets ``step()`` finish the update exactly.
Each case compares the weights with plain PyTorch driven by the operations that succeeded
(``test_engine_backward_undo.py`` fails backwards in every mode).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import pagemem
from pagemem.engine.updates import update as update_module
from exactness import HP, assert_same, engine_config
from exactness_models import OnBackward

_g = torch.Generator().manual_seed(3)
X = [torch.randn(8, 32, generator=_g) for _ in range(8)]


class Net(nn.Module):
    """Three layers; backward fails between the last two (the last has its gradient by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x):
        if getattr(self, "fail_forward", False):
            raise RuntimeError("forward failed")
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(OnBackward.apply(h))


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def loss_of(run, model, s):
    return run(X[s]).pow(2).mean()


def reference(batches: list[list[int]], max_grad_norm=None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: one step per entry, over the backwards of those batch indices."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HP)
    for step in batches:
        for s in step:
            loss_of(model, model, s).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True)
def disarm():
    OnBackward.pending.clear()
    yield
    OnBackward.pending.clear()


def engine_for(tmp_path, optimizer_tier="cpu", **kw):
    model = make()
    return model, pagemem.Engine(model, engine_config(make(), loss_of, tmp_path, optimizer_tier, **kw))


@pytest.mark.parametrize("exc", [RuntimeError("backward failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("habit", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_failed_backward_is_as_if_its_batch_was_skipped(exc, habit, tmp_path):
    model, engine = engine_for(tmp_path)
    with engine:
        for s in range(4):
            if s == 2:
                OnBackward.pending.append(exc)
            try:
                loss = loss_of(engine, model, s)
                loss.backward() if habit else engine.backward(loss)
            except type(exc) as raised:
                assert s == 2
                if not habit:
                    assert any("skipped" in n for n in raised.__notes__)
                continue
            engine.step()
        got = engine.state_dict()
        assert engine.stats()["failed_backwards"] == 1
    assert_same(reference([[0], [1], [3]]), got)


def test_a_failed_backward_in_an_accumulation_keeps_the_earlier_backwards(tmp_path):
    """The sums held part of the failed backward: they are restored, and the step's earlier
    backward counts (it says so); the next backward ends the step."""
    model, engine = engine_for(tmp_path, accumulation_steps=2)
    with engine:
        engine.backward(loss_of(engine, model, 0))
        engine.step()
        engine.backward(loss_of(engine, model, 1))
        engine.step()  # (0, 1): the first step
        engine.backward(loss_of(engine, model, 2))
        OnBackward.pending.append(RuntimeError("backward failed"))
        with pytest.raises(RuntimeError) as raised:
            engine.backward(loss_of(engine, model, 3))
        assert any("the 1 earlier backward(s) of this step are kept" in n for n in raised.value.__notes__)
        for s in (4, 5, 6):
            engine.backward(loss_of(engine, model, s))
            engine.step()
        got = engine.state_dict()
    assert_same(reference([[0, 1], [2, 4], [5, 6]]), got)


def test_a_failed_forward_is_as_if_its_batch_was_skipped(tmp_path):
    model, engine = engine_for(tmp_path)
    with engine:
        for s in range(4):
            model.fail_forward = s == 1
            try:
                loss = loss_of(engine, model, s)
            except RuntimeError:
                continue
            engine.backward(loss)
            engine.step()
        got = engine.state_dict()
    assert_same(reference([[0], [2], [3]]), got)


def fail_once(monkeypatch, target, name, exc, after: int = 0):
    """Make ``target.name`` raise ``exc`` on its ``after``-th call (0-based), once."""
    real = getattr(target, name)
    calls = [0]

    def fake(*args, **kwargs):
        n = calls[0]
        calls[0] += 1
        if n == after:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fake)
    return calls


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
@pytest.mark.parametrize("where", ["update", "refresh"])
@pytest.mark.parametrize("clip", [None, 0.01], ids=["no clip", "clipped"])
def test_a_step_that_fails_part_way_is_finished_exactly_by_the_next_step(optimizer_tier, where, clip, tmp_path,
                                                                         monkeypatch):
    model, engine = engine_for(tmp_path, optimizer_tier, max_grad_norm=clip, adam_threads=1)
    with engine:
        for s in range(2):
            engine.backward(loss_of(engine, model, s))
            engine.step()
        engine.backward(loss_of(engine, model, 2))
        if where == "update":
            fail_once(monkeypatch, update_module, "fused_steps", RuntimeError("adam failed"), after=1)
        else:  # after the master and moments changed: the retry must not step them twice
            fail_once(monkeypatch, engine.bank, "refresh_compute", RuntimeError("refresh failed"), after=1)
        with pytest.raises(pagemem.StepFailed, match="call step\\(\\) again"):
            engine.step()
        with pytest.raises(pagemem.StepFailed):
            engine.backward(loss_of(engine, model, 3))
        with pytest.raises(pagemem.StepFailed):
            engine.zero_grad()
        with pytest.raises(pagemem.StepFailed):
            engine.save(str(tmp_path / "ckpt"))
        assert engine.step()  # finishes the update
        engine.backward(loss_of(engine, model, 3))
        engine.step()
        got = engine.state_dict()
        assert engine.global_step == 4
    assert_same(reference([[0], [1], [2], [3]], max_grad_norm=clip), got)


def test_ctrl_c_while_step_waits_for_its_workers(tmp_path, monkeypatch):
    """Ctrl-C reaches the waiting thread: every task is joined before it propagates, and
    ``step()`` again completes the update (here: all had landed) exactly."""
    from pagemem.engine.updates import adam

    model, engine = engine_for(tmp_path)
    real_wait, waited = adam.wait, []

    def interrupted_wait(futures, *args, **kwargs):
        if futures and not waited:  # the first wait for the update's tasks
            waited.extend(futures)
            raise KeyboardInterrupt
        return real_wait(futures, *args, **kwargs)

    with engine:
        engine.backward(loss_of(engine, model, 0))
        monkeypatch.setattr(adam, "wait", interrupted_wait)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert waited and all(f.done() for f in waited)  # none still writes pages
        assert engine.step()
        engine.backward(loss_of(engine, model, 1))
        engine.step()
        got = engine.state_dict()
    assert_same(reference([[0], [1]]), got)


def test_a_failed_update_during_backward_is_finished_by_step(tmp_path, monkeypatch):
    model, engine = engine_for(tmp_path, overlap_update=True)
    with engine:
        for s in range(2):
            engine.backward(loss_of(engine, model, s))
            engine.step()
        fail_once(monkeypatch, update_module, "fused_steps", RuntimeError("adam failed"), after=0)
        engine.backward(loss_of(engine, model, 2))
        with pytest.raises(pagemem.StepFailed):
            engine.step()
        assert engine.step()
        got = engine.state_dict()
        assert engine.stats()["overlapped_updates"] > 0
    assert_same(reference([[0], [1], [2]]), got)


def test_a_backward_that_fails_after_updates_ran_during_it_is_undone(tmp_path):
    """Updates made during the failed backward are undone (master weights, moments, step
    counts, compute copies as before it): training goes on as if its batch was skipped."""
    model, engine = engine_for(tmp_path, overlap_update=True)
    with engine:
        for s in range(2):
            engine.backward(loss_of(engine, model, s))
            engine.step()
        OnBackward.pending.append(RuntimeError("backward failed"))
        with pytest.raises(RuntimeError) as raised:
            engine.backward(loss_of(engine, model, 2))  # layer c updates before the failure
        assert any("the updates of 2 parameter(s) made during it (overlap_update) were undone" in n
                   for n in raised.value.__notes__), raised.value.__notes__
        engine.backward(loss_of(engine, model, 3))
        engine.step()
        got = engine.state_dict()
        assert engine.stats()["failed_backwards"] == 1
    assert_same(reference([[0], [1], [3]]), got)


def test_engine_zero_grad_discards_accumulated_gradients(tmp_path):
    model, engine = engine_for(tmp_path, accumulation_steps=2)
    with engine:
        engine.backward(loss_of(engine, model, 0))
        engine.zero_grad()
        for s in (1, 2):
            engine.backward(loss_of(engine, model, s))
        assert engine.step()
        got = engine.state_dict()
    assert_same(reference([[1, 2]]), got)


def test_an_engine_refuses_use_after_close(tmp_path):
    model, engine = engine_for(tmp_path)
    engine.backward(loss_of(engine, model, 0))
    engine.step()
    engine.close()
    engine.close()  # twice is fine
    for name, call in {"forward": lambda: engine(X[0]), "backward": lambda: engine.backward(torch.ones(())),
                       "step": engine.step, "zero_grad": engine.zero_grad, "state_dict": engine.state_dict,
                       "save": lambda: engine.save(str(tmp_path / "c"))}.items():
        with pytest.raises(pagemem.InvalidRequest, match=f"{name}: this engine is closed"):
            call()
    assert torch.isfinite(model(X[0])).all()  # the model is plain again, with its trained weights


def test_replacing_the_compute_dtype_gives_its_default_loss_scale():
    cfg = pagemem.EngineConfig(store=pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 24, cpu_bytes=1 << 24))
    assert cfg.effective_loss_scale is None
    half = dataclasses.replace(cfg, compute_dtype=torch.float16)
    assert half.effective_loss_scale == "dynamic"
    off = dataclasses.replace(half, loss_scale=None)
    assert off.effective_loss_scale is None
    assert pagemem.EngineConfig.from_dict(half.to_dict()).effective_loss_scale == "dynamic"
