"""Data parallel over torch.distributed ([Note: data parallel over the process group]): gloo
ranks spawned as processes of their own (``ranks_worker.py``) against torch's
``DistributedDataParallel`` on the same ranks and one plain PyTorch process on the combined batch.

Tolerances: with 2 ranks an average is ``a * 0.5 + b * 0.5`` in any order, so pagemem and DDP
must agree bit for bit. With 3 ranks (and against one process on the combined batch) the sums
are associated differently (gloo's ring cuts each buffer by its size, and DDP's buckets are not
pagemem's batches), so the bound is DDP's own distance from plain PyTorch: pagemem may be at
most 4x as far (and 1e-6) from it, never arbitrarily far."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pagemem
from pagemem.engine.ranks.average import batches

WORKER = Path(__file__).with_name("ranks_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, world: int, out: Path, timeout: float = 240, wait_for: list[int] | None = None,
           during: Callable[[list[subprocess.Popen]], None] | None = None,
           **opts) -> tuple[list[int | None], list[str], float]:
    """Run ``world`` ranks of ``ranks_worker.py`` until the ranks ``wait_for`` (default all) have
    exited (the others are killed then); their exit codes (None: killed by the test), stderr and
    the seconds from the first rank's exit to the last awaited one's."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [f"{k}={v}" for k, v in opts.items()]
    logs = [out.with_name(f"{out.name}.rank{r}.err") for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, str(r), str(world), str(port), str(out),
                                           *args], env=env, stdout=subprocess.DEVNULL, stderr=err))
    awaited = [procs[r] for r in (wait_for if wait_for is not None else range(world))]
    if during is not None:
        threading.Thread(target=during, args=(procs,), daemon=True).start()
    first_end = None
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in awaited):
            if first_end is None and any(p.poll() is not None for p in procs):
                first_end = time.monotonic()
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout} s")
            time.sleep(0.1)
    finally:
        end = time.monotonic()
        codes = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [log.read_text() for log in logs], end - (first_end or end)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path)["weights"]


