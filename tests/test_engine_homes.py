"""Homes on nvme ([Note: homes on nvme] in ``engine/units/homes.py``): compute copies and gradient
sums may live on nvme, the cpu a working set the units pass through. Exactness with everything on
nvme runs in ``test_engine_exactness.py`` (every case at ``"nvme+homes"``); here: the choice of
homes, the budgets refused up front, memory that stays bounded while the model does not, and a
disk that fails part-way through a streamed update."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import pagemem
from exactness import HOMES, PAGE, assert_same, engine_config, reference, through_engine, train_both
from pagemem.engine.units.budget_checks import unit_cap
from pagemem.engine.units.homes import cpu_pages, host_need, nvme_pages
from pagemem.engine.paging.executor import unit_layout
from pagemem.models.gpt import GPT, GPTConfig
from test_engine_fidelity import HP as FHP, engine_mixed, reference as fidelity_reference, reference_mixed, small_gpt
from test_engine_fidelity import through_engine as fidelity_engine

WORKER = Path(__file__).with_name("homes_worker.py")
TINY = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def gpt_loss(run, model, s):
    g = torch.Generator().manual_seed(s)
    x = torch.randint(0, TINY.vocab, (2, 17), generator=g)
    return run(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def store(tmp_path, cpu: int, nvme: int | None = 256 << 20, gpu: int = 32 << 20) -> pagemem.StoreConfig:
    return pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu, cpu_bytes=cpu,
                               nvme_bytes=nvme or 0, nvme_path=str(tmp_path) if nvme else None)


def need_of(model, cfg: pagemem.EngineConfig):
    return host_need(model, cfg, unit_cap(cfg.store))


# ---------------------------------------------------------------------------- the choice of homes

@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_auto_keeps_homes_on_the_cpu_while_it_holds_them_and_moves_them_to_nvme_when_not(optimizer_tier, tmp_path):
    model = tiny_gpt()
    probe = pagemem.EngineConfig(store=store(tmp_path, 1 << 30), optimizer_tier=optimizer_tier)
    need = need_of(model, probe)
    on_cpu = cpu_pages(need, optimizer_tier, "cpu") * PAGE
    for cpu, expected in ((on_cpu, "cpu"), (on_cpu - PAGE, "nvme")):
        cfg = pagemem.EngineConfig(store=store(tmp_path, cpu), optimizer_tier=optimizer_tier)
        with pagemem.Engine(tiny_gpt(), cfg) as engine:
            stats = engine.stats()
            assert stats["home_tier"] == expected
            assert stats["tiers"]["cpu"]["used_bytes"] <= cpu


def test_auto_without_nvme_refuses_a_cpu_too_small_naming_the_least_that_works(tmp_path):
    model = tiny_gpt()
    need = need_of(model, pagemem.EngineConfig(store=store(tmp_path, 1 << 30)))
    least = cpu_pages(need, "cpu", "cpu") * PAGE
    cfg = pagemem.EngineConfig(store=store(tmp_path, least - PAGE, nvme=None))
    with pytest.raises(pagemem.OutOfMemory) as raised:
        pagemem.Engine(model, cfg)
    err = raised.value
    assert err.tier == "cpu" and err.least_bytes == least and not err.least_is_bound
    assert "cpu_bytes" in str(err) and "home_tier='nvme'" in str(err)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())  # model untouched
    with pagemem.Engine(model, pagemem.EngineConfig(store=store(tmp_path, least, nvme=None))) as engine:
        assert engine.stats()["home_tier"] == "cpu"


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_homes_on_nvme_refuse_a_cpu_below_the_working_set_and_train_exactly_at_it(optimizer_tier, tmp_path):
    """The least named is exact: one page less is refused, the least itself trains bit for bit."""
    model = tiny_gpt()
    probe = pagemem.EngineConfig(store=store(tmp_path, 1 << 30), optimizer_tier=optimizer_tier, home_tier="nvme")
    least = cpu_pages(need_of(model, probe), optimizer_tier, "nvme") * PAGE
    with pytest.raises(pagemem.OutOfMemory) as raised:
        pagemem.Engine(model, pagemem.EngineConfig(store=store(tmp_path, least - PAGE), optimizer_tier=optimizer_tier,
                                                   home_tier="nvme"))
    assert raised.value.least_bytes == least and "working set" in str(raised.value)
    stats = train_both(tiny_gpt, gpt_loss, 4, tmp_path, optimizer_tier=optimizer_tier, home_tier="nvme",
                       cpu_bytes=least)
    assert stats["home_tier"] == "nvme"
    assert stats["moved_bytes"]["nvme->gpu"] > 0  # the compute copies came from disk


def test_a_forced_home_is_kept_or_refused_never_changed(tmp_path):
    model = tiny_gpt()
    need = need_of(model, pagemem.EngineConfig(store=store(tmp_path, 1 << 30)))
    small = cpu_pages(need, "cpu", "cpu") * PAGE - PAGE
    with pytest.raises(pagemem.OutOfMemory, match="home_tier='cpu'"):
        pagemem.Engine(model, pagemem.EngineConfig(store=store(tmp_path, small), home_tier="cpu"))
    with pagemem.Engine(tiny_gpt(), pagemem.EngineConfig(store=store(tmp_path, 1 << 30), home_tier="nvme")) as engine:
        assert engine.stats()["home_tier"] == "nvme"  # room on the cpu does not override it


def test_bad_home_tiers_name_the_field(tmp_path):
    with pytest.raises(pagemem.ConfigError, match="home_tier: must be one of 'auto', 'cpu', 'nvme', got 'disk'"):
        pagemem.EngineConfig(store=store(tmp_path, 1 << 20), home_tier="disk")
    with pytest.raises(pagemem.ConfigError, match="home_tier: 'nvme' needs nvme bytes"):
        pagemem.EngineConfig(store=store(tmp_path, 1 << 20, nvme=None), home_tier="nvme")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.sampled_from([16, 48, 96, 160]), depth=st.integers(1, 3), opt=st.sampled_from(["cpu", "nvme"]),
       slack=st.integers(-3, 3), home=st.sampled_from(["auto", "nvme"]))
def test_the_engine_builds_exactly_when_the_budgets_hold_what_host_need_counts(width, depth, opt, slack, home, tmp_path):
    """Over model shapes and budgets around the least: the engine is built iff the cpu budget
    holds ``cpu_pages`` of the chosen homes, and once built its pages stay within the budgets."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    probe = pagemem.EngineConfig(store=store(tmp_path, 1 << 30), optimizer_tier=opt, home_tier=home)
    need = need_of(make(), probe)
    homes = ("cpu", "nvme") if home == "auto" else ("nvme",)
    least = min(cpu_pages(need, opt, h) for h in homes)
    cpu = (least + slack) * PAGE
    if cpu <= 0:
        return
    cfg = pagemem.EngineConfig(store=store(tmp_path, cpu), optimizer_tier=opt, home_tier=home)
    if slack < 0:
        with pytest.raises(pagemem.OutOfMemory):
            pagemem.Engine(make(), cfg)
        return
    model = make()
    with pagemem.Engine(model, cfg) as engine:
        x = torch.randn(2, width)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        s = engine.stats()
        chosen = s["home_tier"]
        assert cpu_pages(need, opt, chosen) * PAGE <= cpu
        assert nvme_pages(need, opt, chosen) * PAGE <= s["tiers"]["nvme"]["capacity_bytes"]
        assert s["tiers"]["cpu"]["used_bytes"] <= cpu


