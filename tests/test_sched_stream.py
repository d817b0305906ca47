"""The cpu an update and the moves of pages homed on nvme need, as the runtime needs it ([Note: a
streamed update] and [Note: staging is optional] in ``pagemem/sched/tasks.py``): a layout's
``stream_pages`` bounds what a streamed update holds on the cpu, pages that do not fit the cpu move
to the gpu straight from nvme; every plan validates, the stated least is exact, and layouts that
say nothing plan as before."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagemem.sched import (InfeasiblePlan, Layout, Setting, Target, Task, effects, least_cpu_bytes, least_gpu_bytes,
                           plan, simulate, validate)
from pagemem.sched.holdings import Key, costs, host_cost
from pagemem.sched.tasks import effect_of
from pagemem.sched.windows import Usage
from pagemem.tracer import synthetic_transformer
from test_sched_planner import small_traces
from test_sched_simulate import profile

PAGE = 4096
SMALL = synthetic_transformer(layers=3, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)


def with_streams(layout: Layout, pages) -> Layout:
    """``layout`` with each layer's ``stream_pages`` from ``pages(layer)``."""
    return dataclasses.replace(layout, layers=tuple(dataclasses.replace(l, stream_pages=pages(l)) for l in layout.layers))


def expected_least(p, tr) -> int:
    """The least cpu, by hand from the note's rule: what rests on the cpu, plus at the op of each
    update what it holds there -- the states (on nvme) up to the stream, then the gradient pages
    (through nvme: up to what is left of it; else every one) -- and nothing for parameter pages."""
    lay, opt, home = p.layout, p.optimizer_tier, p.home_tier
    rest, at = 0, {}
    for l in lay.layers:
        if l.index in p.cached_layers:
            continue
        rest += l.param_pages * (home == "cpu") + l.optim_pages * (opt == "cpu")
    for g in Usage.from_trace(tr).grads:
        l = lay.layers[g.layer] if g is not None else None
        if l is None or l.index in p.cached_layers:
            continue
        S = l.param_pages + l.optim_pages if l.stream_pages is None else l.stream_pages
        states = min(l.optim_pages, S) if opt == "nvme" else 0
        grads = min(l.param_pages, S - states) if home == "nvme" else l.param_pages
        at[g.last + 1] = at.get(g.last + 1, 0) + states + grads
    return (rest + max(at.values(), default=0)) * lay.page_bytes


# ---------------------------------------------------------------- the table

def test_a_direct_move_reads_the_home_on_nvme_and_pays_the_disk_read():
    p = plan(SMALL, {"gpu": "1GiB", "cpu": "1GiB", "nvme": "1GiB"}, page_bytes=PAGE, home_tier="nvme",
             cache_optimizer=False)
    s = p.setting
    staged = Task("move_to_gpu", Target("param", 2, 0), 0, "gpu")
    direct = dataclasses.replace(staged, source="nvme")
    assert [str(k) for k in effects(staged, s).reads] == ["param[2].0@cpu"]
    assert [str(k) for k in effects(direct, s).reads] == ["param[2].0@nvme"]
    assert costs(staged, s) == (("h2d", PAGE),) and host_cost(staged, s) is None
    assert costs(direct, s) == (("nvme_read", PAGE), ("h2d", PAGE)) and host_cost(direct, s) == ("nvme_host", PAGE)
    eff = effect_of(direct)
    assert eff.stream_of(staged) == "h2d" and eff.stream_of(direct) == "nvme"
    assert effects(direct, s).pages("takes", s) == {"gpu": 1}  # no cpu page
    assert str(direct).endswith("@gpu from nvme") and "from" not in str(staged)
    # a source the row does not allow, or on a row without sources, is refused
    assert not effects(dataclasses.replace(staged, source="gpu"), s).tier_ok
    assert not effects(Task("move_to_cpu", Target("optim", 2), 0, "cpu", source="nvme"), s).tier_ok


def test_a_direct_move_of_a_page_homed_on_the_cpu_is_caught():
    p = plan(SMALL, {"gpu": least_gpu_bytes(SMALL, 1, PAGE), "cpu": "1GiB"}, page_bytes=PAGE, cache_optimizer=False)
    i = next(i for i, t in enumerate(p.tasks) if t.operation == "move_to_gpu")
    tasks = list(p.tasks)
    tasks[i] = dataclasses.replace(tasks[i], source="nvme")
    r = validate(dataclasses.replace(p, tasks=tasks), SMALL)
    assert any(v.kind == "not_resident" and "@nvme" in v.message for v in r.violations), r.summary()


@pytest.mark.parametrize("opt,home", [("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme")])
def test_the_cpu_copies_of_a_streamed_update_fill_its_stream_states_first(opt, home):
    lay = Layout.from_trace(SMALL, 1, PAGE)
    L = 2
    P, O = lay.layers[L].param_pages, lay.layers[L].optim_pages
    for S in (None, 1, O - 1, O, O + 2, P + O, P + O + 5):
        s = Setting(with_streams(lay, lambda l: S if l.index == L else None), frozenset(), opt, home)
        room = P + O if S is None else S
        states = min(O, room) if opt == "nvme" else O
        grads = [max(0, min(1, room - (states if opt == "nvme" else 0) - j)) if home == "nvme" else 1 for j in range(P)]
        assert s.held_pages(Key("optim", "cpu", L, None)) == states
        assert [s.held_pages(Key("grad", "cpu", L, j)) for j in range(P)] == grads
        assert s.group_pages("grad", "cpu", L) == sum(grads)
        # what transfers move is every page, whatever the stream
        assert s.pages("optim", L) == O and s.pages("grad", L) == 1
        # other tiers, and layers cached on the gpu, hold their own pages
        assert s.held_pages(Key("grad", "nvme", L, 0)) == 1 and s.held_pages(Key("param", "cpu", L, 0)) == 1
        cached = Setting(s.layout, frozenset({L}), opt, home)
        assert cached.held_pages(Key("grad", "gpu", L, 0)) == 1