def plain(steps: int = 8, clip: float | None = 0.05) -> dict[str, torch.Tensor]:
    """One plain PyTorch process on each step's combined batch (fused AdamW, clipping by
    ``clip``; None: none)."""
    sys.path.insert(0, str(WORKER.parent))
    from ranks_worker import HP, batch_of, make_model

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    for step in range(steps):
        x = batch_of(step, 0, 1)
        model(input_ids=x, labels=x).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def run_ok(mode: str, world: int, out: Path, **opts) -> dict[str, torch.Tensor]:
    rcs, errs, _ = launch(mode, world, out, **opts)
    assert rcs == [0] * world, "\n".join(e[-3000:] for e in errs)
    return weights(out)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ranks_train_as_ddp_and_as_one_process_on_the_combined_batch(tmp_path, world):
    """States on nvme, a gpu budget that moves units every iteration, clipping on, 8 steps."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ours = run_ok("engine", world, tmp_path / "engine.pt", nvme=nvme, weights_dir=tmp_path / "hf")
    stats = torch.load(tmp_path / "engine.pt")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[k], ours[k]) for k in saved) and len(saved) >= len(ours) - 1  # lm_head tied
    assert stats["stats"]["world_size"] == world and stats["stats"]["sent_bytes"] > 0
    assert stats["moved"].get("cpu->gpu", 0) > 0 and stats["moved"].get("nvme->cpu", 0) > 0
    sys.path.insert(0, str(WORKER.parent))
    from ranks_worker import make_model as _model

    # the gpu budget is below this rank's share of the training state (weights, gradient sums,
    # master weights and moments: 16 bytes per parameter over the ranks)
    assert stats["gpu_bytes"] < 16 * sum(p.numel() for p in _model().parameters()) // world
    if world == 2:  # a ring sends (W - 1) / W of a buffer twice: at 2 ranks, each buffer's bytes once
        sys.path.insert(0, str(WORKER.parent))
        from ranks_worker import make_model

        model = make_model()
        n = len(list(model.parameters()))
        header = 3 * 2 * 8  # each operation's count, name and number of values, max and min, int64
        # what the plan sends (the "states" rows: the sums all-reduced, each rank's updated share
        # all-gathered, padded to the largest rank's), which the engine sends to the byte
        sums = 4 * sum(p.numel() for p in model.parameters())  # a ring all-reduce at 2 ranks: the bytes once
        assert stats["plan_network"] > sums
        per_step = stats["plan_network"] + header + 16 * (2 + n)  # + the averaging's header, counts, flags
        buffers = list(model.buffers())  # rank 0's, before each forward
        if buffers:
            per_step += header + 2 * 2 * 8 + sum(b.numel() * b.element_size() for b in buffers) // 2  # + sizes
        assert stats["stats"]["sharded"] and sum(stats["stats"]["moment_shares"]) == sum(p.numel() for p in model.parameters())
        # the gather sends the largest rank's share from every rank: the ring all-gather of it
        assert stats["plan_network"] - sums == (world - 1) * 4 * max(stats["stats"]["moment_shares"])
        per_step += header + 16  # each step's header: the same hyperparameters on every rank
        assert stats["stats"]["sent_bytes"] - stats["made_sent"] == 8 * per_step
    ddp = run_ok("ddp", world, tmp_path / "ddp.pt")
    reference = plain()
    if world == 2:
        assert distance(ours, ddp) == 0.0
        # the sharded moments, gathered by optimizer.state_dict(), are DDP's fused AdamW's, bit for bit
        mine, theirs = torch.load(tmp_path / "engine.pt")["optim"], torch.load(tmp_path / "ddp.pt")["optim"]
        assert mine.keys() == theirs.keys() and len(mine) > 10
        for n in theirs:
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mine[n][kind], theirs[n][kind]), (n, kind)
    else:
        assert distance(ours, ddp) <= max(4 * distance(ddp, reference), 1e-6)
    assert distance(ours, reference) <= max(4 * distance(ddp, reference), 1e-6)
    assert distance(ours, {k: v * 0 for k, v in reference.items()}) > 1e-3


@pytest.mark.slow
def test_saved_with_two_ranks_resumes_with_one_two_and_three(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    whole = run_ok("engine", 2, tmp_path / "whole.pt", nvme=nvme)
    saved = run_ok("engine", 2, tmp_path / "saved.pt", nvme=nvme, save_dir=ckpt, save_at=4)
    assert distance(saved, whole) == 0.0  # saving changes nothing
    assert sorted(os.listdir(ckpt / "step-00000004")).count("rng-ranks.bin") == 1
    ddp_vs_plain = distance(run_ok("ddp", 3, tmp_path / "ddp3.pt"), plain())
    for world in (1, 2, 3):
        resumed = run_ok("engine", world, tmp_path / f"resumed{world}.pt", nvme=nvme, resume=ckpt)
        if world == 2:
            assert distance(resumed, whole) == 0.0
        else:  # the same arithmetic but for the order of the ranks' sums
            assert 0 < distance(resumed, whole) <= max(4 * ddp_vs_plain, 1e-6)


@pytest.mark.slow
def test_a_bf16_model_with_sharded_master_weights_trains_as_replicas_and_resumes(tmp_path):
    """[Note: sharded master weights]: a bf16 model computing in bf16 keeps a share of its fp32
    master on each rank; its training, ``engine.state_dict()`` (the fp32 masters, gathered: a
    collective) and the optimizer state equal replicas' bit for bit, and a sharded checkpoint
    saved with 2 ranks resumes with 2 (bit for bit) and with 1."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    sharded = run_ok("engine", 2, tmp_path / "sharded.pt", nvme=nvme, precision="bf16", save_dir=ckpt, save_at=4)
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", nvme=nvme, precision="bf16", shard=0)
    assert all(v.dtype == torch.float32 for v in sharded.values() if v.is_floating_point())  # the masters
    assert distance(sharded, replicas) == 0.0
    s, r = torch.load(tmp_path / "sharded.pt"), torch.load(tmp_path / "replicas.pt")
    assert s["stats"]["sharded"] and not r["stats"]["sharded"]
    for n in r["optim"]:
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s["optim"][n][kind], r["optim"][n][kind]), (n, kind)
    from pagemem.engine.checkpoints.checkpoint import read_manifest

    manifest = read_manifest(str(ckpt / "step-00000004"))
    assert all("pieces" in w for w in manifest["tensors"]["master"] if w is not None)  # each rank wrote its share
    assert distance(run_ok("engine", 2, tmp_path / "r2.pt", nvme=nvme, precision="bf16", resume=ckpt), sharded) == 0.0
    one = run_ok("engine", 1, tmp_path / "r1.pt", nvme=nvme, precision="bf16", resume=ckpt)
    assert 0 < distance(one, sharded) < 1e-2  # the ranks' sums in another order, through bf16 compute


