"""What ``pagemem train`` writes while it runs: TensorBoard event files flushed as each metrics
line is logged (read while the run goes on, and after a kill -9), nothing without
``tensorboard``; the measured timeline's moves as spans."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from pagemem.commands.train_board import Board
from tests.test_cmd_train_real import SMALL, popen, wait_for_lines


def scalars(path: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(path)
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_without_tensorboard_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    board = Board(str(tmp_path / "tensorboard"), [{"step": 1, "loss": 2.0}])
    board.add({"step": 2, "loss": 1.0})
    board.close()
    assert not board.writing and not (tmp_path / "tensorboard").exists()


@pytest.mark.slow
def test_tensorboard_follows_a_running_job_and_keeps_its_steps_after_kill_9(tmp_path):
    pytest.importorskip("tensorboard")
    proc = popen(tmp_path, "train", *SMALL, "--engine.lock_free", "false", "--train.steps", "100000",
                 "--train.name", "live")
    run = tmp_path / "runs" / "live"
    try:
        wait_for_lines(run / "metrics.jsonl", 5, proc)
        assert proc.poll() is None, proc.communicate()[1]
        logged = [json.loads(line) for line in open(run / "metrics.jsonl")]
        seen = scalars(str(run / "tensorboard"), "loss")  # the job still running
        assert proc.poll() is None
        assert [s for s, _ in seen][:5] == [1, 2, 3, 4, 5]
        assert seen[0][1] == pytest.approx(logged[0]["loss"])
        wait_for_lines(run / "metrics.jsonl", len(logged) + 3, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        done = len(open(run / "metrics.jsonl").read().splitlines())
        after = scalars(str(run / "tensorboard"), "loss")
        steps = [s for s, _ in after]  # every logged step (the last may have died between its line and event)
        assert steps == list(range(1, len(steps) + 1)) and done - 1 <= len(steps) <= done
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)


def test_the_store_keeps_each_directions_busy_periods_as_spans():
    from pagemem.store.stats import TransferMeter

    meter = TransferMeter()
    meter.begin("cpu->gpu", 2)  # two transfers in flight together: one span
    meter.end("cpu->gpu", 100)
    meter.begin("cpu->nvme")
    meter.end("cpu->gpu", 50)
    meter.end("cpu->nvme", 0, 0)  # a failed transfer: a span that moved nothing
    first = meter.spans(0.0)
    assert [(s.direction, s.bytes) for s in first] == [("cpu->gpu", 150), ("cpu->nvme", 0)]
    assert all(s.start <= s.end for s in first)
    meter.begin("nvme->cpu")
    meter.end("nvme->cpu", 7)
    assert [(s.direction, s.bytes) for s in meter.spans(first[-1].end)] == [("nvme->cpu", 7)]


@pytest.mark.slow
def test_the_measured_timeline_shows_the_moves_as_spans_beside_the_phases(tmp_path):
    from tests.test_cmd_train_real import pagemem_cmd

    r = pagemem_cmd(tmp_path, "train", *SMALL, "--train.steps", "6", "--train.save_every", "3", "--train.name", "t")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "t"
    events = json.load(open(run / "timeline-measured.json"))["traceEvents"]
    names = {e["name"] for e in events}
    assert {"forward", "backward", "update", "checkpoint", "h2d", "nvme read", "nvme write"} <= names
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    moves = [e for e in events if e["ph"] == "X" and e["tid"] > 0]
    summary = json.load(open(run / "summary.json"))
    for direction in {e["args"]["direction"] for e in moves}:
        mine = sorted((e for e in moves if e["args"]["direction"] == direction), key=lambda e: e["ts"])
        assert direction in rows[mine[0]["tid"]]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))  # busy periods: disjoint
        assert 0 < sum(e["args"]["bytes"] for e in mine) <= summary["moved_bytes"][direction]
    steps = [e for e in events if e["name"] == "forward"]
    assert min(e["ts"] for e in moves) >= steps[0]["ts"] - 5e6  # the spans sit on the phases' clock


def test_a_disk_that_refuses_the_event_files_warns_and_the_run_goes_on(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    (tmp_path / "tensorboard").write_text("a file where the directory goes")
    board = Board(str(tmp_path / "tensorboard"), [{"step": 1, "loss": 2.0}])
    board.add({"step": 2, "loss": 1.0})
    board.close()
    assert not board.writing and "TensorBoard event files are not written" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_mid_run_keeps_every_logged_step_in_tensorboard_and_a_resume_shows_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tests.test_cmd_train_real import pagemem_cmd

    proc = popen(tmp_path, "train", *SMALL, "--engine.lock_free", "false", "--train.steps", "100000",
                 "--train.save_every", "0", "--train.name", "term")
    run = tmp_path / "runs" / "term"
    wait_for_lines(run / "metrics.jsonl", 6, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err
    done = len(open(run / "metrics.jsonl").read().splitlines())
    assert [s for s, _ in scalars(str(run / "tensorboard"), "loss")] == list(range(1, done + 1))
    r = pagemem_cmd(tmp_path, "train", "--resume", str(run), "--train.steps", str(done + 2))
    assert r.returncode == 0, r.stderr
    assert [s for s, _ in scalars(str(run / "tensorboard"), "loss")] == list(range(1, done + 3))
