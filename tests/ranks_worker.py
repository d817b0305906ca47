"""One rank of a data-parallel run on gloo, for ``test_engine_ranks.py`` (or the reference it is
compared with), in a process of its own.

``python ranks_worker.py MODE RANK WORLD PORT OUT [key=value ...]``; MODE is ``engine`` (pagemem,
data parallel over the default group), ``ddp`` (torch ``DistributedDataParallel`` with fused
AdamW and ``clip_grad_norm_``), ``kill`` (pagemem, and rank ``victim`` SIGKILLs itself in the
forward of step ``at``), ``hang`` (rank ``victim`` stops calling the engine at step ``at`` and
sleeps), ``mismatch`` (rank ``victim`` makes its engine over another model), ``save0`` (rank 0
alone saves at step ``at``, catching what it raises), ``close-early`` (rank ``victim`` closes its
engine after step ``at`` and sleeps), ``fail1`` (rank ``victim``'s backward fails at step ``at``,
caught, and it goes on), ``unused`` /
``unused-ddp`` (``Branchy``, a head unused on some ranks' steps, pagemem or DDP), ``loop`` /
``loop-ddp`` (``run_loop``: loop habits), ``batchnorm`` / ``batchnorm-ddp`` (``run_batchnorm``). Every rank trains on its slice of each step's combined batch
(``batch_of``); rank 0 writes the final weights (``torch.save``) to OUT. Options: ``steps``,
``nvme`` (a directory: optimizer states there), ``save_dir``/``save_at`` (save a checkpoint after
that step), ``resume`` (load the latest checkpoint under it first, and train from its step; ``resume_r<rank>``
for one rank),
``gpu_bytes``, ``clip``, ``weights_dir`` (``save_weights`` there at the end, on every rank),
``precision=bf16`` (a bf16 model computing in bf16), ``shard=0`` (``shard_optimizer_states=False``),
``halve_at`` (before that step's forward, every rank halves some parameters through ``p.data``),
``ragged=1`` (each rank's sequences of a length of its own, ``ragged``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers

import pagemem

V, SEQ, PER_STEP = 128, 16, 6
"""Vocabulary, tokens per sequence, sequences per step over all ranks (divisible by 1, 2, 3)."""
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def model_dtype(opts: dict[str, str]) -> torch.dtype:
    """``precision=bf16``: a bf16 model computing in bf16 (over fp32 master weights)."""
    return torch.bfloat16 if opts.get("precision") == "bf16" else torch.float32


def batch_of(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s sequences of step ``step``: its slice of the combined batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, V, (PER_STEP, SEQ), generator=g)
    per = PER_STEP // world
    return x[rank * per:(rank + 1) * per]


def ragged(x: torch.Tensor, step: int, rank: int, opts: dict[str, str]) -> torch.Tensor:
    """``ragged=1``: each rank's sequences cut to a length of its own (as padding each batch to
    its own longest does), the same on every rank at steps 3 and 7."""
    if opts.get("ragged") != "1" or step % 4 == 3:
        return x
    return x[:, :SEQ - 4 * ((step + rank) % 3)]


PAGE = 64 << 10


def gpu_budget(world: int) -> int:
    """The least gpu budget the scheduler accepts for one rank's step, plus a sixth of the
    parameters' bytes (so units move every iteration), in whole pages: below a rank's share of
    the model's training state (16 bytes per parameter over the ranks) at 2 and 3 ranks."""
    from pagemem.sched import least_gpu_bytes
    from pagemem.tracer import trace

    model = make_model()
    x = batch_of(0, 0, world)
    tr = trace(model, lambda: model(input_ids=x, labels=x).loss.backward()).with_non_model_peak_reserved()
    params = sum(p.numel() * 4 for p in model.parameters())
    return -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params // 6) // PAGE) * PAGE


def clip_of(opts: dict[str, str]) -> float | None:
    """``clip``: the max norm (default 0.05), or ``none`` (no clipping)."""
    clip = opts.get("clip", "0.05")
    return None if clip == "none" else float(clip)


