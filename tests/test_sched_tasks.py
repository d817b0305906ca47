"""The task table: what each task takes, gives back and waits for; the dependencies and compute
windows a plan carries for an executor; the plan format; the validator's checks on every tier."""

import dataclasses
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem.sched.tasks as tasks_mod
from pagemem.errors import ConfigError
from pagemem.sched import EFFECTS, OPERATIONS, InfeasiblePlan, Plan, Setting, Target, Task, effects, plan, validate
from pagemem.sched.holdings import costs, executor_cost, host_cost
from pagemem.sched.windows import Usage
from pagemem.tracer import synthetic_transformer

PAGE = 4096
ROOMY = {"cpu": "1GiB", "nvme": "1GiB"}
SMALL = synthetic_transformer(layers=3, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)


def min_gpu(tr, **kw) -> int:
    with pytest.raises(InfeasiblePlan) as err:
        plan(tr, {"gpu": 0, **ROOMY}, page_bytes=PAGE, **kw)
    return err.value.min_gpu_bytes


def tight(tr=SMALL, slack=0, cache=False, **kw) -> Plan:
    return plan(tr, {"gpu": min_gpu(tr, **kw) + slack, **ROOMY}, page_bytes=PAGE, cache_optimizer=cache, **kw)


def kinds(report):
    return {v.kind for v in report.violations}


# ---------------------------------------------------------------- the table itself

def test_the_table_has_a_row_for_every_task_a_plan_holds_and_its_docs_list_every_row():
    assert {op for op, _ in EFFECTS} == set(OPERATIONS)
    seen = set()
    for kw in (dict(world_size=1, optimizer_tier="nvme"), dict(world_size=4, optimizer_tier="nvme"),
               dict(world_size=2, optimizer_tier="cpu", slack=1 << 24, cache=True),
               dict(world_size=2, optimizer_tier="nvme", home_tier="nvme"),
               dict(world_size=3, optimizer_tier="nvme", sharding="states"),
               dict(world_size=2, optimizer_tier="cpu", slack=1 << 24, cache=True, sharding="states")):
        p = tight(**kw)
        for t in p.tasks:
            fx = effects(t, p.setting)
            assert fx is not None and fx.tier_ok, t
            seen.add((t.operation, t.target.kind))
    assert seen == set(EFFECTS)
    doc = tasks_mod.__doc__
    for op, kind in EFFECTS:
        assert re.search(rf"^{op}\s+{kind}", doc, re.M), (op, kind)


def test_pages_taken_and_given_back_follow_the_layout():
    p = tight(world_size=4, optimizer_tier="nvme")
    s, lay = p.setting, p.layout.layers[2]
    W = 4

    def task(op, kind, page=None, tier=None, **kw):
        return effects(Task(op, Target(kind, 2, page), 0, tier, **kw), s)

    assert task("move_to_gpu", "param", 0, "gpu").pages("takes", s) == {"gpu": 1}
    assert task("all_gather", "param", 0).pages("takes", s) == {"gpu": W - 1}
    assert task("compute", "layer", tier="gpu").takes == ()
    assert task("compute", "layer", tier="gpu", produces_grads=True).pages("takes", s) == {"gpu": W * lay.param_pages}
    assert task("reduce_scatter", "grad", 0).pages("takes", s) == {"gpu": 1}
    assert task("offload", "grad", 0, "cpu").pages("takes", s) == {"cpu": 1}
    assert task("move_to_cpu", "optim", tier="cpu").pages("takes", s) == {"cpu": lay.optim_pages}
    assert task("release", "param", tier="gpu").pages("frees", s) == {"gpu": W * lay.param_pages}
    assert task("release", "fullgrad", tier="gpu").pages("frees", s) == {"gpu": W * lay.param_pages}
    assert task("release", "optim", tier="cpu").pages("frees", s) == {"cpu": lay.optim_pages}
    # the write-back goes home, a release never gives a home copy back, a 1-rank plan gathers nothing
    assert not task("offload", "optim", tier="cpu").tier_ok
    assert task("release", "optim", tier="nvme").frees == ()
    one = Setting(dataclasses.replace(p.layout, world_size=1))
    assert effects(Task("all_gather", Target("param", 2, 0), 0), one) is None
    assert p.bytes_moved()["network"] == sum(
        (W - 1) * PAGE for t in p.tasks if t.operation in ("all_gather", "reduce_scatter"))


