"""Sharded parameters ([Note: gathered units], ``EngineConfig.shard_parameters``): gloo ranks
spawned as processes (``ranks_worker.py``) keep only their share of each compute copy at rest,
gather a unit when it is fetched, and train as the replicated engine and as torch's
``DistributedDataParallel`` do (tolerances: ``test_engine_ranks.py``'s module docs)."""

from __future__ import annotations

import pytest
import torch

from test_engine_ranks import distance, launch, plain, run_ok


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_parameters_train_as_replicas_and_as_ddp(tmp_path, world):
    """Without clipping, bit for bit as the replicated engine and DDP at 2 ranks (each element's
    average is ``a/2 + b/2`` whether all-reduced or reduce-scattered)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ours = run_ok("engine", world, tmp_path / "gathered.pt", nvme=nvme, shard_params=1, weights_dir=tmp_path / "hf",
                  state_dict_too=1, clip="none")
    stats = torch.load(tmp_path / "gathered.pt")
    replicas = run_ok("engine", world, tmp_path / "replicas.pt", nvme=nvme, clip="none")
    ddp = run_ok("ddp", world, tmp_path / "ddp.pt", clip="none")
    # 3 ranks: gloo's reduce-scatter sums in another order than its all-reduce: within DDP's own
    # distance from one process (an element whose gradient is near zero moves by up to 2 lr in Adam)
    exact = 0.0 if world == 2 else max(4 * distance(ddp, plain(clip=None)), 1e-6)
    assert distance(ours, replicas) <= exact
    # no compute copy at rest (the replicated engine keeps the whole one on every rank), and a
    # share of the gradient sums: each unit reduce-scattered as its backward finished
    assert stats["compute_at_rest"] == 0 and torch.load(tmp_path / "replicas.pt")["compute_at_rest"] > 0
    whole_sums = torch.load(tmp_path / "replicas.pt")["grad_at_rest"]
    assert stats["grad_at_rest"] < whole_sums / (world - 0.5)
    # ... and at its peak, the shares and the local buffers of the units in flight: less than whole sums
    assert stats["stats"]["grad_scatters_early"] > 0
    assert 0 < stats["stats"]["grad_local_peak_bytes"] and stats["grad_at_rest"] + stats["stats"]["grad_local_peak_bytes"] < whole_sums
    module = stats["module_weights"]  # model.state_dict() on every rank: the same values
    assert all(torch.equal(module[k], ours[k].to(module[k].dtype)) for k in ours)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[k], ours[k]) for k in saved) and len(saved) >= len(ours) - 1
    assert stats["stats"]["gathered_units"] > 0
    # a planned iteration sends what its plan (``sharding="units"``: each move's gather, each
    # unit's reduce-scatter) says, to the byte, the headers apart
    last = stats["sent_steps"][-1] - stats["sent_steps"][-2]
    assert last == stats["plan_network"] > 0
    # the plan's moves start the gathers ahead of their units' compute, which finds them landed
    assert stats["paging"]["prefetches"] > 0 and stats["paging"]["misses"] < stats["stats"]["gathered_units"]
    assert distance(ours, ddp) <= exact


@pytest.mark.slow  # make test's 10 minutes
def test_clipping_by_the_global_norm_of_the_shares_is_within_ddps_own_distance(tmp_path):
    """``max_grad_norm``: the global norm summed from every rank's share of the sums ([Note:
    sharded gradient sums]), another reduction order than torch's, so not bit for bit."""
    clipped = run_ok("engine", 2, tmp_path / "clipped.pt", shard_params=1)
    ddp_clipped = run_ok("ddp", 2, tmp_path / "ddp_clipped.pt")
    assert distance(clipped, ddp_clipped) <= max(4 * distance(ddp_clipped, plain()), 1e-6)


def test_ranks_with_batches_of_their_own_shapes_train_as_ddp(tmp_path):
    """Each rank pads its batch to its own length ([Note: ranks page alike]): iterations whose
    inputs differ across ranks are paged on demand by module scope on every rank, those alike
    (steps 3 and 7) traced and then planned; bit for bit as DDP on the same batches."""
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, ragged=1, clip="none")
    paging = torch.load(tmp_path / "gathered.pt")["paging"]["iterations"]
    assert paging["unalike"] == 6 and paging["traced"] == 1 and paging["planned"] == 1, paging
    ddp = run_ok("ddp", 2, tmp_path / "ddp.pt", ragged=1, clip="none")
    assert distance(ours, ddp) == 0.0


@pytest.mark.slow  # make test's 10 minutes
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """An inf in one rank's loss is in that rank's gradients only, which each rank holds a share
    of after the reduce-scatter: the ranks agree on the overflow (``all_finite``), skip the step
    together and back the loss scale off alike."""
    run_ok("loop", 2, tmp_path / "o.pt", loop="fp16", shard_params=1)
    runs = [torch.load(tmp_path / f"o.pt.r{r}") for r in range(2)]
    assert [r["skipped"] for r in runs] == [1, 1]
    assert runs[0]["loss_scale"] == runs[1]["loss_scale"] < 65536.0
    assert distance(runs[0]["weights"], runs[1]["weights"]) == 0.0