def engine_config(opts: dict[str, str], world: int) -> pagemem.EngineConfig:
    nvme = opts.get("nvme")
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=int(opts.get("gpu_bytes", gpu_budget(world))),
                                cpu_bytes=int(opts.get("cpu_bytes", 64 << 20)), nvme_bytes=(256 << 20) if nvme else 0,
                                nvme_path=nvme,
                                page_bytes=PAGE)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier="nvme" if nvme else "cpu",
                                compute_dtype=torch.bfloat16 if opts.get("mixed") == "1" else model_dtype(opts), max_grad_norm=clip_of(opts),
                                adam_threads=1, collective_timeout_s=float(opts.get("collective_timeout", 60)),
                                shard_optimizer_states=opts.get("shard", "1") == "1",
                                shard_parameters=opts.get("shard_params", "0") == "1",
                                home_tier="nvme" if opts.get("homes") == "1" else "auto")


def run_engine(rank: int, world: int, out: str, opts: dict[str, str], mode: str = "engine") -> None:
    steps = int(opts.get("steps", 8))
    victim = int(opts.get("victim", 1)) if mode != "engine" else None
    model = make_model(model_dtype(opts))
    if mode == "mismatch" and rank == victim:
        model.transformer.h[0].ln_1.bias.requires_grad_(False)
    if "freeze" in opts:  # on every rank
        model.transformer.h[0].ln_1.weight.requires_grad_(False)
    first = 0
    resume = opts.get(f"resume_r{rank}", opts.get("resume"))
    if resume is not None:
        engine = pagemem.Engine.load(resume, model, engine_config(opts, world))
        first = engine.global_step
    else:
        engine = pagemem.Engine(model, engine_config(opts, world))
    assert (engine.rank, engine.world_size) == (rank, world)
    made_sent = engine.stats()["ranks"]["sent_bytes"]
    sent_steps: list[int] = []
    """Bytes sent so far but for the operations' headers, after each step."""
    with engine:
        for step in range(first, steps):
            if mode == "killgather" and rank == victim and step == int(opts.get("at", 2)):
                from pagemem.engine.ranks.gather import MasterGather  # dies once its share is updated
                MasterGather.__call__ = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
            if mode == "kill" and rank == victim and step == int(opts.get("at", 2)):
                model.transformer.h[0].register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            if mode == "hang" and rank == victim and step == int(opts.get("at", 2)):
                if "marker" in opts:
                    open(opts["marker"], "w").close()
                time.sleep(600)
            if mode == "hang" and rank != victim and step == int(opts.get("at", 2)) and "marker" in opts:
                x = batch_of(step, rank, world)
                try:
                    engine.backward(engine(input_ids=x, labels=x).loss)
                except KeyboardInterrupt:  # a second Ctrl-C while the collective waits
                    try:
                        engine.step()
                    except pagemem.PageMemError as after:
                        print(f"after Ctrl-C, step() raised {type(after).__name__}: {after}", file=sys.stderr)
                    raise
            if "unfreeze_at" in opts and step == int(opts["unfreeze_at"]):  # on every rank
                model.transformer.h[0].ln_1.weight.requires_grad_(True)
            if "halve_at" in opts and step == int(opts["halve_at"]):
                with torch.no_grad():  # on every rank, through .data: no version counter moves
                    for n, p in model.named_parameters():
                        if n.endswith(("mlp.c_fc.weight", "ln_f.weight", "h.0.ln_1.weight")):  # the last frozen with freeze=1
                            p.data.mul_(0.5)
            if "read_on" in opts and rank == int(opts["read_on"]) and step == int(opts.get("at", 2)):
                print(f"rank {rank} reads {float(model.transformer.h[2].mlp.c_fc.weight.sum()):.3f}", file=sys.stderr)
            x = ragged(batch_of(step, rank, world), step, rank, opts)
            loss = engine(input_ids=x, labels=x).loss
            if mode == "fail1" and rank == victim and step == int(opts.get("at", 2)):
                try:  # a backward that fails on one rank alone, caught: "as if its batch had been skipped"
                    loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a failing hook")))
                    engine.backward(loss)
                except RuntimeError as err:
                    print(f"rank {rank}'s backward failed: {err}", file=sys.stderr)
                continue
            try:
                engine.backward(loss)
            except pagemem.RankFailed:
                try:  # the ranks are out of step for good: the engine refuses to go on alone
                    engine.step()
                except pagemem.PageMemError as after:
                    print(f"after RankFailed, step() raised {type(after).__name__}", file=sys.stderr)
                raise
            try:
                engine.step()
            except pagemem.RankFailed:
                if mode == "killgather":  # the weights now mix two steps: a read must say so
                    try:
                        model.state_dict()
                        print("after RankFailed in the update, model.state_dict() returned", file=sys.stderr)
                    except pagemem.RankFailed as after:
                        print(f"after RankFailed in the update, model.state_dict() raised: {after}", file=sys.stderr)
                raise
            sent_steps.append(engine.stats()["ranks"]["sent_bytes"] - engine.stats()["ranks"]["header_bytes"])
            if mode == "save0" and rank == 0 and step == int(opts.get("at", 2)):
                try:  # a DDP habit: rank 0 alone saves
                    engine.save(opts["save_dir"])
                except pagemem.PageMemError as err:
                    print(f"rank 0's lone save raised {type(err).__name__}", file=sys.stderr)
            if mode == "close-early" and rank == victim and step == int(opts.get("at", 2)):
                engine.close()  # ran out of data, and goes on with something else
                time.sleep(60)
            if mode == "savefail" and step + 1 == int(opts["save_at"]):
                first = engine.save(opts["save_dir"])  # a whole one, then one whose share fails on ``victim``
                import errno
                from pagemem.engine.checkpoints import page_files as ck
                write_share = ck.write_share
                if rank == victim:
                    def full(*args, **kwargs):
                        raise pagemem.TierIOError("writing the share: no space left on device (a full disk, test)", errno.ENOSPC)
                    ck.write_share = full
                try:
                    engine.save(opts["save_dir"])
                except pagemem.PageMemError as err:
                    print(f"rank {rank}'s second save raised {type(err).__name__}: {err}", file=sys.stderr)
                ck.write_share = write_share
                assert open(os.path.join(opts["save_dir"], "latest")).read().strip() == os.path.basename(first)
                engine.save(opts["save_dir"])  # the ranks are still in step: the next save works
            elif "save_dir" in opts and mode != "save0" and step + 1 == int(opts["save_at"]):
                engine.save(opts["save_dir"])
        if "sd_mix" in opts:  # an expert-parallel habit: each rank reads its own block's weights
            model.transformer.h[rank].mlp.c_fc.state_dict()
        stats = engine.stats()
        paging = engine.pager.stats()
        at_rest = sum(t.nbytes for layer in engine.bank.layers for t in layer.compute)  # between steps
        grad_at_rest = engine.bank.state_bytes()["grad"]
        if "state_dict_too" in opts:  # every rank reads the weights through the module too
            module_weights = {k: v.clone() for k, v in model.state_dict().items()}
        plan = engine.pager.last_plan
        plan_network = plan.bytes_moved()["network"] if plan is not None else None
        weights = engine.state_dict()
        optim = engine.optimizer.state_dict()["state"]  # with sharded moments, a collective
        if "weights_dir" in opts:
            paths = engine.save_weights(opts["weights_dir"])
            assert os.path.exists(paths[-1])  # rank 0 wrote them; every rank is told where
    if rank == 0:
        torch.save({"weights": weights, "stats": stats["ranks"], "made_sent": made_sent, "sent_steps": sent_steps, "optim": optim,
                    "plan_network": plan_network, "compute_at_rest": at_rest, "grad_at_rest": grad_at_rest,
                    "module_weights": module_weights if "state_dict_too" in opts else None,
                    "gpu_bytes": engine.config.store.gpu_bytes,
                    "moved": stats["moved_bytes"], "paging": paging}, out)