# ---------------------------------------------------------------------------- exact, and streamed

def least_cpu(model, **cfg) -> int:
    """The least cpu budget with everything on nvme (the engine's working set)."""
    probe = pagemem.EngineConfig(store=store(Path(__file__).parent, 1 << 30), home_tier="nvme", **cfg)
    return cpu_pages(need_of(model, probe), probe.optimizer_tier, "nvme") * PAGE


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_everything_on_nvme_clips_and_accumulates_bit_identically(optimizer_tier, tmp_path):
    """Four backwards a step add into the sums on nvme (read, added, written back), clipping
    reads every sum before any update (the streamed check), over 8 steps."""
    model = small_gpt()
    ref = fidelity_reference(copy.deepcopy(model), 8, FHP, max_grad_norm=0.5, accumulation=4)
    got, stats = fidelity_engine(model, 8, FHP, tmp_path, optimizer_tier, max_grad_norm=0.5, accumulation=4,
                                 home_tier="nvme", cpu_bytes=least_cpu(model, optimizer_tier=optimizer_tier))
    assert stats["home_tier"] == "nvme" and stats["evictions"] > 0
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_everything_on_nvme_in_mixed_precision_with_loss_scaling_is_plain_pytorchs_policy(dtype, tmp_path):
    """fp16 compute copies on nvme, the loss scale's overflow verdict read from the sums on nvme
    before any update: skipped steps and the scale as ``GradScaler``'s, weights bit for bit."""
    model = small_gpt()
    overflow = (3, 4) if dtype is torch.float16 else ()
    ref, skipped = reference_mixed(copy.deepcopy(model), 8, FHP, dtype, scaled=dtype is torch.float16,
                                   overflow_at=overflow)
    got, stats = engine_mixed(model, 8, FHP, dtype, overflow_at=overflow, nvme_path=tmp_path, home_tier="nvme",
                              optimizer_tier="nvme", cpu_bytes=least_cpu(model, optimizer_tier="nvme",
                                                                         compute_dtype=dtype),
                              **({} if dtype is torch.float16 else {"loss_scale": None}))
    assert stats["home_tier"] == "nvme" and stats["skipped_steps"] == skipped
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


