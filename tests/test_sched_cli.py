"""``pagemem plan`` end to end, and the memory plot."""


import json

import pytest

from pagemem.cli import main
from pagemem.sched import Plan, plan, validate
from pagemem.tracer import synthetic_transformer

SMALL = ["--model", "tiny", "--batch", "2", "--seq", "16", "--page_bytes", "4096", "--world_size", "2",
         "--cpu_bytes", "1GiB", "--nvme_bytes", "1GiB"]


def test_plan_command_writes_a_valid_plan_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "mem.png"
    rc = main(["plan", *SMALL, "--gpu_bytes", "64MiB", "--optimizer_tier", "nvme", "--out", str(out),
               "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "validated" in text and "valid" in text and "peak / budget" in text
    p = Plan.load(out)
    assert p.world_size == 2 and p.optimizer_tier == "nvme"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plan_and_simulate_commands_plan_ranks_that_shard_the_states_only(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", *SMALL, "--gpu_bytes", "64MiB", "--sharding", "states", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    p = Plan.load(out)
    assert p.layout.sharding == "states" and p.counts()["all_reduce"] > 0 and "reduce_scatter" not in p.counts()
    assert main(["simulate", *SMALL, "--gpu_bytes", "64MiB", "--sharding", "states", "--profile", "dev-vm"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", *SMALL, "--sharding", "experts"])


def test_plan_and_simulate_commands_home_parameters_on_nvme(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", *SMALL, "--gpu_bytes", "512KiB", "--home_tier", "nvme", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "parameters and gradients on nvme" in text
    p = Plan.load(out)
    assert p.home_tier == "nvme" and p.counts()["move_to_cpu"] > 0
    assert main(["simulate", *SMALL, "--gpu_bytes", "512KiB", "--home_tier", "nvme", "--profile", "dev-vm"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", *SMALL, "--home_tier", "disk"])
    assert "--home_tier" in capsys.readouterr().err


def test_plan_command_reports_infeasible_with_the_minimum(capsys):
    rc = main(["plan", *SMALL, "--gpu_bytes", "1KiB"])
    text = capsys.readouterr().err
    assert rc == 3
    assert "smallest GPU budget that works is" in text


def test_plan_command_reads_a_trace_file(tmp_path, capsys):
    tr = synthetic_transformer(layers=2, hidden=32, ffn=128, heads=2, seq=8, batch=1, vocab=64)
    tr.save(tmp_path / "t.json")
    rc = main(["plan", "--trace", str(tmp_path / "t.json"), "--gpu_bytes", "1GiB", "--cpu_bytes", "1GiB",
               "--page_bytes", "4096", "--world_size", "1"])
    assert rc == 0, capsys.readouterr().out


def test_plan_command_bad_input(capsys):
    assert main(["plan", *SMALL, "--gpu_bytes", "lots"]) == 2
    assert "gpu_bytes: cannot parse 'lots'" in capsys.readouterr().err


def test_plot_draws_a_plan_that_is_over_budget_too(tmp_path):
    pytest.importorskip("matplotlib")
    from pagemem.sched.plot import plot_memory

    tr = synthetic_transformer(layers=2, hidden=64, ffn=256, heads=4, seq=16, batch=2, vocab=128)
    p = plan(tr, {"gpu": "1GiB", "cpu": "1GiB"}, page_bytes=4096, cache_optimizer=False)
    report = validate(p, tr, {"gpu": 50_000, "cpu": "1GiB"})
    assert not report.ok
    path = plot_memory(report, tmp_path / "over.png", phases=[o.phase for o in tr.ops] + ["end"])
    assert open(path, "rb").read(4) == b"\x89PNG"


def test_simulate_command_on_both_profiles(tmp_path, capsys):
    chrome = tmp_path / "sim.json"
    for profile in ("a100-server", "dev-vm"):
        rc = main(["simulate", *SMALL, "--gpu_bytes", "64MiB", "--profile", profile, "--chrome", str(chrome)])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert "gpu idle" in text and "busy:" in text
        events = json.loads(chrome.read_text())
        assert events["traceEvents"]


def test_profile_command_shows_a_builtin(capsys):
    assert main(["profile", "--show", "a100-server"]) == 0
    assert "32" in capsys.readouterr().out
