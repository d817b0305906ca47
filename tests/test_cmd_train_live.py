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
