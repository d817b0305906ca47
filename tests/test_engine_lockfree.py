"""The lock-free updater ([Note: the lock-free updater] in ``engine/updates/lockfree.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pagemem
from pagemem.engine.updates import lockfree, lockfree_thread
from pagemem.engine.updates import update as update_module
from exactness import assert_same, engine_config, reference, same_loop, train_both
from test_engine_exactness import CASES, hf_model, lm_loss

TIERS = ["cpu", "nvme", "nvme+homes"]
UNBOUNDED = {"max_staleness": None, "synchronous_steps": 0}
"""The paper's behaviour: never waits (the default bounds the staleness: [Note: the lock-free default])."""


def train(engine, model, loss, steps: range) -> None:
    for s in steps:
        engine.backward(loss(engine, model, s))
        engine.step()


def nvme_config(tmp_path, **kw):
    """The lock-free engine over ``parameter read after a child`` with states on nvme."""
    make, loss = CASES["parameter read after a child"]
    (tmp_path / "nvme").mkdir()
    return make, loss, engine_config(make(), loss, tmp_path / "nvme", "nvme", lock_free=True, **kw)


# ---------------------------------------------------------------- max_staleness=0 is synchronous


@pytest.mark.parametrize("optimizer_tier", TIERS)
@pytest.mark.parametrize("case", ["parameter read after a child", "class token and position embedding"])
def test_max_staleness_zero_is_bit_identical_to_synchronous_training(case, optimizer_tier, tmp_path):
    make, loss = CASES[case]
    stats = train_both(make, loss, 5, tmp_path, optimizer_tier=optimizer_tier, lock_free=True, max_staleness=0)
    assert stats["staleness"]["max"] == 0 and stats["staleness"]["updates"] > 0


@pytest.mark.parametrize("optimizer_tier", TIERS)
def test_max_staleness_zero_on_hugging_face_gpt2(optimizer_tier, tmp_path):
    train_both(hf_model("gpt2"), lm_loss, 4, tmp_path, optimizer_tier=optimizer_tier, lock_free=True,
               max_staleness=0)


def test_max_staleness_zero_with_groups_a_scheduler_and_accumulation(tmp_path):
    """Each update takes the hyperparameters of its iteration's ``step()``; the backwards of an
    accumulation are summed as in synchronous training."""
    make, loss = CASES["parameter read after a child"]

    def groups(model):
        decay, no_decay = pagemem.decay_groups(model, weight_decay=0.2)
        no_decay["lr"] = 1e-3
        return [decay, no_decay]

    def scheduler(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    train_both(make, loss, 5, tmp_path, groups=groups, scheduler=scheduler, lock_free=True, max_staleness=0)


def test_under_max_staleness_zero_step_does_not_wait_but_a_read_of_a_unit_not_updated_does(tmp_path, monkeypatch):
    """[Note: reads between steps]: ``step()`` returns while its update runs (the loop's own work
    overlaps it); a read of a parameter whose unit is not updated yet waits for it, and then
    reads synchronous training's value."""
    make, loss = CASES["parameter read after a child"]
    want = reference(make, loss, 2)
    model = make()
    cfg = engine_config(make(), loss, tmp_path, lock_free=True, max_staleness=0)
    release, blocking, left = threading.Event(), threading.Event(), threading.Event()

    def seam(where):
        if where == "update" and blocking.is_set():
            release.wait(10)
            left.set()

    monkeypatch.setattr(lockfree, "SEAM", seam)
    with pagemem.Engine(model, cfg) as engine:
        engine.backward(loss(engine, model, 0))
        engine.step()
        engine.backward(loss(engine, model, 1))
        blocking.set()  # the updating thread stops at its next update until released
        engine.step()
        returned_before_release = not left.is_set()  # the updating thread is still held
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(
            {n: p.detach().clone() for n, p in model.named_parameters()}))
        reader.start()
        reader.join(0.5)
        read_waited = reader.is_alive()
        release.set()
        reader.join(30)
    assert returned_before_release and read_waited
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("where", ["read", "forward"])
def test_a_write_of_published_updates_that_raises_loses_none(where, tmp_path, monkeypatch):
    """An exception (a Ctrl-C, a failed write) while published updates are written into the
    buffered parameters puts the unwritten ones back: the next read or forward writes them and
    nothing waits forever for an update nobody holds (the attack: every later wait hung)."""
    make, loss = CASES["parameter read after a child"]
    want = reference(make, loss, 3)
    model = make()
    cfg = engine_config(make(), loss, tmp_path, lock_free=True, max_staleness=0)
    raised = []

    def seam(at):
        if at == "drain" and not raised:
            raised.append(at)
            raise KeyboardInterrupt

    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a regression hangs: end the run with the stacks
    with pagemem.Engine(model, cfg) as engine:
        engine.backward(loss(engine, model, 0))
        engine.step()
        engine.backward(loss(engine, model, 1))
        monkeypatch.setattr(lockfree, "SEAM", seam)
        with pytest.raises(KeyboardInterrupt):
            engine.step()  # its non-blocking write of what was published
            if where == "read":
                [p.detach() for p in model.parameters()]
            else:
                loss(engine, model, 2)
        assert raised
        engine.backward(loss(engine, model, 2))
        engine.step()
        got = engine.state_dict()
    faulthandler.cancel_dump_traceback_later()
    assert_same(want, got)


