"""``pagemem train``'s inputs and pieces without a run: text fields stay text, the config TOML
round-trips any name, errors name the dotted field, the learning-rate schedule, the batches of
your own data (a pure function of the index: resume mid-epoch reads the same), the run lock,
NaN as null, ``--help_config`` describes the settings."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.commands.run_dir import RunDir, _json
from pagemem.commands.train_config import layered, resolve, to_toml
from pagemem.commands.train_data import Batches, DataSettings
from pagemem.commands.train_schedule import lr_factor
from tests.conftest import exit_status


CPU = {"engine.optimizer_tier": "cpu"}
"""Optimizer states in memory: no page files, no nvme_path to make."""


@pytest.mark.parametrize("text", ["2024", "true", "2024-05-01", "1e3", "[1, 2]", "none-of-it"])
def test_text_fields_take_the_text_as_given(text):
    plain = layered([], {"train.name": text, "data.text_key": text})
    assert plain["train"]["name"] == text and plain["data"]["text_key"] == text
    assert resolve(layered([], {"train.name": text, **CPU}), "/tmp").train.name == text
    assert layered([], {"train.name": "none"})["train"]["name"] is None  # an optional text field: unset
    assert layered([], {"optimizer.lr": "3e-4"})["optimizer"]["lr"] == 3e-4  # numbers stay numbers


@settings(max_examples=30, deadline=None)
@given(st.text(min_size=1, max_size=30).filter(lambda s: "/" not in s and s not in (".", "..")))
def test_a_name_is_refused_or_round_trips_through_config_toml(name):
    try:
        cfg = resolve(layered([], {"train.name": name, **CPU}), "/tmp")
    except pagemem.ConfigError as exc:
        assert str(exc).startswith("train.name:") and not name.isprintable()
        return
    assert name.isprintable()
    if name.lower() in ("none", "null"):  # an optional text field's way to say unset
        assert cfg.train.name is None
        return
    assert tomllib.loads(to_toml(cfg.to_plain()))["train"]["name"] == name


@pytest.mark.parametrize("argv,needle", [
    (["--train.name", "a\nb"], "train.name: must be a directory name of printable characters"),
    (["--store.gpu_bytes", "1PiB"], "store.gpu_bytes:"),
    (["--engine.compute_dtype", "float16", "--engine.lock_free", "true"], "give --engine.lock_free false"),
    (["--train.schedule", "step"], "train.schedule: must be one of 'constant', 'linear', 'cosine'"),
    (["--data.validation", "1.5"], "data.validation: must be a fraction in [0, 1)"),
    (["--data.path", "/does/not/exist"], "data.path: /does/not/exist does not exist"),
    (["--train.export", "hf"], 'train.export: "hf" needs model.hf'),
    (["--model.layers", "200", "--model.hidden", "8192", "--model.heads", "64"], "model: its weights take"),
])
def test_errors_name_the_dotted_field(tmp_path, capsys, argv, needle):
    small = ["--model.layers", "1", "--model.hidden", "32", "--model.heads", "1", "--model.vocab", "32", "--model.seq",
             "8", "--data.vocab", "32", "--data.seq", "8", "--store.page_bytes", "64KiB"]
    rc = exit_status("train", "--train.runs", str(tmp_path / "runs"), "--train.steps", "1", "--train.progress", "false",
                     *small, *argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and "\n" not in err, err
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


def test_train_runs_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert exit_status("train", "--train.runs", str(tmp_path / "afile"), "--train.steps", "1") == 2
    assert "train.runs: " in capsys.readouterr().err


def test_help_config_shows_every_default_and_describes_the_settings(capsys):
    assert exit_status("train", "--help_config") == 0
    lines = capsys.readouterr().out.splitlines()
    settings_ = [i for i, line in enumerate(lines) if line.startswith("  --")]
    assert len(settings_) > 55 and not any("(the field's default)" in line for line in lines)
    described = [i for i in settings_ if i + 1 < len(lines) and lines[i + 1].startswith("      ")]
    assert len(described) >= 0.9 * len(settings_)
    assert any("--data.path" in lines[i] for i in described)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 500), st.integers(0, 100), st.sampled_from(["constant", "linear", "cosine"]),
       st.floats(0, 1), st.data())
def test_the_schedule_warms_up_then_ends_at_its_floor(steps, warmup, schedule, floor, data):
    step = data.draw(st.integers(0, steps - 1))
    f = lr_factor(step, steps, schedule, warmup, floor)
    if step < warmup:
        assert f == pytest.approx((step + 1) / warmup)
    elif schedule == "constant":
        assert f == 1.0
    else:
        assert floor - 1e-12 <= f <= 1.0 + 1e-12
        if step == steps - 1:
            assert f == pytest.approx(floor)
        if step + 1 < steps:  # never rises after warm-up
            assert lr_factor(step + 1, steps, schedule, warmup, floor) <= f + 1e-12


def _token_file(tmp_path, n=1000, vocab=50):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16).tofile(path)
    return str(path)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 5), st.sampled_from([0.0, 0.1, 0.3]), st.integers(0, 3))
def test_token_batches_are_a_pure_function_of_the_index_and_each_epoch_reads_every_window_once(
        seq, batch, validation, seed):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.bin")
        tokens = np.arange(200, dtype=np.uint16)  # token k is its own position: windows are identifiable
        tokens.tofile(path)
        data = DataSettings(path=path, seq=seq, batch=batch, validation=validation, seed=seed)
        a, b = Batches(data), Batches(data)
        n_train = len(a._train)
        rows = [a.train(i) for i in range(3 * n_train // batch + 2)]
        for i in (5, 0, 3):  # another reader, jumping about (a resume mid-epoch), reads the same
            assert b.train(i).equal(rows[i]) if i < len(rows) else True
        starts = [int(r[0]) for x in rows for r in x]
        first_epoch = starts[:n_train]
        assert sorted(first_epoch) == [k * seq for k in range(n_train)]
        for x in rows:  # each row is seq + 1 consecutive tokens
            assert (x[:, 1:] - x[:, :-1] == 1).all()
        if a.validation_windows:
            held = {int(a.validation(k)[r, 0]) for k in range(4) for r in range(batch)}
            assert held.isdisjoint(set(starts)) and min(held) >= n_train * seq


def test_a_token_id_beyond_the_model_vocabulary_is_named(tmp_path):
    batches = Batches(DataSettings(path=_token_file(tmp_path, vocab=50), seq=8, batch=2), vocab_limit=10)
    with pytest.raises(pagemem.ConfigError, match="data.path: token id"):
        batches.train(0)


def test_a_token_file_of_odd_length_is_named(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(pagemem.ConfigError, match="data.token_dtype"):
        Batches(DataSettings(path=str(tmp_path / "odd.bin"), seq=1, batch=1))


def test_a_run_directory_has_one_writer(tmp_path):
    a, b = RunDir(str(tmp_path)), RunDir(str(tmp_path))
    a.lock()
    with pytest.raises(pagemem.ConfigError, match=rf"another pagemem train \(pid {os.getpid()}\)"):
        b.lock()
    a.unlock()
    b.lock()  # free again
    b.unlock()


def test_nan_and_infinities_are_written_as_null():
    text = _json({"loss": math.nan, "x": [math.inf, 1.0], "y": {"z": -math.inf}})
    assert json.loads(text) == {"loss": None, "x": [None, 1.0], "y": {"z": None}}


@pytest.mark.slow
def test_a_periodic_checkpoint_that_finds_the_disk_full_is_reported_and_training_goes_on(tmp_path, capsys,
                                                                                         monkeypatch):
    import errno

    real = pagemem.Engine.save
    calls = []

    def full_disk_once(self, directory, keep=None):
        calls.append(self.global_step)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, directory, keep)

    monkeypatch.setattr(pagemem.Engine, "save", full_disk_once)
    rc = exit_status("train", "--train.runs", str(tmp_path / "runs"), "--train.steps", "6", "--train.save_every", "2",
                     "--train.progress", "false", "--train.name", "f", "--model.layers", "1", "--model.hidden", "32",
                     "--model.heads", "1", "--model.vocab", "32", "--model.seq", "8", "--data.vocab", "32",
                     "--data.seq", "8", "--store.page_bytes", "64KiB")
    err = capsys.readouterr().err
    assert rc == 0 and calls == [2, 4, 6]
    assert "the checkpoint of step 4 failed" in err and "last checkpoint is step 2" in err
    assert RunDir(str(tmp_path / "runs" / "f")).latest_step() == 6


def test_metrics_go_to_csv_always_and_to_tensorboard_where_installed(tmp_path):
    rd = RunDir(str(tmp_path))
    metrics = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "tier_used_bytes": {"gpu": 4096 * s}, "val_loss": None}
               for s in (1, 2, 3)]
    rd.write_csv(metrics)
    text = (tmp_path / "metrics.csv").read_text().splitlines()
    assert text[0] == "step,loss,lr,tier_used_bytes.gpu,val_loss" and text[3].startswith("3,0.333")
    pytest.importorskip("tensorboard")
    assert rd.write_tensorboard(metrics)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.step for e in events.Scalars("tier_used_bytes/gpu")] == [1, 2, 3]


def test_page_files_of_a_killed_run_are_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "nvme").mkdir()
    for name in (f"pagemem-{gone}-ab.pages", f"pagemem-{os.getpid()}-cd.pages", "notes.txt"):
        (tmp_path / "nvme" / name).write_text("x")
    assert RunDir(str(tmp_path)).remove_stale_page_files() == [f"pagemem-{gone}-ab.pages"]
    assert sorted(os.listdir(tmp_path / "nvme")) == ["notes.txt", f"pagemem-{os.getpid()}-cd.pages"]


def test_a_text_directory_is_read_in_order_without_hidden_files_each_document_ending_with_eos(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from pagemem.commands.train_corpus import load_corpus

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "[UNK]": 4},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / ".hidden").mkdir()
    (docs / "1.txt").write_text("a b")
    (docs / "sub" / "2.md").write_text("c c a")
    (docs / ".hidden" / "3.txt").write_text("b b b")
    (docs / "image.png").write_bytes(b"\x89PNG")
    data = DataSettings(path=str(docs), tokenizer=str(tmp_path / "tokenizer.json"), seq=2, batch=1)
    corpus = load_corpus(data, None)
    assert corpus.train.tolist() == [1, 2, 0, 3, 3, 1, 0] and corpus.vocab == 5
    with pytest.raises(pagemem.ConfigError, match="data.tokenizer: text needs a tokenizer"):
        load_corpus(DataSettings(path=str(docs), seq=2, batch=1), None)


@pytest.mark.slow
def test_a_disk_without_room_for_keep_checkpoints_is_refused_at_start(tmp_path, capsys, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    rc = exit_status("train", "--train.runs", str(tmp_path / "runs"), "--train.steps", "2", "--train.progress",
                     "false", "--model.layers", "1", "--model.hidden", "32", "--model.heads", "1", "--model.vocab",
                     "32", "--model.seq", "8", "--data.vocab", "32", "--data.seq", "8", "--store.page_bytes", "64KiB")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("pagemem train: ConfigError: train.keep: 2 checkpoints") and "\n" not in err
    assert os.listdir(tmp_path / "runs") == []