# ---------------------------------------------------------------- the planner, the validator, the simulator

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=small_traces(), world=st.sampled_from([1, 2]), opt=st.sampled_from(["cpu", "nvme"]),
       home=st.sampled_from(["cpu", "nvme"]), cache=st.booleans(), slack=st.integers(0, 300_000),
       streams=st.lists(st.one_of(st.none(), st.integers(0, 60)), min_size=8, max_size=8),
       cpu_slack=st.sampled_from([0, 1, 5 * PAGE, None]))
def test_every_plan_validates_and_its_least_cpu_is_exact(tr, world, opt, home, cache, slack, streams, cpu_slack):
    """With any stream bounds: every plan validates within its budgets, the validator's peaks are
    the planner's, the least cpu is the rule's figure by hand, and one byte below it is refused
    naming the cpu and the same figure."""
    lay = with_streams(Layout.from_trace(tr, world, PAGE), lambda l: streams[l.index % len(streams)])
    kw = dict(world_size=world, optimizer_tier=opt, page_bytes=PAGE, cache_optimizer=cache, home_tier=home, layout=lay)
    gpu = least_gpu_bytes(tr, world, PAGE) + slack
    need = least_cpu_bytes(tr, gpu_bytes=gpu, **kw)
    cpu = 1 << 40 if cpu_slack is None else need + cpu_slack
    p = plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": "1GiB"}, **kw)
    r = validate(p, tr)
    assert r.ok, r.summary()
    assert r.peak == p.predicted_peak and r.peak["cpu"] <= cpu
    assert need == expected_least(p, tr)
    if cpu_slack == 0:
        assert r.peak["cpu"] == need
    if need:
        with pytest.raises(InfeasiblePlan) as err:
            plan(tr, {"gpu": gpu, "cpu": need - 1, "nvme": "1GiB"}, **kw)
        assert (err.value.tier, err.value.min_bytes) == ("cpu", need)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=small_traces(), opt=st.sampled_from(["cpu", "nvme"]), stream=st.integers(1, 8),
       slack=st.integers(0, 200_000))
def test_a_plan_at_its_least_cpu_simulates_within_its_budgets(tr, opt, stream, slack):
    lay = with_streams(Layout.from_trace(tr, 1, PAGE), lambda l: stream)
    kw = dict(optimizer_tier=opt, page_bytes=PAGE, home_tier="nvme", layout=lay)
    gpu = least_gpu_bytes(tr, 1, PAGE) + slack
    cpu = least_cpu_bytes(tr, gpu_bytes=gpu, **kw)
    p = plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": "1GiB"}, **kw)
    s = simulate(p, tr, profile())
    assert s.peak["cpu"] <= cpu and s.peak["gpu"] <= gpu
    assert s.memory[-1][1:] == s.memory[0][1:]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=small_traces(), world=st.sampled_from([1, 2]), opt=st.sampled_from(["cpu", "nvme"]),
       home=st.sampled_from(["cpu", "nvme"]), cache=st.booleans(), cpu=st.sampled_from([None, 0, 9 * PAGE]))
def test_a_layout_that_says_the_whole_layer_plans_as_one_that_says_nothing(tr, world, opt, home, cache, cpu):
    base = Layout.from_trace(tr, world, PAGE)
    whole = with_streams(base, lambda l: l.param_pages + l.optim_pages)
    kw = dict(world_size=world, optimizer_tier=opt, page_bytes=PAGE, cache_optimizer=cache, home_tier=home)
    gpu = least_gpu_bytes(tr, world, PAGE)
    need = least_cpu_bytes(tr, gpu_bytes=gpu, **kw)
    assert least_cpu_bytes(tr, gpu_bytes=gpu, layout=whole, **kw) == need
    budgets = {"gpu": gpu, "cpu": 1 << 40 if cpu is None else need + cpu, "nvme": "1GiB"}
    a, b = plan(tr, budgets, **kw), plan(tr, budgets, layout=whole, **kw)
    assert a.tasks == b.tasks and a.deps == b.deps and a.predicted_peak == b.predicted_peak


def test_a_small_stream_lowers_the_least_cpu_to_the_largest_update_and_no_parameter_page():
    """Everything on nvme: the least cpu is the largest stream (parameters need none), not the
    largest layer's gradients and states."""
    base = Layout.from_trace(SMALL, 1, PAGE)
    kw = dict(optimizer_tier="nvme", page_bytes=PAGE, home_tier="nvme", cache_optimizer=False)
    whole = least_cpu_bytes(SMALL, **kw)
    assert whole == max(l.param_pages + l.optim_pages for l in base.layers) * PAGE
    assert least_cpu_bytes(SMALL, layout=with_streams(base, lambda l: 3), **kw) == 3 * PAGE
    p = plan(SMALL, {"gpu": least_gpu_bytes(SMALL, 1, PAGE), "cpu": 3 * PAGE, "nvme": "1GiB"},
             layout=with_streams(base, lambda l: 3), **kw)
    r = validate(p, SMALL)
    assert r.ok and r.peak["cpu"] == 3 * PAGE  # pages staged while the cpu is free of updates
    assert any(t.source == "nvme" for t in p.tasks) and any(t.operation == "move_to_cpu" for t in p.tasks)
