"""HardwareProfile: validation, sharing a server's SSD and CPUs, JSON, cost model, the shipped
profiles; the measurement helpers and the ``profile`` command."""

import argparse
import json
import math
import os

import pytest
import torch

from pagemem.commands import measure
from pagemem.commands import profile as profile_cmd
from pagemem.errors import ConfigError
from pagemem.sched import HardwareProfile
from pagemem.sched.hardware import PROFILES_DIR
from pagemem.tracer import CostModel, synthetic_transformer

RATES = ("h2d_bytes_per_s", "d2h_bytes_per_s", "nvlink_bytes_per_s", "internode_bytes_per_s", "nvme_read_bytes_per_s",
         "nvme_write_bytes_per_s", "cpu_adam_elements_per_s", "gpu_adam_elements_per_s", "flops_per_s",
         "hbm_bytes_per_s", "host_memory_bytes_per_s", "nvme_host_bytes_per_s", "compute_scale")


def base(**kw) -> HardwareProfile:
    d = dict(name="t", h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, nvlink_bytes_per_s=3e9, internode_bytes_per_s=2.5e9,
             nvme_read_bytes_per_s=4e9,
             nvme_write_bytes_per_s=5e9, cpu_adam_elements_per_s=6e9, gpu_adam_elements_per_s=7e9, flops_per_s=8e12,
             hbm_bytes_per_s=9e11, host_memory_bytes_per_s=1e11, nvme_host_bytes_per_s=2e10, ranks_per_server=8)
    d.update(kw)
    return HardwareProfile(**d)


@pytest.mark.parametrize("field", RATES)
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1e9", None])
def test_every_rate_is_validated_by_name(field, bad):
    with pytest.raises(ConfigError, match=field):
        base(**{field: bad})


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_ranks_per_server_is_validated(bad):
    with pytest.raises(ConfigError, match="ranks_per_server"):
        base(ranks_per_server=bad)


def test_name_and_facts_are_validated():
    with pytest.raises(ConfigError, match="name"):
        base(name=" ")
    with pytest.raises(ConfigError, match="facts"):
        base(facts=[1, 2])
    with pytest.raises(ConfigError, match="h2d_bytes_per_s"):
        base().replace(h2d_bytes_per_s=0)


@pytest.mark.parametrize("world,share", [(1, 1), (2, 2), (8, 8), (16, 8), (64, 8)])
def test_a_server_is_shared_by_its_ranks(world, share):
    hw = base()
    assert hw.sharing(world) == share
    assert hw.nvme_read_per_rank(world) == pytest.approx(4e9 / share)
    assert hw.nvme_write_per_rank(world) == pytest.approx(5e9 / share)
    assert hw.cpu_adam_per_rank(world) == pytest.approx(6e9 / share)
    one = base(ranks_per_server=1)
    assert one.nvme_read_per_rank(world) == 4e9 and one.cpu_adam_per_rank(world) == 6e9


def test_sharing_rejects_bad_world_sizes():
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ConfigError, match="world_size"):
            base().sharing(bad)


def test_rate_per_resource_tier_and_rank():
    hw = base()
    assert hw.rate("h2d", "gpu", 8) == 1e9
    # collectives are not linear in their bytes: seconds(), through pagemem.sched.network
    assert hw.seconds("all_gather", 1 << 20, None, 8) == hw.collective_seconds("all_gather", 1 << 20, 8) > 0
    assert hw.seconds("h2d", 1e9, "gpu", 8) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="resource"):
        hw.rate("network", None, 8)
    assert hw.rate("nvme_read", None, 4) == pytest.approx(4e9 / 4)
    assert hw.rate("adam", "gpu", 8) == 7e9 and hw.rate("adam", "cpu", 16) == pytest.approx(6e9 / 8)
    assert hw.rate("memory", "gpu", 8) == 9e11 and hw.rate("memory", "cpu", 2) == pytest.approx(1e11 / 2)
    assert hw.rate("nvme_host", "cpu", 4) == pytest.approx(2e10 / 4)
    # the executor's host time: windows per second, none charged (an infinite rate) at 0
    assert hw.rate("window", "gpu", 8) == math.inf
    assert base(window_host_seconds=0.002).rate("window", "gpu", 8) == pytest.approx(500)
    with pytest.raises(ConfigError, match="resource"):
        hw.rate("pcie", "gpu", 1)


@pytest.mark.parametrize("bad", [-1e-3, math.inf, math.nan, "1ms", True])
def test_window_host_seconds_is_a_finite_number_at_least_zero(bad):
    with pytest.raises(ConfigError, match="window_host_seconds.*>= 0"):
        base(window_host_seconds=bad)


