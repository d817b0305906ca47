"""``pagemem train`` for real use, through the real command (a subprocess): your own data (a
tokenizer directory and a text file, a token file, a saved dataset), export that
``from_pretrained`` loads, SIGTERM at a random step and during start-up, two resumes at once,
settings given with ``--resume`` saved, a loss that is not finite, a damaged ``latest``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import pagemem
from pagemem.commands.run_dir import RunDir

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model.layers", "2", "--model.hidden", "64", "--model.heads", "2", "--model.vocab", "64", "--model.seq", "16",
         "--data.vocab", "64", "--data.seq", "16", "--data.batch", "8", "--store.page_bytes", "64KiB", "--train.progress", "false"]
SYNC = ["--engine.lock_free", "false", "--optimizer.lr", "3e-3"]


def pagemem_cmd(cwd, *argv: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "pagemem", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=kw.pop("timeout", 300), env=env, **kw)


def popen(cwd, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "pagemem", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_lines(path, n: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        time.sleep(0.02)


def weights(run: str) -> dict[str, torch.Tensor]:
    from pagemem.commands.models import build
    from pagemem.commands.train_config import resolve

    cfg = resolve(json.load(open(os.path.join(run, "config.json"))), run)
    with pagemem.Engine.load(os.path.join(run, "checkpoints"), build(cfg.model, 0).model, cfg.engine) as engine:
        return engine.state_dict()


def tokens_file(tmp_path, n=6000, vocab=64) -> str:
    path = tmp_path / "train.bin"
    rng = np.random.default_rng(0)  # a learnable stream: each token mostly follows its predecessor + 1
    x = np.cumsum(rng.integers(1, 3, n)) % vocab
    x.astype(np.uint16).tofile(path)
    return str(path)


def tiny_hf_model_with_tokenizer(tmp_path) -> tuple[str, str]:
    """A GPT-2-shaped model directory with a BPE tokenizer trained here, and a text file."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = "the cat sat on a mat and the dog ran to the red ball while birds sang in tall green trees".split()
    r = random.Random(0)
    text = "\n".join(" ".join(r.choice(words) for _ in range(12)) for _ in range(300))
    (tmp_path / "corpus.txt").write_text(text)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=80,
                                                                    special_tokens=["<unk>", "<|endoftext|>"]))
    model = tmp_path / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                         unk_token="<unk>").save_pretrained(model)
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1).save_pretrained(model)
    return str(model), str(tmp_path / "corpus.txt")


def test_a_hugging_face_model_fine_tunes_on_a_text_file_and_exports_a_directory_from_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, text = tiny_hf_model_with_tokenizer(tmp_path)
    r = pagemem_cmd(tmp_path, "train", "--model.hf", model, "--data.path", text, "--data.seq", "16", "--data.batch", "8",
                    "--data.validation", "0.1", "--train.eval_every", "10", "--train.steps", "20", "--train.export", "hf",
                    "--train.name", "t", "--train.progress", "false", "--store.page_bytes", "64KiB",
                    "--optimizer.lr", "3e-3", "--train.schedule", "cosine", "--train.warmup_steps", "5",
                    "--engine.lock_free", "true")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "t"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    assert [m["lr"] for m in metrics[:5]] == pytest.approx([3e-3 * (i + 1) / 5 for i in range(5)])
    assert metrics[-1]["lr"] == pytest.approx(3e-4) and all(m["grad_norm"] > 0 for m in metrics)  # lock-free too
    assert metrics[9]["val_loss"] is not None and metrics[-1]["val_loss"] is not None
    assert metrics[-1]["val_perplexity"] == pytest.approx(np.exp(metrics[-1]["val_loss"]))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "export")
    trained = weights(str(run))
    got = loaded.state_dict()
    assert trained.keys() == got.keys() and all(torch.equal(trained[k], got[k]) for k in trained)
    tok = transformers.AutoTokenizer.from_pretrained(run / "export")
    assert tok("the cat")["input_ids"]
    again = tmp_path / "again"
    r = pagemem_cmd(tmp_path, "export", str(run), "--out_dir", str(again), "--max_shard_bytes", "20KiB")
    assert r.returncode == 0, r.stderr
    assert os.path.exists(again / "model.safetensors.index.json")  # sharded
    got = transformers.AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(trained[k], got[k]) for k in trained)


def test_a_saved_dataset_trains(tmp_path):
    datasets = pytest.importorskip("datasets")
    model, text = tiny_hf_model_with_tokenizer(tmp_path)
    lines = open(text).read().splitlines()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines[:250]}),
                          "validation": datasets.Dataset.from_dict({"text": lines[250:]})}).save_to_disk(tmp_path / "ds")
    r = pagemem_cmd(tmp_path, "train", "--model.hf", model, "--data.path", str(tmp_path / "ds"), "--data.seq", "16",
                    "--train.steps", "6", "--train.eval_every", "3", "--train.name", "d", "--train.progress", "false",
                    "--store.page_bytes", "64KiB")
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "d" / "metrics.jsonl")]
    assert len(metrics) == 6 and metrics[2]["val_loss"] is not None


