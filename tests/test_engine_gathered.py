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
    ours = run_ok("engine", world, tmp_path / "gathered.pt", nvme=nvme, shard_params=1, weights_dir=tmp_path / "hf")
    stats = torch.load(tmp_path / "gathered.pt")
    replicas = run_ok("engine", world, tmp_path / "replicas.pt", nvme=nvme)
    assert distance(ours, replicas) == 0.0  # the same arithmetic: only where the compute copy lives differs
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[k], ours[k]) for k in saved) and len(saved) >= len(ours) - 1
    assert stats["stats"]["gathered_units"] > 0
    ddp = run_ok("ddp", world, tmp_path / "ddp.pt")
    if world == 2:
        assert distance(ours, ddp) == 0.0
    else:
        assert distance(ours, ddp) <= max(4 * distance(ddp, plain()), 1e-6)