def test_json_round_trip(tmp_path):
    hw = base(compute_scale=0.5, window_host_seconds=7e-4, facts={"source": "test", "nested": {"a": [1, 2]}})
    path = tmp_path / "hw.json"
    hw.save(path)
    assert HardwareProfile.load(path) == hw
    assert HardwareProfile.from_dict(json.loads(path.read_text())) == hw
    d = hw.to_dict()
    with pytest.raises(ConfigError, match="format"):
        HardwareProfile.from_dict({**d, "format": "other"})
    with pytest.raises(ConfigError, match="version"):
        HardwareProfile.from_dict({**d, "version": 99})
    # a profile written before the executor's host time was measured charges none
    assert HardwareProfile.from_dict({k: v for k, v in d.items() if k != "window_host_seconds"}).window_host_seconds == 0
    with pytest.raises(ConfigError, match="host_memory_bytes_per_s.*pagemem profile"):  # written before the field
        HardwareProfile.from_dict({**{k: v for k, v in d.items() if k != "host_memory_bytes_per_s"}, "version": 1})
    with pytest.raises(ConfigError, match="unknown"):
        HardwareProfile.from_dict({**d, "pcie": 1})
    with pytest.raises(ConfigError, match="missing"):
        HardwareProfile.from_dict({k: v for k, v in d.items() if k != "nvme_read_bytes_per_s"})
    with pytest.raises(ConfigError, match="flops_per_s"):
        HardwareProfile.from_dict({**d, "flops_per_s": -1})