@pytest.mark.slow  # make test's budget: the simulated-rank tests cover the sharded master in the fast suite
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_write_through_data_between_steps_is_kept_with_sharded_master_weights(tmp_path, precision):
    """``p.data.mul_(0.5)`` between steps on every rank moves no version counter; with sharded
    master weights the compute copy the write landed in is what ``host_value`` read, so the write
    went unseen and the update overwrote it from the unwritten master share (silently wrong
    weights). The sharded run equals replicas' bit for bit."""
    opts = dict(steps=4, halve_at=2, precision=precision)
    sharded = run_ok("engine", 2, tmp_path / "sharded.pt", **opts)
    replicas = run_ok("engine", 2, tmp_path / "replicas.pt", shard=0, **opts)
    assert distance(sharded, replicas) == 0.0


@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_a_killed_rank_makes_the_others_fail_naming_it(tmp_path, victim):
    rcs, errs, after = launch("kill", 3, tmp_path / "k.pt", timeout=120, victim=victim)
    assert rcs[victim] == -9
    others = [r for r in range(3) if r != victim]
    assert all(rcs[r] not in (0, None) for r in others)
    assert after < 60
    for r in others:
        assert "RankFailed" in errs[r]
        named = f"rank(s) {victim} stopped" if victim else "rank 0 unless torchrun's agent holds it, is gone"
        assert named in errs[r], errs[r][-2000:]
        assert "after RankFailed, step() raised StepFailed" in errs[r]


@pytest.mark.slow
def test_a_rank_killed_while_the_shares_are_gathered_leaves_weights_that_refuse_to_be_read(tmp_path):
    """The survivor updated its share and never received the victim's: its weights mix two steps,
    so ``model.state_dict()`` (the habit of saving in an exception handler) raises ``RankFailed``
    instead of returning them."""
    rcs, errs, after = launch("killgather", 2, tmp_path / "k.pt", timeout=120, victim=1)
    assert rcs[1] == -9 and rcs[0] not in (0, None) and after < 60
    assert "after RankFailed in the update, model.state_dict() raised" in errs[0], errs[0][-2000:]
    assert "mix two steps" in errs[0]


@pytest.mark.slow  # make test's budget: the killed-rank and lone-save cases cover the liveness and the headers
def test_a_rank_that_stops_calling_is_named_within_the_timeout(tmp_path):
    rcs, errs, _ = launch("hang", 2, tmp_path / "h.pt", timeout=120, wait_for=[0], victim=1, at=2, steps=4, collective_timeout=5)
    assert rcs[0] not in (0, None)
    assert "RankFailed" in errs[0] and "rank(s) 1 (at collective" in errs[0], errs[0][-2000:]


def test_a_parameter_unused_on_one_rank_gets_the_average_ddp_gives(tmp_path):
    """Head ``b`` has a gradient on rank 0 only (most steps): rank 1 contributes zeros, as DDP with
    ``find_unused_parameters=True`` does, and every rank updates it alike."""
    ours = run_ok("unused", 2, tmp_path / "ours.pt")
    ddp = run_ok("unused-ddp", 2, tmp_path / "ddp.pt")
    assert distance(ours, ddp) == 0.0


@pytest.mark.parametrize("loop", ["habit", pytest.param("accum", marks=pytest.mark.slow)])
def test_loop_habits_equal_ddp_bit_for_bit(tmp_path, loop):
    """``p.grad`` after ``loss.backward()`` is the average, as DDP's is (clipping by hand reads
    it); accumulation averages once per step, as DDP with ``no_sync`` does."""
    ours = run_ok("loop", 2, tmp_path / "ours.pt", loop=loop)
    ddp = run_ok("loop-ddp", 2, tmp_path / "ddp.pt", loop=loop)
    assert distance(ours, ddp) == 0.0


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    run_ok("loop", 2, tmp_path / "o.pt", loop="fp16")
    runs = [torch.load(tmp_path / f"o.pt.r{r}") for r in range(2)]
    assert [r["skipped"] for r in runs] == [1, 1]
    assert runs[0]["loss_scale"] == runs[1]["loss_scale"] < 65536.0
    assert distance(runs[0]["weights"], runs[1]["weights"]) == 0.0


@pytest.mark.parametrize("signals, said", [(2, "interrupted while waiting"),
                                           pytest.param(1, "a signal (Ctrl-C) arrived", marks=pytest.mark.slow)])
def test_ctrl_c_in_a_hung_collective_breaks_the_engine(tmp_path, signals, said):
    """Ctrl-C while rank 0 waits for rank 1 (which stopped): a second one raises at once, one
    alone after 5 s of waiting; the collective may still be in flight, so the engine refuses to
    go on (a step would update with gradients that are not the average)."""
    marker = tmp_path / "stopped"

    def interrupt(procs):
        deadline = time.monotonic() + 100
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # rank 0 reaches the averaging and waits
        for _ in range(signals):
            procs[0].send_signal(signal.SIGINT)
            time.sleep(0.5)

    rcs, errs, _ = launch("hang", 2, tmp_path / "h.pt", timeout=120, wait_for=[0], during=interrupt, victim=1,
                          at=2, steps=4, collective_timeout=60, marker=marker)
    assert rcs[0] not in (0, None)
    assert "KeyboardInterrupt" in errs[0]
    assert "after Ctrl-C, step() raised StepFailed" in errs[0] and said in errs[0], errs[0][-2000:]


