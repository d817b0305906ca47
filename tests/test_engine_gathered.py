"""Sharded parameters ([Note: gathered units], ``EngineConfig.shard_parameters``): gloo ranks
spawned as processes (``ranks_worker.py``) keep only their share of each compute copy at rest,
gather a unit when it is fetched, and train as the replicated engine and as torch's
``DistributedDataParallel`` do (tolerances: ``test_engine_ranks.py``'s module docs)."""

from __future__ import annotations

import sys

import pytest
import torch

from test_engine_ranks import WORKER, distance, launch, plain, run_ok, weights


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_parameters_train_as_replicas_and_as_ddp(tmp_path, world):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ours = run_ok("engine", world, tmp_path / "gathered.pt", nvme=nvme, shard_params=1, weights_dir=tmp_path / "hf",
                  state_dict_too=1)
    stats = torch.load(tmp_path / "gathered.pt")
    replicas = run_ok("engine", world, tmp_path / "replicas.pt", nvme=nvme)
    assert distance(ours, replicas) == 0.0  # the same arithmetic: only where the compute copy lives differs
    # no compute copy at rest (the replicated engine keeps the whole one on every rank)
    assert stats["compute_at_rest"] == 0 and torch.load(tmp_path / "replicas.pt")["compute_at_rest"] > 0
    module = stats["module_weights"]  # model.state_dict() on every rank: the same values
    assert all(torch.equal(module[k], ours[k].to(module[k].dtype)) for k in ours)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[k], ours[k]) for k in saved) and len(saved) >= len(ours) - 1
    assert stats["stats"]["gathered_units"] > 0
    ddp = run_ok("ddp", world, tmp_path / "ddp.pt")
    if world == 2:
        assert distance(ours, ddp) == 0.0
    else:
        assert distance(ours, ddp) <= max(4 * distance(ddp, plain()), 1e-6)


def test_writes_between_steps_and_a_checkpoint_resumed_with_one_and_two_ranks(tmp_path):
    """``p.data.mul_`` between steps on every rank (each fetch a gather, each rank keeping the
    elements it owns); a checkpoint saved with sharded parameters resumes with 2 ranks sharded,
    2 ranks replicated and 1 process, each equal to the uninterrupted run."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    whole = run_ok("engine", 2, tmp_path / "whole.pt", nvme=nvme, shard_params=1, halve_at=3)
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", nvme=nvme, halve_at=3)
    assert distance(whole, replicas) == 0.0
    saved = run_ok("engine", 2, tmp_path / "saved.pt", nvme=nvme, shard_params=1, halve_at=3, save_dir=ckpt, save_at=5)
    assert distance(saved, whole) == 0.0
    for world, sharded in ((2, 1), (2, 0), (1, 0)):
        resumed = run_ok("engine", world, tmp_path / f"resumed{world}{sharded}.pt", nvme=nvme, shard_params=sharded,
                         resume=ckpt)
        assert distance(resumed, whole) <= (0.0 if world == 2 else 1e-6), (world, sharded)