@pytest.mark.slow  # make test's 10 minutes
def test_a_cpu_budget_that_holds_no_compute_copy_is_planned(tmp_path):
    """``cpu_bytes`` of 28 MiB holds this model's sharded states and gradient sums (27.7 MiB)
    but not a whole compute copy beside them: the iterations still follow a plan (the plan's
    phantom compute copy at home is budgeted on top), not pages on demand."""
    run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, clip="none", cpu_bytes=28 << 20)
    iterations = torch.load(tmp_path / "gathered.pt")["paging"]["iterations"]
    assert iterations.get("planned") == 7 and "demand" not in iterations, iterations


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_writes_between_steps_and_a_checkpoint_resumed_with_one_and_two_ranks(tmp_path):
    """``p.data.mul_`` between steps on every rank (each fetch a gather, each rank keeping the
    elements it owns); a checkpoint saved with sharded parameters resumes with 2 ranks sharded,
    2 ranks replicated and 1 process, each equal to the uninterrupted run."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    whole = run_ok("engine", 2, tmp_path / "whole.pt", nvme=nvme, shard_params=1, halve_at=3, clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", nvme=nvme, halve_at=3, clip="none")
    assert distance(whole, replicas) == 0.0
    saved = run_ok("engine", 2, tmp_path / "saved.pt", nvme=nvme, shard_params=1, halve_at=3, save_dir=ckpt, save_at=5, clip="none")
    assert distance(saved, whole) == 0.0
    one = max(4 * distance(run_ok("ddp", 2, tmp_path / "ddp.pt", clip="none"), plain(clip=None)), 1e-6)
    for world, sharded in ((2, 1), (2, 0), (1, 0)):
        resumed = run_ok("engine", world, tmp_path / f"resumed{world}{sharded}.pt", nvme=nvme, shard_params=sharded,
                         resume=ckpt, clip="none")
        # one process: its mean over the combined batch is another reduction order than 2 ranks'
        assert distance(resumed, whole) <= (0.0 if world == 2 else one), (world, sharded)


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_a_bf16_model_with_sharded_parameters_trains_as_replicas(tmp_path):
    """Each rank sends the bf16 bits of its share (its master cast), which are the bits every
    replica's compute copy holds."""
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, precision="bf16", clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", precision="bf16", clip="none")
    assert distance(ours, replicas) == 0.0
    assert distance(ours, {k: v * 0 for k, v in ours.items()}) > 1e-3


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_a_rank_killed_in_forward_makes_the_other_fail_naming_it(tmp_path):
    """The survivor waits in the next unit's gather: ``RankFailed`` naming the dead rank, within
    the liveness bound, not the collective timeout."""
    rcs, errs, after = launch("kill", 2, tmp_path / "k.pt", timeout=120, victim=1, shard_params=1)
    assert rcs[1] == -9 and rcs[0] not in (0, None) and after < 60
    assert "RankFailed" in errs[0] and "rank(s) 1 stopped" in errs[0], errs[0][-2000:]


def test_a_parameter_read_on_one_rank_alone_fails_every_rank_instead_of_hanging(tmp_path):
    """A rank-0 habit between steps (reading a parameter that is not resident) is a gather the
    other rank does not make: both raise ``RankFailed`` naming what they were at."""
    rcs, errs, after = launch("engine", 2, tmp_path / "r.pt", timeout=120, shard_params=1, read_on=0, at=2,
                              collective_timeout=20)
    assert rcs[0] not in (0, None) and rcs[1] not in (0, None), errs
    for err in errs:
        assert "RankFailed" in err and "different" in err, err[-2000:]


@pytest.mark.parametrize("loop", [pytest.param("habit", marks=pytest.mark.slow),  # make test's 10 minutes
                                  pytest.param("accum", marks=pytest.mark.slow)])
def test_loop_habits_with_sharded_parameters_equal_ddp(tmp_path, loop):
    """``loss.backward()``, clipping by hand over ``model.parameters()`` (each ``p.grad``'s norm
    a collective over the shares), ``optimizer.step()``/``zero_grad()``; accumulation over two
    micro-batches (each reduce-scattered, as FSDP2 does, where DDP's ``no_sync`` sums first).
    Both change a reduction order ([Note: sharded gradient sums]): within DDP's own distance from
    one process on the combined batch."""
    ours = run_ok("loop", 2, tmp_path / "ours.pt", loop=loop, shard_params=1)
    ddp = run_ok("loop-ddp", 2, tmp_path / "ddp.pt", loop=loop)
    assert distance(ours, ddp) <= max(4 * distance(ddp, plain()), 1e-6)
    assert distance(ours, {k: v * 0 for k, v in ours.items()}) > 1e-3