class Wide(torch.nn.Module):
    """Four weights of two pages each (at ``PAGE``) in one module: a unit whose update streams
    through far fewer cpu pages (one weight's states and sums) than its gradients and states take."""

    def __init__(self, n: int = 128, m: int = 256) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(n, m) / n ** 0.5), torch.nn.Parameter(torch.randn(m, n) / m ** 0.5)
        self.c, self.d = torch.nn.Parameter(torch.randn(n, m) / n ** 0.5), torch.nn.Parameter(torch.randn(m, n) / m ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(torch.tanh(x @ self.a) @ self.b)
        return x + torch.tanh(torch.tanh(x @ self.c) @ self.d)


def wide() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Wide() for _ in range(3)))


_wg = torch.Generator().manual_seed(3)
WIDE_X = [torch.randn(8, 128, generator=_wg) for _ in range(6)]


def wide_loss(run, model, s):
    return run(WIDE_X[s]).pow(2).mean()


@pytest.mark.parametrize("optimizer_tier", ["nvme", "cpu"])
def test_everything_on_nvme_is_planned_at_the_engines_least_cpu_and_exact(optimizer_tier, tmp_path):
    """At the least cpu budget the engine accepts -- below what a whole unit's update (and the
    pages moved to the gpu at one op) would take on the cpu -- the scheduler still plans every
    iteration after the warm-up: each update holds one weight's states and sums at once, as the
    engine streams them, and pages that do not fit the cpu go to the gpu straight from nvme."""
    probe = engine_config(wide(), wide_loss, tmp_path, optimizer_tier + HOMES)
    need = need_of(wide(), probe)
    least = cpu_pages(need, optimizer_tier, "nvme") * PAGE
    expected = reference(wide, wide_loss, 4)
    got, stats, engine = through_engine(wide, wide_loss, 4, tmp_path, optimizer_tier + HOMES, cpu_bytes=least)
    assert_same(expected, got)
    assert stats["home_tier"] == "nvme" and stats["iterations"] == {"traced": 1, "planned": 3}, stats["iterations"]
    p = engine.pager.last_plan
    whole = max(l.param_pages + l.optim_pages for l in p.layout.layers)  # a whole unit's update
    moved: dict[int, int] = {}
    for t in p.tasks:
        if t.operation == "move_to_gpu":
            moved[t.trigger_id] = moved.get(t.trigger_id, 0) + 1
    assert {l.stream_pages for l in p.layout.layers} == {need.unit_update if optimizer_tier == "nvme" else 3}
    if optimizer_tier == "nvme":  # everything on the cpu is a working set: the update's, not a unit's
        assert least == need.unit_update * PAGE < min(whole, max(moved.values())) * PAGE
    assert any(t.source == "nvme" for t in p.tasks)


