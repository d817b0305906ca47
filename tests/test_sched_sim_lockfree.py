"""The simulator's lock-free mode ([Note: simulating the lock-free updater])."""

from __future__ import annotations

import dataclasses

import pytest

from pagemem.sched import HardwareProfile, simulate
from pagemem.sched.hardware import HOST_STAND_IN_SHARED
from pagemem.sched.sim_lockfree import simulate_lock_free
from pagemem.tracer import synthetic_transformer
from test_sched_simulate import expected_busy, profile, tight_plan


def ssd_bound():
    hw = HardwareProfile.a100_server()
    tr = synthetic_transformer(layers=4, hidden=256, heads=4, seq=256, batch=2, cost=hw.cost_model())
    return hw, tr, tight_plan(tr, world_size=8, optimizer_tier="nvme")


def test_the_update_leaves_the_iteration_where_the_ssd_was_the_bottleneck():
    """ANGEL-PTM's case: synchronously the GPU idles for the SSD; lock-free the iteration is
    the compute side's, and the SSD's pass spans several iterations (staleness)."""
    hw, tr, p = ssd_bound()
    sync = simulate(p, tr, hw)
    free = simulate_lock_free(p, tr, hw)
    assert free.iteration_time < 0.5 * sync.iteration_time
    assert free.iteration_time == pytest.approx(free.compute_side.iteration_time)
    assert free.compute_side.busy.get("nvme", 0.0) == 0.0  # no state traffic inside the iteration
    assert free.update_pass_time == pytest.approx(free.pass_busy["nvme"])
    assert free.staleness == pytest.approx(free.update_pass_time / free.iteration_time - 1)
    assert free.staleness > 1


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_pass_costs_what_the_synchronous_updates_cost_per_stream(tier):
    tr = synthetic_transformer(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    hw = profile()
    p = tight_plan(tr, optimizer_tier=tier)
    want = expected_busy(p, tr, hw)
    free = simulate_lock_free(p, tr, hw)
    assert free.pass_busy["cpu"] == pytest.approx(want["cpu"])
    if tier == "nvme":
        assert free.pass_busy["nvme"] == pytest.approx(want["nvme"])
        assert free.pass_busy["io"] == pytest.approx(want["io"])


def test_on_one_processor_the_updaters_work_is_charged_to_the_iteration():
    """The host stand-in: every iteration's Adam steps and a pass's share of the disk's host
    work run on the cores that compute."""
    hw, tr, p = ssd_bound()
    alone = simulate_lock_free(p, tr, hw)
    shared = simulate_lock_free(p, tr, dataclasses.replace(hw, shared_processor=HOST_STAND_IN_SHARED))
    assert shared.iteration_time > alone.iteration_time
    extra = shared.iteration_time - shared.compute_side.iteration_time
    share = min(1.0, shared.iteration_time / shared.update_pass_time)
    want = (shared.pass_busy.get("cpu", 0.0) if "cpu" in HOST_STAND_IN_SHARED else 0.0) + share * sum(
        s for k, s in shared.pass_busy.items() if k in HOST_STAND_IN_SHARED and k != "cpu")
    assert extra == pytest.approx(want, rel=1e-6)


def test_a_staleness_bound_makes_the_compute_wait_for_the_pass():
    """With ``max_staleness`` a pass may span at most that many iterations and one more: the
    iteration stretches to ``pass / (bound + 1)`` where the pass is longer, and is unchanged
    where it is not."""
    hw, tr, p = ssd_bound()
    free = simulate_lock_free(p, tr, hw)
    for bound in (0, 1):
        got = simulate_lock_free(p, tr, hw, max_staleness=bound)
        assert got.iteration_time == pytest.approx(free.update_pass_time / (bound + 1))
        assert got.staleness == pytest.approx(bound)
    loose = simulate_lock_free(p, tr, hw, max_staleness=1000)
    assert loose.iteration_time == free.iteration_time and loose.staleness == free.staleness
    with pytest.raises(Exception, match="^max_staleness: must be None or an integer >= 0"):
        simulate_lock_free(p, tr, hw, max_staleness=-1)
