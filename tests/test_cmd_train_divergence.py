"""Divergence detection in ``pagemem train`` ([Note: detecting divergence]): synthetic loss
sequences (noise and the spikes of normal training never stop a run; a sustained rise does,
soon), resume equivalence, the config's checks, and real runs: one whose learning rate is raised
too high stops with the last good checkpoint kept, one with a spike that recovers does not."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.commands.run_dir import RunDir
from pagemem.commands.train_config import TrainSettings
from pagemem.commands.train_divergence import DivergenceWatch
from pagemem.plain import from_plain
from tests.conftest import exit_status


def first_stop(losses: list[float], **kw) -> int | None:
    """The 1-based step the default watch (or ``kw``'s) stops at, or None."""
    d = TrainSettings(**kw)
    w = DivergenceWatch(d.divergence_nats, d.divergence_span, d.divergence_after)
    for loss in losses:
        if w.diverged(loss) is not None:
            return w.steps + 1
        w.observe(loss)
    return None


def falling(n: int, start: float, floor: float, tau: float) -> np.ndarray:
    return floor + (start - floor) * np.exp(-np.arange(n) / tau)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0, 0.3), st.floats(0.5, 8), st.floats(0, 6), st.floats(1, 200),
       st.integers(30, 600))
def test_noise_on_a_falling_or_flat_loss_never_stops_a_run(seed, sigma, floor, drop, tau, n):
    rng = np.random.default_rng(seed)
    losses = falling(n, floor + drop, floor, tau) + rng.normal(0, sigma, n)
    assert first_stop(list(losses)) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0, 0.1), st.integers(1, 3), st.floats(0.5, 1), st.integers(20, 60),
       st.integers(100, 500))
def test_the_spikes_of_normal_training_never_stop_a_run(seed, sigma, length, share, gap, n):
    """Spikes of up to 6 nats-steps in all (one step 6 nats above, three 2 above), at least a
    span apart, each back to the curve after."""
    rng = np.random.default_rng(seed)
    losses = falling(n, 5.0, 2.0, 50) + rng.normal(0, sigma, n)
    height = share * 6 / length
    for at in range(int(rng.integers(5, 30)), n - length, gap + length):
        losses[at:at + length] += height
    assert first_stop(list(losses)) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0, 0.1), st.floats(1.5, 20), st.integers(0, 40), st.integers(20, 200))
def test_a_sustained_rise_stops_the_run_soon_after_it_passes_the_threshold(seed, sigma, rise, ramp, learnt):
    """A loss that learns for ``learnt`` steps and settles (60 steps: the average catches up),
    then climbs over ``ramp`` steps to ``rise`` nats above where it got to, and stays: stopped
    within 30 steps of reaching 1.5 nats above."""
    rng = np.random.default_rng(seed)
    low = falling(learnt, 5.0, 2.0, 20)
    low = np.concatenate([low, np.full(60, low[-1])])
    learnt += 60
    climb = low[-1] + np.linspace(0, rise, ramp + 1)[1:]
    stay = np.full(200, low[-1] + rise)
    losses = np.concatenate([low, climb, stay]) + rng.normal(0, sigma, learnt + ramp + 200)
    stop = first_stop(list(losses))
    assert stop is not None
    crossed = learnt + int(np.argmax(np.concatenate([climb, stay]) >= low[-1] + 1.5)) + 1
    assert stop <= crossed + 30


def test_it_waits_for_divergence_after_and_none_turns_it_off():
    losses = [2.0] * 5 + [9.0] * 100
    assert first_stop(losses) == 21  # train.divergence_after 20: step 21 is the first checked
    assert first_stop(losses, divergence_after=0) == 7  # 7 nats above: the average moves 0.67, then 1.27
    assert first_stop(losses, divergence_nats=None) is None
    assert first_stop([4.0] * 50 + [math.nan] * 3 + [4.2] * 50) is None  # a NaN step is skipped


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 20), min_size=1, max_size=120), st.data())
def test_a_replayed_watch_goes_on_as_the_uninterrupted_one(losses, data):
    cut = data.draw(st.integers(0, len(losses)))
    whole = DivergenceWatch(1.0, 20, 20)
    verdicts = []
    for loss in losses:
        verdicts.append(whole.diverged(loss))
        whole.observe(loss)
    resumed = DivergenceWatch(1.0, 20, 20)
    resumed.replay(losses[:cut])
    for loss, verdict in zip(losses[cut:], verdicts[cut:]):
        assert resumed.diverged(loss) == verdict
        resumed.observe(loss)
    assert (resumed.ema, resumed.best, resumed.steps) == (whole.ema, whole.best, whole.steps)


