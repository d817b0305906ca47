"""A failed backward is undone, in every mode ([Note: a failed backward is undone] in
``engine/updates/backward_undo.py``).

A backward fails at a chosen layer (``OnBackward`` there raises before that layer's gradients,
after the later layers' were handed off and, with ``overlap_update``, updated) or in its
bookkeeping at the end; the engine must then be where plain PyTorch that never saw the failed
batch is: after the retry and the rest of training, the weights bit for bit those of
``torch.optim.AdamW(fused=True)`` over fp32 masters trained on the batches that counted.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pagemem
from exactness import HP, PAGE, assert_same, engine_config
from exactness_models import OnBackward
from pagemem.engine.gradients import grad_copies
from pagemem.engine.gradients.grad_ledger import GradState
from pagemem.engine.phase import EnginePhase
from pagemem.engine.updates import backward_undo, lockfree

W, L = 128, 4
"""Each layer is larger than the unit cap: one paging unit per layer."""
_g = torch.Generator().manual_seed(11)
X = [torch.randn(4, W, generator=_g) for _ in range(16)]


class Deep(nn.Module):
    """``L`` layers; ``fail_at`` k: ``OnBackward`` on layer k's output, so a backward that fails
    there has handed off layers k+1.. and none of k..0 (None: nowhere)."""

    fail_at: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(L))

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == self.fail_at:
                x = OnBackward.apply(x)
        return x


def make() -> Deep:
    torch.manual_seed(0)
    return Deep()


def loss_for(dtype: torch.dtype):
    def loss_of(run, model, s):
        return run(X[s % len(X)].to(dtype)).float().pow(2).mean()
    return loss_of


def reference(steps: list[list[int]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Plain PyTorch with the engine's precision policy: the model computes in ``dtype``, each
    backward's gradients are summed in fp32 into fp32 master weights, which fused AdamW steps
    and which are cast back (in fp32 this is plain PyTorch's arithmetic, bit for bit)."""
    model = make()
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    model.to(dtype)
    opt = torch.optim.AdamW(master, fused=True, **HP)
    loss_of = loss_for(dtype)
    for step in steps:
        for s in step:
            loss_of(model, model, s).backward()
            for m, p in zip(master, params):
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad + g
                p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m.to(dtype))
    names = [n for n, _ in model.named_parameters()]
    return {n: m.detach() for n, m in zip(names, master)}


@pytest.fixture(autouse=True)
def disarm():
    OnBackward.pending.clear()
    yield
    OnBackward.pending.clear()
    backward_undo.RESTORE_SEAM = None


MODES = {
    # name: (optimizer tier, EngineConfig extras)
    "overlap cpu": ("cpu", dict(overlap_update=True)),
    "overlap gpu": ("gpu", dict(overlap_update=True)),  # stepped in the hook (fp32, states on the gpu)
    "accumulation": ("cpu", dict(overlap_update=False)),
    "accumulation overlap gpu": ("gpu", dict(overlap_update=True)),
    "accumulation nvme": ("nvme", dict()),
    "lock-free": ("cpu", dict(lock_free=True, max_staleness=0)),
    "lock-free nvme": ("nvme", dict(lock_free=True, max_staleness=0)),
}


def open_engine(tmp_path, mode: str, accumulation: int = 1, dtype=torch.float32, **extra):
    tier, kw = MODES[mode]
    if dtype is not torch.float32:
        kw = {**kw, "compute_dtype": dtype, "loss_scale": None}
    kw = {**kw, **extra}
    where = tmp_path / mode.replace(" ", "-")
    where.mkdir(parents=True, exist_ok=True)
    model = make()
    cfg = engine_config(make(), loss_for(torch.float32), where, tier, accumulation_steps=accumulation, **kw)
    if tier == "gpu":  # room for the states kept there (16 bytes a parameter) beside the units
        states = -(-5 * sum(p.numel() * 4 for p in model.parameters()) // PAGE) * PAGE + 16 * PAGE
        cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, gpu_bytes=cfg.store.gpu_bytes + states))
    return model, pagemem.Engine(model, cfg)


def fail_end_once(engine, monkeypatch, exc: BaseException) -> None:
    """The backward's bookkeeping at its end raises once (every gradient handed off by then)."""
    real = engine.pager.end_backward

    def failing():
        monkeypatch.setattr(engine.pager, "end_backward", real)
        raise exc

    monkeypatch.setattr(engine.pager, "end_backward", failing)


