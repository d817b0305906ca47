"""Plans for ranks that gather each layer when it moves (``sharding="units"``, ZeRO-3 as an engine
with ``shard_parameters`` runs it, the table's ``U`` rows): no compute copy at rest, each layer's
first page's move carries its all-gather, its gradient sums are reduce-scattered before its
update, and nothing is gathered after it."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from pagemem.errors import ConfigError
from pagemem.sched import HardwareProfile, Plan, plan, simulate, validate
from pagemem.sched.network import bus_bytes
from pagemem.tracer import synthetic_transformer

PAGE = 64 << 10
ROOMY = {"cpu": "4GiB", "nvme": "4GiB"}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), hidden=st.sampled_from([32, 64, 128]), world=st.integers(2, 8),
       optimizer_tier=st.sampled_from(["cpu", "nvme"]), cache=st.booleans(),
       slack=st.sampled_from([0, 1 << 20, 1 << 26]))
def test_a_units_plan_is_valid_and_sends_each_move_s_gather_and_the_sums_share(layers, hidden, world, optimizer_tier,
                                                                                 cache, slack):
    tr = synthetic_transformer(layers=layers, hidden=hidden, ffn=4 * hidden, heads=4, seq=16, batch=2, vocab=128)
    least = plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=world, page_bytes=PAGE, sharding="units").min_gpu_bytes
    p = plan(tr, {"gpu": least + slack, **ROOMY}, world_size=world, page_bytes=PAGE, sharding="units",
             optimizer_tier=optimizer_tier, cache_optimizer=cache)
    report = validate(p, tr)
    assert report.ok, report.violations[:3]
    counts = p.counts()
    assert "all_gather" not in counts and "reduce_scatter" not in counts  # no gather after the update
    assert not p.cached_layers  # gathered again after every update: none stays on the gpu
    lay = p.layout.layers
    moves = [t for t in p.tasks if t.operation == "move_to_gpu" and t.target.page == 0]
    sums = [t for t in p.tasks if t.operation == "all_reduce"]
    assert {t.target.layer for t in sums} == {t.target.layer for t in p.tasks if t.operation == "update"}
    gathered = sum(bus_bytes("all_gather", -(-lay[t.target.layer].param_bytes // world), world) for t in moves)
    scattered = sum(bus_bytes("reduce_scatter", 4 * lay[t.target.layer].shard_elements, world) for t in sums)
    assert p.bytes_moved()["network"] == gathered + scattered
    # no compute copy at rest: the cpu holds no parameter pages, so it needs less than a states
    # plan that caches nothing either
    states = plan(tr, {"gpu": least + slack, **ROOMY}, world_size=world, page_bytes=PAGE, sharding="states",
                  optimizer_tier=optimizer_tier, cache_optimizer=False)
    assert p.predicted_peak["cpu"] < states.predicted_peak["cpu"]
    assert simulate(p, tr, HardwareProfile.builtin("dev-vm")).iteration_time > 0
    again = Plan.from_dict(p.to_dict())  # a saved units plan loads as it was
    assert again.layout == p.layout and again.bytes_moved() == p.bytes_moved()


def test_units_need_the_compute_copy_homed_on_the_cpu():
    tr = synthetic_transformer(layers=1, hidden=32, ffn=128, heads=4, seq=16, batch=2, vocab=128)
    with pytest.raises(ConfigError, match="home_tier"):
        plan(tr, {"gpu": "1GiB", **ROOMY}, world_size=2, page_bytes=PAGE, sharding="units", home_tier="nvme")