class Branchy(torch.nn.Module):
    """A trunk and two heads; a rank's batch may skip head ``b`` (as a mixture of experts' routing
    leaves experts unused on some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 4)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return (self.a(h) + (self.b(h) if use_b else 0)).square().mean()


class GatedBlock(torch.nn.Module):
    """A linear layer and an ``extra`` parameter its forward adds only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)
        self.extra = torch.nn.Parameter(torch.full((256,), 0.1))

    def forward(self, h: torch.Tensor, use: bool) -> torch.Tensor:
        y = torch.tanh(self.lin(h))
        return y + self.extra if use else y


class Gated(torch.nn.Module):
    """A trunk, a block every rank runs whose ``extra`` parameter a rank's batch may not reach
    (data-dependent control flow inside a module), and two more layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(16, 256)
        self.block = GatedBlock()
        self.mid = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = bool(x[0, 0] > 0)  # from the data: every rank's inputs have one signature
        h = self.block(torch.tanh(self.trunk(x)), use)
        return self.head(torch.tanh(self.mid(h))).square().mean()


def branchy_batch(step: int, rank: int) -> tuple[torch.Tensor, bool]:
    g = torch.Generator().manual_seed(50 + 10 * step + rank)
    return torch.randn(4, 16, generator=g), rank == 0 or step % 3 == 0


def run_unused(rank: int, world: int, out: str, opts: dict[str, str], ddp: bool) -> None:
    """``Branchy`` for 6 steps, head ``b`` unused on rank 1 except every third step (``inner=1``:
    ``Gated``, its block's ``extra`` unreached likewise)."""
    model = Gated() if opts.get("inner") == "1" else Branchy()
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    else:
        store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=int(opts.get("gpu_bytes", 1 << 20)),
                                    cpu_bytes=16 << 20, page_bytes=PAGE)
        engine = pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), adam_threads=1,
                                                            shard_parameters=opts.get("shard_params") == "1"))
    for step in range(6):
        x, use_b = branchy_batch(step, rank)
        args = (x, use_b)
        if isinstance(model, Gated):  # whether the block's extra is reached, told by the data alone
            x[0, 0] = 1.0 if use_b else -1.0
            args = (x,)
        if ddp:
            net(*args).backward()
            opt.step()
            opt.zero_grad()
        else:
            engine.backward(engine(*args))
            engine.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()} if ddp else engine.state_dict()
    if not ddp:
        engine.close()
    if rank == 0:
        torch.save({"weights": weights}, out)