def backward_that_fails(engine, model, s: int, at, monkeypatch, habit: bool = False,
                        exc: BaseException | None = None, dtype=torch.float32) -> BaseException:
    """Batch ``s``'s backward, failing at layer ``at`` (or ``"end"``); returns what it raised,
    after the engine found it (a backward by habit is found at the next call)."""
    exc = exc if exc is not None else RuntimeError("backward failed")
    if at == "end":
        fail_end_once(engine, monkeypatch, exc)
        model.fail_at = None
    else:
        model.fail_at = at
        OnBackward.pending[:] = [exc]
    try:
        loss = loss_for(dtype)(engine, model, s)
        with pytest.raises(type(exc)) as raised:
            loss.backward() if habit else engine.backward(loss)
    finally:
        model.fail_at = None
        OnBackward.pending.clear()
    assert raised.value is exc
    if engine.phase.now is EnginePhase.BACKWARD_BY_HABIT:  # found at the next call into the engine, which warns
        assert habit
        with pytest.warns(RuntimeWarning, match="undone, as if this batch had been skipped"):
            assert engine.step() is False  # between accumulation boundaries: it only finds the backward
    elif habit and not getattr(exc, "__notes__", None):  # it failed before its first gradient: no backward
        assert at == L - 1                                # through the engine began (nothing to undo)
    else:
        assert any("undone" in n and "skipped" in n for n in exc.__notes__), exc.__notes__
    return exc


def train(engine, model, steps: list[list[int]], dtype=torch.float32) -> None:
    for step in steps:
        for s in step:
            engine.backward(loss_for(dtype)(engine, model, s))
        assert engine.step()


def trainable_elements(engine) -> int:
    return sum(p.numel() for i, (_, p) in enumerate(engine.bank.params) if engine.bank.is_trainable(i))


# ---------------------------------------------------------------------------- updates during backward


@pytest.mark.parametrize("at", [0, 1, 2, 3, "end"])
@pytest.mark.parametrize("mode", ["overlap cpu", "overlap gpu"])
def test_a_failed_last_backward_undoes_the_updates_made_during_it(mode, at, tmp_path, monkeypatch):
    """Layers after the failing one were updated during the backward; the engine goes on (no
    ``StepFailed``), and the retry of the same batch and the rest train exactly."""
    model, engine = open_engine(tmp_path, mode)
    with engine:
        train(engine, model, [[0], [1]])  # the second step updates during backward
        assert engine.stats()["overlapped_updates"] > 0
        before = engine.state_dict()
        steps_before = [r.steps for r in engine.bank.records]
        exc = backward_that_fails(engine, model, 2, at, monkeypatch)
        handed = L - 1 - at if at != "end" else L
        if handed:
            assert any(f"updates of {2 * handed} parameter(s)" in n for n in exc.__notes__), exc.__notes__
        assert_same(before, engine.state_dict())  # the master weights as before it
        assert [r.steps for r in engine.bank.records] == steps_before
        assert engine.phase.now is EnginePhase.IDLE and not engine.updater.updated_during_backward()
        assert engine.ledger.pending() == []
        stats = engine.stats()
        assert stats["backward_undo_bytes"] == 0
        # master and moments of each parameter updated during it (an update still queued when a
        # backward ends is not kept: nothing can fail it then)
        updated = sum(p.numel() for layer in model.layers[L - handed:] for p in layer.parameters())
        assert 12 * updated <= stats["backward_undo_peak_bytes"] <= 12 * trainable_elements(engine)
        train(engine, model, [[2], [3]])  # the same batch again, then the next
        got = engine.state_dict()
    assert_same(reference([[0], [1], [2], [3]]), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["overlap cpu", "overlap gpu"])
def test_a_failed_last_backward_is_undone_with_a_compute_dtype(mode, dtype, tmp_path, monkeypatch):
    """The compute copy is refreshed from the restored master (cast as an update casts it)."""
    model, engine = open_engine(tmp_path, mode, dtype=dtype)
    with engine:
        train(engine, model, [[0], [1]], dtype)
        assert engine.stats()["overlapped_updates"] > 0
        backward_that_fails(engine, model, 2, 1, monkeypatch, dtype=dtype)
        train(engine, model, [[3], [4]], dtype)  # the next batches: the failed one is skipped
        got = engine.state_dict()
    assert_same(reference([[0], [1], [3], [4]], dtype), got)


