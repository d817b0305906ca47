"""Parameters and gradients homed on nvme (``home_tier="nvme"``, issue 31): the task table's new
rows, the planner's cpu working set and its refusals, the validator on plans it makes and on
broken ones, the disk traffic the simulator sees -- and ``home_tier="cpu"`` plans unchanged."""

import dataclasses
import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagemem.errors import ConfigError
from pagemem.sched import (InfeasiblePlan, Plan, Setting, Target, Task, effects, least_cpu_bytes, least_gpu_bytes,
                           plan, simulate, validate)
from pagemem.sched.holdings import costs, executor_cost, host_cost
from pagemem.sched.network import COLLECTIVES, bus_bytes
from pagemem.sched.tasks import effect_of
from pagemem.sched.windows import Usage
from pagemem.tracer import synthetic_transformer
from test_sched_planner import small_traces
from test_sched_simulate import profile

PAGE = 4096
ROOMY = {"cpu": "1GiB", "nvme": "1GiB"}
SMALL = synthetic_transformer(layers=3, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)


def nvme_plan(tr=SMALL, slack=0, cpu="1GiB", nvme="1GiB", **kw) -> Plan:
    kw.setdefault("cache_optimizer", False)
    gpu = least_gpu_bytes(tr, kw.get("world_size", 1), PAGE) + slack
    return plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": nvme}, page_bytes=PAGE, home_tier="nvme", **kw)


def kinds(report):
    return {v.kind for v in report.violations}


def without(p: Plan, i: int) -> Plan:
    return dataclasses.replace(p, tasks=p.tasks[:i] + p.tasks[i + 1:])


def index(p: Plan, op: str, kind: str, tier: str | None = None) -> int:
    return next(i for i, t in enumerate(p.tasks) if t.operation == op and t.target.kind == kind
                and (tier is None or t.tier == tier))


# ---------------------------------------------------------------- home_tier="cpu": nothing changes

def _as_before(terms, W: int):
    """Cost terms as they were written before the two-level network: a collective as
    ``("network", W - 1 pages)``."""
    return tuple(("network", bus_bytes(r, n, W)) if r in COLLECTIVES else (r, n) for r, n in terms)


# one level, no latencies: the network of the profile these digests were made with (version 3's)
ONE_LEVEL = dict(nvlink_bytes_per_s=3e9, internode_bytes_per_s=3e9, collective_latency_s=0.0, internode_latency_s=0.0)


