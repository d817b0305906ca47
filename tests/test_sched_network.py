"""The two-level network (``pagemem.sched.network``): what collectives cost, ring against tree,
the profile's knobs, and version-3 profiles keeping their one-level behaviour."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemem.errors import ConfigError
from pagemem.sched import HardwareProfile, plan, simulate
from pagemem.sched.network import COLLECTIVES, bus_bytes, collective_time, ring_seconds, tree_seconds
from pagemem.tracer import synthetic_transformer

NEW_FIELDS = ("nvlink_bytes_per_s", "internode_bytes_per_s", "collective_latency_s", "internode_latency_s")


def hw(**kw) -> HardwareProfile:
    d = dict(name="net", h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, nvlink_bytes_per_s=300e9,
             internode_bytes_per_s=200e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
             cpu_adam_elements_per_s=1e9, gpu_adam_elements_per_s=1e9, flops_per_s=1e12, hbm_bytes_per_s=1e11,
             host_memory_bytes_per_s=1e10, nvme_host_bytes_per_s=1e10, ranks_per_server=8,
             collective_latency_s=10e-6, internode_latency_s=5e-6)
    d.update(kw)
    return HardwareProfile(**d)


def version_3(profile: HardwareProfile, bus: float) -> dict:
    """``profile`` as a version-3 file would hold it: one ``network_bytes_per_s``."""
    d = {k: v for k, v in profile.to_dict().items() if k not in NEW_FIELDS}
    return {**d, "version": 3, "network_bytes_per_s": bus}


collectives = st.sampled_from(COLLECTIVES)
worlds = st.integers(1, 1024)
sizes = st.integers(0, 1 << 32)
rates = st.floats(1e8, 1e12)
profiles = st.builds(hw, nvlink_bytes_per_s=rates, internode_bytes_per_s=rates,
                     collective_latency_s=st.sampled_from([0.0, 1e-5]), internode_latency_s=st.sampled_from([0.0, 5e-6]),
                     ranks_per_server=st.sampled_from([1, 2, 8]))


@settings(max_examples=200, deadline=None)
@given(profiles, collectives, sizes)
def test_one_rank_costs_nothing(p, c, nbytes):
    assert collective_time(p, c, nbytes, 1) == (0.0, "none")
    assert p.seconds(c, nbytes, None, 1) == 0.0


@settings(max_examples=300, deadline=None)
@given(profiles, collectives, worlds, sizes, sizes)
def test_more_bytes_never_take_less_time(p, c, W, a, b):
    lo, hi = sorted((a, b))
    t_lo, t_hi = p.collective_seconds(c, lo, W), p.collective_seconds(c, hi, W)
    assert t_lo <= t_hi
    if W > 1 and lo < hi:
        assert t_lo < t_hi


@settings(max_examples=300, deadline=None)
@given(profiles, collectives, st.integers(2, 1024), st.integers(1, 1 << 32), st.floats(1.01, 100))
def test_faster_nics_never_slow_a_collective(p, c, W, nbytes, factor):
    slow = p.collective_seconds(c, nbytes, W)
    fast = p.replace(internode_bytes_per_s=factor * p.internode_bytes_per_s).collective_seconds(c, nbytes, W)
    assert fast <= slow
    if W > p.ranks_per_server and p.internode_bytes_per_s * factor <= p.nvlink_bytes_per_s:
        assert fast < slow  # across servers, with the NICs the slower link, they set the pace


@settings(max_examples=200, deadline=None)
@given(profiles, collectives, st.integers(1, 8), sizes)
def test_ranks_of_one_server_never_touch_the_nics(p, c, W, nbytes):
    p = p.replace(ranks_per_server=8)
    t = p.collective_seconds(c, nbytes, W)
    for other in (p.replace(internode_bytes_per_s=1.0), p.replace(internode_latency_s=100.0)):
        assert other.collective_seconds(c, nbytes, W) == t
    if W > 1 and nbytes:  # a ring over NVLink: (W - 1) S (all_reduce: 2 (W - 1) / W S) at its bus bandwidth
        sent = 2 * (W - 1) / W * nbytes if c == "all_reduce" else (W - 1) * nbytes
        assert t == pytest.approx(p.collective_latency_s + sent / p.nvlink_bytes_per_s, rel=1e-12)


def test_the_formulas_on_one_case_by_hand():
    p = hw()  # 300 GB/s NVLink, 200 GB/s NICs per server, 10 us per call, 5 us per step across servers
    S = 1e6
    # 16 ranks on 2 servers; ring: 15 steps across servers, 15 S through the slower link (the NICs)
    assert ring_seconds(p, "all_gather", S, 16) == pytest.approx(10e-6 + 15 * 5e-6 + 15 * S / 200e9)
    # tree: across servers first (8 rails share the NICs: 8 S out of each server, 1 step), then
    # 2 S per rank gathered inside the server (7 x 2 S over NVLink)
    assert tree_seconds(p, "all_gather", S, 16) == pytest.approx(10e-6 + 5e-6 + 8 * S / 200e9 + 14 * S / 300e9)
    assert collective_time(p, "all_gather", S, 16).algorithm == "tree"  # the ring's 15 steps cost more
    # all_reduce over 768 ranks (96 servers): ring 2 x 767 steps; tree 2 x ceil(log2 96) = 14
    ring = 10e-6 + 2 * 767 * 5e-6 + 2 * 767 / 768 * S / 200e9
    tree = 10e-6 + 14 * 5e-6 + 2 * 7 / 8 * S / 300e9 + 2 * 95 / 96 * S / 200e9
    assert ring_seconds(p, "all_reduce", S, 768) == pytest.approx(ring)
    assert tree_seconds(p, "all_reduce", S, 768) == pytest.approx(tree)
    # a ring spanning servers runs at the slower link, NVLink when the NICs are faster
    fast_nics = hw(internode_bytes_per_s=1e12, internode_latency_s=0.0, collective_latency_s=0.0)
    assert ring_seconds(fast_nics, "reduce_scatter", S, 64) == pytest.approx(63 * S / 300e9)


def test_ring_for_large_messages_tree_for_small_ones_at_scale():
    p = hw()
    for c in COLLECTIVES:
        for W in (256, 768):
            big = collective_time(p, c, 1 << 33, W)
            small = collective_time(p, c, 1 << 10, W)
            assert big.algorithm == "ring" and small.algorithm == "tree", (c, W)
            assert big.seconds == pytest.approx(ring_seconds(p, c, 1 << 33, W))
            assert small.seconds == pytest.approx(tree_seconds(p, c, 1 << 10, W))
    # NICs far slower than NVLink: the tree moves less through them than the ring, at any size
    slow_nics = hw(internode_bytes_per_s=10e9, collective_latency_s=0.0, internode_latency_s=0.0)
    assert collective_time(slow_nics, "all_reduce", 1 << 30, 64).algorithm == "tree"
    assert collective_time(slow_nics, "all_gather", 1 << 30, 64).algorithm == "tree"
    # no latencies and equal links: the ring is never beaten (ties go to it)
    flat = hw(nvlink_bytes_per_s=50e9, internode_bytes_per_s=50e9, collective_latency_s=0.0, internode_latency_s=0.0)
    for W in (2, 8, 9, 16, 100):
        assert collective_time(flat, "all_gather", 1 << 20, W).algorithm == "ring"


@settings(max_examples=100, deadline=None)
@given(profiles, st.integers(2, 1024), st.integers(1, 1 << 30))
def test_the_chosen_time_is_the_faster_algorithm(p, W, nbytes):
    for c in COLLECTIVES:
        t = collective_time(p, c, nbytes, W)
        ring, tree = ring_seconds(p, c, nbytes, W), tree_seconds(p, c, nbytes, W)
        assert t.seconds == min(ring, tree)
        assert t.algorithm == ("tree" if tree < ring else "ring")


@settings(max_examples=100, deadline=None)
@given(profiles, st.integers(2, 1024), st.integers(1, 1 << 30))
def test_a_ring_all_reduce_is_a_reduce_scatter_then_an_all_gather(p, W, nbytes):
    p = p.replace(collective_latency_s=0.0, internode_latency_s=0.0)
    rs = ring_seconds(p, "reduce_scatter", nbytes / W, W)
    ag = ring_seconds(p, "all_gather", nbytes / W, W)
    assert ring_seconds(p, "all_reduce", nbytes, W) == pytest.approx(rs + ag, rel=1e-12)


def test_bus_bytes_are_what_plans_report_as_network_traffic():
    assert bus_bytes("all_gather", 100, 4) == bus_bytes("reduce_scatter", 100, 4) == 300
    assert bus_bytes("all_reduce", 100, 4) == 150
    tr = synthetic_transformer(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    p = plan(tr, {"gpu": "1GiB", "cpu": "1GiB"}, world_size=4, page_bytes=4096, cache_optimizer=False)
    n = sum(t.operation in ("all_gather", "reduce_scatter") for t in p.tasks)
    assert n and p.bytes_moved()["network"] == n * 3 * 4096


# ---------------------------------------------------------------------------------------- version 3

@settings(max_examples=100, deadline=None)
@given(st.floats(1e8, 1e12), st.sampled_from([1, 2, 8]), st.integers(1, 1024), st.integers(1, 1 << 32))
def test_a_version_3_profile_keeps_its_one_level_network(bus, rps, W, nbytes):
    """Version 3: a collective over W ranks on S bytes took ``(W - 1) * S / network_bytes_per_s``
    wherever the ranks were; loaded as version 4 it still does."""
    old = HardwareProfile.from_dict(version_3(hw(ranks_per_server=rps), bus))
    assert old.nvlink_bytes_per_s == old.internode_bytes_per_s == bus
    assert old.collective_latency_s == old.internode_latency_s == 0
    for c in ("all_gather", "reduce_scatter"):
        assert old.collective_seconds(c, nbytes, W) == pytest.approx((W - 1) * nbytes / bus, rel=1e-12)


def test_a_version_3_file_simulates_as_it_did(tmp_path):
    """The simulator's network time from a version-3 file: version 3's formula, task by task."""
    bus = 3e9
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(version_3(hw(), bus)))
    old = HardwareProfile.load(path)
    tr = synthetic_transformer(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    for W in (4, 16):
        p = plan(tr, {"gpu": "1GiB", "cpu": "1GiB"}, world_size=W, page_bytes=4096, cache_optimizer=False)
        assert simulate(p, tr, old).busy["network"] == pytest.approx(p.bytes_moved()["network"] / bus, rel=1e-9)
    # the shipped dev-vm profile was written from version 3 this way
    dev = HardwareProfile.builtin("dev-vm")
    assert dev.nvlink_bytes_per_s == dev.internode_bytes_per_s and dev.collective_latency_s == 0


def test_a_version_3_profile_with_version_4_fields_or_without_its_bandwidth_is_refused():
    d = version_3(hw(), 3e9)
    with pytest.raises(ConfigError, match="nvlink_bytes_per_s.*version-4"):
        HardwareProfile.from_dict({**d, "nvlink_bytes_per_s": 1e9})
    with pytest.raises(ConfigError, match="network_bytes_per_s"):
        HardwareProfile.from_dict({k: v for k, v in d.items() if k != "network_bytes_per_s"})
    with pytest.raises(ConfigError, match="network_bytes_per_s: unknown key"):  # version 4 has no such field
        HardwareProfile.from_dict({**hw().to_dict(), "network_bytes_per_s": 3e9})
    for bad in (0, -1.0, math.nan, "3e9"):  # named as the file names it
        with pytest.raises(ConfigError, match="network_bytes_per_s"):
            HardwareProfile.from_dict({**d, "network_bytes_per_s": bad})


def test_json_round_trip_keeps_the_network():
    p = hw(collective_latency_s=3e-6, internode_latency_s=7e-6, ranks_per_server=4)
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    a100 = HardwareProfile.builtin("a100-server")
    assert a100.collective_latency_s > 0 and a100.internode_latency_s > 0
    assert {"nvlink_bytes_per_s", "internode_bytes_per_s"} <= set(a100.facts["given"])
    assert {"collective_latency_s", "internode_latency_s"} <= set(a100.facts["assumed"])


# ---------------------------------------------------------------------------------------- bad values

@pytest.mark.parametrize("field", ["nvlink_bytes_per_s", "internode_bytes_per_s"])
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1e9", None])
def test_bandwidths_are_validated_by_name(field, bad):
    with pytest.raises(ConfigError, match=field):
        hw(**{field: bad})


@pytest.mark.parametrize("field", ["collective_latency_s", "internode_latency_s"])
@pytest.mark.parametrize("bad", [-1e-6, math.nan, math.inf, True, "5us", None])
def test_latencies_are_validated_by_name(field, bad):
    with pytest.raises(ConfigError, match=f"{field}: must be a finite number >= 0"):
        hw(**{field: bad})


def test_bad_arguments_name_what_is_wrong():
    p = hw()
    with pytest.raises(ConfigError, match="collective"):
        p.collective_seconds("all_to_all", 1, 8)
    with pytest.raises(ConfigError, match="nbytes"):
        p.collective_seconds("all_gather", -1, 8)
    with pytest.raises(ConfigError, match="world_size"):
        p.collective_seconds("all_gather", 1, 0)
