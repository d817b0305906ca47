"""The engine on a real GPU trains exactly as plain PyTorch doing the same arithmetic on it.

The other engine tests run on the host stand-in (``gpu_backend="host"``), where every path but
CUDA's runs. These train on the CUDA gpu tier, its arena resized to the plan, pages staged on
copy streams, gradients copied back, CPU Adam beside the GPU, and compare bit for bit with a
reference that does the same arithmetic: forward and backward on the GPU with the same weights
and batches, and the update where the engine makes it (fused AdamW on the GPU for states on
the ``gpu``; fused AdamW on the CPU over fp32 master weights, the gradients copied there, for
states on ``cpu`` or ``nvme``: what ZeRO-Offload and torchao's CPU-offload optimizer do).
Attention runs in SDPA's math kernel on both sides and cuBLAS with a fixed workspace, so that
equal inputs give equal bits."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import pagemem
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.sched import least_gpu_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAGE = 64 * 1024
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 12


@pytest.fixture(autouse=True)
def same_bits(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


CFG = GPTConfig(layers=4, hidden=512, heads=8, vocab=4096, seq=64)
"""15M parameters, 59 MB in fp32: large beside the allocator's own (cuBLAS workspaces of 32 MiB
and more), so that a third of them is a real share of the budget and units move every iteration."""


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randint(0, CFG.vocab, (4, CFG.seq + 1), generator=g)
        yield x[:, :-1].contiguous().cuda(), x[:, 1:].contiguous().cuda()


def loss_of(model, idx, targets) -> torch.Tensor:
    return model(idx, targets)


def reference(model: GPT, compute_dtype: torch.dtype, optimizer_tier: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch, the engine's arithmetic: compute in ``compute_dtype`` on the GPU; the fp32
    master weights and AdamW on the GPU (``gpu``) or on the CPU (``cpu``, ``nvme``)."""
    params = list(model.parameters())
    device = "cuda" if optimizer_tier == "gpu" else "cpu"
    master = [p.detach().to(device=device, dtype=torch.float32).clone().requires_grad_() for p in params]
    model.to(device="cuda", dtype=compute_dtype)
    opt = torch.optim.AdamW(master, fused=True, **HP)
    for idx, targets in batches(STEPS):
        loss_of(model, idx, targets).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.to(device=device, dtype=torch.float32)
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m.to(device="cuda", dtype=compute_dtype))
    names = [n for n, _ in model.named_parameters()]
    return {n: m.detach().cpu() for n, m in zip(names, master)}