@pytest.mark.slow  # make test's budget
def test_replicas_start_from_rank_zero_and_follow_its_buffers_as_ddp(tmp_path):
    """Ranks that initialised their models with different seeds train rank 0's model, and
    BatchNorm's running statistics are rank 0's before each forward: every rank's weights and
    buffers equal DDP's on that rank ([Note: replicas agree as DDP makes them])."""
    launch_ok = [launch(mode, 2, tmp_path / f"{mode}.pt") for mode in ("batchnorm", "batchnorm-ddp")]
    assert all(rcs == [0, 0] for rcs, _, _ in launch_ok), [e[-2000:] for _, errs, _ in launch_ok for e in errs]
    for r in range(2):
        ours = weights(Path(f"{tmp_path / 'batchnorm.pt'}.r{r}"))
        ddp = weights(Path(f"{tmp_path / 'batchnorm-ddp.pt'}.r{r}"))
        assert distance(ours, ddp) == 0.0
    rank0, rank1 = (weights(Path(f"{tmp_path / 'batchnorm.pt'}.r{r}")) for r in range(2))
    assert not torch.equal(rank0["2.running_mean"], rank1["2.running_mean"])  # each rank's last forward
    assert torch.equal(rank0["1.weight"], rank1["1.weight"]) and torch.equal(rank0["0.offset"], rank1["0.offset"])


@pytest.mark.slow
def test_a_rank_whose_share_of_a_checkpoint_fails_fails_the_save_on_every_rank(tmp_path):
    """[Note: sharded checkpoints]: rank 1's disk is full while it writes its share of the moments:
    every rank raises, nothing is published (latest names the last whole checkpoint), the ranks
    stay in step and the next save and the resume from it work."""
    ckpt = tmp_path / "ck"
    rcs, errs, _ = launch("savefail", 2, tmp_path / "s.pt", steps=3, save_dir=ckpt, save_at=2)
    assert rcs == [0, 0], "\n".join(e[-3000:] for e in errs)
    assert "rank 1's second save raised TierIOError" in errs[1] and "no space left" in errs[1], errs[1][-2000:]
    assert "rank 0's second save raised InvalidRequest" in errs[0] and "rank 1" in errs[0], errs[0][-2000:]
    steps = sorted(p.name for p in ckpt.iterdir())
    assert not [p for p in steps if ".tmp" in p] and len([p for p in steps if p.startswith("step-")]) == 2
    run_ok("engine", 2, tmp_path / "resumed.pt", steps=4, resume=ckpt)


@pytest.mark.slow
def test_what_the_ranks_must_agree_on_is_refused_on_every_rank(tmp_path):
    """Found by an attack: a learning rate changed on one rank, or different optimizer states
    loaded, updated the ranks' shares (or replicas) differently, silently; a sharding that
    differs hung. Each is refused on every rank alike, the ranks still in step; a model with a
    0-dim parameter trains; a load on one rank alone is a ``RankFailed``."""
    rcs, errs, _ = launch("disagree", 2, tmp_path / "d.pt", timeout=180)
    for r, e in enumerate(errs):
        assert "sharding: " in e and "shard_optimizer_states" in e, e[-3000:]
        assert "lr: step: the ranks' optimizer param_groups differ" in e, e[-3000:]
        assert "load different: optimizer.load_state_dict: the ranks loaded different" in e, e[-3000:]
        assert "steps 3 scale" in e and "alone: RankFailed" in e, e[-3000:]
    scales = [line for e in errs for line in e.splitlines() if line.startswith("steps 3 scale")]
    assert len(scales) == 2 and scales[0] == scales[1]  # the ranks still train one model


def test_a_save_on_rank_zero_alone_fails_every_rank_at_once(tmp_path):
    """``if rank == 0: save()``: rank 0's save meets rank 1's averaging; both find it in the
    operation's header and raise at once (not after the timeout), naming both operations."""
    rcs, errs, after = launch("save0", 2, tmp_path / "s.pt", timeout=120, save_dir=tmp_path / "ck",
                              collective_timeout=100)
    assert all(rc not in (0, None) for rc in rcs)
    for e in errs:
        assert "the ranks are at different operations" in e and "'saving a checkpoint'" in e, e[-2000:]
    assert "rank 0's lone save raised RankFailed" in errs[0]
    assert after < 30