# ---------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("mode", ["accumulation", "accumulation overlap gpu", "accumulation nvme"])
@pytest.mark.parametrize("accumulation,failing", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_a_failed_backward_in_an_accumulation_keeps_the_earlier_backwards(mode, accumulation, failing, tmp_path,
                                                                          monkeypatch):
    """The step's earlier backwards count: their sums are restored, ``p.grad`` shows them, the
    phase keeps their count; the step ends with the next batch in place of the failed one."""
    model, engine = open_engine(tmp_path, mode, accumulation)
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), fused=True, **HP)
    with engine:
        train(engine, model, [list(range(accumulation))])
        for s in range(accumulation):
            loss_for(torch.float32)(ref, ref, s).backward()
        opt.step()
        opt.zero_grad()
        first = list(range(accumulation, accumulation + failing))
        for s in first:
            engine.backward(loss_for(torch.float32)(engine, model, s))
            loss_for(torch.float32)(ref, ref, s).backward()
        before = engine.state_dict()
        exc = backward_that_fails(engine, model, 50, 1, monkeypatch)
        if failing:
            assert any(f"the {failing} earlier backward(s) of this step are kept" in n for n in exc.__notes__)
        assert engine.phase.micro == failing
        assert engine.phase.now is (EnginePhase.ACCUMULATED if failing else EnginePhase.IDLE)
        assert_same(before, engine.state_dict())
        stats = engine.stats()
        assert stats["backward_undo_bytes"] == 0
        if failing and mode == "accumulation":  # each sum kept once, before the failed backward added to it
            assert stats["backward_undo_peak_bytes"] == 4 * trainable_elements(engine)
        # p.grad shows the earlier backwards' sums again, as plain PyTorch's p.grad after them
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if failing:
                assert p.grad is not None and torch.equal(torch.linalg.vector_norm(p.grad),
                                                          torch.linalg.vector_norm(q.grad)), name
            else:
                assert p.grad is None, name
        rest = list(range(100, 100 + accumulation - failing))
        train(engine, model, [rest, [20 + k for k in range(accumulation)]])
        got = engine.state_dict()
    assert_same(reference([list(range(accumulation)), first + rest, [20 + k for k in range(accumulation)]]), got)


def test_a_failed_backward_in_an_accumulation_under_loss_scaling(tmp_path, monkeypatch):
    """fp16 with dynamic loss scaling: the restored sums are the scaled earlier ones, and the
    step unscales them as if the failed backward never ran."""
    def run(fail: bool):
        model, engine = open_engine(tmp_path / str(fail), "accumulation", 2, dtype=torch.float16,
                                    loss_scale="dynamic")
        with engine:
            loss = loss_for(torch.float16)
            for s in (0, 1):
                engine.backward(loss(engine, model, s))
            engine.step()
            engine.backward(loss(engine, model, 2))
            if fail:
                backward_that_fails(engine, model, 3, 2, monkeypatch, dtype=torch.float16)
            engine.backward(loss(engine, model, 4))
            engine.step()
            return engine.state_dict(), engine.updater.scaler.scale
    failed, scale_failed = run(True)
    clean, scale_clean = run(False)
    assert scale_failed == scale_clean
    assert_same(clean, failed)


# ---------------------------------------------------------------------------- lock-free


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("mode", ["lock-free", "lock-free nvme"])
def test_lock_free_at_staleness_zero_a_failed_backward_is_as_if_skipped(mode, accumulation, tmp_path, monkeypatch):
    model, engine = open_engine(tmp_path, mode, accumulation)
    with engine:
        train(engine, model, [list(range(accumulation))])
        done = list(range(10, 10 + accumulation - 1))
        for s in done:
            engine.backward(loss_for(torch.float32)(engine, model, s))
        backward_that_fails(engine, model, 5, 2, monkeypatch)
        assert engine.phase.micro == accumulation - 1 and engine.phase.broken is None
        engine.backward(loss_for(torch.float32)(engine, model, 6))
        assert engine.step()
        third = [7 + k for k in range(accumulation)]
        train(engine, model, [third])
        got = engine.state_dict()
    assert_same(reference([list(range(accumulation)), done + [6], third]), got)


def test_lock_free_unbounded_a_failed_backward_into_submitted_sums_is_undone(tmp_path, monkeypatch):
    """The updating thread is held before it takes anything: the failed backward adds into sums
    that hold a submitted iteration (``HANDED_OFF``), which are restored; the run goes on, and
    once the thread is let go every unit holds what the same run without the failed batch holds."""
    def run(fail: bool) -> dict[str, torch.Tensor]:
        gate = threading.Event()
        monkeypatch.setattr(lockfree, "SEAM", lambda where: gate.wait(30) if where == "take" else None)
        model, engine = open_engine(tmp_path / str(fail), "lock-free", max_staleness=None,
                                    synchronous_steps=0)
        with engine:
            try:
                engine.backward(loss_for(torch.float32)(engine, model, 0))
                engine.step()
                if fail:
                    handed = engine.ledger.holding(GradState.HANDED_OFF)
                    assert handed == list(range(len(engine.bank.params)))
                    sums = {i: engine.updater.take_sum(i) for i in handed}
                    backward_that_fails(engine, model, 1, 0, monkeypatch)  # every layer but the first adds
                    assert engine.ledger.holding(GradState.HANDED_OFF) == handed and engine.phase.broken is None
                    assert all(torch.equal(engine.updater.take_sum(i), s) for i, s in sums.items())
                    assert engine.stats()["backward_undo_peak_bytes"] == 4 * sum(
                        p.numel() for layer in model.layers[1:] for p in layer.parameters())
                engine.backward(loss_for(torch.float32)(engine, model, 2))
                engine.step()
                assert engine.stats()["staleness"]["updates"] == 0  # nothing taken yet
            finally:
                gate.set()
            return engine.state_dict()

    assert_same(run(False), run(True))