def _digest(p: Plan, tr) -> str:
    s = p.setting
    rows = [(str(t), t.end_id, t.produces_grads, _as_before(costs(t, s), p.world_size), host_cost(t, s),
             executor_cost(t, s), d.same, d.previous) for t, d in zip(p.tasks, p.deps)]
    r = validate(p, tr)
    sim = simulate(p, tr, profile(**ONE_LEVEL))
    blob = json.dumps([rows, p.predicted_peak, p.min_gpu_bytes, list(p.cached_layers), r.peak, r.ok,
                       p.bytes_moved(), repr(sim.iteration_time), sorted(sim.busy.items()), sim.peak], default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


BEFORE = {  # _digest of each plan, made by the commit before home_tier existed (02fee16)
    "W1-cpu-nocache-0": "36351d268fd98382", "W1-cpu-nocache-163840": "8035f47378537d00",
    "W1-cpu-nocache-409600": "d8eb3541b038d24d", "W1-cpu-cache-409600": "f58523f6c052c1f0",
    "W1-nvme-nocache-0": "cd73b832392e06ed", "W1-nvme-cache-409600": "044a3d823dc2842f",
    "W2-cpu-nocache-0": "eee9234ae64051e1", "W2-nvme-nocache-163840": "5d88d4bfd4a34159",
    "W2-nvme-cache-409600": "2946c10b93b63c84", "W4-cpu-cache-409600": "c67586e6ed5a7b3b",
    "W4-nvme-nocache-0": "35cc99d968b628a9", "W4-nvme-cache-4194304": "0b72169602510be5",
}


def test_cpu_homes_plan_simulate_and_validate_exactly_as_before():
    """The same tasks, dependencies, costs, peaks, traffic and simulated times as before
    ``home_tier`` existed, for plans with and without caching, on 1, 2 and 4 ranks."""
    got = {}
    for name in BEFORE:
        w, opt, cache, slack = name.split("-")
        W = int(w[1:])
        p = plan(SMALL, {"gpu": least_gpu_bytes(SMALL, W, PAGE) + int(slack), **ROOMY}, world_size=W,
                 optimizer_tier=opt, page_bytes=PAGE, cache_optimizer=cache == "cache", home_tier="cpu")
        assert p.home_tier == "cpu" and p.setting.home_tier == "cpu"
        got[name] = _digest(p, SMALL)
    assert got == BEFORE


# ---------------------------------------------------------------- the table's new rows

def test_the_new_rows_take_read_and_cost_what_the_table_says():
    p = nvme_plan(world_size=2, optimizer_tier="nvme")
    s, lay = p.setting, p.layout.layers[2]
    P = lay.param_pages
    assert s.home_tier == "nvme" and s.home("param", 2) == "nvme" and s.home("grad", 2) is None

    def task(op, kind, page=None, tier=None):
        t = Task(op, Target(kind, 2, page), 0, tier)
        return t, effects(t, s)

    t, fx = task("move_to_cpu", "param", 0, "cpu")
    assert fx.pages("takes", s) == {"cpu": 1} and [str(k) for k in fx.reads] == ["param[2].0@nvme"]
    assert costs(t, s) == (("nvme_read", PAGE),) and host_cost(t, s) == ("nvme_host", PAGE)
    assert effect_of(t).stream_for("cpu") == "nvme"
    t, fx = task("move_to_gpu", "param", 0, "gpu")
    assert [str(k) for k in fx.reads] == ["param[2].0@cpu"]  # the staged copy
    t, fx = task("offload", "grad", 0, "nvme")
    assert fx.pages("takes", s) == {"nvme": 1} and costs(t, s) == (("d2h", PAGE), ("nvme_write", PAGE))
    assert host_cost(t, s) == ("nvme_host", PAGE) and effect_of(t).stream_for("nvme") == "nvme"
    t, fx = task("offload", "grad", 0, "cpu")
    assert costs(t, s) == (("d2h", PAGE),) and host_cost(t, s) is None and effect_of(t).stream_for("cpu") == "d2h"
    t, fx = task("move_to_cpu", "grad", tier="cpu")
    assert fx.pages("takes", s) == {"cpu": P} and {k.tier for k in fx.reads} == {"nvme"}
    assert costs(t, s) == (("nvme_read", P * PAGE),)
    # the staged copy goes back alone: no gathered pages, no executor window
    t, fx = task("release", "param", tier="cpu")
    assert fx.pages("frees", s) == {"cpu": P} and executor_cost(t, s) is None
    t, fx = task("release", "param", tier="gpu")
    assert fx.pages("frees", s) == {"gpu": 2 * P} and executor_cost(t, s) == ("window", 1)
    assert task("release", "grad", tier="nvme")[1].pages("frees", s) == {"nvme": P}
    # the update writes the refreshed compute copy home: to disk
    t, fx = task("update", "layer", tier="cpu")
    assert costs(t, s)[2] == ("nvme_write", P * PAGE) and host_cost(t, s) == ("nvme_host", P * PAGE)
    assert {(k.name, k.tier) for k in fx.writes} == {("optim", "cpu"), ("param", "nvme")}
    # none of it where parameters rest on the cpu
    cpu = Setting(p.layout, frozenset(), "nvme", "cpu")
    assert effects(Task("move_to_cpu", Target("param", 2, 0), 0, "cpu"), cpu) is None
    assert len(costs(Task("update", Target("layer", 2), 0, "cpu"), cpu)) == 2
    assert host_cost(Task("update", Target("layer", 2), 0, "cpu"), cpu) is None
    with pytest.raises(ValueError, match="unknown condition"):
        s.holds("X=1")


@pytest.mark.parametrize("tight", [False, True])
def test_dependencies_run_through_the_staged_copies(tight):
    cpu = least_cpu_bytes(SMALL, 1, "nvme", PAGE, home_tier="nvme", cache_optimizer=False) if tight else "1GiB"
    p = nvme_plan(world_size=1, optimizer_tier="nvme", cpu=cpu)
    T, D = p.tasks, p.deps
    assert any(t.source == "nvme" for t in T) == tight
    for i, (t, d) in enumerate(zip(T, D)):
        L, before = t.target.layer, [T[j] for j in d.same]
        if t.operation == "move_to_gpu" and t.source is None:  # the staging of its page
            assert any(u.operation == "move_to_cpu" and u.target == t.target for u in before) and not d.previous
        if t.operation == "move_to_gpu" and t.source == "nvme":  # its home copy: last iteration's update
            assert {(u.operation, u.tier) for u in before} <= {("release", "gpu")}
            assert [T[j].operation for j in d.previous] in (["update"], [])
        if t.operation == "move_to_cpu" and t.target.kind == "param":  # last iteration's update of the layer
            assert [T[j].operation for j in d.previous] in (["update"], [])
        if t.operation == "release" and t.tier == "cpu" and t.target.kind == "param":
            assert {u.operation for u in before} == {"move_to_cpu", "move_to_gpu"}
        if t.operation == "move_to_cpu" and t.target.kind == "grad":  # every offload of the layer
            assert sorted(u.target.page for u in before if u.operation == "offload") == list(
                range(p.layout.layers[L].param_pages))
        if t.operation == "update":
            assert any(u.operation == "move_to_cpu" and u.target.kind == "grad" for u in before)
        if t.operation == "release" and t.tier == "nvme":
            assert any(u.operation == "move_to_cpu" and u.target.kind == "grad" for u in before)


# ---------------------------------------------------------------- the planner

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=small_traces(), world=st.sampled_from([1, 2, 4]), opt=st.sampled_from(["cpu", "nvme"]),
       cache=st.booleans(), page=st.sampled_from([PAGE, 2 * PAGE]), slack=st.integers(0, 400_000),
       cpu_slack=st.sampled_from([0, 1, 3 * PAGE, 40 * PAGE, None]))
