"""The engine trains exactly as plain PyTorch does: same model, same data, same AdamW, with the
model's parameters paged through a gpu tier far smaller than its states."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import pagemem
from conftest import engine_gpu_budget
from pagemem.engine.units.bank import ParamBank
from pagemem.models.gpt import GPT, GPTConfig

PAGE = 64 * 1024


def small_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = dict(layers=3, hidden=64, heads=4, vocab=128, seq=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def batches(n: int, batch: int = 4, seq: int = 32, vocab: int = 128):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def loss_of(model, idx, targets) -> torch.Tensor:
    logits = model(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def state_bytes(model) -> int:
    """Parameters + gradients + fp32 master + two moments: what the model's states take."""
    n = sum(p.numel() for p in model.parameters())
    return n * (4 + 4 + 4 + 4 + 4)


def gpu_budget(model) -> int:
    """The gpu budget covers activations and the other non-model memory too: the least the
    scheduler accepts for this model plus a third of its parameters' bytes (a third of all its
    states would hold every parameter), so layers are evicted and fetched again in every forward
    and backward."""
    idx, targets = next(batches(1))
    return engine_gpu_budget(model, lambda m: loss_of(m, idx, targets).backward(), PAGE, 1 / 3)


def assert_followed_the_plan(stats, iterations: int) -> None:
    """Every iteration after the warm-up followed the plan, which had everything staged in time."""
    assert stats["iterations"] == {"traced": 1, "planned": iterations - 1}, stats["iterations"]
    assert stats["misses"] == 0 and stats["replans"] == 0
    assert 0 < stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]


def reference(model, steps: int, hp: dict, max_grad_norm=None, accumulation: int = 1):
    opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)
    data = list(batches(steps * accumulation))
    for s in range(steps):
        for m in range(accumulation):
            loss_of(model, *data[s * accumulation + m]).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def through_engine(model, steps: int, hp: dict, tmp_path, optimizer_tier="cpu", max_grad_norm=None,
                   accumulation: int = 1, budget: int | None = None, overlap_update: bool | None = True,
                   copy_threads: int = 2, home_tier: str = "auto", cpu_bytes: int | None = None,
                   backward_on=None):
    """``backward_on(fn, loss)``: runs each ``engine.backward`` (on another thread, say, as
    autograd's device thread runs backward on CUDA)."""
    budget = budget or gpu_budget(model)
    if optimizer_tier == "gpu":  # the states and gradient sums stay there, beside the paged parameters
        n = sum(p.numel() for p in model.parameters())
        budget += (-(-16 * n // PAGE) + 4) * PAGE
    disk = optimizer_tier == "nvme" or home_tier == "nvme"
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                cpu_bytes=cpu_bytes or 8 * state_bytes(model),
                                nvme_bytes=8 * state_bytes(model) if disk else 0,
                                nvme_path=str(tmp_path) if disk else None,
                                copy_threads=copy_threads)
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**hp), optimizer_tier=optimizer_tier,
                               max_grad_norm=max_grad_norm, accumulation_steps=accumulation, adam_threads=2,
                               overlap_update=overlap_update, home_tier=home_tier)
    data = list(batches(steps * accumulation))
    with pagemem.Engine(model, cfg) as engine:
        for s in range(steps * accumulation):
            loss = loss_of(engine, *data[s])
            if backward_on is None:
                engine.backward(loss)
            else:
                backward_on(engine.backward, loss)
            engine.step()
        stats = engine.stats()
        return engine.state_dict(), stats


HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme", "gpu"])
def test_fp32_training_is_bit_identical_to_plain_pytorch(tmp_path, optimizer_tier, monkeypatch):
    model = small_gpt()
    ref = reference(copy.deepcopy(model), 50, HP)
    leases = []
    lease_many = pagemem.PageStore.lease_many

    def spy(store, *args, **kw):
        out = lease_many(store, *args, **kw)
        leases.extend((x.tier, x.copied, x.in_pieces and x.split) for x in out)
        return out

    monkeypatch.setattr(pagemem.PageStore, "lease_many", spy)
    copied_grads = []
    accumulate = ParamBank.accumulate_grad
    monkeypatch.setattr(ParamBank, "accumulate_grad", lambda bank, i, *a, **kw: (copied_grads.append(i),
                                                                                  accumulate(bank, i, *a, **kw)))
    # updates overlap backward (asked for: by default states on the gpu are updated in step())
    got, stats = through_engine(model, 50, HP, tmp_path, optimizer_tier, overlap_update=True)
    if optimizer_tier == "gpu":
        # fp32 beside states on the gpu: the parameters are views of the master pages, which never
        # move; the gpu holds 16 bytes per parameter (master, gradient sums, two moments), as
        # plain PyTorch does, not a compute copy beside them (4 more)
        n = sum(p.numel() for p in model.parameters())
        assert stats["evictions"] == 0 and not stats["moved_bytes"]
        assert stats["tiers"]["gpu"]["used_bytes"] <= 16 * n + 4 * PAGE
        assert stats["tiers"]["cpu"]["used_bytes"] == 0
        # from the second step on each parameter is stepped in its gradient hook, from autograd's
        # gradient: nothing is copied into the gradient pages after the first backward
        assert len(copied_grads) == len(list(model.parameters()))
    else:
        assert stats["evictions"] > 0  # the parameters really moved in and out of the gpu tier
    if optimizer_tier == "nvme":
        # states fetched onto scattered cpu pages are updated in place, piece by piece: the
        # update's leases (of cpu pages) are never merged copies
        on_cpu = [(copied, split) for tier, copied, split in leases if tier == "cpu"]
        assert on_cpu and not any(copied for copied, _ in on_cpu) and any(split for _, split in on_cpu)
    assert_followed_the_plan(stats, 50)
    # updates overlap backward from the second step on (states on nvme are updated in step())
    assert (stats["overlapped_updates"] > 0) == (optimizer_tier != "nvme")
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_inline_store_copies_train_the_same(tmp_path, optimizer_tier):
    """``copy_threads=0`` (copies on the issuing thread, the stand-in's faster setting)."""
    model = small_gpt()
    ref = reference(copy.deepcopy(model), 10, HP)
    got, stats = through_engine(model, 10, HP, tmp_path, optimizer_tier, copy_threads=0)
    assert stats["evictions"] > 0
    assert_followed_the_plan(stats, 10)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_clipping_and_accumulation_match_plain_pytorch(tmp_path, optimizer_tier):
    """(On nvme the states come back to scattered cpu pages: the update runs over split leases.)"""
    model = small_gpt()
    ref = reference(copy.deepcopy(model), 10, HP, max_grad_norm=0.5, accumulation=4)
    got, stats = through_engine(model, 10, HP, tmp_path, optimizer_tier, max_grad_norm=0.5, accumulation=4)
    assert_followed_the_plan(stats, 40)
    for k in ref:
        # micro-batch gradients add up in fp32 pages in autograd's order, and the global norm is
        # torch's (a norm of per-parameter fp32 norms): bit-identical
        assert torch.equal(got[k], ref[k]), k


def test_updates_in_step_only_match_too(tmp_path):
    model = small_gpt()
    ref = reference(copy.deepcopy(model), 10, HP)
    got, stats = through_engine(model, 10, HP, tmp_path, overlap_update=False)
    assert stats["overlapped_updates"] == 0
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_activation_checkpointing_matches(tmp_path):
    """A checkpointed block recomputes its forward inside backward and keeps the recomputed
    tensors, parameter views among them, until its backward is done: its parameters must be
    resident together; the trace sees the recomputation and the plan keeps them."""
    model = small_gpt(checkpoint_activations=True)
    ref = reference(copy.deepcopy(model), 10, HP)
    got, stats = through_engine(model, 10, HP, tmp_path)
    assert stats["evictions"] > 0
    assert_followed_the_plan(stats, 10)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_activation_checkpointing_with_backward_on_another_thread_follows_the_plan(tmp_path):
    """On CUDA backward runs on autograd's device thread, numbering its nodes apart from the
    forward's: the recomputed blocks' ops must come in the traced order every iteration (the
    first GPU run left the plan at another op each iteration; [Note: nodes an invocation made])."""
    import concurrent.futures

    model = small_gpt(checkpoint_activations=True)
    ref = reference(copy.deepcopy(model), 6, HP)
    drift = iter([300, 5, 900, 0, 40, 7000])

    def elsewhere(fn, loss):  # that thread's numbers move by a different amount each iteration
        def run():
            for _ in range(next(drift)):
                torch.ones(1, requires_grad=True).mul(2)
            fn(loss)
        pool.submit(run).result()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        got, stats = through_engine(model, 6, HP, tmp_path, backward_on=elsewhere)
    assert stats["left_plan_at"] is None
    assert_followed_the_plan(stats, 6)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_evicted_parameters_keep_shape_and_dtype(tmp_path):
    model = small_gpt()
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_budget(model), cpu_bytes=8 * state_bytes(model))
    with pagemem.Engine(model, pagemem.EngineConfig(store=store)) as engine:
        idx, targets = next(batches(1))
        engine.backward(loss_of(engine, idx, targets))
        engine.step()
        assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == shapes


