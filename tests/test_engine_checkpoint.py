"""Checkpoints: resuming continues exactly as if training had never stopped, even after the
process is killed at a random moment (during a save included); corrupt checkpoints are refused."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import pagemem
from pagemem.models.gpt import GPT, GPTConfig

from conftest import engine_gpu_budget

PAGE = 64 * 1024
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_resume_worker.py")


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=16))


def make(tmp_path, seed=0, optimizer_tier="nvme"):
    torch.manual_seed(seed)
    model = tiny_gpt()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    # the activations plus a third of the parameters (was nbytes // 2, too small for the activations:
    # it ran over the budget, which the engine now refuses); states + activations on the gpu
    gpu = (engine_gpu_budget(model, lambda m: loss(m, batch(0)).backward(), PAGE, 1 / 3) if optimizer_tier != "gpu"
           else 4 * nbytes + 64 * PAGE)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu, cpu_bytes=16 * nbytes + 64 * PAGE,
                                nvme_bytes=16 * nbytes + 64 * PAGE, nvme_path=str(nvme))
    return model, pagemem.EngineConfig(store=store, optimizer_tier=optimizer_tier, adam_threads=1,
                                       optimizer=pagemem.AdamW(lr=3e-3, weight_decay=0.1))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1000 + step))


def loss(model, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 128), x[:, 1:].reshape(-1))


def train(engine, until: int):
    while engine.global_step < until:
        engine.backward(loss(engine, batch(engine.global_step)))
        engine.step()


def resume_and_compare(ckpt: str, model, cfg, until: int, expected, check=None) -> None:
    """Resume ``model`` from ``ckpt``, train to ``until``: the weights equal ``expected`` bit for
    bit. ``check(engine, model)`` runs right after loading."""
    with pagemem.Engine.load(ckpt, model, cfg) as engine:
        if check is not None:
            check(engine, model)
        train(engine, until)
        got = engine.state_dict()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def saved_midway(tmp_path, save_at: int, until: int, optimizer_tier="nvme"):
    """Train to ``save_at``, save, train on to ``until``; the checkpoint's path, the final weights
    and the config."""
    model, cfg = make(tmp_path, optimizer_tier=optimizer_tier)
    with pagemem.Engine(model, cfg) as engine:
        train(engine, save_at)
        path = engine.save(str(tmp_path / "ckpt"))
        train(engine, until)
        return path, engine.state_dict(), cfg


def test_resume_in_process_is_bit_identical(tmp_path):
    path, expected, _ = saved_midway(tmp_path, 4, 8)
    assert os.path.basename(path) == "step-00000004"
    fresh, _ = make(tmp_path, seed=5)  # other initial weights: everything must come from the checkpoint

    def at_step_4(engine, _model):
        assert engine.global_step == 4

    resume_and_compare(str(tmp_path / "ckpt"), fresh, None, 8, expected, at_step_4)


def test_resume_with_optimizer_states_kept_on_the_gpu_is_bit_identical(tmp_path):
    """A budget with room: the plan keeps units on the gpu with their optimizer states; the save
    reads those states there, and the resumed engine (states home until its first plan places
    them again) trains on exactly as the uninterrupted one."""
    model, cfg = make(tmp_path, optimizer_tier="cpu")
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, gpu_bytes=6 * nbytes))
    with pagemem.Engine(model, cfg) as engine:
        train(engine, 3)
        assert engine.stats()["gpu_state_units"] > 0
        engine.save(str(tmp_path / "ckpt"))
        train(engine, 7)
        expected = engine.state_dict()
    fresh, _ = make(tmp_path, seed=5)
    resume_and_compare(str(tmp_path / "ckpt"), fresh, cfg, 7, expected)


def test_a_corrupt_checkpoint_is_refused(tmp_path):
    model, cfg = make(tmp_path)
    with pagemem.Engine(model, cfg) as engine:
        train(engine, 2)
        path = engine.save(str(tmp_path / "ckpt"))
    with open(os.path.join(path, "exp_avg.pages"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh, _ = make(tmp_path)
    with pytest.raises(pagemem.CorruptPage, match="exp_avg"):
        pagemem.Engine.load(str(tmp_path / "ckpt"), fresh, cfg)


def test_saving_mid_accumulation_is_refused_and_leftovers_are_ignored(tmp_path):
    model, cfg = make(tmp_path)
    import dataclasses
    cfg = dataclasses.replace(cfg, accumulation_steps=2)
    with pagemem.Engine(model, cfg) as engine:
        x = torch.randint(0, 128, (2, 17))
        engine.backward(torch.nn.functional.cross_entropy(engine(x[:, :-1]).reshape(-1, 128), x[:, 1:].reshape(-1)))
        with pytest.raises(pagemem.InvalidRequest, match="accumulation"):
            engine.save(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "step-00000009.tmp-deadbeef").mkdir()  # a save that crashed
    with pytest.raises(pagemem.InvalidRequest, match="no checkpoint"):
        pagemem.Engine.load(str(tmp_path / "ckpt"), tiny_gpt(), cfg)


def _run(tmp_path, out: str, save: bool, kill_after=None, steps: int = 8) -> subprocess.CompletedProcess | None:
    cmd = [sys.executable, WORKER, "--ckpt", str(tmp_path / "ckpt"), "--nvme_path", str(tmp_path / "nvme"),
           "--out_dir", str(tmp_path / out), "--steps", str(steps)] + (["--save"] if save else [])
    (tmp_path / "nvme").mkdir(exist_ok=True)
    if kill_after is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    kind, value = kill_after
    if kind == "during_save":  # kill right after the n-th save begins
        seen = 0
        for line in proc.stdout:
            if line.startswith("saving"):
                seen += 1
                if seen == value[0]:
                    time.sleep(value[1])
                    break
    else:
        time.sleep(value)
    proc.kill()
    proc.wait(timeout=60)
    proc.stdout.close()
    return None


def _weights(path) -> dict[str, np.ndarray]:
    return {name: np.fromfile(os.path.join(path, name), dtype=np.float32) for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_at_a_random_moment_resumes_to_the_uninterrupted_result(tmp_path, seed):
    rng = random.Random(seed)
    (tmp_path / "a").mkdir()
    _run(tmp_path / "a", "out", save=False)
    expected = _weights(tmp_path / "a" / "out")
    work = tmp_path / "b"
    work.mkdir()
    kills = [("during_save", (rng.randint(1, 6), rng.random() * 0.05)), ("time", 2.0 + rng.random() * 4.0)]
    for kill in kills:
        _run(work, "unused", save=True, kill_after=kill)
    _run(work, "out", save=True)
    got = _weights(work / "out")
    assert got.keys() == expected.keys()
    for k in expected:
        assert np.array_equal(got[k], expected[k]), k


def crash_loop(tmp_path, kills: int, steps: int, seed: int) -> None:
    """``kills`` SIGKILLs, each during a save or between them, each followed by a resume; then
    a run to the end: its weights are the uninterrupted run's, and no page file is left (the
    killed processes' were removed by the next store, the last one's by its close)."""
    rng = random.Random(seed)
    (tmp_path / "a").mkdir()
    _run(tmp_path / "a", "out", save=False, steps=steps)
    work = tmp_path / "b"
    work.mkdir()
    for _ in range(kills):
        kill = ("during_save", (rng.randint(1, 2), rng.random() * 0.05))
        _run(work, "unused", save=True, kill_after=kill, steps=steps)
    _run(work, "out", save=True, steps=steps)
    expected, got = _weights(tmp_path / "a" / "out"), _weights(work / "out")
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    assert os.listdir(work / "nvme") == []
    assert not [n for n in os.listdir(work / "ckpt") if ".tmp" in n]


def test_four_sigkills_in_a_row_resume_to_the_uninterrupted_result(tmp_path):
    crash_loop(tmp_path, kills=4, steps=8, seed=3)


@pytest.mark.slow
def test_twenty_sigkills_in_a_row_resume_to_the_uninterrupted_result(tmp_path):
    crash_loop(tmp_path, kills=20, steps=30, seed=4)


def test_a_model_built_on_meta_resumes_from_a_checkpoint(tmp_path):
    _, expected, cfg = saved_midway(tmp_path, 3, 6)
    with torch.device("meta"):
        empty = tiny_gpt()
    with pytest.raises(pagemem.InvalidRequest, match="meta"):
        pagemem.Engine(empty, cfg)
    with torch.device("meta"):
        empty = tiny_gpt()

    def tied_and_real(_engine, model):
        assert model.head.weight is model.wte.weight  # still tied
        assert all(not p.is_meta for p in model.parameters())

    resume_and_compare(str(tmp_path / "ckpt"), empty, cfg, 6, expected, tied_and_real)


def test_fp32_states_on_the_gpu_resume_into_a_model_on_meta(tmp_path):
    """fp32 beside states on the gpu: the parameters are the master pages, which the checkpoint
    fills (no compute copy to refresh)."""
    _, expected, cfg = saved_midway(tmp_path, 3, 6, optimizer_tier="gpu")
    with torch.device("meta"):
        empty = tiny_gpt()

    def reads_the_checkpoint(engine, model):
        ckpt_weights = engine.state_dict()
        with torch.no_grad():  # an evaluation forward binds the parameters (and they stay bound)
            engine(torch.zeros(1, 4, dtype=torch.long))
        for name, p in model.named_parameters():
            assert p.numel() == 1 or p.stride() != (0,) * p.dim(), name  # real pages, not a placeholder
            assert torch.equal(p.detach(), ckpt_weights[name]), name

    resume_and_compare(str(tmp_path / "ckpt"), empty, cfg, 6, expected, reads_the_checkpoint)


def test_saving_twice_at_one_step_never_removes_the_checkpoint_latest_names(tmp_path):
    model, cfg = make(tmp_path)
    with pagemem.Engine(model, cfg) as engine:
        train(engine, 2)
        first = engine.save(str(tmp_path / "ckpt"))
        second = engine.save(str(tmp_path / "ckpt"))
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    with open(tmp_path / "ckpt" / "latest") as f:
        assert f.read() == os.path.basename(second)


def test_save_keeps_the_newest_checkpoints_it_is_asked_to(tmp_path):
    """``save(keep=2)``: older checkpoints go; the one ``latest`` names never does; a second
    save at one step counts as newer."""
    model, cfg = make(tmp_path)
    with pagemem.Engine(model, cfg) as engine:
        for step in range(1, 4):
            train(engine, step)
            engine.save(str(tmp_path / "ckpt"), keep=2)
        again = engine.save(str(tmp_path / "ckpt"), keep=2)
        with pytest.raises(pagemem.ConfigError, match="keep"):
            engine.save(str(tmp_path / "ckpt"), keep=0)
    names = sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith("step-"))
    assert len(names) == 2 and "step-00000003" in names and os.path.basename(again) in names
    assert open(tmp_path / "ckpt" / "latest").read().strip() == os.path.basename(again)
