"""Plans for ranks that shard the optimizer states only (``sharding="states"``, ZeRO-1: the
engine's data parallelism today, [Note: sharded moments]): every rank holds the whole parameters
and gradients; the table's ``R>1`` rows average the gradient sums (``all_reduce grad``) before
each update and all-gather the updated share (``all_gather optim``) after it."""

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagemem.sched import HardwareProfile, Plan, plan, simulate, validate
from pagemem.sched.layout import Layout
from pagemem.sched.network import bus_bytes
from pagemem.tracer import synthetic_transformer

PAGE = 64 << 10
ROOMY = {"cpu": "4GiB", "nvme": "4GiB"}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), hidden=st.sampled_from([32, 64, 128]), world=st.integers(2, 8),
       optimizer_tier=st.sampled_from(["cpu", "nvme"]), home_tier=st.sampled_from(["cpu", "nvme"]),
       cache=st.booleans(), slack=st.sampled_from([0, 1 << 20, 1 << 26]))
def test_a_states_plan_is_valid_and_sends_the_sums_and_the_shares(layers, hidden, world, optimizer_tier, home_tier,
                                                                   cache, slack):
    tr = synthetic_transformer(layers=layers, hidden=hidden, ffn=4 * hidden, heads=4, seq=16, batch=2, vocab=128)
    one = plan(tr, {"gpu": "1GiB", **ROOMY}, page_bytes=PAGE)
    least = plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=world, page_bytes=PAGE, sharding="states").min_gpu_bytes
    assert least == one.min_gpu_bytes  # the whole parameters and gradients move, as with one rank
    p = plan(tr, {"gpu": least + slack, **ROOMY}, world_size=world, page_bytes=PAGE, sharding="states",
             optimizer_tier=optimizer_tier, home_tier=home_tier, cache_optimizer=cache)
    report = validate(p, tr)
    assert report.ok, report.violations[:3]
    counts = p.counts()
    grads = {t.target.layer for t in p.tasks if t.operation == "update"}
    assert counts.get("all_reduce") == counts.get("all_gather") == len(grads) and "reduce_scatter" not in counts
    # every all-reduce before its layer's update, every all-gather after it
    at = {(t.operation, t.target.layer): k for k, t in enumerate(p.tasks) if t.operation in ("all_reduce", "update",
                                                                                                "all_gather")}
    assert all(at["all_reduce", L] < at["update", L] < at["all_gather", L] for L in grads)
    # the bytes: each layer's fp32 sums all-reduced, its fp32 share all-gathered
    lay = p.layout.layers
    want = sum(bus_bytes("all_reduce", 4 * lay[L].elements, world) + bus_bytes("all_gather", 4 * lay[L].shard_elements,
                                                                                world) for L in grads)
    assert p.bytes_moved()["network"] == want > 0
    # a rank's Adam steps its share: 1/W of one rank's elements (rounded up)
    assert all(lay[L].shard_elements == -(-lay[L].elements // world) for L in grads)
    # the plan's file keeps the sharding
    again = Plan.from_dict(p.to_dict())
    assert again.layout == p.layout and again.layout.sharding == "states"
    assert again.bytes_moved() == p.bytes_moved()


def test_the_network_is_time_the_simulator_counts():
    tr = synthetic_transformer(layers=2, hidden=128, ffn=512, heads=4, seq=16, batch=2, vocab=128)
    hw = HardwareProfile.builtin("dev-vm")
    one = plan(tr, {"gpu": "1GiB", **ROOMY}, page_bytes=PAGE, cache_optimizer=False)
    two = plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=2, page_bytes=PAGE, sharding="states", cache_optimizer=False)
    slow = dataclasses.replace(hw, nvlink_bytes_per_s=hw.nvlink_bytes_per_s / 1000,
                               internode_bytes_per_s=hw.internode_bytes_per_s / 1000)
    t1, t2 = simulate(one, tr, hw).iteration_time, simulate(two, tr, hw).iteration_time
    assert two.bytes_moved()["network"] > 0 == one.bytes_moved()["network"]
    assert t2 != t1  # the collectives and the smaller update are in the time
    busy = simulate(two, tr, hw).busy["network"]
    assert busy > 0 and simulate(two, tr, slow).busy["network"] > 100 * busy
    assert simulate(two, tr, slow).iteration_time > t2  # a network slow enough is the critical path
    assert simulate(one, tr, slow).iteration_time == t1


def test_a_layout_refuses_an_unknown_sharding_and_a_plan_a_mismatched_one():
    import pytest

    from pagemem.errors import ConfigError

    tr = synthetic_transformer(layers=1, hidden=32, ffn=128, heads=4, seq=8, batch=1, vocab=64)
    with pytest.raises(ValueError, match="sharding"):
        Layout(PAGE, 2, (), "experts")
    with pytest.raises(ConfigError, match="sharding"):
        plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=2, page_bytes=PAGE, sharding="everything")
    states = Layout.from_trace(tr, 2, PAGE, "states")
    with pytest.raises(ConfigError, match="sharding"):
        plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=2, page_bytes=PAGE, layout=states)