def reference_mixed(model, steps: int, hp: dict, dtype: torch.dtype, scaled: bool = False,
                    overflow_at: tuple[int, ...] = ()):
    """Plain PyTorch with the engine's precision policy: the model in ``dtype``, fp32 master
    weights stepped by fused AdamW on the gradients cast to fp32, the model refreshed from them;
    with ``scaled``, torch's GradScaler (dynamic scale, overflow skips the step)."""
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    names = {id(p): n for n, p in model.named_parameters()}
    model.to(dtype)
    opt = torch.optim.AdamW(master, fused=True, **hp)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    skipped = 0
    for s, (idx, targets) in enumerate(batches(steps)):
        loss = loss_of(model, idx, targets).float()
        if s in overflow_at:
            loss = loss * float("inf")
        (scaler.scale(loss) if scaler else loss).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        if scaler:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m.to(dtype))
    by_name = {names[id(p)]: m.detach() for p, m in zip(params, master)}
    out = {k: by_name[k] for k in by_name}
    for k, v in model.state_dict(keep_vars=True).items():  # tied names point at the same master
        if k not in out:
            out[k] = next(m.detach() for p, m in zip(params, master) if p is v)
    return out, skipped


def engine_mixed(model, steps: int, hp: dict, dtype: torch.dtype, overflow_at: tuple[int, ...] = (),
                 nvme_path=None, cpu_bytes: int | None = None, **cfg):
    budget = gpu_budget(model)
    if cfg.get("optimizer_tier") == "gpu":  # room for the states and gradient sums
        budget += (-(-16 * sum(p.numel() for p in model.parameters()) // PAGE) + 4) * PAGE
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                cpu_bytes=cpu_bytes or 8 * state_bytes(model),
                                nvme_bytes=8 * state_bytes(model) if nvme_path else 0,
                                nvme_path=str(nvme_path) if nvme_path else None)
    config = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**hp), compute_dtype=dtype,
                                  adam_threads=2, **cfg)
    with pagemem.Engine(model, config) as engine:
        for s, (idx, targets) in enumerate(batches(steps)):
            loss = loss_of(engine, idx, targets).float()
            if s in overflow_at:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        return engine.state_dict(), engine.stats()


@pytest.mark.parametrize("dtype,optimizer_tier", [(torch.bfloat16, "cpu"), (torch.float16, "cpu"),
                                                   (torch.bfloat16, "gpu")])
def test_mixed_precision_is_bit_identical_to_the_same_policy_in_plain_pytorch(dtype, optimizer_tier):
    """(With states on the gpu the bf16 compute copies are paged beside them.)"""
    model = small_gpt()
    ref, _ = reference_mixed(copy.deepcopy(model), 20, HP, dtype)
    got, stats = engine_mixed(model, 20, HP, dtype, loss_scale=None, optimizer_tier=optimizer_tier)
    assert stats["evictions"] > 0
    assert_followed_the_plan(stats, 20)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_fp16_loss_scaling_skips_overflowing_steps_as_grad_scaler_does():
    model = small_gpt()
    overflow = (3, 4, 11)
    ref, skipped = reference_mixed(copy.deepcopy(model), 15, HP, torch.float16, scaled=True, overflow_at=overflow)
    got, stats = engine_mixed(model, 15, HP, torch.float16, overflow_at=overflow)  # "dynamic" by default
    # the three forced overflows, and any the starting scale of 2**16 causes by itself
    assert skipped >= 3 and stats["skipped_steps"] == skipped
    assert stats["loss_scale"] == 65536.0 / 2 ** skipped
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_a_change_of_sequence_length_still_matches(tmp_path):
    """Iterations with other sequence lengths (the access order stays, the activations change)."""
    model = small_gpt()
    lengths = [32, 32, 16, 32, 8, 24, 32]
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 128, (4, n + 1), generator=g) for n in lengths]

    def run(m, opt_step, backward):
        for x in data:
            backward(loss_of(m, x[:, :-1], x[:, 1:]))
            opt_step()

    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), fused=True, **HP)
    run(ref_model, lambda: (opt.step(), opt.zero_grad(set_to_none=True)), lambda loss: loss.backward())
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_budget(model), cpu_bytes=8 * state_bytes(model))
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP),
                                                    overlap_update=True)) as engine:
        with pytest.warns(RuntimeWarning, match="traced and planned again"):
            run(engine, engine.step, engine.backward)
        got = engine.state_dict()
        stats = engine.stats()
        assert stats["overlapped_updates"] > 0
        # each new length is traced and planned once (32, 16, 8, 24); a length seen before
        # follows its plan
        assert stats["iterations"] == {"traced": 4, "planned": 3} and stats["replans"] == 3
        assert stats["misses"] == 0 and stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]
    for k, v in ref_model.state_dict().items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_states_of_units_the_plan_keeps_on_the_gpu_are_updated_there_bit_identically(tmp_path, optimizer_tier):
    """A budget with room beside the paged units: the plan caches a unit on the gpu (its update
    runs there), and the engine keeps that unit's optimizer states and gradient sums on the gpu,
    the others' on the optimizer tier; training is still bit-identical to plain PyTorch."""
    model = small_gpt()
    idx, targets = next(batches(1))
    budget = engine_gpu_budget(model, lambda m: loss_of(m, idx, targets).backward(), PAGE, 3.0)
    ref = reference(copy.deepcopy(model), 20, HP)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=8 * state_bytes(model),
                                nvme_bytes=8 * state_bytes(model) if optimizer_tier == "nvme" else 0,
                                nvme_path=str(tmp_path) if optimizer_tier == "nvme" else None)
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier=optimizer_tier,
                               adam_threads=2, overlap_update=True)
    with pagemem.Engine(model, cfg) as engine:
        for s, (x, y) in enumerate(batches(20)):
            engine.backward(loss_of(engine, x, y))
            engine.step()
            if s == 1:  # the first planned iteration placed them
                on_gpu = [li for li, t in enumerate(engine.bank.state_tiers) if t == "gpu"]
                engine.updater.flush()
                tiers = [({t.tier for t in layer.master + layer.exp_avg_sq}, {t.tier for t in layer.grad})
                         for layer in engine.bank.layers]
        stats = engine.stats()
        got = engine.state_dict()
    assert 0 < len(on_gpu) < len(tiers) and stats["gpu_state_units"] == len(on_gpu)
    for li, (states, grads) in enumerate(tiers):
        home = "gpu" if li in on_gpu else optimizer_tier
        assert states == {home} and grads == {"gpu" if li in on_gpu else "cpu"}, li
    assert_followed_the_plan(stats, 20)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("optimizer_tier,grad_tier", [("gpu", "gpu"), ("cpu", "cpu"), ("nvme", "cpu")])