# ---------------------------------------------------------------------------- every mode, anywhere

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(mode=st.sampled_from(list(MODES)), accumulation=st.integers(1, 3), data=st.data(),
       at=st.sampled_from([0, 1, 2, 3, "end"]), habit=st.booleans(), ctrl_c=st.booleans(),
       retry=st.booleans())
def test_any_failed_backward_in_any_mode_is_as_if_its_batch_was_skipped(mode, accumulation, data, at, habit,
                                                                         ctrl_c, retry, tmp_path_factory):
    if mode.startswith("overlap"):
        accumulation = 1
    failing = data.draw(st.integers(0, accumulation - 1), label="failing backward")
    tmp_path = tmp_path_factory.mktemp("undo")
    mp = pytest.MonkeyPatch()
    grad_copies.DEFER_ON_HOST = True  # copies land only when waited for: the undo must wait too
    try:
        model, engine = open_engine(tmp_path, mode, accumulation)
        with engine:
            warm = [list(range(accumulation)), list(range(10, 10 + accumulation))]
            train(engine, model, warm)  # with overlap_update the next step's last backward updates early
            first = list(range(20, 20 + failing))
            for s in first:
                (engine.backward if not habit else (lambda x: x.backward()))(loss_for(torch.float32)(engine, model, s))
            exc = KeyboardInterrupt() if ctrl_c else RuntimeError("backward failed")
            backward_that_fails(engine, model, 30, at, mp, habit=habit, exc=exc)
            assert engine.phase.broken is None and engine.phase.micro == failing
            again = [30] if retry else [31]
            rest = list(range(40, 40 + accumulation - failing - 1))
            for s in again + rest:
                engine.backward(loss_for(torch.float32)(engine, model, s))
            assert engine.step()
            train(engine, model, [list(range(50, 50 + accumulation))])
            got = engine.state_dict()
            assert engine.stats()["backward_undo_bytes"] == 0
    finally:
        mp.undo()
        grad_copies.DEFER_ON_HOST = False
        OnBackward.pending.clear()
    assert_same(reference(warm + [first + again + rest, list(range(50, 50 + accumulation))]), got)


# ---------------------------------------------------------------------------- what cannot be undone


@pytest.mark.parametrize("mode,accumulation", [("overlap cpu", 1), ("overlap gpu", 1), ("accumulation", 2),
                                               ("lock-free", 1)])
def test_an_undo_that_fails_breaks_the_engine_and_says_so(mode, accumulation, tmp_path, monkeypatch):
    """The pages are then neither the old values nor the new: every later call raises
    ``StepFailed`` until a checkpoint is loaded (never silently wrong)."""
    extra = {"max_staleness": None, "synchronous_steps": 0} if mode == "lock-free" else {}
    model, engine = open_engine(tmp_path, mode, accumulation, **extra)
    with engine:
        train(engine, model, [list(range(accumulation))] * 2)
        saved = engine.save(str(tmp_path / "ckpt"))
        expected = engine.state_dict()  # (unbounded lock-free training is not plain PyTorch's)
        for s in range(accumulation - 1):
            engine.backward(loss_for(torch.float32)(engine, model, 5 + s))
        if mode == "lock-free":  # sums that hold a submitted iteration: hold the thread off them
            gate = threading.Event()
            monkeypatch.setattr(lockfree, "SEAM", lambda where: gate.wait(30) if where == "take" else None)
            engine.backward(loss_for(torch.float32)(engine, model, 6))
            engine.step()
        calls = []

        def broken_restore(i):
            calls.append(i)
            raise OSError("the page could not be written")

        monkeypatch.setattr(backward_undo, "RESTORE_SEAM", broken_restore)
        model.fail_at = 0
        OnBackward.pending[:] = [RuntimeError("backward failed")]
        try:
            with pytest.raises(RuntimeError, match="backward failed") as raised:
                engine.backward(loss_for(torch.float32)(engine, model, 7))
        finally:
            model.fail_at = None
            if mode == "lock-free":
                gate.set()
        assert calls, "nothing was restored"
        assert any("undoing it failed too" in n and "OSError" in n for n in raised.value.__notes__)
        assert engine.phase.now is EnginePhase.BROKEN
        for call in (lambda: engine(X[0]), engine.step, engine.zero_grad, lambda: engine.save(str(tmp_path / "x"))):
            with pytest.raises(pagemem.StepFailed, match="load the last checkpoint"):
                call()
    model = make()
    with pagemem.Engine.load(saved, model) as engine:
        got = engine.state_dict()
    assert_same(expected, got)