def test_the_staleness_histogram_counts_steps_under_accumulation(tmp_path):
    """One record per unit per step, as ``iterations`` counts steps, not one per forward of an
    accumulation (found by an attack: 12 forwards of 6 steps were 156 records of 13 units)."""
    make, loss = CASES["parameter read after a child"]
    model = make()
    cfg = engine_config(make(), loss, tmp_path, max_staleness=0, lock_free=True, accumulation_steps=2)
    with pagemem.Engine(model, cfg) as engine:
        for s in range(6):
            engine.backward(loss(engine, model, s))
            engine.step()
        st = engine.stats()["staleness"]
        units = sum(1 for u in engine.bank.layers if any(engine.bank.is_trainable(i) for i in u.params))
    assert st["iterations"] == 3 and sum(st["histogram"].values()) == 3 * units


@pytest.mark.parametrize("optimizer_tier", TIERS)
@pytest.mark.parametrize("case", ["parameter read after a child", "class token and position embedding"])
def test_reads_between_steps_under_max_staleness_zero_are_synchronous_training(case, optimizer_tier, tmp_path):
    """Between ``step()`` and the next forward, what a loop reads (an EMA, logging, an
    evaluation) is the weights synchronous training holds: ``named_parameters``,
    ``model.state_dict()``, a direct call of the model, a forward hook's view and a
    ``torch.func.functional_call``, bit for bit (one update behind before)."""
    make, loss = CASES[case]
    seen: list[list[torch.Tensor]] = []

    def loop(run, model, opt, s, loss):
        loss(run, model, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            reads = [p.detach().clone() for _, p in model.named_parameters()]
            reads += [v.detach().clone() for v in model.state_dict().values()]
            hooked: list[torch.Tensor] = []
            hook = model.register_forward_hook(lambda m, i, out: hooked.append(out.detach().clone()))
            reads.append(loss(model, model, s).detach().clone())  # the model itself, not the engine
            hook.remove()
            reads += hooked
            reads.append(loss(lambda *a, **k: torch.func.functional_call(model, {}, a, k), model, s).detach().clone())
        seen.append(reads)

    same_loop(make, loss, loop, 4, tmp_path, optimizer_tier=optimizer_tier, lock_free=True, max_staleness=0)
    plain, engine = seen[:4], seen[4:]
    for s, (a, b) in enumerate(zip(plain, engine)):
        assert len(a) == len(b)
        for k, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (s, k)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("field,kw", [
    ("optimizer_tier", dict(optimizer_tier="gpu")),
    ("max_grad_norm", dict(max_grad_norm=1.0)),
    ("loss_scale", dict(compute_dtype=torch.float16)),
    ("overlap_update", dict(overlap_update=True)),
])
def test_what_the_lock_free_updater_cannot_do_is_refused_naming_the_field(field, kw):
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 24, cpu_bytes=1 << 24)
    with pytest.raises(pagemem.ConfigError, match=f"^{field}: with lock_free"):
        pagemem.EngineConfig(store=store, lock_free=True, **kw)
    with pytest.raises(pagemem.ConfigError, match="^max_staleness"):
        pagemem.EngineConfig(store=store, max_staleness=1)
    with pytest.raises(pagemem.ConfigError, match="^max_staleness"):
        pagemem.EngineConfig(store=store, lock_free=True, max_staleness=-1)
    with pytest.raises(pagemem.ConfigError, match="^staleness_correction: must be one of"):
        pagemem.EngineConfig(store=store, lock_free=True, staleness_correction="dc-asgd")
    cfg = pagemem.EngineConfig(store=store, lock_free=True, max_staleness=2, staleness_correction="none")
    assert pagemem.EngineConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------- the thread-safety stress test


