"""The planner and the validator: hypothesis properties over random traces and budgets, and
targeted checks that the validator catches broken plans."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.models import GPT, gpt_config
from pagemem.sched import InfeasiblePlan, Plan, Task, least_gpu_bytes, plan, validate
from pagemem.tracer import synthetic_transformer, trace

PAGE = 4096
ROOMY = {"cpu": "1GiB", "nvme": "1GiB"}


@st.composite
def small_traces(draw):
    heads = draw(st.sampled_from([2, 4]))
    hidden = heads * draw(st.sampled_from([8, 16, 32]))
    return synthetic_transformer(
        layers=draw(st.integers(1, 4)), hidden=hidden, ffn=draw(st.sampled_from([2, 4])) * hidden,
        heads=heads, seq=draw(st.sampled_from([4, 8, 16, 32])), batch=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from([torch.float16, torch.float32])), vocab=draw(st.sampled_from([32, 100, 256])),
        tie_embeddings=draw(st.booleans()), optimizer_model=draw(st.sampled_from(["adam", "none"])))


_cache: dict = {}


def min_gpu(tr, **kw) -> int:
    key = (tr.fingerprint, tuple(op.non_model_bytes for op in tr.ops), tuple(sorted(kw.items())))
    if key not in _cache:
        with pytest.raises(InfeasiblePlan) as err:
            plan(tr, {"gpu": 0, **ROOMY}, **kw)
        _cache[key] = err.value.min_gpu_bytes
    return _cache[key]


settings_ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings_
@given(tr=small_traces(), world=st.sampled_from([1, 2, 4, 8]), tier=st.sampled_from(["cpu", "nvme"]),
       cache=st.booleans(), page=st.sampled_from([PAGE, 2 * PAGE]), slack=st.integers(0, 400_000),
       home=st.sampled_from(["cpu", "nvme"]))
def test_a_plan_validates_or_the_planner_says_what_would_fit(tr, world, tier, cache, page, slack, home):
    kw = dict(world_size=world, optimizer_tier=tier, page_bytes=page)
    need = min_gpu(tr, **kw)
    budget = need + slack
    p = plan(tr, {"gpu": budget, **ROOMY}, cache_optimizer=cache, home_tier=home, **kw)
    report = validate(p, tr)
    assert report.ok, report.summary()
    assert report.peak["gpu"] <= budget
    assert report.peak["gpu"] == p.predicted_peak["gpu"]
    assert report.peak["cpu"] <= p.budgets.cpu


@settings_
@given(tr=small_traces(), world=st.sampled_from([1, 2, 8]), tier=st.sampled_from(["cpu", "nvme"]),
       cache=st.booleans())
def test_stated_minimum_is_feasible_and_one_byte_less_is_not(tr, world, tier, cache):
    kw = dict(world_size=world, optimizer_tier=tier, page_bytes=PAGE)
    need = min_gpu(tr, **kw)
    p = plan(tr, {"gpu": need, **ROOMY}, cache_optimizer=cache, **kw)
    assert validate(p, tr).ok
    with pytest.raises(InfeasiblePlan) as err:
        plan(tr, {"gpu": need - 1, **ROOMY}, cache_optimizer=cache, **kw)
    assert err.value.tier == "gpu" and err.value.min_gpu_bytes == need
    assert least_gpu_bytes(tr, world, PAGE) == need  # the same figure, without planning
    assert isinstance(err.value, pagemem.PageMemError)
    assert str(need) in str(err.value)


@settings(max_examples=25, deadline=None)
@given(tr=small_traces(), world=st.sampled_from([1, 4]), slack=st.integers(0, 200_000))
def test_segment_tree_and_rescan_timelines_plan_identically(tr, world, slack):
    kw = dict(world_size=world, page_bytes=PAGE)
    budget = {"gpu": min_gpu(tr, **kw, optimizer_tier="cpu") + slack, **ROOMY}
    a = plan(tr, budget, timeline="segment", **kw)
    b = plan(tr, budget, timeline="scan", **kw)
    assert a.tasks == b.tasks


def gpt_trace(name="tiny", **overrides):
    cfg = gpt_config(name, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (2, 16))
    return trace(model, lambda: model(idx, idx).backward())


@pytest.mark.parametrize("overrides", [{}, {"checkpoint_activations": True}, {"tie_embeddings": False}])
@pytest.mark.parametrize("world", [1, 4])
def test_traced_gpt_plans_validate_across_budgets(overrides, world):
    tr = gpt_trace(**overrides)
    need = min_gpu(tr, world_size=world, optimizer_tier="cpu", page_bytes=PAGE)
    for budget in (need, need + 64 * PAGE, 100 * need):
        p = plan(tr, {"gpu": budget, **ROOMY}, world_size=world, page_bytes=PAGE)
        r = validate(p, tr)
        assert r.ok, r.summary()


def test_roomy_gpu_caches_every_layer_and_moves_nothing():
    tr = synthetic_transformer(layers=2, hidden=32, ffn=128, heads=2, seq=8, batch=1, vocab=64)
    p = plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=1, page_bytes=PAGE)
    assert p.cached_layers == tuple(range(len(tr.layers)))
    assert p.counts().get("move_to_gpu", 0) == 0 and p.counts().get("offload", 0) == 0
    assert p.counts()["update"] == len(tr.layers)
    assert all(t.tier == "gpu" for t in p.tasks if t.operation == "update")
    assert validate(p, tr).ok


def test_cached_layers_are_counted_at_the_state_pages_the_executor_keeps():
    """An executor that keeps more pages for a cached layer's states than the trace's (gradient
    sums beside them) says so: what the plan holds plus those extra pages stays within the
    budget, so the planner caches fewer layers where the budget is tight."""
    tr = synthetic_transformer(layers=4, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    need = min_gpu(tr, world_size=1, page_bytes=PAGE)
    layers = plan(tr, {"gpu": "1GiB", **ROOMY}, page_bytes=PAGE).layout.layers
    more = {l.index: 2 * l.optim_pages for l in layers}
    fewer_somewhere = False
    for budget in range(need, need + sum(l.param_pages + more[l.index] for l in layers) * PAGE, 8 * PAGE):
        base = plan(tr, {"gpu": budget, **ROOMY}, page_bytes=PAGE)
        p = plan(tr, {"gpu": budget, **ROOMY}, page_bytes=PAGE, cached_state_pages=more)
        extra = sum(more[L] - layers[L].optim_pages for L in p.cached_layers) * PAGE
        assert validate(p, tr).peak["gpu"] + extra <= budget, budget
        assert len(p.cached_layers) <= len(base.cached_layers)
        fewer_somewhere |= len(p.cached_layers) < len(base.cached_layers)
    assert fewer_somewhere
    with pytest.raises(pagemem.ConfigError, match=r"cached_state_pages\[0\]"):
        plan(tr, {"gpu": need, **ROOMY}, page_bytes=PAGE, cached_state_pages={0: -1})


def test_tight_gpu_caches_nothing_and_prefetches_within_budget():
    tr = synthetic_transformer(layers=4, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    need = min_gpu(tr, world_size=2, optimizer_tier="nvme", page_bytes=PAGE)
    p = plan(tr, {"gpu": need, **ROOMY}, world_size=2, optimizer_tier="nvme", page_bytes=PAGE)
    assert p.cached_layers == ()
    c = p.counts()
    assert c["move_to_gpu"] == c["all_gather"] > 0
    assert c["move_to_cpu"] == c["update"] == len(tr.layers)
    assert validate(p, tr).peak["gpu"] <= need


def test_more_room_lets_moves_start_earlier():
    tr = synthetic_transformer(layers=4, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    kw = dict(world_size=1, page_bytes=PAGE, cache_optimizer=False)
    need = min_gpu(tr, optimizer_tier="cpu", **kw)

    def mean_lead(p):  # how long before its window each page arrives, averaged
        starts = {}
        for t in p.tasks:
            if t.operation == "compute":
                starts.setdefault(t.target.layer, []).append(t.trigger_id)
        leads = []
        for t in p.tasks:
            if t.operation == "move_to_gpu":
                nxt = min(s for s in starts[t.target.layer] if s >= t.trigger_id)
                leads.append(nxt - t.trigger_id)
        return sum(leads) / len(leads)

    tight = plan(tr, {"gpu": need, **ROOMY}, **kw)
    roomy = plan(tr, {"gpu": 4 * need, **ROOMY}, **kw)
    assert mean_lead(roomy) > mean_lead(tight)
    assert validate(tight, tr).ok and validate(roomy, tr).ok


def test_cpu_budget_too_small_names_the_cpu():
    tr = synthetic_transformer(layers=2, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    with pytest.raises(InfeasiblePlan, match="the cpu tier needs at least") as err:
        plan(tr, {"gpu": "1GiB", "cpu": 8192, "nvme": "1GiB"}, world_size=1, page_bytes=PAGE,
             cache_optimizer=False)
    assert err.value.tier == "cpu" and err.value.min_bytes > 8192
    with pytest.raises(InfeasiblePlan, match="nvme"):
        plan(tr, {"gpu": "1GiB", "cpu": "1GiB", "nvme": 0}, optimizer_tier="nvme", page_bytes=PAGE,
             cache_optimizer=False)


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 0}, "world_size"),
    ({"optimizer_tier": "ssd"}, "optimizer_tier"),
    ({"page_bytes": 1000}, "page_bytes"),
    ({"budgets": {"cpu": "1GiB"}}, r"budgets\['gpu'\]: required"),
    ({"budgets": {"gpu": "1GiB", "cpu": "1GiB", "tape": 1}}, "unknown tier"),
    ({"budgets": {"gpu": "lots", "cpu": "1GiB"}}, r"budgets\['gpu'\]"),
    ({"timeline": "fenwick"}, "timeline"),
])
def test_bad_input_names_the_field(kwargs, match):
    tr = synthetic_transformer(layers=1, hidden=32, ffn=64, heads=2, seq=4, batch=1, vocab=32)
    args = {"budgets": {"gpu": "1GiB", "cpu": "1GiB"}, **kwargs}
    with pytest.raises(pagemem.ConfigError, match=match):
        plan(tr, **args)


def test_plan_json_round_trip(tmp_path):
    tr = synthetic_transformer(layers=2, hidden=32, ffn=128, heads=2, seq=8, batch=1, vocab=64)
    p = plan(tr, {"gpu": min_gpu(tr, world_size=2, optimizer_tier="nvme", page_bytes=PAGE), **ROOMY},
             world_size=2, optimizer_tier="nvme", page_bytes=PAGE)
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q.tasks == p.tasks and q.layout == p.layout and q.budgets == p.budgets
    assert validate(q, tr).ok
    assert p.holds_for(tr)
    other = synthetic_transformer(layers=3, hidden=32, ffn=128, heads=2, seq=8, batch=1, vocab=64)
    assert not p.holds_for(other)


# ---------------------------------------------------------------- the validator catches broken plans

@pytest.fixture(scope="module")
def base():
    tr = synthetic_transformer(layers=3, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    need = min_gpu(tr, world_size=2, optimizer_tier="nvme", page_bytes=PAGE)
    p = plan(tr, {"gpu": need, **ROOMY}, world_size=2, optimizer_tier="nvme", page_bytes=PAGE,
             cache_optimizer=False)
    assert validate(p, tr).ok
    return tr, p


def mutate(p, tasks):
    return dataclasses.replace(p, tasks=tasks)


def first(p, op, kind=None):
    return next(i for i, t in enumerate(p.tasks) if t.operation == op and (kind is None or t.target.kind == kind))


def kinds(report):
    return {v.kind for v in report.violations}


def test_dropped_move_is_caught(base):
    tr, p = base
    i = first(p, "move_to_gpu")
    r = validate(mutate(p, p.tasks[:i] + p.tasks[i + 1:]), tr)
    assert "not_resident" in kinds(r)


def test_early_release_is_a_use_after_release(base):
    tr, p = base
    i = first(p, "release", "param")
    t = p.tasks[i]
    early = Task(t.operation, t.target, t.trigger_id - 1, t.tier)
    tasks = p.tasks[:i] + p.tasks[i + 1:]
    # put it where its new trigger belongs in the queue
    pos = max(k for k, x in enumerate(tasks) if (2 * x.trigger_id + x.issued_at_end) <= 2 * early.trigger_id + 1) + 1
    tasks.insert(pos, early)
    r = validate(mutate(p, tasks), tr)
    assert "use_after_release" in kinds(r)


def test_missing_update_and_missing_write_back_are_caught(base):
    tr, p = base
    i = first(p, "update")
    r = validate(mutate(p, p.tasks[:i] + p.tasks[i + 1:]), tr)
    assert "not_updated" in kinds(r)
    j = first(p, "offload", "optim")
    r = validate(mutate(p, p.tasks[:j] + p.tasks[j + 1:]), tr)
    assert "lost_update" in kinds(r)


def test_missing_release_is_a_leak(base):
    tr, p = base
    i = first(p, "release", "fullgrad")
    r = validate(mutate(p, p.tasks[:i] + p.tasks[i + 1:]), tr)
    assert "leak" in kinds(r)


def test_over_budget_is_caught(base):
    tr, p = base
    r = validate(p, tr, {"gpu": p.budgets.gpu - PAGE, "cpu": "1GiB", "nvme": "1GiB"})
    assert "over_budget" in kinds(r)
    assert any(v.target == "gpu" for v in r.violations)


def test_out_of_order_queue_is_caught(base):
    tr, p = base
    tasks = list(reversed(p.tasks))
    r = validate(mutate(p, tasks), tr)
    assert "bad_task" in kinds(r)


def test_reduce_scatter_before_gradients_are_complete(base):
    tr, p = base
    i = first(p, "reduce_scatter")
    t = p.tasks[i]
    bad = Task(t.operation, t.target, t.trigger_id - 1, t.tier)
    tasks = p.tasks[:i] + p.tasks[i + 1:]
    pos = max(k for k, x in enumerate(tasks) if (2 * x.trigger_id + x.issued_at_end) <= 2 * bad.trigger_id) + 1
    tasks.insert(pos, bad)
    assert "bad_task" in kinds(validate(mutate(p, tasks), tr))


def test_plan_for_another_trace_is_refused(base):
    tr, p = base
    other = synthetic_transformer(layers=4, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    assert other.fingerprint != tr.fingerprint
    r = validate(p, other)
    assert any("another access order" in v.message for v in r.violations)


def test_a_bigger_batch_breaks_a_tight_plan():
    small = synthetic_transformer(layers=2, hidden=64, ffn=256, heads=4, seq=16, batch=1, vocab=128)
    big = synthetic_transformer(layers=2, hidden=64, ffn=256, heads=4, seq=16, batch=4, vocab=128)
    assert small.fingerprint == big.fingerprint  # same access order, more activation memory
    need = min_gpu(small, world_size=1, optimizer_tier="cpu", page_bytes=PAGE)
    p = plan(small, {"gpu": need, **ROOMY}, page_bytes=PAGE)
    assert p.holds_for(small) and not p.holds_for(big)
    assert "over_budget" in kinds(validate(p, big))
    roomy = plan(small, {"gpu": 100 * need, **ROOMY}, page_bytes=PAGE, cache_optimizer=False)
    assert roomy.holds_for(big) and validate(roomy, big).ok


def test_a_layout_given_by_the_caller_is_what_planner_and_validator_count():
    """An engine hands the planner its own pages (``plan(layout=)``): the param pages it moves
    and the pages a cached layer's states take; the validator then counts the same, so the
    validated peak itself stays within the budget."""
    import dataclasses

    from pagemem.sched import Layout
    tr = synthetic_transformer(layers=4, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    need = min_gpu(tr, world_size=1, page_bytes=PAGE)
    base = Layout.from_trace(tr, 1, PAGE)
    mine = Layout(PAGE, 1, tuple(dataclasses.replace(l, cached_pages=2 * l.optim_pages) for l in base.layers))
    some = False
    for budget in range(need, need + sum(l.param_pages + 2 * l.optim_pages for l in base.layers) * PAGE, 8 * PAGE):
        p = plan(tr, {"gpu": budget, **ROOMY}, page_bytes=PAGE, layout=mine)
        assert p.layout is mine
        peak = validate(p, tr).peak["gpu"]
        assert peak <= budget, budget
        if p.cached_layers:  # counted at the caller's pages, not the trace's
            some = True
            assert peak > validate(dataclasses.replace(p, layout=base), tr).peak["gpu"]
    assert some
    with pytest.raises(pagemem.ConfigError, match="layout: made for"):
        plan(tr, {"gpu": "1GiB", **ROOMY}, page_bytes=2 * PAGE, layout=mine)
    with pytest.raises(pagemem.ConfigError, match="one layer per trace layer"):
        plan(tr, {"gpu": "1GiB", **ROOMY}, page_bytes=PAGE, layout=Layout(PAGE, 1, base.layers[:-1]))
