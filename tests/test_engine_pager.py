"""How parameters reach the gpu per iteration (``pagemem/engine/paging/pager.py``): the traced warm-up,
following the plan, leaving it, evaluation calls, and no plan at all. Every run is compared with
plain PyTorch doing the same arithmetic."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.engine.paging.executor import PlanMismatch, Schedule
from pagemem.models.gpt import GPT, GPTConfig

from conftest import engine_gpu_budget

PAGE = 64 * 1024
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
VOCAB = 128


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=VOCAB, seq=32))


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def batch(seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, seq + 1), generator=torch.Generator().manual_seed(seed))


def budget_for(model, fraction: float = 1 / 3) -> int:
    x = batch(32, 0)  # the longest sequence used: the budget holds its activations
    return engine_gpu_budget(model, lambda m: loss_of(m, x).backward(), PAGE, fraction)


def _config(model, gpu_bytes: int, **cfg) -> pagemem.EngineConfig:
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=16 * nbytes + 64 * PAGE)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), adam_threads=2, **cfg)


def make_engine(model, gpu_bytes: int, **cfg) -> pagemem.Engine:
    return pagemem.Engine(model, _config(model, gpu_bytes, **cfg))


def plain_run(model, steps):
    """``steps``: (batch, train) pairs; an untrained step is an evaluation forward under no_grad."""
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HP)
    evals = []
    for x, train in steps:
        if train:
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                evals.append(loss_of(model, x))
    return model.state_dict(), evals


def engine_run(engine, steps):
    evals = []
    for x, train in steps:
        if train:
            engine.backward(loss_of(engine, x))
            engine.step()
        else:
            with torch.no_grad():
                evals.append(loss_of(engine, x))
    return engine.state_dict(), evals


def assert_same(got, ref) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_planned_iterations_move_exactly_what_the_plan_moves():
    model = small_gpt()
    steps = [(batch(32, s), True) for s in range(6)]
    ref, _ = plain_run(copy.deepcopy(model), steps)
    with make_engine(model, budget_for(model)) as engine:
        engine_run(engine, steps[:2])  # the warm-up and one planned iteration
        before = engine.stats()
        engine_run(engine, steps[2:])
        after = engine.stats()
        got = engine.state_dict()
        plan = engine.pager.last_plan
    assert after["iterations"] == {"traced": 1, "planned": 5} and after["misses"] == 0
    moves = plan.counts()["move_to_gpu"]
    assert moves > 0  # pages really move every iteration
    moved = after["moved_bytes"]["cpu->gpu"] - before["moved_bytes"]["cpu->gpu"]
    assert moved == 4 * moves * PAGE  # one page per move_to_gpu task, nothing more, nothing less
    # the executor gave back one unit per window the plan ends with a release (what the
    # simulator charges its host time for), and spent host time doing so
    windows = sum(t.operation == "release" and t.target.kind == "param" for t in plan.tasks)
    assert windows and after["executor_releases"] - before["executor_releases"] == 4 * windows
    assert after["executor_seconds"] > before["executor_seconds"] > 0
    assert 0 < after["gpu_peak_bytes"] <= after["gpu_budget_bytes"]
    assert after["gpu_peak_bytes_by_mode"]["plan"] <= plan.predicted_peak["gpu"]
    assert_same(got, ref)


def test_evaluation_calls_between_training_iterations_leave_the_plan_alone():
    model = small_gpt()
    steps = [(batch(32, 0), True), (batch(32, 1), False), (batch(32, 2), True), (batch(16, 3), False),
             (batch(32, 4), True), (batch(32, 5), True)]
    ref, ref_evals = plain_run(copy.deepcopy(model), steps)
    with make_engine(model, budget_for(model)) as engine:
        got, evals = engine_run(engine, steps)
        stats = engine.stats()
    assert stats["iterations"] == {"traced": 1, "demand": 2, "planned": 3}
    assert stats["misses"] == 0 and stats["replans"] == 0
    assert stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]
    assert_same(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(evals, ref_evals))


def test_a_budget_too_small_for_the_activations_is_refused_after_the_traced_iteration(tmp_path):
    """Was: warned and paged on demand over the budget. Now the next iteration with those inputs
    is refused, naming the least budget; the run resumes under it exactly ([Note: gpu budgets
    refused early])."""
    model = small_gpt()
    steps = [(batch(32, s), True) for s in range(4)]
    ref, _ = plain_run(copy.deepcopy(model), steps)
    after_one, _ = plain_run(copy.deepcopy(model), steps[:1])
    least = budget_for(model, 0.0)
    engine = make_engine(model, least // 2 // PAGE * PAGE)
    engine_run(engine, steps[:1])  # traced: its activations were unknown before it ran
    with pytest.raises(pagemem.OutOfMemory, match=r"gpu_bytes: the traced iteration's activations .* refused.*"
                                                  r"the smallest budget that works is (at least )?gpu_bytes=\d+") as err:
        engine_run(engine, steps[1:])
    stats = engine.stats()
    assert stats["iterations"] == {"traced": 1} and stats["plan"] is None  # nothing ran over the budget
    assert "smallest budget" in stats["plan_note"]
    named = err.value.least_bytes
    assert least // 2 < named <= least and named % PAGE == 0
    with pytest.raises(pagemem.OutOfMemory):
        engine(batch(32, 9)[:, :-1])  # every such iteration, not only the first
    saved = engine.save(str(tmp_path))
    engine.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert_same(model.state_dict(), after_one)  # the model holds its values
    with pagemem.Engine.load(saved, model, _config(model, named - PAGE)) as smaller:  # a page less: refused
        engine_run(smaller, steps[1:2])
        with pytest.raises(pagemem.OutOfMemory):
            engine_run(smaller, steps[2:3])
    # this budget merges the units into fewer, larger ones (up to gpu_bytes / 16), so the least
    # named was for the old units, and said so; the new units' least is named in turn, and works
    assert "(at least: a budget that size merges the paging units otherwise" in str(err.value)
    rounds = []
    while True:  # each refusal names the least for its own units: following them converges
        with pagemem.Engine.load(saved, model, _config(model, named)) as coarser:
            engine_run(coarser, steps[1:2])
            try:
                engine_run(coarser, steps[2:3])
                break
            except pagemem.OutOfMemory as again:
                rounds.append(again.least_bytes)
                assert again.least_bytes > named
                named = again.least_bytes
    assert len(rounds) <= 2
    resumed = pagemem.Engine.load(saved, model, _config(model, named))
    with resumed:
        got, _ = engine_run(resumed, steps[1:])
        assert resumed.stats()["iterations"] == {"traced": 1, "planned": 2}
    assert_same(got, ref)


def test_executor_demand_never_traces():
    model = small_gpt()
    steps = [(batch(32, s), True) for s in range(3)]
    ref, _ = plain_run(copy.deepcopy(model), steps)
    with make_engine(model, budget_for(model), executor="demand") as engine:
        got, _ = engine_run(engine, steps)
        stats = engine.stats()
    assert stats["iterations"] == {"demand": 3} and stats["plan"] is None
    assert stats["fetches"] > 0
    assert_same(got, ref)
    with pytest.raises(pagemem.ConfigError, match="executor"):
        pagemem.EngineConfig(store=pagemem.StoreConfig(gpu_backend="host", gpu_bytes=PAGE, cpu_bytes=PAGE), executor="eager")


def test_amsgrad_is_refused_not_half_run():
    """The engine keeps no max_exp_avg_sq pages: AMSGrad is a clear error at construction, and
    at the step when a param group turns it on, before anything changes."""
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=PAGE, cpu_bytes=PAGE)
    with pytest.raises(pagemem.ConfigError, match="amsgrad"):
        pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(amsgrad=True))
    model = small_gpt()
    with make_engine(copy.deepcopy(model), budget_for(model)) as engine:
        engine.optimizer.param_groups[0]["amsgrad"] = True
        engine.backward(loss_of(engine, batch(32, 0)))
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        with pytest.raises(pagemem.ConfigError, match="amsgrad"):
            engine.step()
        assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())


def test_a_plan_for_other_units_is_refused():
    """A plan names layers by their parameters and pages: compiled for a bank whose units differ
    it raises PlanMismatch (the engine then pages on demand) instead of moving the wrong pages."""
    model = small_gpt()
    with make_engine(copy.deepcopy(model), budget_for(model)) as a:
        engine_run(a, [(batch(32, 0), True)])
        plan, trace = a.pager.last_plan, a.pager.last_trace
        assert plan is not None
        Schedule.compile(plan, trace, a.bank)  # its own units: fine
        # a much larger budget merges modules into larger units
        with make_engine(copy.deepcopy(model), 64 * budget_for(model)) as b:
            assert len(b.bank.units) != len(a.bank.units)
            with pytest.raises(PlanMismatch):
                Schedule.compile(plan, trace, b.bank)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([8, 16, 32]), st.booleans()), min_size=2, max_size=7))
def test_any_sequence_of_lengths_and_evaluations_trains_exactly(schedule):
    """Random interleavings of sequence lengths and evaluation calls: plain PyTorch's results, one
    trace per length trained, a planned iteration for every other training call."""
    model = small_gpt()
    steps = [(batch(seq, i), train) for i, (seq, train) in enumerate(schedule)]
    ref, ref_evals = plain_run(copy.deepcopy(model), steps)
    with make_engine(model, budget_for(model)) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got, evals = engine_run(engine, steps)
        stats = engine.stats()
    assert_same(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(evals, ref_evals))
    trained = [seq for seq, train in schedule if train]
    want = {"traced": len(set(trained)), "planned": len(trained) - len(set(trained)),
            "demand": len(schedule) - len(trained)}
    assert stats["iterations"] == {k: v for k, v in want.items() if v}
    assert stats["replans"] == max(0, len(set(trained)) - 1)
    assert stats["misses"] == 0 and stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]


def test_a_forward_without_backward_is_no_trace_and_leaves_nothing_resident():
    """A training-mode forward whose loss is dropped: its recording is abandoned (no trace, no
    plan), and a planned one's leftovers are released when the next iteration begins."""
    model = small_gpt()
    xs = [batch(32, s) for s in range(5)]
    plain = copy.deepcopy(model)
    ref, _ = plain_run(plain, [(x, True) for x in (xs[1], xs[3], xs[4])])
    with make_engine(model, budget_for(model)) as engine:
        loss_of(engine, xs[0])  # dropped: never backward
        engine.backward(loss_of(engine, xs[1]))
        engine.step()
        loss_of(engine, xs[2])  # dropped, while following the plan
        for x in (xs[3], xs[4]):
            engine.backward(loss_of(engine, x))
            engine.step()
        stats = engine.stats()
        got = engine.state_dict()
    assert stats["iterations"] == {"traced": 1, "planned": 3} and stats["replans"] == 0
    assert stats["misses"] == 0 and stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]
    assert_same(got, ref)