class Twins(nn.Module):
    """Two parameters with the same values and, from ``loss``, the same gradient every
    iteration (``c_t`` everywhere, whatever the weights): after any whole update they are
    equal, so a forward that sees them differ saw a torn unit."""

    torn: list[str] = []

    def __init__(self, n: int = 256) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.linspace(-1, 1, n))
        self.w2 = nn.Parameter(torch.linspace(-1, 1, n))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        if not torch.equal(self.w1.detach(), self.w2.detach()):
            Twins.torn.append("torn")
        return (self.w1 * c).sum() + (self.w2 * c).sum()


class Units(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Twins() for _ in range(3))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return sum(p(c) for p in self.parts)


def c_of(t: int) -> torch.Tensor:
    return torch.full((256,), 2.0 ** t)  # the sum of any set of them is exact, and names the set


def units_loss(run, model, t):
    return run(c_of(t))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seams=st.dictionaries(st.sampled_from(["take", "update", "publish", "accumulate", "drain"]),
                             st.lists(st.sampled_from([0.0, 0.0005, 0.002, 0.006]), min_size=1, max_size=4)),
       compute=st.lists(st.sampled_from([0.0, 0.001, 0.004]), min_size=1, max_size=4),
       bound=st.sampled_from([None, 0, 1, 2]), optimizer_tier=st.sampled_from(TIERS))
def test_every_gradient_is_applied_once_and_no_unit_is_ever_torn(seams, compute, bound, optimizer_tier, tmp_path,
                                                                  monkeypatch):
    """Random delays on the updating thread, the buffering side and the compute side: each
    parameter's taken sums add up to every gradient it produced, exactly once; no forward sees
    a unit half updated; no unit lags more than ``max_staleness``."""
    Twins.torn.clear()
    calls: dict[str, int] = {}

    def seam(where):
        n = calls[where] = calls.get(where, 0) + 1
        delays = seams.get(where)
        if delays:
            time.sleep(delays[n % len(delays)])

    taken: dict[int, torch.Tensor] = {}
    real_take = update_module.Updater.take_sum

    def take_sum(self, i):
        value = real_take(self, i)
        taken[i] = taken.get(i, 0) + value
        return value

    monkeypatch.setattr(lockfree, "SEAM", seam)
    monkeypatch.setattr(update_module.Updater, "take_sum", take_sum)
    torch.manual_seed(0)
    model = Units()
    cfg = engine_config(Units(), units_loss, tmp_path, optimizer_tier, lock_free=True, max_staleness=bound,
                        synchronous_steps=0, fraction=0.0)
    iterations = 10
    with pagemem.Engine(model, cfg) as engine:
        for t in range(iterations):
            engine.backward(units_loss(engine, model, t))
            engine.step()
            time.sleep(compute[t % len(compute)])
        engine.state_dict()  # drains
        stats = engine.stats()["staleness"]
        steps = {i: int(s["step"]) for i, s in engine.optimizer.state_dict()["state"].items()}
    want = sum(2.0 ** t for t in range(iterations))
    assert steps == {i: iterations for i in range(6)}  # one AdamW step per iteration, none taken early
    assert set(taken) == set(range(6))
    assert all(torch.equal(v, torch.full((256,), want)) for v in taken.values())
    assert Twins.torn == []
    if bound is not None:
        assert stats["max"] <= bound


# ---------------------------------------------------------------- staleness, failures, checkpoints