@pytest.mark.parametrize("key,value,needle", [
    ("divergence_nats", 0, "train.divergence_nats: must be a number of nats in (0, 100]"),
    ("divergence_nats", -1.0, "train.divergence_nats: must be a number of nats in (0, 100]"),
    ("divergence_nats", math.inf, "train.divergence_nats: must be a number of nats in (0, 100]"),
    ("divergence_nats", math.nan, "train.divergence_nats: must be a number of nats in (0, 100]"),
    ("divergence_nats", True, "train.divergence_nats: must be a number of nats in (0, 100]"),
    ("divergence_nats", "1", "train.divergence_nats:"),
    ("divergence_span", 0, "train.divergence_span: must be an integer in [1, 100000]"),
    ("divergence_span", 2.5, "train.divergence_span: must be an integer"),
    ("divergence_after", -1, "train.divergence_after: must be an integer in [0,"),
])
def test_bad_divergence_settings_are_refused_naming_the_field(key, value, needle):
    with pytest.raises(pagemem.ConfigError) as exc:
        from_plain(TrainSettings, {key: value}, "train")
    assert needle in str(exc.value)


@pytest.mark.parametrize("argv,needle", [
    (["--train.divergence_nats", "0"], "train.divergence_nats: must be a number of nats in (0, 100]"),
    (["--train.divergence_nats", "lots"], "train.divergence_nats:"),
    (["--train.divergence_span", "-3"], "train.divergence_span: must be an integer in [1, 100000]"),
])
def test_bad_divergence_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    rc = exit_status("train", "--train.runs", str(tmp_path / "runs"), "--train.steps", "1", *argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and "\n" not in err, err


def test_help_config_describes_the_divergence_settings(capsys):
    assert exit_status("train", "--help_config") == 0
    out = capsys.readouterr().out
    for name in ("divergence_nats", "divergence_span", "divergence_after"):
        line = out.split(f"--train.{name}")[1].splitlines()
        assert line[1].startswith("      ") and len(line[1].strip()) > 20


# ---------------------------------------------------------------------- real runs

def run_losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("lock_free", ["false", "true"])
def test_a_learning_rate_raised_too_high_stops_the_run_on_divergence_keeping_the_last_good_checkpoint(
        tmp_path, lock_free):
    from tests.test_cmd_train_real import SMALL, pagemem_cmd

    r = pagemem_cmd(tmp_path, "train", *SMALL, "--engine.lock_free", lock_free, "--optimizer.lr", "3e-3",
                    "--train.steps", "60", "--train.save_every", "20", "--train.name", "d")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "d"
    learnt = run_losses(run)
    assert learnt[-1] < learnt[0] - 1.0
    r = pagemem_cmd(tmp_path, "train", "--resume", str(run), "--optimizer.lr", "0.1", "--train.steps", "200",
                    "--train.save_every", "1")
    assert r.returncode == 1, r.stderr
    assert "stopped: the loss is diverging at step" in r.stderr and "nats above its best" in r.stderr
    assert "lower optimizer.lr" in r.stderr and "Traceback" not in r.stderr
    assert ("engine.max_grad_norm" in r.stderr) == (lock_free == "false")  # lock-free rules clipping out
    losses = run_losses(run)
    assert all(math.isfinite(v) for v in losses) and max(losses) < 30  # finite: max_loss unset would not stop it
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = int(summary["stopped"].split("at step ")[1].split(":")[0])
    assert summary["steps_done"] == stopped_at - 1 == len(losses) < 200
    assert RunDir(str(run)).latest_step() == stopped_at - 1  # saved every step, none of the diverged step


@pytest.mark.slow
def test_a_real_run_with_a_spike_that_recovers_is_not_stopped(tmp_path):
    """lr 0.1 reached over 120 steps of warm-up: the loss learns, spikes near step 35 and
    recovers (measured on this host: 2.73 -> 3.59 -> 2.41)."""
    from tests.test_cmd_train_real import SMALL, pagemem_cmd

    r = pagemem_cmd(tmp_path, "train", *SMALL, "--engine.lock_free", "false", "--optimizer.lr", "0.1",
                    "--train.warmup_steps", "120", "--train.steps", "120", "--train.save_every", "0",
                    "--train.name", "s")
    assert r.returncode == 0, r.stderr
    losses = run_losses(tmp_path / "runs" / "s")
    assert len(losses) == 120 and losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("text,value", [("none", None), ("null", None), ("2.5", 2.5)])
def test_divergence_nats_none_from_the_command_line_turns_it_off(text, value):
    from pagemem.commands.train_config import layered, resolve

    cfg = resolve(layered([], {"train.divergence_nats": text, "engine.optimizer_tier": "cpu"}), "/tmp")
    assert cfg.train.divergence_nats == value