def test_units_the_plan_keeps_on_the_gpu_have_one_copy_there_and_train_exactly():
    """A budget that holds every unit with its optimizer states and gradient sums (fp32: 4 + 16
    bytes per parameter): the plan caches them, the engine settles them (the gpu copy is the
    only one, so the update writes one copy), and evicting them moves them home intact."""
    steps = [(batch(32, s), True) for s in range(4)]
    ref, _ = plain_run(small_gpt(), steps)
    model = small_gpt()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    with make_engine(model, 6 * nbytes + budget_for(model, 1.0)) as engine:
        cpu = engine.store.tier("cpu")
        engine_run(engine, steps[:2])
        cached = engine.pager.last_plan.cached_layers
        assert len(cached) == len(engine.bank.layers)
        layers = engine.bank.layers
        res = engine.pager.residency
        assert all(res.is_settled(l.index) and res.is_bound(l.index) for l in layers)
        assert all(u.state_tier == "gpu" for u in layers)  # their updates run on the gpu
        home_pages = sum(engine.store.page_count(l.compute) for l in layers)
        used = cpu.used_pages
        engine.pager.residency.release_all()  # every unit goes home, its only copy moved
        assert not any(res.is_settled(l.index) or res.is_bound(l.index) for l in layers)
        assert cpu.used_pages == used + home_pages
        got, _ = engine_run(engine, steps[2:])  # the next planned iteration settles them again
        assert all(res.is_settled(l.index) for l in layers)
        assert engine.stats()["misses"] == 0
    assert_same(got, ref)