def test_the_bank_counts_an_update_as_the_engines_least_does(tmp_path):
    """One count: the largest ``ParamBank.stream_pages`` is ``host_need``'s ``unit_update`` (states
    and sums on nvme), and the layout the engine plans with carries it per unit."""
    cfg = engine_config(wide(), wide_loss, tmp_path, "nvme" + HOMES)
    model = wide()
    with pagemem.Engine(model, cfg) as engine:
        bank = engine.bank
        assert max(bank.stream_pages(u) for u in range(len(bank.layers))) == need_of(wide(), cfg).unit_update
        engine.backward(wide_loss(engine, model, 0))
        engine.step()
        lay = unit_layout(engine.pager.last_trace, bank, PAGE)
        engine.bank.drop_cpu_copies()
        free = engine.store.tier("cpu").free_pages
        bank.stage_states(1)  # a plan's fetch copies a whole unit's states, or nothing, and leaves the update its room
        after = engine.store.tier("cpu").free_pages
        assert free - after in (0, engine.store.page_count(bank.layers[1].states()))
        assert after >= 2 * bank.stream_pages(1)
        assert [l.stream_pages for l in lay.layers] == [bank.stream_pages(u) for u in range(len(bank.layers))]


def test_everything_on_nvme_on_demand_is_exact(tmp_path):
    stats = train_both(tiny_gpt, gpt_loss, 5, tmp_path, optimizer_tier="nvme" + HOMES, executor="demand")
    assert stats["home_tier"] == "nvme" and stats["iterations"].get("demand") == 5


def test_the_update_streams_through_a_cpu_smaller_than_the_states(tmp_path):
    """The cpu budget is the least working set: far less than the states and gradient sums the
    update reads, which pass through it a batch at a time; the results are exact."""
    cpu = least_cpu(tiny_gpt(), optimizer_tier="nvme")
    stats = train_both(tiny_gpt, gpt_loss, 3, tmp_path, optimizer_tier="nvme", home_tier="nvme", cpu_bytes=cpu)
    state = stats["optimizer_state_bytes"] + stats["grad_bytes"]
    assert cpu * 3 < state
    assert stats["moved_bytes"]["nvme->cpu"] >= 3 * state  # every step read them all, through the cpu


def test_a_disk_failing_between_batches_of_a_streamed_update_says_how_far_it_got_and_retries_exactly(tmp_path):
    from test_step_io_errors import faulty
    make, loss = tiny_gpt, gpt_loss
    expected = reference(make, loss, 3)
    model = make()
    cfg = engine_config(make(), loss, tmp_path, "nvme" + HOMES, executor="demand")
    with pagemem.Engine(model, cfg) as engine:
        faults = faulty(engine)
        engine.backward(loss(engine, model, 0))
        engine.step()
        engine.backward(loss(engine, model, 1))
        calls = {"n": 0}
        real = engine.updater._bring

        def bring(disk, u):  # the second batch's read fails
            calls["n"] += 1
            if calls["n"] == 2:
                faults.fail_next("read", "eio", count=1)
            return real(disk, u)
        engine.updater._bring = bring
        with pytest.raises(pagemem.StepIOError) as raised:
            engine.step()
        assert calls["n"] == 2, "the update was not streamed in batches"
        text = str(raised.value)
        assert "reading the optimizer states and gradient sums from nvme" in text
        assert "parameters were updated" in text and "call step() again" in text
        engine.updater._bring = real
        assert engine.step()
        engine.backward(loss(engine, model, 2))
        engine.step()
        assert_same(expected, engine.state_dict())


# ---------------------------------------------------------------------------- beyond host memory

def run_worker(tmp_path, layers: int, hidden: int, vocab: int, gpu: int, cpu: int, steps: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path), str(layers), str(hidden), str(vocab), str(gpu),
                          str(cpu), "nvme", "nvme", str(steps)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_gpt2_of_16_layers_trains_with_peak_memory_bounded_by_the_budgets_not_the_model(tmp_path):
    """The issue's acceptance: a GPT-2 shape of 16 layers at hidden 768 built on ``meta``,
    ``cpu_bytes=64MiB``, everything on nvme: two steps (the second planned: the scheduler plans
    within the cpu the engine needs, not 204 MiB of whole layers), and the process's peak resident memory
    (``ru_maxrss``, the gpu tier being host memory here, counted) grows by at most the gpu and
    cpu budgets plus four layers plus 256 MiB, while the training state is over three times that."""
    gpu, cpu = 256 << 20, 64 << 20
    r = run_worker(tmp_path, 16, 768, 2048, gpu, cpu)
    bound = gpu + cpu + 4 * r["layer_bytes"] + (256 << 20)
    assert r["home_tier"] == "nvme" and r["iterations"] == {"traced": 1, "planned": 1}, r["iterations"]
    assert r["training_growth"] <= bound, (r["training_growth"], bound)
    assert r["training_state_bytes"] > 3 * bound
    assert all(l == l and l < 20 for l in r["losses"]) and r["losses"][1] < r["losses"][0]


