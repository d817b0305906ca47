"""``pagemem train`` under torchrun ([Note: pagemem train under torchrun]): 2 gloo ranks on this
machine train data parallel into one run directory, and ``--max-restarts`` resumes a run whose
rank was killed from its last checkpoint, ending with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagemem
from pagemem.commands.train_ranks import ONE, KILL_HOOK, Launch, launch_from_env, restart_target
from tests.conftest import exit_status
from tests.test_cmd_train import SMALL, _weights
from tests.test_engine_ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
RUN = ["--train.steps", str(STEPS), "--train.save_every", "4", "--train.log_every", "4", "--train.name", "r",
       *SMALL, "--data.batch", "8", "--optimizer.lr", "3e-3"]
"""8 sequences per rank; synchronous updates, the default with several ranks (the lock-free updater
runs in one process)."""


def torchrun(cwd: Path, *argv: str, restarts: int = 0, env: dict[str, str] | None = None,
             timeout: float = 150) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m pagemem train ARGV`` in ``cwd``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--max-restarts", str(restarts), "-m", "pagemem", "train", "--train.runs", str(cwd / "runs"), *argv]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """An uninterrupted run of 2 ranks: its run directory and the torchrun process."""
    cwd = tmp_path_factory.mktemp("whole")
    proc = torchrun(cwd, *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "runs" / "r", proc


def test_two_ranks_train_into_one_run_directory(whole, tmp_path):
    run, proc = whole
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("run directory") == 1  # rank 0 alone prints the summary
    assert proc.stdout.count("step      4  loss") == 1
    assert sorted(os.listdir(run.parent)) == ["r"]
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        if m["step"] % 4:
            assert "ranks" not in m
            continue
        assert [r["rank"] for r in m["ranks"]] == [0, 1]
        assert all(r["tokens_per_s"] > 0 and r["sent_bytes"] > 0 for r in m["ranks"])
        # every rank averages every gradient: both send the same bytes
        assert m["ranks"][0]["sent_bytes"] == m["ranks"][1]["sent_bytes"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps_done"] == STEPS
    assert [r["rank"] for r in summary["ranks"]] == [0, 1] and all(r["sent_bytes"] > 0 for r in summary["ranks"])
    assert summary["ranks"][0]["sent_bytes"] == sum(m["ranks"][0]["sent_bytes"] for m in lines if "ranks" in m)
    assert summary["last_loss"] < summary["first_loss"]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    manifest = json.loads((run / "checkpoints" / latest / "manifest.json").read_text())["manifest"]
    assert latest.endswith(str(STEPS)) and manifest["ranks"]["world_size"] == 2
    assert _weights(str(run))  # the last checkpoint loads in one process
    # the ranks' combined batch is one process's with twice the batch: the same losses
    one = tmp_path / "one"
    one.mkdir()
    argv = ["train", "--train.runs", str(one / "runs"), *RUN, "--data.batch", "16", "--train.steps", "3",
            "--engine.lock_free", "false"]  # one process: synchronous as the ranks are
    assert exit_status(*argv) == 0
    alone = [m["loss"] for m in metrics(one / "runs" / "r")]
    assert alone == pytest.approx([m["loss"] for m in lines[:3]], rel=1e-5, abs=1e-6)


@pytest.mark.slow  # make test's budget: test_engine_ranks covers a killed rank
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(whole, tmp_path):
    run, _ = whole
    proc = torchrun(tmp_path, *RUN, restarts=1, env={KILL_HOOK: "1:7"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # rank 1 died, by the test hook
    assert "torchrun restart 1: resuming" in proc.stderr and "(step 4)" in proc.stderr
    cut = tmp_path / "runs" / "r"
    assert [m["step"] for m in metrics(cut)] == list(range(1, STEPS + 1))  # steps 5, 6 once: logged again
    assert [m["loss"] for m in metrics(cut)] == [m["loss"] for m in metrics(run)]
    a, b = _weights(str(run)), _weights(str(cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((cut / "summary.json").read_text())["steps_done"] == STEPS


def test_torchrun_environment_and_restart_targets(tmp_path):
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert launch_from_env({}) == ONE and launch_from_env({**env, "MASTER_PORT": "1"}) == Launch(1, 1, 2, 0)
    assert launch_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "2"}).restart == 2
    with pytest.raises(pagemem.ConfigError, match="do not fit"):
        launch_from_env({**env, "RANK": "2"})
    runs = tmp_path / "runs"
    first, again = Launch(0, 0, 2, 0), Launch(0, 0, 2, 1)
    (runs / "a" / "checkpoints").mkdir(parents=True)
    (runs / "a" / "config.json").write_text("{}")
    assert restart_target(first, str(runs), "a") is None  # the first attempt starts its run
    assert restart_target(again, str(runs), None) is None  # no checkpoint anywhere: start afresh
    assert restart_target(again, str(runs), "a") is None and not (runs / "a").exists()  # removed: start again
    (runs / "b" / "checkpoints").mkdir(parents=True)
    (runs / "b" / "config.json").write_text("{}")
    (runs / "b" / "checkpoints" / "latest").write_text("step-4")
    assert restart_target(again, str(runs), "b") == str(runs / "b")
    assert restart_target(again, str(runs), None) == str(runs / "b")