@pytest.mark.parametrize("optimizer_tier", ["cpu", "gpu"])
def test_planned_iterations_run_in_a_gpu_arena_sized_from_the_plan(optimizer_tier):
    """The budget covers two pools, the page arena and the non-model memory: planned iterations
    run in an arena of the states kept on the gpu plus the plan's most pages at once, beside
    the trace's non-model peak, within the budget; a longer sequence re-plans and resizes."""
    model = small_gpt()
    n = sum(p.numel() for p in model.parameters())
    static = (-(-16 * n // PAGE) + 4) * PAGE if optimizer_tier == "gpu" else 0
    budget = budget_for(model) + static
    steps = [(batch(16, s), True) for s in range(3)] + [(batch(32, s), True) for s in range(3, 6)]
    ref, _ = plain_run(copy.deepcopy(model), steps)
    with make_engine(model, budget, optimizer_tier=optimizer_tier) as engine:
        engine_run(engine, steps[:3])
        short = engine.stats()
        short_nm = engine.pager.last_trace.peak_non_model_bytes
        engine_run(engine, steps[3:])
        long = engine.stats()
        long_nm = engine.pager.last_trace.peak_non_model_bytes
        report = pagemem.sched.validate(engine.pager.last_plan, engine.pager.last_trace)
        most_pages = int((report.timeline["gpu"] - report.non_model).max())
        resident = engine.pager.static_gpu_pages * PAGE
        got = engine.state_dict()
    for s, nm in ((short, short_nm), (long, long_nm)):
        assert s["gpu_arena_bytes"] + nm <= s["gpu_budget_bytes"]
        assert s["misses"] == 0
    # the peak is the most of any planned iteration so far (the longer sequence's plan may hold
    # fewer pages: its larger activations leave less room to keep gradients on the gpu)
    short_peak = short["gpu_arena_bytes"] + short_nm
    assert short["gpu_peak_bytes_by_mode"]["plan"] == short_peak
    assert long["gpu_peak_bytes_by_mode"]["plan"] == max(short_peak, long["gpu_arena_bytes"] + long_nm)
    assert short["arena_resizes"] == 1 and long["arena_resizes"] == 3  # warm-up at the whole budget, then the plan's
    assert long["gpu_arena_bytes"] == resident + -(-most_pages // PAGE) * PAGE
    if optimizer_tier == "gpu":  # fp32: the parameters are the master pages, which stay: a plan
        assert most_pages == 0    # holds nothing more (it does not count the states twice)
    assert long["iterations"] == {"traced": 2, "planned": 4}
    assert_same(got, ref)


def test_the_executor_host_time_per_window_is_measured_on_planned_iterations():
    """``pagemem profile``'s ``window_host_seconds`` (the host stand-in): copies excluded."""
    from pagemem.engine.paging.measure import window_host_seconds

    seconds, how = window_host_seconds(iterations=2, repeats=1)
    assert 0 < seconds < 1 and how["samples_s"] == [seconds]
    assert how["windows_per_iteration"] > 0 and how["iterations"] == 2


def test_every_row_of_the_task_table_has_a_handler_at_world_size_1():
    """Each row a single-process plan may hold is carried out by someone (``HANDLERS``); the rows
    of data parallelism are the ones left, and a plan holding one is refused when compiled."""
    import dataclasses

    from pagemem.engine.paging.executor import HANDLERS, unhandled_rows
    from pagemem.sched.tasks import EFFECTS, Target, Task

    assert unhandled_rows(1) == []
    assert set(unhandled_rows(2)) == {("all_gather", "param"), ("reduce_scatter", "grad"), ("release", "fullgrad")}
    assert set(HANDLERS) <= set(EFFECTS)
    model = small_gpt()
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget_for(model), cpu_bytes=64 << 20)
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP))) as engine:
        engine.backward(loss_of(engine, batch(32, 0)))
        engine.step()
        plan, trace = engine.pager.last_plan, engine.pager.last_trace
        Schedule.compile(plan, trace, engine.bank)  # as the engine compiled it
        gather = Task("all_gather", Target("param", 0, 0), 0)
        with pytest.raises(PlanMismatch, match="all_gather param"):
            Schedule.compile(dataclasses.replace(plan, tasks=(*plan.tasks, gather)), trace, engine.bank)