# ---------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("resume_home", ["nvme", "cpu"])
def test_a_checkpoint_saved_with_everything_on_nvme_resumes_bit_identically_on_meta_with_either_home(resume_home,
                                                                                                    tmp_path):
    """Saved while compute copies, gradient sums and states all live on nvme; resumed into a model
    built on ``meta``, with the homes on nvme again or on the cpu: the same bits as the
    uninterrupted run (a checkpoint does not depend on where the engine kept things)."""
    from test_engine_checkpoint import make as ckpt_make, resume_and_compare, tiny_gpt as ckpt_gpt, train
    model, cfg = ckpt_make(tmp_path)
    cfg = dataclasses.replace(cfg, home_tier="nvme")
    with pagemem.Engine(model, cfg) as engine:
        assert engine.stats()["home_tier"] == "nvme"
        train(engine, 3)
        engine.save(str(tmp_path / "ckpt"))
        train(engine, 6)
        expected = engine.state_dict()
    with torch.device("meta"):
        empty = ckpt_gpt()

    def homed(engine, _model):
        assert engine.stats()["home_tier"] == resume_home and engine.global_step == 3

    resume_and_compare(str(tmp_path / "ckpt"), empty, dataclasses.replace(cfg, home_tier=resume_home), 6, expected,
                       homed)


@pytest.mark.parametrize("executor", ["plan", "demand"])
@pytest.mark.parametrize("op,kind", [("write", "enospc"), ("read", "eio")])
def test_a_disk_failing_during_a_backward_with_everything_on_nvme_loses_nothing(executor, op, kind, tmp_path):
    """A gradient written to its nvme sums, or a compute page read from nvme, fails once in the
    second step's iteration: either the iteration raises ``TierIOError`` and training goes on as if
    its batch was skipped, or the failed read was a staging the bind then made good, and training
    is as if nothing happened. Never silently different."""
    from test_step_io_errors import faulty
    model = tiny_gpt()
    cfg = engine_config(tiny_gpt(), gpt_loss, tmp_path, "nvme" + HOMES, executor=executor)
    with pagemem.Engine(model, cfg) as engine:
        faults = faulty(engine)
        engine.backward(gpt_loss(engine, model, 0))
        engine.step()
        faults.fail_next(op, kind, count=1)
        try:
            engine.backward(gpt_loss(engine, model, 1))
            engine.step()
            batches = [0, 1, 2]
        except pagemem.TierIOError as exc:
            assert ("ENOSPC" if kind == "enospc" else "EIO") in str(exc)
            batches = [0, 2]
        assert faults.injected == 1
        engine.backward(gpt_loss(engine, model, 2))
        engine.step()
        got = engine.state_dict()
    expected = reference(tiny_gpt, lambda run, m, s: gpt_loss(run, m, batches[s]), len(batches))
    assert_same(expected, got)


def test_ctrl_c_landing_inside_disk_io_of_a_backward_on_nvme_never_hangs(tmp_path):
    """A SIGINT raised while the aio engine has counted a gradient's write to nvme but not yet
    handed it to the kernel: the hand-off is shielded, so the Ctrl-C lands after it (before this
    was shielded, the request stayed counted forever and the next write hung)."""
    from pagemem.tiers.io.aio import AioEngine
    from pagemem.tiers.io.base import EngineUnavailable
    try:  # (not conftest's helper: a full run imports tests/tracer/conftest.py under that name)
        AioEngine(1).close()
    except EngineUnavailable:
        pytest.skip("libaio.so.1 not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("homes_sigint_worker.py")), str(tmp_path), "aio"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    outcomes = out.stdout.split()
    assert outcomes[0] == "ok" and "interrupted" in outcomes, out.stdout