def test_gradient_sums_live_beside_optimizer_states_kept_on_the_gpu(tmp_path, optimizer_tier, grad_tier):
    """A GPU's fused AdamW needs the gradient on the device with the states: states kept on the
    gpu get their gradient sums there (no round trip through the cpu), others get them on the cpu."""
    model = small_gpt()
    n = sum(p.numel() for p in model.parameters())
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_budget(model) + (-(-16 * n // PAGE) + 4) * PAGE,
                                cpu_bytes=8 * state_bytes(model),
                                nvme_bytes=8 * state_bytes(model) if optimizer_tier == "nvme" else 0,
                                nvme_path=str(tmp_path) if optimizer_tier == "nvme" else None)
    idx, targets = next(batches(1))
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer_tier=optimizer_tier)) as engine:
        engine.backward(loss_of(engine, idx, targets))
        engine.step()
        engine.updater.flush()  # states on nvme are written back behind the next iteration
        tiers = {t.tier for layer in engine.bank.layers for t in layer.grad}
        states = {t.tier for layer in engine.bank.layers for t in layer.master + layer.exp_avg}
    assert tiers == {grad_tier}
    assert states == {optimizer_tier}


@pytest.mark.parametrize("optimizer_tier", ["cpu", "gpu"])
def test_a_learning_rate_schedule_matches_with_updates_during_backward(tmp_path, optimizer_tier):
    """An lr scheduler drives ``engine.optimizer`` as it drives a torch optimizer, stepped after
    ``step()``; updates made during backward (on by default for states on the gpu) read the
    scheduled lr. Changing it between backward and ``step()`` is warned about: those updates
    are already done."""
    model = small_gpt()
    warm = lambda s: min(1.0, (s + 1) / 4) * 0.9 ** s  # noqa: E731 (a warm-up, then decay)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), fused=True, **HP)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    data = list(batches(12))
    for x, y in data:
        loss_of(ref_model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_sched.step()
    n = sum(p.numel() for p in model.parameters())
    budget = gpu_budget(model) + ((-(-16 * n // PAGE) + 4) * PAGE if optimizer_tier == "gpu" else 0)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=8 * state_bytes(model))
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier=optimizer_tier,
                               overlap_update=True)
    with pagemem.Engine(model, cfg) as engine:
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warm)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # scheduled after step(): nothing to warn
            for x, y in data:
                engine.backward(loss_of(engine, x, y))
                engine.step()
                sched.step()
        assert engine.stats()["overlapped_updates"] > 0
        got = engine.state_dict()
        for k in ref_model.state_dict():
            assert torch.equal(got[k], ref_model.state_dict()[k]), k
        engine.backward(loss_of(engine, *data[0]))
        engine.optimizer.param_groups[0]["lr"] *= 0.5
        with pytest.warns(RuntimeWarning, match="param_groups changed between backward and step"):
            engine.step()