def test_units_whose_gradients_are_final_are_queued_during_backward():
    """[Note: the gradient hand-off]: once the structure repeats, each unit is announced final
    as soon as its last gradient is handed off, inside backward, once, in the order backward
    completes them; the first backward announces them all at its end."""
    model = small_gpt()
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget_for(model), cpu_bytes=64 << 20)
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP))) as engine:
        seen: list[tuple[int, int, bool]] = []
        # inside: in autograd's run (a node runs), not in the engine's bookkeeping at its end
        engine.gradients.handoff.subscribe(
            lambda u: seen.append((engine.global_step, u, torch._C._current_autograd_node() is not None)))
        for s in range(3):
            engine.backward(loss_of(engine, batch(32, s)))
            engine.step()
        with_grads = {u for u, (_, idx) in enumerate(engine.bank.units)
                      if any(engine.bank.params[i][1].requires_grad for i in idx)}
        for step in range(3):
            units = [u for g, u, _ in seen if g == step]
            assert sorted(units) == sorted(with_grads)  # each once
        assert all(inside for g, _, inside in seen if g > 0)  # announced during backward, not at its end
        later = [u for g, u, _ in seen if g == 2]
        assert later[0] > later[-1]  # backward completes the last units first
        assert engine.stats()["units_final_in_backward"] >= 2 * len(with_grads) - 2