def test_unbounded_staleness_is_measured_and_the_run_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(lockfree, "SEAM", lambda where: time.sleep(0.01) if where == "update" else None)
    make, loss = CASES["parameter read after a child"]
    model = make()
    cfg = engine_config(make(), loss, tmp_path, "nvme", lock_free=True, **UNBOUNDED)
    with pagemem.Engine(model, cfg) as engine:
        losses = []
        for s in range(6):
            out = loss(engine, model, s)
            losses.append(out.item())
            engine.backward(out)
            engine.step()
        stats = engine.stats()["staleness"]
    assert stats["max"] >= 1 and sum(stats["histogram"].values()) == 6
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_failing_updater_thread_surfaces_in_the_training_loop(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("adam failed on the updating thread")

    make, loss = CASES["parameter read after a child"]
    model = make()
    engine = pagemem.Engine(model, engine_config(make(), loss, tmp_path, "nvme", lock_free=True))
    monkeypatch.setattr(lockfree_thread, "fused_steps", broken)
    engine.backward(loss(engine, model, 0))
    engine.step()
    with pytest.raises(pagemem.StepFailed, match="adam failed") as raised:
        for s in range(1, 4):  # within an iteration or so, never a hang
            engine.backward(loss(engine, model, s))
            engine.step()
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(pagemem.StepFailed):
        engine.close()
    assert not [t for t in threading.enumerate() if t.name == "pagemem-lockfree" and t.is_alive()]


def test_checkpoints_drain_the_updater_and_resume_exactly(tmp_path):
    """``save()`` waits for every submitted update; with ``max_staleness=0`` a resumed run goes
    on bit for bit as the uninterrupted one."""
    make, loss, cfg = nvme_config(tmp_path, max_staleness=0)
    model = make()
    with pagemem.Engine(model, cfg) as engine:
        train(engine, model, loss, range(3))
        path = engine.save(str(tmp_path / "ckpt"))
        train(engine, model, loss, range(3, 6))
        uninterrupted = engine.state_dict()
    model = make()
    with pagemem.Engine.load(path, model, cfg) as engine:
        train(engine, model, loss, range(3, 6))
        assert_same(uninterrupted, engine.state_dict())


def test_a_checkpoint_of_an_unbounded_run_holds_every_submitted_update(tmp_path, monkeypatch):
    monkeypatch.setattr(lockfree, "SEAM", lambda where: time.sleep(0.01) if where == "update" else None)
    make, loss, cfg = nvme_config(tmp_path, **UNBOUNDED)
    model = make()
    with pagemem.Engine(model, cfg) as engine:
        train(engine, model, loss, range(4))
        path = engine.save(str(tmp_path / "ckpt"))
        saved = engine.state_dict()
        steps = {int(s["step"]) for s in engine.optimizer.state_dict()["state"].values()}
    assert steps == {4}  # every submitted iteration applied before the save: one step each
    with pagemem.Engine.load(path, make(), cfg) as engine:
        assert_same(saved, engine.state_dict())


def test_discarding_gradients_that_share_sums_with_submitted_ones_is_refused(tmp_path):
    make, loss = CASES["parameter read after a child"]
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path, lock_free=True)) as engine:
        engine.backward(loss(engine, model, 0))
        with pytest.raises(pagemem.InvalidRequest, match="lock_free"):
            engine.zero_grad()
        engine.step()
        engine.zero_grad()  # nothing of this iteration yet: fine