def test_what_each_task_costs_follows_the_layout():
    p = tight(world_size=4, optimizer_tier="nvme")
    s, lay = p.setting, p.layout.layers[2]

    def cost(op, kind, page=None, tier=None):
        return costs(Task(op, Target(kind, 2, page), 0, tier), s)

    assert cost("move_to_gpu", "param", 0, "gpu") == (("h2d", PAGE),)
    assert cost("all_gather", "param", 0) == (("all_gather", PAGE),)  # bytes per rank: network.py times it
    assert cost("reduce_scatter", "grad", 0) == (("reduce_scatter", PAGE),)
    assert cost("move_to_cpu", "optim", tier="cpu") == (("nvme_read", lay.optim_pages * PAGE),)
    # a disk transfer also costs the CPU its share (checksums, submission), beside it on io
    assert host_cost(Task("move_to_cpu", Target("optim", 2), 0, "cpu"), s) == ("nvme_host", lay.optim_pages * PAGE)
    assert host_cost(Task("offload", Target("optim", 2), 0, "nvme"), s) == ("nvme_host", lay.optim_pages * PAGE)
    assert host_cost(Task("move_to_gpu", Target("param", 2, 0), 0, "gpu"), s) is None
    # the executor's host time: one window per release of a layer's parameters, nothing else
    assert executor_cost(Task("release", Target("param", 2), 5, "gpu"), s) == ("window", 1)
    assert executor_cost(Task("release", Target("grad", 2), 5, "cpu"), s) is None
    assert executor_cost(Task("move_to_gpu", Target("param", 2, 0), 0, "gpu"), s) is None
    assert cost("compute", "layer", tier="gpu") == () and cost("release", "param", tier="gpu") == ()
    # an update: Adam over the shard, then the compute copy written from the fp32 master weights
    assert cost("update", "layer", tier="cpu") == (("adam", lay.shard_elements),
                                                   ("memory", 4 * lay.shard_elements + lay.shard_bytes))
    # parameters that are views of the master weights (no bytes of their own) have nothing to refresh
    bare = Setting(dataclasses.replace(p.layout, layers=tuple(dataclasses.replace(l, shard_bytes=0)
                                                              for l in p.layout.layers)))
    assert costs(Task("update", Target("layer", 2), 0, "gpu"), bare) == (("adam", lay.shard_elements), ("memory", 0))


# ---------------------------------------------------------------- what a plan carries for an executor

def test_dependencies_are_those_an_executor_needs():
    p = tight(world_size=2, optimizer_tier="nvme")
    T, D = p.tasks, p.deps
    assert len(D) == len(T)
    index = {t: i for i, t in enumerate(T)}
    for i, (t, d) in enumerate(zip(T, D)):
        assert all(j < i for j in d.same)
        L = t.target.layer
        mine = lambda op, kind, ts=T[:i]: {index[x] for x in ts if x.operation == op and x.target.kind == kind
                                           and x.target.layer == L}
        if t.operation == "update":  # its gradient offloads and its optimizer fetch
            assert mine("offload", "grad") | mine("move_to_cpu", "optim") <= set(d.same)
        if t.operation == "offload" and t.target.kind == "optim":  # the write-back: after the update
            assert set(d.same) == mine("update", "layer")
        if t.operation == "release" and t.target.kind == "optim":
            assert mine("offload", "optim") <= set(d.same)
        if t.operation == "release" and t.target.kind == "param":  # the compute of the window it closes
            window = [x for x in T[:i] if x.operation == "compute" and x.target.layer == L][-1]
            assert window.end_id == t.trigger_id and index[window] in d.same
        if t.operation == "compute":  # exactly the moves and all-gathers of its pages since the last release
            last_release = max((j for j in range(i) if T[j].operation == "release"
                                and T[j].target == Target("param", L)), default=-1)
            fetch = {j for j in range(last_release + 1, i) if T[j].operation in ("move_to_gpu", "all_gather")
                     and T[j].target.layer == L}
            assert set(d.same) == fetch
            assert t.end_id >= t.trigger_id
        if t.operation == "move_to_gpu":  # synchronous updates: the last iteration's update of the layer
            assert [T[j].operation for j in d.previous] == ["update"] and T[d.previous[0]].target.layer == L
        if t.operation == "move_to_cpu":
            assert [T[j].operation for j in d.previous] == ["offload"]