def test_nvme_home_plans_validate_and_the_cpu_and_nvme_needs_are_exact(tr, world, opt, cache, page, slack, cpu_slack):
    """Every plan validates, its predicted peaks are the validator's, the cpu budget it was
    given (from the stated need up) holds, and one byte below the stated cpu or nvme need is
    refused naming that tier and the same need."""
    kw = dict(world_size=world, optimizer_tier=opt, page_bytes=page, cache_optimizer=cache, home_tier="nvme")
    gpu = least_gpu_bytes(tr, world, page) + slack
    need = least_cpu_bytes(tr, world, opt, page, home_tier="nvme", gpu_bytes=gpu, cache_optimizer=cache)
    cpu = 1 << 40 if cpu_slack is None else need + cpu_slack
    p = plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": "1GiB"}, **kw)
    r = validate(p, tr)
    assert r.ok, r.summary()
    assert r.peak == p.predicted_peak
    assert r.peak["cpu"] <= cpu and (cpu_slack != 0 or r.peak["cpu"] == need)
    if need:  # (zero: every layer cached on the gpu, nothing on the cpu)
        with pytest.raises(InfeasiblePlan) as err:
            plan(tr, {"gpu": gpu, "cpu": need - 1, "nvme": "1GiB"}, **kw)
        assert (err.value.tier, err.value.min_bytes) == ("cpu", need)
    nvme = r.peak["nvme"]
    assert validate(plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": nvme}, **kw), tr).ok
    if nvme:
        with pytest.raises(InfeasiblePlan) as err:
            plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": nvme - 1}, **kw)
        assert (err.value.tier, err.value.min_bytes) == ("nvme", nvme)
    # at rest the compute copies are on nvme (on the gpu where cached), none on the cpu
    assert {k.tier for k in p.setting.at_rest() if k.name == "param"} <= {"nvme", "gpu"}


def test_the_cpu_is_a_working_set_smaller_than_the_parameters():
    """Parameters homed on the cpu need all their pages there plus an update's gradients and
    states; homed on nvme, the cpu needs only an update's (pages reach the gpu without it)."""
    tr = synthetic_transformer(layers=12, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    kw = dict(optimizer_tier="nvme", page_bytes=PAGE, cache_optimizer=False)
    on_cpu = least_cpu_bytes(tr, **kw)
    working = least_cpu_bytes(tr, home_tier="nvme", **kw)
    layers = plan(tr, {"gpu": "1GiB", **ROOMY}, **kw).layout.layers
    params = sum(l.param_pages for l in layers) * PAGE
    update = max(l.param_pages + l.optim_pages for l in layers) * PAGE  # one layer's gradients and states
    assert on_cpu == params + update
    assert working == update < params
    with pytest.raises(InfeasiblePlan, match="the cpu tier needs at least") as err:
        plan(tr, {"gpu": least_gpu_bytes(tr, 1, PAGE), "cpu": working - 1, "nvme": "1GiB"}, home_tier="nvme", **kw)
    assert err.value.min_bytes == working and "an update holds on the cpu" in str(err.value)


def test_each_window_stages_what_the_cpu_holds_as_early_as_it_allows_and_moves_the_rest_from_nvme():
    tight = nvme_plan(optimizer_tier="nvme", cpu=least_cpu_bytes(SMALL, 1, "nvme", PAGE, home_tier="nvme",
                                                                 cache_optimizer=False))
    roomy = nvme_plan(optimizer_tier="nvme")

    def lead(p):  # ops from each page's staging to its move, summed; and the moves from nvme
        staged, total, direct = {}, 0, 0
        for t in p.tasks:
            if t.operation == "move_to_cpu" and t.target.kind == "param":
                staged[t.target] = t.trigger_id
            elif t.operation == "move_to_gpu" and t.source == "nvme":
                assert t.target not in staged  # a staged page is moved from its staged copy
                direct += 1
            elif t.operation == "move_to_gpu":
                assert t.source is None and staged[t.target] <= t.trigger_id
                total += t.trigger_id - staged.pop(t.target)
        return total, direct

    (roomy_lead, roomy_direct), (tight_lead, tight_direct) = lead(roomy), lead(tight)
    assert roomy_lead > tight_lead and roomy_direct == 0 < tight_direct
    # the staged copy is given back at the end of the op of the window's last move
    for p in (tight, roomy):
        moves: dict[int, int] = {}
        for t in p.tasks:
            if t.operation == "move_to_gpu":
                moves[t.target.layer] = t.trigger_id
            if t.operation == "release" and t.tier == "cpu" and t.target.kind == "param":
                assert t.trigger_id == moves.pop(t.target.layer)


def test_a_window_stages_as_many_pages_as_the_cpu_holds():
    """Partway: a budget a few pages over the least stages part of a run (the rest of it moves
    from nvme), and whatever the budget, every staged page lies within it."""
    least = least_cpu_bytes(SMALL, 1, "nvme", PAGE, home_tier="nvme", cache_optimizer=False)
    for extra in (0, 1, 3, 7, 30):
        p = nvme_plan(optimizer_tier="nvme", cpu=least + extra * PAGE)
        r = validate(p, SMALL)
        assert r.ok and r.peak["cpu"] <= least + extra * PAGE, r.summary()
        by_op: dict[tuple[int, int], set] = {}
        for t in p.tasks:
            if t.operation == "move_to_gpu":
                by_op.setdefault((t.target.layer, t.trigger_id), set()).add(t.source)
        mixed = [k for k, sources in by_op.items() if sources == {None, "nvme"}]
        if extra in (1, 3):  # a run a page or three of which fit
            assert mixed, extra

@pytest.mark.parametrize("kwargs,match", [
    ({"home_tier": "disk"}, r"home_tier: must be one of .*'cpu'.*'nvme'.*'disk'"),
    ({"home_tier": None}, "home_tier"),
])
def test_bad_home_tier_names_the_field_and_the_choices(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan(SMALL, {"gpu": "1GiB", **ROOMY}, page_bytes=PAGE, **kwargs)
    with pytest.raises(ConfigError, match=match):
        least_cpu_bytes(SMALL, page_bytes=PAGE, **kwargs)


def test_plan_json_keeps_the_home_tier(tmp_path):
    p = nvme_plan(world_size=2, optimizer_tier="nvme")
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q.home_tier == "nvme" and q.tasks == p.tasks and q.deps == p.deps and validate(q, SMALL).ok
    assert q.bytes_moved() == p.bytes_moved()


# ---------------------------------------------------------------- the validator catches broken plans

@pytest.fixture(scope="module")
def tight_nvme():
    need = least_cpu_bytes(SMALL, 2, "nvme", PAGE, home_tier="nvme", cache_optimizer=False)
    p = nvme_plan(world_size=2, optimizer_tier="nvme", cpu=need)
    assert validate(p, SMALL).ok
    return p


def test_a_move_to_the_gpu_without_its_staged_copy_is_caught(tight_nvme):
    p = tight_nvme
    r = validate(without(p, index(p, "move_to_cpu", "param")), SMALL)
    assert any(v.kind == "not_resident" and "@cpu" in v.message and "move_to_gpu" in v.message
               for v in r.violations)


def test_a_staged_copy_never_given_back_is_a_leak(tight_nvme):
    p = tight_nvme
    i = max(i for i, t in enumerate(p.tasks) if t.operation == "release" and t.tier == "cpu"
            and t.target.kind == "param")  # the layer's last window: nothing stages it again
    r = validate(without(p, i), SMALL)
    assert any(v.kind == "leak" and "@cpu" in v.message for v in r.violations), r.summary()
    # an earlier one: the next staging of the layer finds its pages still there
    j = index(p, "release", "param", "cpu")
    assert "bad_task" in kinds(validate(without(p, j), SMALL))


def test_staging_over_the_cpu_budget_is_caught(tight_nvme):
    roomy = nvme_plan(world_size=2, optimizer_tier="nvme")  # stages as early as 1 GiB allows
    need = tight_nvme.budgets.cpu
    assert roomy.predicted_peak["cpu"] > need
    r = validate(roomy, SMALL, {"gpu": roomy.budgets.gpu, "cpu": need, "nvme": "1GiB"})
    assert [v.target for v in r.violations if v.kind == "over_budget"] == ["cpu"]


def test_an_update_without_its_gradients_fetched_is_caught(tight_nvme):
    p = tight_nvme
    r = validate(without(p, index(p, "move_to_cpu", "grad")), SMALL)
    assert any(v.kind == "not_resident" and v.message.startswith("update") and "grad" in v.message
               for v in r.violations), r.summary()
    r = validate(without(p, index(p, "release", "grad", "nvme")), SMALL)
    assert "leak" in kinds(r)


def test_staging_for_a_layer_homed_on_the_cpu_is_refused():
    p = plan(SMALL, {"gpu": least_gpu_bytes(SMALL, 1, PAGE), **ROOMY}, page_bytes=PAGE, cache_optimizer=False)
    i = index(p, "move_to_gpu", "param")
    stage = Task("move_to_cpu", p.tasks[i].target, p.tasks[i].trigger_id, "cpu")
    r = validate(dataclasses.replace(p, tasks=p.tasks[:i] + [stage] + p.tasks[i:]), SMALL)
    assert any(v.kind == "bad_task" and "H=nvme" in v.message for v in r.violations)


# ---------------------------------------------------------------- the simulator sees the disk

def by_hand(p: Plan, tr) -> dict[str, int]:
    """Disk bytes of an uncached 1-rank nvme-home plan, from the layout and the trace alone: every
    window reads its layer's pages; every updated layer writes its gradient pages, reads them
    back, and writes its refreshed compute copy; optimizer states on nvme are read and written."""
    usage, lay = Usage.from_trace(tr), p.layout.layers
    updated = [g.layer for g in usage.grads if g is not None]
    windows = sum(len(ws) * lay[L].param_pages for L, ws in enumerate(usage.windows))
    grads = sum(lay[L].param_pages for L in updated)
    optim = sum(lay[L].optim_pages for L in updated) if p.optimizer_tier == "nvme" else 0
    return {"nvme_read": (windows + grads + optim) * PAGE, "nvme_write": (2 * grads + optim) * PAGE}


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_bytes_moved_are_the_disk_traffic_counted_by_hand(opt):
    p = nvme_plan(optimizer_tier=opt)
    cpu = plan(SMALL, {"gpu": p.budgets.gpu, **ROOMY}, page_bytes=PAGE, optimizer_tier=opt, cache_optimizer=False)
    moved, before = p.bytes_moved(), cpu.bytes_moved()
    assert {k: moved[k] for k in ("nvme_read", "nvme_write")} == by_hand(p, SMALL)
    assert {k: moved[k] for k in ("h2d", "d2h", "network")} == {k: before[k] for k in ("h2d", "d2h", "network")}
    assert moved["nvme_read"] > before["nvme_read"] and moved["nvme_write"] > before["nvme_write"]


def test_simulated_time_follows_the_nvme_bandwidth():
    """With parameters on nvme and a slow disk, an iteration takes longer than with them on the
    cpu, and longer still as the disk slows; with them on the cpu the disk speed matters less."""
    cpu_need = least_cpu_bytes(SMALL, 1, "cpu", PAGE, home_tier="nvme", cache_optimizer=False)
    p = nvme_plan(optimizer_tier="cpu", cpu=cpu_need)
    on_cpu = plan(SMALL, {"gpu": p.budgets.gpu, **ROOMY}, page_bytes=PAGE, cache_optimizer=False)
    times = []
    for rate in (4e8, 1e8, 2.5e7):
        hw = profile(nvme_read_bytes_per_s=rate, nvme_write_bytes_per_s=rate)
        s = simulate(p, SMALL, hw)
        base = simulate(on_cpu, SMALL, hw)
        assert s.iteration_time > base.iteration_time
        assert s.busy["nvme"] > 0 and base.busy["nvme"] == 0
        assert max(c for _, _, c in s.memory) <= p.budgets.cpu and s.peak["cpu"] <= p.budgets.cpu
        assert s.memory[-1][1:] == s.memory[0][1:]  # back to the state at rest
        times.append(s.iteration_time)
    assert times[0] < times[1] < times[2]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=small_traces(), world=st.sampled_from([1, 2]), opt=st.sampled_from(["cpu", "nvme"]),
       cache=st.booleans(), slack=st.integers(0, 200_000))
def test_a_tight_nvme_home_plan_simulates_within_its_budgets(tr, world, opt, cache, slack):
    gpu = least_gpu_bytes(tr, world, PAGE) + slack
    cpu = least_cpu_bytes(tr, world, opt, PAGE, home_tier="nvme", gpu_bytes=gpu, cache_optimizer=cache)
    p = plan(tr, {"gpu": gpu, "cpu": cpu, "nvme": "1GiB"}, world_size=world, optimizer_tier=opt, page_bytes=PAGE,
             cache_optimizer=cache, home_tier="nvme")
    s = simulate(p, tr, profile(nvme_read_bytes_per_s=5e7, nvme_write_bytes_per_s=5e7))
    assert s.peak["cpu"] <= cpu and s.peak["gpu"] <= gpu
    assert s.memory[-1][1:] == s.memory[0][1:]
