"""``pagemem train``: the run directory it writes, bad input, Ctrl-C and ``--resume auto``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import pagemem
from pagemem.commands.run_dir import METRIC_KEYS, files_of_a_finished_run
from tests.conftest import exit_status

SMALL = ["--model.layers", "2", "--model.hidden", "64", "--model.heads", "2", "--model.vocab", "64", "--model.seq", "16",
         "--data.vocab", "64", "--data.seq", "16", "--data.batch", "16", "--store.page_bytes", "64KiB",
         "--train.progress", "false"]


def train(tmp_path, *extra: str, steps: int = 8) -> int:
    """``pagemem train`` in this process; its exit status (argparse's exits included)."""
    return exit_status("train", "--train.runs", str(tmp_path / "runs"), "--train.steps", str(steps), *SMALL, *extra)


def only_run(tmp_path) -> str:
    (name,) = os.listdir(tmp_path / "runs")
    return str(tmp_path / "runs" / name)


def test_the_default_run_writes_every_file_and_the_loss_falls(tmp_path, capsys):
    assert train(tmp_path, "--optimizer.lr", "3e-3", steps=40) == 0
    run = only_run(tmp_path)
    for name in files_of_a_finished_run():
        assert os.path.lexists(os.path.join(run, name)), name
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert all(set(m) == set(METRIC_KEYS) for m in metrics)
    assert all(m["gpu_peak_bytes"] <= m["gpu_budget_bytes"] for m in metrics)
    assert sum(m["loss"] for m in metrics[-5:]) < sum(m["loss"] for m in metrics[:5]) - 5 * 0.3
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["steps_done"] == 40 and summary["last_loss"] < summary["first_loss"]
    assert summary["staleness"] is None  # the default is synchronous (issue 35: lock-free loses quality)
    assert summary["moved_bytes"]["nvme->cpu"] > 0  # optimizer states on nvme: pages really moved
    param_bytes = 4 * sum(p.numel() for p in _model(run).parameters())
    assert summary["moved_bytes"]["cpu->gpu"] > 40 * param_bytes / 2  # the gpu budget makes units move every step
    for name in ("trace.chrome.json", "timeline-planned.json", "timeline-measured.json"):
        events = json.load(open(os.path.join(run, name)))["traceEvents"]
        assert events and all("ph" in e and "name" in e for e in events), name
        assert any(e["ph"] == "X" and e.get("dur", 0) > 0 for e in events), name
    from PIL import Image

    for name in ("loss.png", "memory.png"):
        img = torch.tensor(list(Image.open(os.path.join(run, name)).convert("L").tobytes()), dtype=torch.float32)
        assert img.numel() > 10_000 and img.std() > 5, name  # decodes, and is not blank
    config = open(os.path.join(run, "config.toml")).read()
    assert 'optimizer_tier = "nvme"' in config and "lr = 0.003" in config and 'bytes = "auto"' not in config
    out = capsys.readouterr().out
    assert "step     40  loss" in out and "throughput" in out


def test_a_config_file_and_overrides_layer_over_the_default(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\noptimizer_tier = "cpu"\nlock_free = false\n[optimizer]\nlr = 5e-4\n')
    assert train(tmp_path, "--config", str(cfg), "--optimizer.weight_decay", "0.0", "--train.name", "x", steps=2) == 0
    saved = json.load(open(tmp_path / "runs" / "x" / "config.json"))
    assert saved["engine"]["optimizer_tier"] == "cpu" and saved["optimizer"]["lr"] == 5e-4
    assert saved["optimizer"]["weight_decay"] == 0.0 and saved["store"]["nvme_bytes"] == 0
    assert not (tmp_path / "runs" / "x" / "nvme").exists()


@pytest.mark.parametrize("argv,message", [
    (["--store.nvme_path", "/does/not/exist"], "store.nvme_path"),
    (["--store.gpu_bytes", "64KiB"], "gpu_bytes"),
    (["--store.gpu_bytes", "-4096"], "store.gpu_bytes"),
    (["--store.gpu_byte", "1"], "unrecognized arguments: --store.gpu_byte"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--optimizer.lr", "-1"], "optimizer.lr"),
    (["--engine.optimizer_tier", "tape"], "engine.optimizer_tier"),
    (["--data.vocab", "100000"], "data.vocab"),
    (["--resume", "auto"], "resume: no run with a checkpoint"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, capsys, argv, message):
    rc = train(tmp_path, *argv, steps=2)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")  # nothing left behind


def test_bad_config_files_are_one_line(tmp_path, capsys):
    bad = {"malformed.toml": "[engine\nlock_free = true", "unknown.toml": "[engine]\nlock_freee = true\n",
           "section.toml": "[engin]\nlock_free = true\n", "negative.toml": '[store]\ncpu_bytes = -1\n'}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        assert train(tmp_path, "--config", str(tmp_path / name), steps=2) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err and err.startswith("pagemem train: ConfigError:"), err
    assert train(tmp_path, "--config", str(tmp_path / "missing.toml")) == 2
    assert "missing.toml does not exist" in capsys.readouterr().err


def test_a_read_only_nvme_path_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:  # root writes to a read-only directory: /proc refuses everyone
        assert train(tmp_path, "--store.nvme_path", "/proc" if os.geteuid() == 0 else str(ro), steps=2) == 2
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err.strip()
    assert "nvme_path" in err and "\n" not in err and "Traceback" not in err, err


# ---------------------------------------------------------------- Ctrl-C and --resume auto

DETERMINISTIC = ["--engine.lock_free", "false", "--optimizer.lr", "3e-3"]


def _model(run: str) -> torch.nn.Module:
    from pagemem.commands.models import build
    from pagemem.commands.train_config import resolve

    return build(resolve(json.load(open(os.path.join(run, "config.json"))), run).model, 0).model


def _weights(run: str) -> dict[str, torch.Tensor]:
    from pagemem.commands.models import build
    from pagemem.commands.train_config import resolve

    cfg = resolve(json.load(open(os.path.join(run, "config.json"))), run)
    model = build(cfg.model, 0).model
    with pagemem.Engine.load(os.path.join(run, "checkpoints"), model, cfg.engine) as engine:
        return engine.state_dict()


@pytest.mark.parametrize("accumulation", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_ctrl_c_leaves_a_resumable_run_that_ends_as_an_uninterrupted_one(tmp_path, accumulation):
    """A step is ``accumulation_steps`` backwards and one update; checkpoints, metrics and
    ``train.steps`` all count steps (the attack found a resumed run with accumulation taking
    a different number of updates)."""
    steps = 30
    whole = tmp_path / "whole"
    whole.mkdir()
    acc = ["--engine.accumulation_steps", accumulation]
    assert train(whole, *DETERMINISTIC, *acc, "--train.name", "w", steps=steps) == 0
    cut = tmp_path / "cut"
    cut.mkdir()
    argv = [sys.executable, "-m", "pagemem", "train", "--train.runs", str(cut / "runs"), "--train.steps", str(steps),
            "--train.name", "c", "--train.save_every", "7", *SMALL, *DETERMINISTIC, *acc]
    proc = subprocess.Popen(argv, cwd=cut, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = cut / "runs" / "c" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 11):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted after step" in err and "Traceback" not in err
    assert sorted(os.listdir(cut)) == ["runs"]  # nothing outside the run directory
    done = len(metrics.read_text().splitlines())
    assert 11 <= done < steps
    rc = subprocess.run([sys.executable, "-m", "pagemem", "train", "--resume", "auto", "--train.runs",
                         str(cut / "runs")], cwd=cut, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr
    a, b = _weights(str(whole / "runs" / "w")), _weights(str(cut / "runs" / "c"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in open(whole / "runs" / "w" / "metrics.jsonl")]


def test_a_hugging_face_model_from_a_local_config_directory_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "tiny-gpt2"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(d)
    assert train(tmp_path, "--model.hf", str(d), "--optimizer.lr", "3e-3", "--train.name", "hf", steps=30) == 0
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "hf" / "metrics.jsonl")]
    assert sum(m["loss"] for m in metrics[-5:]) < sum(m["loss"] for m in metrics[:5]) - 5 * 0.3


def test_an_unknown_hugging_face_model_type_is_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert train(tmp_path, "--model.hf", "no-such-model", steps=2) == 2
    err = capsys.readouterr().err.strip()
    assert "model.hf" in err and "\n" not in err


def test_auto_gpu_bytes_holds_a_model_whose_units_need_more_than_its_trace_says(tmp_path):
    """4 layers of hidden 128: the scheduler's least for the plain model's trace is below what
    the engine's units need; ``auto`` tries it and grows to the least the engine names."""
    assert train(tmp_path, "--model.layers", "4", "--model.hidden", "128", "--model.heads", "4", "--model.vocab", "256",
                 "--model.seq", "64", "--data.vocab", "256", "--data.seq", "64", "--data.batch", "8",
                 "--store.page_bytes", "256KiB", "--train.name", "a", steps=3) == 0
    saved = json.load(open(tmp_path / "runs" / "a" / "config.json"))
    summary = json.load(open(tmp_path / "runs" / "a" / "summary.json"))
    assert summary["steps_done"] == 3 and summary["peak_bytes"]["gpu"] <= saved["store"]["gpu_bytes"]


def test_runs_started_in_the_same_second_get_a_directory_each(tmp_path):
    from pagemem.commands.train import _new_run_dir
    from pagemem.commands.train_config import TrainSettings

    settings = TrainSettings(runs=str(tmp_path / "runs"))
    paths = {_new_run_dir(settings) for _ in range(3)}
    assert len(paths) == 3 and all(os.path.isdir(p) for p in paths)
    named = TrainSettings(runs=str(tmp_path / "runs"), name="x")
    _new_run_dir(named)
    with pytest.raises(pagemem.ConfigError, match="train.name: .* exists"):
        _new_run_dir(named)


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    assert train(tmp_path, "--train.name", "f", steps=3) == 0
    summary = (tmp_path / "runs" / "f" / "summary.json").read_text()
    assert exit_status("train", "--resume", str(tmp_path / "runs" / "f")) == 0
    assert "has finished its 3 steps" in capsys.readouterr().out
    assert (tmp_path / "runs" / "f" / "summary.json").read_text() == summary


def test_a_non_utf8_config_file_is_one_line(tmp_path, capsys):
    (tmp_path / "bin.toml").write_bytes(bytes(range(256)))
    assert train(tmp_path, "--config", str(tmp_path / "bin.toml"), steps=2) == 2
    err = capsys.readouterr().err.strip()
    assert "is not valid TOML" in err and "\n" not in err