def run_loop(rank: int, world: int, out: str, opts: dict[str, str], ddp: bool) -> None:
    """The loop habits people bring from plain PyTorch, on GPT-2, pagemem or DDP (``loop``):
    ``habit`` (``loss.backward()``, clipping by hand over ``model.parameters()``,
    ``optimizer.step()``, ``optimizer.zero_grad()``), ``accum`` (two micro-batches per step:
    ``accumulation_steps=2``, DDP's ``no_sync`` on the first) or ``fp16`` (float16 compute with a
    dynamic loss scale, and rank ``victim``'s loss is inf at step 2: every rank skips that step).
    Every rank writes its weights and counters to ``OUT.r<rank>``."""
    loop = opts["loop"]
    model = make_model()
    steps = int(opts.get("steps", 6))
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    else:
        store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=gpu_budget(world), cpu_bytes=64 << 20,
                                    page_bytes=PAGE)
        extra = {"accumulation_steps": 2} if loop == "accum" else {}
        if opts.get("shard_params") == "1":
            extra["shard_parameters"] = True
        if loop == "fp16":
            extra.update(compute_dtype=torch.float16, max_grad_norm=1.0)
        engine = pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP),
                                                            adam_threads=1, **extra))
        net, opt = engine, engine.optimizer
    for step in range(steps):
        x = batch_of(step, rank, world)
        if loop == "habit":
            net(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        elif loop == "accum":
            halves = (x[: len(x) // 2], x[len(x) // 2:])
            if ddp:
                with net.no_sync():
                    net(input_ids=halves[0], labels=halves[0]).loss.backward()
                net(input_ids=halves[1], labels=halves[1]).loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                for h in halves:
                    engine.backward(engine(input_ids=h, labels=h).loss)
                engine.step()
        else:  # fp16, pagemem only
            loss = engine(input_ids=x, labels=x).loss
            if step == 2 and rank == int(opts.get("victim", 1)):
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
    if ddp:
        result = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    else:
        result = {"weights": engine.state_dict(), "skipped": engine.stats()["skipped_steps"],
                  "loss_scale": engine.stats()["loss_scale"]}
        engine.close()
    torch.save(result, f"{out}.r{rank}")
    if rank == 0:
        torch.save(result, out)


class Shift(torch.nn.Module):
    """A buffer of three floats ahead of BatchNorm's: its int64 ``num_batches_tracked`` then lies
    at a byte offset that is no multiple of 8 in the buffers' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.arange(3.0) + 10 * float(torch.rand(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset.sum() * 0.01


def run_batchnorm(rank: int, world: int, out: str, ddp: bool) -> None:
    """An MLP with BatchNorm, each rank's model initialised with its own seed (no common seed),
    5 steps; every rank writes its weights and buffers to ``OUT.r<rank>``."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(Shift(), torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24), torch.nn.ReLU(),
                                torch.nn.Linear(24, 3))
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    else:
        store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 20, cpu_bytes=16 << 20, page_bytes=PAGE)
        net = pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), adam_threads=1))
        opt = net.optimizer
    for step in range(5):
        g = torch.Generator().manual_seed(7 * step + rank)
        x = torch.randn(8, 12, generator=g) * (1 + rank)
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if ddp else net.state_dict()
    if not ddp:
        net.close()
    torch.save({"weights": state}, f"{out}.r{rank}")


