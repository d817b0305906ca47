"""The examples in ``examples/`` run, at small sizes, and do what they say."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib

import pytest

from pagemem.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
SMALL = ["--layers", "2", "--hidden", "64", "--seq", "32", "--batch", "8"]


def example(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``examples/<name>`` as a user would, this checkout's pagemem first on the path."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)


def test_adopt_existing_loop_matches_plain_pytorch():
    r = example("adopt_existing_loop.py", "--steps", "6", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "against plain PyTorch on the same batches: bit-identical" in r.stdout
    paged = int(r.stdout.split("layers paged in: ")[1].split(" KiB")[0])
    assert paged > 0  # the gpu budget made layers move


def test_adopt_existing_loop_changes_five_lines():
    source = open(os.path.join(EXAMPLES, "adopt_existing_loop.py")).read()
    marked = [ln.strip() for ln in source.splitlines() if "# pagemem" in ln]
    assert len(marked) == 5, marked
    for call in ("pagemem.StoreConfig(", "pagemem.EngineConfig(", "pagemem.Engine(model", "engine.backward(loss)",
                 "engine.step()"):
        assert any(call in ln for ln in marked), call


def test_huggingface_gpt2_trains_with_states_on_nvme():
    pytest.importorskip("transformers")
    r = example("huggingface_gpt2.py", "--steps", "4", *SMALL)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    read = int(out.split("optimizer states on nvme: ")[1].split("read ")[1].split(" KiB")[0])
    assert read > 0 and ".pages" in out  # the states really went through page files
    assert "round trip: same weights" in out


def test_huggingface_gpt2_without_transformers_skips(tmp_path):
    (tmp_path / "transformers.py").write_text("raise ImportError('no transformers here')\n")
    r = example("huggingface_gpt2.py", "--steps", "1", *SMALL, env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("skipped: transformers is not installed") and "Traceback" not in r.stderr


def test_lock_free_prints_staleness():
    r = example("lock_free.py", "--steps", "6", *SMALL)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("staleness: "))
    staleness = ast.literal_eval(line[len("staleness: "):])  # the dict engine.stats() returned
    assert staleness["iterations"] == 6 and staleness["max"] >= 0 and sum(staleness["histogram"].values()) > 0


def test_train_toml_runs(tmp_path):
    config = os.path.join(EXAMPLES, "train.toml")
    code = main(["train", "--config", config, "--train.runs", str(tmp_path), "--train.steps", "5",
                 "--train.progress", "false"])
    assert code == 0
    (run,) = os.listdir(tmp_path)
    summary = json.load(open(tmp_path / run / "summary.json"))
    assert summary["steps_done"] == 5 and summary["staleness"] is None  # synchronous, as the file says
    saved = json.load(open(tmp_path / run / "config.json"))
    with open(config, "rb") as f:
        given = tomllib.load(f)
    for section in ("model", "data", "engine", "optimizer"):
        assert {k: saved[section][k] for k in given[section]} == given[section], section
    assert saved["optimizer"]["lr"] == 3e-3 and saved["store"]["page_bytes"] == 64 << 10  # not the default's


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # on a loaded 2-core machine more threads make torch's ops ten times slower


@pytest.mark.slow
def test_hf_trainer_example_trains_through_the_engine_and_checkpoints_it():
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    r = example("hf_trainer.py", "--steps", "12", env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    held = next(ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint-10 holds "))
    assert "'pagemem'" in held and "optimizer.pt" not in held
    paged = int(r.stdout.split("layers paged in: ")[1].split(" KiB")[0])
    read = int(r.stdout.split("read from nvme: ")[1].split(" KiB")[0])
    assert paged > 0 and read > 0


@pytest.mark.slow
def test_lightning_example_resumes_from_last():
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    r = example("lightning_strategy.py", "--steps", "20", env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "'latest', 'lightning-00000010.pt', 'step-00000010'" in r.stdout
    assert "step   20  loss" in r.stdout and "(resumed from last.ckpt)" in r.stdout
    paged = int(r.stdout.split("layers paged in: ")[1].split(" KiB")[0])
    assert paged > 0


@pytest.mark.slow
def test_integration_examples_skip_without_their_framework(tmp_path):
    (tmp_path / "transformers.py").write_text("raise ImportError('no transformers here')\n")
    for name, says in (("hf_trainer.py", "pagemem[hf]"), ("lightning_strategy.py", "pagemem[lightning,hf]")):
        r = example(name, "--steps", "1", env={"PYTHONPATH": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("skipped: ") and says in r.stdout and "Traceback" not in r.stderr