def test_sigterm_at_a_random_step_checkpoints_and_the_resumed_token_file_run_ends_as_an_uninterrupted_one(tmp_path):
    """A token file read mid-epoch: SIGTERM saves, exits 143 with a summary and no page files;
    the resumed run reads the same batches and ends with the same weights, bit for bit."""
    data = ["--data.path", tokens_file(tmp_path), "--data.batch", "16", "--data.validation", "0.1",
            "--train.eval_every", "7", "--train.schedule", "cosine", "--train.warmup_steps", "5"]
    steps, cut_at = 40, random.Random(os.getpid()).randint(3, 30)
    r = pagemem_cmd(tmp_path, "train", *SMALL, *SYNC, *data, "--train.steps", str(steps), "--train.name", "whole")
    assert r.returncode == 0, r.stderr
    proc = popen(tmp_path, "train", *SMALL, *SYNC, *data, "--train.steps", str(steps), "--train.name", "cut",
                 "--train.save_every", "0")
    run = tmp_path / "runs" / "cut"
    wait_for_lines(run / "metrics.jsonl", cut_at, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "preempted (SIGTERM) after step" in err and "Traceback" not in err
    summary = json.load(open(run / "summary.json"))
    done = len(open(run / "metrics.jsonl").read().splitlines())
    assert summary["wall_seconds"] > 0 and summary["session_steps"] == done
    assert summary["interrupted"] and summary["steps_done"] == done and cut_at <= done < steps
    assert open(run / "checkpoints" / "latest").read().strip() == f"step-{done:08d}"
    assert not [f for f in os.listdir(run / "nvme")]  # no page file left
    events = json.load(open(run / "timeline-measured.json"))["traceEvents"]
    assert {"forward", "backward", "grad norm", "update", "checkpoint", "tier used bytes",
            "moved bytes per second"} <= {e["name"] for e in events}
    r = pagemem_cmd(tmp_path, "train", "--resume", str(run))
    assert r.returncode == 0, r.stderr
    a, b = weights(str(tmp_path / "runs" / "whole")), weights(str(run))
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    times, walls = [m["time"] for m in lines], [m["wall_seconds"] for m in lines]
    assert times == sorted(times) and walls == sorted(walls)  # the resumed part goes on from the first's wall time
    losses = [m["loss"] for m in lines]
    assert losses == [json.loads(line)["loss"] for line in open(tmp_path / "runs" / "whole" / "metrics.jsonl")]


def test_sigterm_during_start_up_leaves_nothing(tmp_path):
    proc = popen(tmp_path, "train", *SMALL, "--train.steps", "5", "--train.name", "s")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.exists(tmp_path / "runs" / "s"):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert os.listdir(tmp_path / "runs") == []  # neither the run directory nor a page file


def test_two_resumes_at_once_are_refused_and_resume_settings_are_saved(tmp_path):
    r = pagemem_cmd(tmp_path, "train", *SMALL, *SYNC, "--train.steps", "4", "--train.name", "r")
    assert r.returncode == 0, r.stderr
    run = str(tmp_path / "runs" / "r")
    first = popen(tmp_path, "train", "--resume", run, "--train.steps", "60", "--data.seed", "5")
    wait_for_lines(os.path.join(run, "metrics.jsonl"), 6, first)
    second = pagemem_cmd(tmp_path, "train", "--resume", run, "--train.steps", "60")
    assert second.returncode == 2
    assert f"another pagemem train (pid {first.pid})" in second.stderr and "\n" not in second.stderr.strip()
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=120)
    saved = json.load(open(os.path.join(run, "config.json")))
    assert saved["train"]["steps"] == 60 and saved["data"]["seed"] == 5
    history = [json.loads(line) for line in open(os.path.join(run, "config-history.jsonl"))]
    assert [h["step"] for h in history] == [0, 4] and history[1]["overrides"]["train.steps"] == "60"
    steps = [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no step twice


def test_a_loss_that_is_not_finite_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    r = pagemem_cmd(tmp_path, "train", *SMALL, "--engine.lock_free", "false", "--optimizer.lr", "1e4",
                    "--train.steps", "60", "--train.save_every", "1", "--train.name", "n")
    assert r.returncode == 1, r.stderr
    assert "stopped: the" in r.stderr and "not finite" not in r.stdout.splitlines()[0]
    run = tmp_path / "runs" / "n"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]  # valid JSON: json.loads refuses NaN
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] and summary["steps_done"] < 60
    assert RunDir(str(run)).latest_step() == len(metrics) == summary["steps_done"]  # the last good step    assert all(m["loss"] is not None and np.isfinite(m["loss"]) for m in metrics)
    w = weights(str(run))
    assert all(torch.isfinite(v).all() for v in w.values())


def test_a_loss_above_max_loss_stops_the_run(tmp_path):
    r = pagemem_cmd(tmp_path, "train", *SMALL, *SYNC, "--train.steps", "5", "--train.max_loss", "0.5",
                    "--train.name", "m")
    assert r.returncode == 1 and "above train.max_loss 0.5 at step 1" in r.stderr, r.stderr
    summary = json.loads((tmp_path / "runs" / "m" / "summary.json").read_text())
    assert summary["steps_done"] == 0 and "max_loss" in summary["stopped"]


def test_a_damaged_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    r = pagemem_cmd(tmp_path, "train", *SMALL, *SYNC, "--train.steps", "4", "--train.save_every", "2",
                    "--train.keep", "2", "--train.name", "c")
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "runs" / "c" / "checkpoints"
    (ckpt / "step-00000004" / "manifest.json").write_text("{")
    r = pagemem_cmd(tmp_path, "train", "--resume", str(tmp_path / "runs" / "c"), "--train.steps", "5")
    assert r.returncode == 0, r.stderr
    assert "resuming from step-00000002, the newest intact one" in r.stderr
    steps = [json.loads(line)["step"] for line in open(tmp_path / "runs" / "c" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5]
    r = pagemem_cmd(tmp_path, "export", str(tmp_path / "runs" / "c"))  # the project's GPT: safetensors
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    exported, trained = load_file(tmp_path / "runs" / "c" / "export" / "model.safetensors"), weights(
        str(tmp_path / "runs" / "c"))
    assert all(torch.equal(exported[k], trained[k]) for k in exported) and "wte.weight" in exported