@pytest.mark.slow  # make test's 10 minutes
def test_a_parameter_reached_on_some_ranks_only_trains_as_ddp(tmp_path):
    """A block every rank runs, whose ``extra`` parameter only some ranks' batches reach (told
    by the data: the inputs' signatures are alike): the block's unit is ready on some ranks only,
    so no rank sends it before the others agree, and it goes at the end of backward, ``extra``
    taking the average of the ranks that reached it ([Note: sharded gradient sums]). Bit for bit
    as DDP with ``find_unused_parameters``."""
    ours = run_ok("unused", 2, tmp_path / "ours.pt", shard_params=1, inner=1)
    ddp = run_ok("unused-ddp", 2, tmp_path / "ddp.pt", inner=1)
    assert distance(ours, ddp) == 0.0


def test_a_module_run_on_some_ranks_only_fails_every_rank_loudly(tmp_path):
    """A head one rank's batch skips (as a mixture of experts routes) is a gather the other rank
    does not make: every rank raises ``RankFailed`` within the liveness bound, none hangs (the
    replicated engine trains this model as DDP with ``find_unused_parameters`` does)."""
    rcs, errs, after = launch("unused", 2, tmp_path / "u.pt", timeout=120, shard_params=1)
    assert rcs[0] not in (0, None) and rcs[1] not in (0, None)
    assert all("RankFailed" in e and "same modules in the same order" in e for e in errs), errs


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_mixed_precision_with_sharded_parameters_trains_as_replicas(tmp_path):
    """A fp32 model computing in bf16: the fp32 master is sharded too (the replicated engine
    keeps it whole, since its reads between steps are local), each rank's share of the bf16
    compute copy its master share cast; ``engine.state_dict()`` gathers the fp32 masters."""
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, mixed=1, state_dict_too=1, clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", mixed=1, state_dict_too=1, clip="none")
    assert distance(ours, replicas) == 0.0
    assert all(v.dtype == torch.float32 for v in ours.values())
    module, theirs = (torch.load(tmp_path / f"{n}.pt")["module_weights"] for n in ("gathered", "replicas"))
    assert module.keys() == theirs.keys() and all(torch.equal(module[k], theirs[k]) for k in theirs)


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_a_frozen_parameter_trains_as_replicas_and_its_checkpoint_loads_anywhere(tmp_path):
    """A frozen parameter keeps a master share for its compute copy (no moments, no gradient
    sums); a checkpoint saved with sharded parameters loads in a replicated engine and in one
    process, and one saved by a replicated engine loads with sharded parameters."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    # halved through p.data at step 3 on every rank, the frozen one included: its checkpointed value is not its first
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, freeze=1, save_dir=ckpt, save_at=4, halve_at=3, clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", freeze=1, save_dir=other, save_at=4, halve_at=3, clip="none")
    assert distance(ours, replicas) == 0.0
    assert torch.load(tmp_path / "gathered.pt")["compute_at_rest"] == 0
    one = max(4 * distance(run_ok("ddp", 2, tmp_path / "ddp.pt", clip="none"), plain(clip=None)), 1e-6)
    for world, sharded, source in ((2, 0, ckpt), (1, 0, ckpt), (2, 1, other)):
        resumed = run_ok("engine", world, tmp_path / f"r{world}{sharded}.pt", shard_params=sharded, freeze=1,
                         resume=source, halve_at=3, clip="none")
        assert distance(resumed, ours) <= (0.0 if world == 2 else one), (world, sharded)


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_a_parameter_unfrozen_part_way_trains_as_replicas(tmp_path):
    """Unfrozen at step 3 on every rank: its master share is already there; moments and
    gradient sums are made then."""
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", shard_params=1, freeze=1, unfreeze_at=3, clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", freeze=1, unfreeze_at=3, clip="none")
    frozen = run_ok("engine", 2, tmp_path / "frozen.pt", shard_params=1, freeze=1, clip="none")
    assert distance(ours, replicas) == 0.0
    key = "transformer.h.0.ln_1.weight"
    assert not torch.equal(ours[key], frozen[key])  # it trained once unfrozen


@pytest.mark.slow
def test_sharded_parameters_with_gradient_sums_homed_on_nvme_train_as_replicas(tmp_path):
    """``home_tier="nvme"``: no compute copy at rest anyway; the gradient sums live on nvme."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ours = run_ok("engine", 2, tmp_path / "gathered.pt", nvme=nvme, homes=1, shard_params=1, clip="none")
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", nvme=nvme, homes=1, clip="none")
    assert distance(ours, replicas) == 0.0


@pytest.mark.slow  # make test's 10 minutes: the 2-rank training, a loop habit and two refusals stay fast
def test_each_rank_reading_another_submodules_state_dict_fails_every_rank(tmp_path):
    """Rank r reads block r's weights: the gathers of the whole masters name which parameters,
    so the ranks raise ``RankFailed`` instead of joining one rank's share of one block to the
    other's share of another (found by an attack: it returned wrong values, no error)."""
    rcs, errs, _ = launch("engine", 2, tmp_path / "s.pt", timeout=120, shard_params=1, steps=2, sd_mix=1)
    assert rcs[0] not in (0, None) and rcs[1] not in (0, None)
    for err in errs:
        assert "RankFailed" in err and "read different parameters" in err, err[-2000:]