@pytest.mark.slow  # make test's budget: the killed-rank and lone-save cases cover the liveness and the headers
def test_ranks_loading_different_checkpoints_refuse(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    for at in (2, 4):
        run_ok("engine", 1, tmp_path / f"s{at}.pt", nvme=nvme, steps=at, save_dir=tmp_path / f"ck{at}", save_at=at)
    rcs, errs, _ = launch("engine", 2, tmp_path / "r.pt", timeout=120, nvme=nvme, resume=tmp_path / "ck2",
                          resume_r1=tmp_path / "ck4")
    assert all(rc not in (0, None) for rc in rcs)
    assert all("the ranks loaded different checkpoints" in e for e in errs), errs[0][-2000:]


@pytest.mark.slow  # make test's budget: the killed-rank and lone-save cases cover the liveness and the headers
def test_a_rank_that_closes_its_engine_releases_the_others_at_once(tmp_path):
    rcs, errs, after = launch("close-early", 2, tmp_path / "c.pt", timeout=120, wait_for=[1], victim=0, at=2,
                              collective_timeout=100)
    assert rcs[1] not in (0, None)
    assert "rank(s) 0 closed their engine" in errs[1], errs[1][-2000:]


@pytest.mark.slow  # make test's budget: the lone-save case covers the headers
def test_a_backward_failed_on_one_rank_alone_fails_every_rank_at_the_next_average(tmp_path):
    """Rank 1 catches its failed backward and goes on: its batches no longer line up with rank
    0's, so the next average finds the ranks at different steps and every rank raises."""
    rcs, errs, _ = launch("fail1", 2, tmp_path / "f.pt", timeout=120, victim=1, at=2, collective_timeout=100)
    assert all(rc not in (0, None) for rc in rcs)
    for e in errs:
        assert "the ranks are at different steps" in e, e[-2000:]


@pytest.mark.slow  # make test's budget
def test_ranks_over_different_models_all_refuse(tmp_path):
    rcs, errs, _ = launch("mismatch", 2, tmp_path / "m.pt", timeout=120)
    assert all(rc not in (0, None) for rc in rcs)
    assert all("with different parameters (names, shapes, dtypes, requires_grad)" in e for e in errs), errs


# ---------------------------------------------------------------------------------- in process


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 64))
def test_batches_cover_every_gradient_once_in_order(sizes, per_batch):
    spans = batches(dict(enumerate(sizes)), per_batch)
    assert all(0 < sum(hi - lo for _, lo, hi in b) <= per_batch for b in spans)
    flat = [s for b in spans for s in b]
    covered = [(i, e) for i, lo, hi in flat for e in range(lo, hi)]
    assert covered == [(i, e) for i, n in enumerate(sizes) for e in range(n)]
    assert all(sum(hi - lo for _, lo, hi in b) == per_batch for b in spans[:-1])  # only the last is short


def test_one_process_is_rank_zero_of_one(tmp_path):
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 20, cpu_bytes=16 << 20, page_bytes="64KiB")
    with pagemem.Engine(torch.nn.Linear(8, 8), pagemem.EngineConfig(store=store)) as engine:
        assert (engine.rank, engine.world_size) == (0, 1)
        assert engine.stats()["ranks"]["collectives"] == 0


def test_rank_and_world_size_are_not_config(tmp_path):
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 20, cpu_bytes=16 << 20, page_bytes="64KiB")
    with pytest.raises(TypeError):
        pagemem.EngineConfig(store=store, world_size=2)
    cfg = pagemem.EngineConfig(store=store)
    old = {**cfg.to_dict(), "rank": 0, "world_size": 1}  # a checkpoint from before data parallelism
    assert pagemem.EngineConfig.from_dict(old) == cfg
    with pytest.raises(pagemem.ConfigError, match="process group"):
        pagemem.EngineConfig.from_dict({**cfg.to_dict(), "rank": 1, "world_size": 2})
    with pytest.raises(pagemem.ConfigError, match="collective_timeout_s"):
        pagemem.EngineConfig(store=store, collective_timeout_s=0)


def test_a_process_group_without_torch_distributed_is_refused():
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 20, cpu_bytes=16 << 20, page_bytes="64KiB")
    model = torch.nn.Linear(8, 8)
    before = model.weight.detach().clone()
    with pytest.raises(pagemem.ConfigError, match="process_group"):
        pagemem.Engine(model, pagemem.EngineConfig(store=store), process_group=object())
    assert torch.equal(model.weight, before) and type(model.weight) is torch.nn.Parameter