def test_gradients_by_habit_are_refused_not_ignored(tmp_path):
    """``p.grad`` shows a handle whose norm (``clip_grad_norm_`` by habit) raises, instead of
    None, which would clip nothing silently."""
    make, loss = CASES["parameter read after a child"]
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path, lock_free=True)) as engine:
        loss(engine, model, 0).backward()
        assert all(p.grad is not None for p in model.parameters())
        with pytest.raises(pagemem.InvalidRequest, match="lock_free"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        loss(engine, model, 1).backward()
        next(model.parameters()).grad = None
        next(model.parameters()).grad = torch.zeros_like(next(model.parameters()))
        with pytest.raises(pagemem.InvalidRequest, match="lock_free"):
            engine.optimizer.step()


@pytest.mark.parametrize("spare", [0.0, 12.0], ids=["tight", "states could fit on the gpu"])
def test_constant_gradients_move_every_weight_one_step_per_iteration(spare, tmp_path, monkeypatch):
    """Gradient 1 everywhere: AdamW moves each weight by lr per step, so after N iterations
    every weight moved N lr, whatever the staleness (the attack found a unit taken before its
    step() lost a step; and, with room on the gpu, the plan moved states the thread was using)."""
    monkeypatch.setattr(lockfree, "SEAM", lambda where: time.sleep(0.003) if where in ("update", "take") else None)
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))  # noqa: E731

    def loss(run, model, s):
        return run(torch.ones(4, 64)).sum() * 0.0 + sum(p.sum() for p in model.parameters())

    model = make()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = engine_config(make(), loss, tmp_path, "nvme", lock_free=True, fraction=spare, **UNBOUNDED,
                        optimizer=pagemem.AdamW(lr=1e-3, weight_decay=0.0))
    n = 12
    with pagemem.Engine(model, cfg) as engine:
        for s in range(n):
            engine.backward(loss(engine, model, s))
            engine.step()
        got = engine.state_dict()
        steps = {int(s["step"]) for s in engine.optimizer.state_dict()["state"].values()}
        assert engine.stats()["gpu_state_units"] == 0
    assert steps == {n}
    for k in start:
        assert torch.allclose(start[k] - got[k], torch.full_like(got[k], n * 1e-3), rtol=1e-4, atol=1e-6), k


def test_model_zero_grad_mid_iteration_is_refused_not_ignored(tmp_path):
    make, loss = CASES["parameter read after a child"]
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path, lock_free=True)) as engine:
        engine.backward(loss(engine, model, 0))
        model.zero_grad()
        with pytest.raises(pagemem.InvalidRequest, match="lock_free"):
            engine.step()


# ---------------------------------------------------------------- staleness_correction


class Probe(nn.Module):
    """Records, at each forward, how many AdamW steps of ``lr`` its weights have moved."""

    seen: list[tuple[int, float]] = []
    now = 0

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Probe.seen.append((Probe.now, float(-self.w.detach().mean()) / 1e-3))
        return (self.w * x).sum()


class Probes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Probe() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p(x) for p in self.parts)


@pytest.mark.parametrize("correction", ["predict", "none"])
def test_prediction_buffers_the_weights_synchronous_training_would_hold(correction, tmp_path, monkeypatch):
    """Gradient 1 everywhere: every update moves each weight by the same lr, so a unit's weights
    predicted past its staleness are exactly the synchronous ones: an update holding ``j`` steps
    drained while ``a`` submitted iterations are not in it is buffered as ``j + a`` steps (``j``
    without the correction). The first updates are held back until a later ``step()``, so some
    drains happen with ``a >= 1``. No forward sees more steps than were submitted, or a
    fraction of a step. [Note: predicting past the staleness]"""
    gate = threading.Event()
    monkeypatch.setattr(lockfree, "SEAM", lambda where: gate.wait(10) if where == "publish" else None)
    writes: list[tuple[int, float, float]] = []
    real = lockfree._predicted

    def predicted(p, ahead):
        out = real(p, ahead)
        i = min(out)
        writes.append((ahead, float(-p.values[i].float().mean()) / 1e-3, float(-out[i].float().mean()) / 1e-3))
        return out

    monkeypatch.setattr(lockfree, "_predicted", predicted)
    Probe.seen = []
    make = lambda: Probes()  # noqa: E731

    def loss(run, model, s):
        return run(torch.ones(64))

    model = make()
    cfg = engine_config(make(), loss, tmp_path, "cpu", lock_free=True, staleness_correction=correction, **UNBOUNDED,
                        optimizer=pagemem.AdamW(lr=1e-3, weight_decay=0.0))
    Probe.seen = []
    with pagemem.Engine(model, cfg) as engine:
        for t in range(8):
            Probe.now = t
            engine.backward(loss(engine, model, t))
            engine.step()
            if t == 1:
                gate.set()
    assert any(a >= 1 for a, _, _ in writes)
    for ahead, applied, written in writes:
        assert abs(applied - round(applied)) < 1e-3
        assert abs(written - (applied + (ahead if correction == "predict" else 0))) < 1e-3, (ahead, applied, written)
    assert all(abs(j - round(j)) < 1e-3 and round(j) <= t for t, j in Probe.seen)  # never torn, never ahead