def test_compute_windows_and_gradient_flags_are_the_traces():
    p = tight(world_size=1, optimizer_tier="cpu")
    usage = Usage.from_trace(SMALL)
    windows = {(w.layer, w.start): w.end for ws in usage.windows for w in ws}
    computes = [t for t in p.tasks if t.operation == "compute"]
    assert {(t.target.layer, t.trigger_id): t.end_id for t in computes} == windows
    grads = {(t.target.layer, t.trigger_id) for t in computes if t.produces_grads}
    assert grads == {(g.layer, usage.windows[g.layer][g.window].start) for g in usage.grads if g is not None}


@st.composite
def plans(draw):
    heads = draw(st.sampled_from([2, 4]))
    tr = synthetic_transformer(layers=draw(st.integers(1, 3)), hidden=heads * draw(st.sampled_from([8, 16])),
                               heads=heads, seq=draw(st.sampled_from([8, 16])), batch=1,
                               vocab=draw(st.sampled_from([32, 100])), tie_embeddings=draw(st.booleans()),
                               checkpoint_activations=draw(st.booleans()),
                               optimizer_model=draw(st.sampled_from(["adam", "none"])))
    kw = dict(world_size=draw(st.sampled_from([1, 2, 4])), optimizer_tier=draw(st.sampled_from(["cpu", "nvme"])),
              home_tier=draw(st.sampled_from(["cpu", "nvme"])))
    return tight(tr, slack=draw(st.sampled_from([0, 8 * PAGE, 1 << 24])), cache=draw(st.booleans()), **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=plans())
def test_an_executor_following_the_queue_never_waits_for_something_later(p):
    """Issuing tasks in queue order at their trigger ops, every task a task waits for has been
    issued before it, and a compute it waits for has finished (op ``end_id`` over) by then."""
    key = lambda t: 2 * t.trigger_id + t.issued_at_end
    for t, d in zip(p.tasks, p.deps):
        for j in d.same:
            u = p.tasks[j]
            done = 2 * u.end_id + 1 if u.operation == "compute" else key(u)
            assert done <= key(t), (t, u)


def test_deps_follow_the_tasks():
    p = tight(world_size=2, optimizer_tier="nvme")
    i = next(i for i, t in enumerate(p.tasks) if t.operation == "move_to_cpu")
    q = dataclasses.replace(p, tasks=p.tasks[:i] + p.tasks[i + 1:])
    assert len(q.deps) == len(q.tasks)
    L = p.tasks[i].target.layer
    update = next(j for j, t in enumerate(q.tasks) if t.operation == "update" and t.target.layer == L)
    assert all(q.tasks[j].operation != "move_to_cpu" for j in q.deps[update].same)


# ---------------------------------------------------------------- the plan format