def cuda_budget(model: GPT, compute_dtype: torch.dtype = torch.float32, param_fraction: float = 1 / 3) -> int:
    """The least the scheduler accepts for the trace an engine records on the GPU in its warm-up
    (its units; the caching allocator's bytes beside its arena: activations, and the gradients
    autograd makes there before they are copied out), plus a fraction of the parameters: pages
    move every iteration."""
    twin = copy.deepcopy(model)
    n = sum(p.numel() for p in model.parameters())
    store = pagemem.StoreConfig(gpu_backend="cuda", page_bytes=PAGE, gpu_bytes=(64 * n // PAGE + 64) * PAGE,
                                cpu_bytes=64 * n + (8 << 20))
    with pagemem.Engine(twin, pagemem.EngineConfig(store=store, compute_dtype=compute_dtype)) as engine:
        idx, targets = next(batches(1))
        engine.backward(loss_of(engine, idx, targets))
        tr = engine.pager.last_trace
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    least = least_gpu_bytes(tr.with_non_model_peak_reserved(), page_bytes=PAGE)
    return -(-(least + int(params * param_fraction)) // PAGE) * PAGE


@pytest.mark.parametrize("optimizer_tier,compute_dtype,overlap_update", [
    ("gpu", torch.float32, None), ("cpu", torch.float32, None), ("cpu", torch.float32, False),
    ("nvme", torch.float32, None), ("cpu", torch.bfloat16, None)])
def test_training_on_the_gpu_is_bit_identical_to_plain_pytorch(tmp_path, optimizer_tier, compute_dtype,
                                                                overlap_update):
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
    model = small_gpt()
    expected = reference(copy.deepcopy(model), compute_dtype, optimizer_tier)
    n = sum(p.numel() for p in model.parameters())
    budget = cuda_budget(model, compute_dtype) + ((-(-16 * n // PAGE) + 4) * PAGE if optimizer_tier == "gpu" else 0)
    store = pagemem.StoreConfig(gpu_backend="cuda", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=64 * n * 4 + (8 << 20),
                                nvme_bytes=32 * n + (8 << 20) if optimizer_tier == "nvme" else 0,
                                nvme_path=str(tmp_path) if optimizer_tier == "nvme" else None)
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier=optimizer_tier,
                               compute_dtype=compute_dtype, adam_threads=2, overlap_update=overlap_update)
    with pagemem.Engine(model, cfg) as engine:
        assert engine.device.type == "cuda" and engine.store.cuda
        for idx, targets in batches(STEPS):
            engine.backward(loss_of(engine, idx, targets))
            engine.step()
        got = engine.state_dict()
        stats = engine.stats()
    assert stats["iterations"] == {"traced": 1, "planned": STEPS - 1}, stats["iterations"]
    assert stats["misses"] == 0 and stats["replans"] == 0
    assert 0 < stats["gpu_peak_bytes"] <= stats["gpu_budget_bytes"]
    if optimizer_tier != "gpu":  # the parameters really moved in and out of the GPU, every planned iteration
        assert stats["executor_releases"] >= STEPS - 1 and stats["moved_bytes"].get("cpu->gpu", 0) > 0
    differ = {k: (got[k].float() - v).abs().max().item() for k, v in expected.items() if not torch.equal(got[k].float(), v)}
    assert not differ, f"{len(differ)} of {len(expected)} parameters differ (most abs difference): {differ}"


def test_the_gpu_tier_is_device_memory_the_plan_resizes():
    model = small_gpt()
    budget = cuda_budget(model)
    n = sum(p.numel() for p in model.parameters())
    store = pagemem.StoreConfig(gpu_backend="cuda", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=64 * n + (8 << 20))
    with pagemem.Engine(model, pagemem.EngineConfig(store=store)) as engine:
        assert engine.store.tier("gpu").buffer(0).is_cuda
        for idx, targets in batches(3):
            engine.backward(loss_of(engine, idx, targets))
            engine.step()
        stats = engine.stats()
        assert stats["iterations"] == {"traced": 1, "planned": 2}
        assert stats["executor_releases"] >= 2  # units moved in each planned iteration
        assert 0 < stats["gpu_arena_bytes"] < budget  # planned iterations run in an arena sized from the plan
        assert engine.store.tier("gpu").buffer(0).is_cuda  # still device memory after the resize
        assert all(p.is_cuda for p in model.parameters())


def test_work_given_to_the_adam_workers_runs_on_the_callers_stream():
    """Updates of states kept on the gpu run on CPU workers: their kernels must queue behind the
    caller's (the gradient accumulated into the pages), on the caller's stream, not the worker's."""
    from pagemem.engine.updates.adam import CpuAdam

    side = torch.cuda.Stream()
    with CpuAdam(2) as adam, torch.cuda.stream(side):
        got = adam.submit(torch.cuda.current_stream).result()
    assert got == side


def test_gradient_copies_to_host_pages_land_whole_behind_backward():
    """[Note: gradient copies]: the copy waits for the kernel that made the gradient, keeps the
    gradient's memory from reuse until it has read it, and an added one lands on the host."""
    from pagemem.engine.gradients.grad_copies import GradCopies

    copies = GradCopies()
    dst = torch.zeros(1 << 20, pin_memory=True)
    a = torch.randn(2048, 2048, device="cuda")
    grad = (a @ a @ a).reshape(-1)[: 1 << 20]  # still being computed when put() queues the copy
    want = grad.clone()
    copies.put(0, dst, grad, first=True)
    del grad
    torch.empty(1 << 22, device="cuda").fill_(float("nan"))  # would take the freed memory
    copies.put(0, dst, torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16), first=False)
    copies.landed()
    assert torch.equal(dst, want.cpu() + 1) and copies.in_flight() == 0