def test_a_version_2_profile_loads_through_the_table_of_old_names():
    """Version 2 called the nvme tier ``ssd`` (``ssd_read_bytes_per_s``, the stream ``"ssd"``);
    ``from_dict`` reads it through ``LEGACY_NAMES``, and version 3 knows only the new names."""
    from pagemem.sched.hardware import LEGACY_NAMES

    assert LEGACY_NAMES == {"ssd_read_bytes_per_s": "nvme_read_bytes_per_s",
                            "ssd_write_bytes_per_s": "nvme_write_bytes_per_s",
                            "ssd_host_bytes_per_s": "nvme_host_bytes_per_s"}
    # version 2 had version 3's one network_bytes_per_s (tests/test_sched_network.py: version 3)
    hw = base(shared_processor=("compute", "nvme", "cpu"), facts={"source": "test"}, nvlink_bytes_per_s=3e9,
              internode_bytes_per_s=3e9, collective_latency_s=0, internode_latency_s=0)
    new = hw.to_dict()
    new_to_old = {n: o for o, n in LEGACY_NAMES.items()}
    old = {new_to_old.get(k, k): v for k, v in new.items()
           if k not in ("nvlink_bytes_per_s", "internode_bytes_per_s", "collective_latency_s", "internode_latency_s")}
    old.update(version=2, shared_processor=["compute", "ssd", "cpu"], network_bytes_per_s=3e9)
    assert {"ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "ssd_host_bytes_per_s"} <= set(old)
    assert not any(k.startswith("nvme_") for k in old)
    assert HardwareProfile.from_dict(old) == hw
    assert HardwareProfile.from_dict(new) == hw
    with pytest.raises(ConfigError, match="both"):
        HardwareProfile.from_dict({**old, "nvme_read_bytes_per_s": 4e9})
    with pytest.raises(ConfigError, match="ssd_read_bytes_per_s: unknown key"):  # not in version 3
        HardwareProfile.from_dict({**new, "ssd_read_bytes_per_s": 4e9})
    with pytest.raises(ConfigError, match="shared_processor"):
        HardwareProfile.from_dict({**new, "shared_processor": ["ssd"]})


def test_cost_model_gives_synthetic_traces_the_profiles_durations():
    hw = base(flops_per_s=50e12, hbm_bytes_per_s=1e12)
    cm = hw.cost_model()
    assert cm == CostModel(flops_per_second=50e12, bytes_per_second=1e12)
    shape = dict(layers=1, hidden=1024, heads=8, seq=512, batch=4)
    slow = synthetic_transformer(**shape, cost=cm)
    fast = synthetic_transformer(**shape, cost=base(flops_per_s=100e12, hbm_bytes_per_s=2e12).cost_model())
    for a, b in zip(slow.ops, fast.ops):
        assert a.duration == pytest.approx(2 * b.duration, rel=1e-12, abs=1e-18)
    qkv = next(op for op in slow.ops if op.module == "blocks.0.attn.qkv" and op.event == "forward_pre")
    tokens = 4 * 512
    assert qkv.duration == pytest.approx(2 * tokens * 1024 * 3072 / 50e12)  # compute-bound matmul


def test_a100_server_carries_the_papers_numbers():
    hw = HardwareProfile.a100_server()
    assert (hw.h2d_bytes_per_s, hw.d2h_bytes_per_s) == (32e9, 32e9)
    assert hw.nvlink_bytes_per_s == 12 * 25e9 and hw.internode_bytes_per_s == 16 * 12.5e9
    assert (hw.nvme_read_bytes_per_s, hw.nvme_write_bytes_per_s) == (3.5e9, 3.5e9)
    assert hw.ranks_per_server == 8 and hw.compute_scale == 1
    assert hw.nvme_read_per_rank(8) == pytest.approx(3.5e9 / 8)
    # the assumptions, as derived in the docstring
    assert hw.cpu_adam_elements_per_s == pytest.approx(0.6 * 16 * 2933e6 * 8 / 26)
    assert hw.gpu_adam_elements_per_s == pytest.approx(hw.hbm_bytes_per_s / 26)
    assert hw.host_memory_bytes_per_s == pytest.approx(0.6 * 16 * 2933e6 * 8)
    assert set(hw.facts["given"]) >= {"h2d_bytes_per_s", "nvlink_bytes_per_s", "internode_bytes_per_s",
                                      "nvme_read_bytes_per_s"}
    assert hw.facts["assumed"]


def test_shipped_profiles():
    assert set(HardwareProfile.builtin_names()) >= {"a100-server", "dev-vm"}
    assert HardwareProfile.builtin("a100-server") == HardwareProfile.a100_server()
    # the JSON next to the code is the same profile, so the two cannot drift apart
    assert HardwareProfile.load(os.path.join(PROFILES_DIR, "a100-server.json")) == HardwareProfile.a100_server()
    dev = HardwareProfile.builtin("dev-vm")
    assert dev.name == "dev-vm"
    assert {"date", "cpu", "cpus", "memory_bytes", "torch", "method", "disk"} <= set(dev.facts)
    with pytest.raises(ConfigError, match="dev-vm"):
        HardwareProfile.builtin("nope")
    with pytest.raises(ConfigError):
        HardwareProfile.builtin("../profiles/dev-vm")


# ---------------------------------------------------------------------------------------- measuring

def test_measurement_helpers_report_positive_rates(tmp_path):
    assert measure.host_copy(1 << 20, repeats=2) > 0
    rate, impl = measure.adam(100_000, repeats=2)
    assert rate > 0 and impl in ("fused", "foreach")
    assert measure.matmul_flops(repeats=1) > 0
    assert measure.device_memory(1 << 20, repeats=2) > 0
    read, write, info = measure.nvme(str(tmp_path), 8 << 20, repeats=1)
    assert read > 0 and write > 0 and info["io_depth"] == measure.DEPTH
    # the CPU time of those moves: checksums alone keep it far below memcpy speed
    assert 0 < info["host_bytes_per_s"] < 1e12
    facts = measure.machine_facts(str(tmp_path))
    assert facts["cpus"] == os.cpu_count() and "date" in facts and "device" in facts["disk"]


@pytest.mark.slow
def test_network_measurement_with_two_gloo_processes():
    net = measure.network(1 << 20, repeats=2)
    assert net["all_gather"] > 0 and net["reduce_scatter"] > 0


@pytest.mark.slow
def test_profile_command_measures_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    profile_cmd.configure(parser)
    out = tmp_path / "me.json"
    args = parser.parse_args(["--out", str(out), "--name", "me", "--nvme_path", str(tmp_path), "--nvme_bytes", "8MiB",
                              "--copy_bytes", "4MiB", "--adam_elements", "100000", "--network_bytes", "1MiB",
                              "--repeats", "1"])
    assert profile_cmd.run(args) == 0
    hw = HardwareProfile.load(out)
    assert hw.name == "me" and hw.ranks_per_server == (torch.cuda.device_count() or 1)
    assert hw.facts["method"]["nvme_backend"]["io_depth"] == 8
    # the executor's host time per moved window: measured by the engine on the host stand-in only
    assert (hw.window_host_seconds > 0) != torch.cuda.is_available()


def test_profile_command_shows_a_builtin_and_needs_out(capsys):
    parser = argparse.ArgumentParser()
    profile_cmd.configure(parser)
    assert profile_cmd.run(parser.parse_args(["--show", "a100-server"])) == 0
    assert "a100-server" in capsys.readouterr().out
    assert profile_cmd.run(parser.parse_args([])) == 2
    assert profile_cmd.run(parser.parse_args(["--show", "nope"])) == 2