def test_plan_format_4_round_trip_and_versions_3_2_and_1(tmp_path):
    p = tight(world_size=2, optimizer_tier="nvme")
    path = tmp_path / "plan.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["home_tier"] == "cpu" and len(data["tasks"][0]) == 11
    q = Plan.load(path)
    assert q.tasks == p.tasks and q.deps == p.deps and q.home_tier == "cpu" and q.layout == p.layout
    # version 3: no task sources, no stream pages (tasks copy from the cpu, updates hold whole layers)
    v3 = dict(data, version=3, tasks=[row[:10] for row in data["tasks"]],
              layout=dict(data["layout"], layers=[row[:9] for row in data["layout"]["layers"]]))
    q3 = Plan.from_dict(v3)
    assert q3.tasks == p.tasks and q3.deps == p.deps and q3.layout == p.layout and validate(q3, SMALL).ok
    # version 2: the same rows, no home_tier: parameters homed on the cpu
    v2 = {k: v for k, v in v3.items() if k != "home_tier"}
    v2["version"] = 2
    q2 = Plan.from_dict(v2)
    assert q2.tasks == p.tasks and q2.deps == p.deps and q2.home_tier == "cpu" and validate(q2, SMALL).ok
    with pytest.raises(ConfigError, match="home_tier.*'disk'"):
        Plan.from_dict(dict(data, home_tier="disk"))
    assert [t.end_id for t in q.tasks] == [t.end_id for t in p.tasks]
    assert [t.produces_grads for t in q.tasks] == [t.produces_grads for t in p.tasks]
    # version 1: the same rows without window ends, gradient flags and dependencies
    old = dict(v3, version=1, tasks=[row[:6] for row in data["tasks"]])
    (tmp_path / "v1.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="version 1.*trace"):
        Plan.load(tmp_path / "v1.json")
    upgraded = Plan.load(tmp_path / "v1.json", trace=SMALL)
    assert upgraded.tasks == p.tasks and upgraded.deps == p.deps and validate(upgraded, SMALL).ok
    other = synthetic_transformer(layers=2, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    with pytest.raises(ConfigError, match="not the one"):
        Plan.from_dict(old, trace=other)
    # a plan whose dependencies are not this table's, and an unknown version
    bad = json.loads(path.read_text())
    row = next(r for r in bad["tasks"] if r[8])
    row[8] = []
    with pytest.raises(ConfigError, match="waits for"):
        Plan.from_dict(bad)
    with pytest.raises(ConfigError, match="version 5"):
        Plan.from_dict(dict(data, version=5))


# ---------------------------------------------------------------- the validator, tier by tier

@pytest.fixture(scope="module")
def nvme_plan():
    p = tight(world_size=2, optimizer_tier="nvme")
    r = validate(p, SMALL)
    assert r.ok and all(r.peak[t] > 0 for t in ("gpu", "cpu", "nvme"))
    return p, r


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_over_budget_is_caught_on_every_tier(nvme_plan, tier):
    p, r = nvme_plan
    at_peak = {t: r.peak[t] for t in ("gpu", "cpu", "nvme")}
    assert validate(p, SMALL, at_peak).ok  # exactly the peak fits
    over = validate(p, SMALL, {**at_peak, tier: r.peak[tier] - 1})
    assert [v.target for v in over.violations if v.kind == "over_budget"] == [tier]
    v = next(v for v in over.violations if v.kind == "over_budget")
    assert r.timeline[tier][v.op_id] > r.peak[tier] - 1 and tier in v.message


def test_missing_or_wrong_compute_windows_are_caught(nvme_plan):
    p, _ = nvme_plan
    i = next(i for i, t in enumerate(p.tasks) if t.operation == "compute" and not t.produces_grads)
    t = p.tasks[i]
    dropped = validate(dataclasses.replace(p, tasks=p.tasks[:i] + p.tasks[i + 1:]), SMALL)
    assert any("outside every compute window" in v.message for v in dropped.violations)
    if t.end_id > t.trigger_id:
        short = dataclasses.replace(t, end_id=t.end_id - 1)
        r = validate(dataclasses.replace(p, tasks=p.tasks[:i] + [short] + p.tasks[i + 1:]), SMALL)
        assert any("outside every compute window" in v.message for v in r.violations)
    longer = dataclasses.replace(t, end_id=t.end_id + 1)
    r = validate(dataclasses.replace(p, tasks=p.tasks[:i] + [longer] + p.tasks[i + 1:]), SMALL)
    assert any("inside the layer's compute window" in v.message for v in r.violations)
    g = next(i for i, t in enumerate(p.tasks) if t.produces_grads)
    no_grads = dataclasses.replace(p.tasks[g], produces_grads=False)
    r = validate(dataclasses.replace(p, tasks=p.tasks[:g] + [no_grads] + p.tasks[g + 1:]), SMALL)
    assert "not_resident" in kinds(r)


def test_a_task_on_a_tier_the_table_does_not_allow_is_caught(nvme_plan):
    p, _ = nvme_plan
    i = next(i for i, t in enumerate(p.tasks) if t.operation == "offload" and t.target.kind == "optim")
    wrong = dataclasses.replace(p.tasks[i], tier="cpu")
    r = validate(dataclasses.replace(p, tasks=p.tasks[:i] + [wrong] + p.tasks[i + 1:]), SMALL)
    assert any(v.kind == "bad_task" and "tier cpu" in v.message for v in r.violations)
    assert "lost_update" in kinds(r)