class Scaled(torch.nn.Module):
    """A layer and a 0-dim parameter (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 4)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.layer(x) * self.scale).square().mean()


def run_disagree(rank: int, world: int, out: str) -> None:
    """What ranks must agree on, each refused on every rank alike: the sharding at construction,
    a learning rate changed on one rank, different optimizer states loaded; then one rank alone
    loading one (``RankFailed``). Prints what each raised."""
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=4 << 20, cpu_bytes=16 << 20, page_bytes=4096)
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), adam_threads=1, collective_timeout_s=60)
    import dataclasses
    try:
        pagemem.Engine(Scaled(), dataclasses.replace(cfg, shard_optimizer_states=rank == 0))
    except pagemem.ConfigError as err:
        print(f"sharding: {err}", file=sys.stderr)
    model = Scaled()
    engine = pagemem.Engine(model, cfg)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(10 * i + rank)
        engine.backward(engine(torch.randn(4, 16, generator=g)))
        engine.step()

    step(0)
    group = engine.optimizer.param_groups[0]
    if rank == 1:
        group["lr"] *= 10
    try:
        step(1)
    except pagemem.InvalidRequest as err:
        print(f"lr: {err}", file=sys.stderr)
    group["lr"] = HP["lr"]
    engine.step()  # the kept gradients, with the same lr everywhere now
    saved = engine.optimizer.state_dict()
    theirs = {**saved, "param_groups": [{**g, "lr": g["lr"] * (1 + rank)} for g in saved["param_groups"]]}
    try:
        engine.optimizer.load_state_dict(theirs)
    except pagemem.InvalidRequest as err:
        print(f"load different: {err}", file=sys.stderr)
    engine.optimizer.load_state_dict(saved)
    step(2)
    print(f"steps {engine.global_step} scale {float(model.scale):.6f}", file=sys.stderr)
    try:
        if rank == 0:
            engine.optimizer.load_state_dict(saved)
        else:
            step(3)
    except pagemem.RankFailed as err:
        print(f"alone: {type(err).__name__}", file=sys.stderr)
    if rank == 0:
        torch.save({"ok": True}, out)


def run_ddp(rank: int, world: int, out: str, opts: dict[str, str]) -> None:
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    for step in range(int(opts.get("steps", 8))):
        x = ragged(batch_of(step, rank, world), step, rank, opts)
        ddp(input_ids=x, labels=x).loss.backward()
        if clip_of(opts) is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_of(opts))
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "optim": opt.state_dict()["state"]}, out)


def main() -> None:
    mode, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    opts = dict(a.split("=", 1) for a in sys.argv[6:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    if mode == "ddp":
        run_ddp(rank, world, out, opts)
    elif mode == "disagree":
        run_disagree(rank, world, out)
    elif mode in ("batchnorm", "batchnorm-ddp"):
        run_batchnorm(rank, world, out, ddp=mode == "batchnorm-ddp")
    elif mode in ("loop", "loop-ddp"):
        run_loop(rank, world, out, opts, ddp=mode == "loop-ddp")
    elif mode in ("unused", "unused-ddp"):
        run_unused(rank, world, out, opts, ddp=mode == "unused-ddp")
    else:
        run_engine(rank, world, out, opts, mode)
    dist.barrier()
    # every output is written: leave without tearing the group down, whose gloo threads have been
    # seen to abort the process ("terminate called without an active exception") at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
