"""Architectures the engine knows nothing about train through it exactly as in plain PyTorch:
Hugging Face GPT-2 built from a config, and a mixture-of-experts model whose routing changes
which experts each iteration uses (unused experts get no gradient and no update, as in torch)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pagemem
from conftest import engine_gpu_budget

PAGE = 64 * 1024
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def run_both(model, step_loss, steps: int, budget_fraction: int = 3):
    """Train a copy in plain PyTorch and the model through the engine; return both state dicts."""
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), fused=True, **HP)
    for s in range(steps):
        step_loss(ref_model, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    budget = engine_gpu_budget(model, lambda m: step_loss(m, 0).backward(), PAGE, 1 / budget_fraction)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=40 * nbytes + 64 * PAGE)
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP),
                                                    adam_threads=2)) as engine:
        for s in range(steps):
            engine.backward(step_loss(engine, s))
            engine.step()
        return ref_model.state_dict(), engine.state_dict(), engine.stats()


def test_hugging_face_gpt2_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(8)]

    def step_loss(m, s):
        return m(input_ids=data[s], labels=data[s]).loss

    ref, got, stats = run_both(model, step_loss, 8)
    assert stats["evictions"] > 0
    assert stats["iterations"] == {"traced": 1, "planned": 7} and stats["misses"] == 0
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # the trained weights load back into a fresh model with plain PyTorch
    fresh = transformers.GPT2LMHeadModel(cfg)
    fresh.load_state_dict(got)


class TinyMoE(nn.Module):
    """Embedding, a top-1 router over four experts (each an MLP), and an output head."""

    def __init__(self, vocab: int = 64, hidden: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                   nn.Linear(4 * hidden, hidden)) for _ in range(experts))
        self.head = nn.Linear(hidden, vocab)
        self.choices: list[int] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        choice = self.router(x.mean(dim=(0, 1))).argmax().item()  # the whole batch takes one expert
        self.choices.append(choice)
        return self.head(x + self.experts[choice](x))


def test_mixture_of_experts_with_changing_routing():
    torch.manual_seed(0)
    model = TinyMoE()
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(12)]

    def step_loss(m, s):
        logits = m(data[s])
        return nn.functional.cross_entropy(logits.reshape(-1, 64), data[s].roll(1, 1).reshape(-1))

    with pytest.warns(RuntimeWarning, match="traced and planned again"):
        ref, got, stats = run_both(model, step_loss, 12)
    engine_choices = model.choices  # plain PyTorch and the budget trace ran on copies
    assert len(set(engine_choices)) > 1, engine_choices  # routing really changed between iterations
    # the rule (pagemem/engine/paging/pager.py): an iteration routed otherwise than the traced one leaves
    # its plan at the first other expert and finishes on demand; the next one is traced again;
    # after MAX_DIVERGENCES such iterations the inputs are paged on demand for good
    from pagemem.engine.paging.pager import MAX_DIVERGENCES
    want = {"traced": 0, "planned": 0, "left_plan": 0, "demand": 0}
    traced_choice = None
    for c in engine_choices:
        if want["left_plan"] >= MAX_DIVERGENCES:
            want["demand"] += 1
        elif traced_choice is None:
            want["traced"] += 1
            traced_choice = c
        else:
            want["planned"] += 1
            if c != traced_choice:
                want["left_plan"] += 1
                traced_choice = None
    assert want["left_plan"] > 0
    assert stats["iterations"] == {k: v for k, v in want.items() if v}
    assert stats["replans"] == want["traced"] - 1
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert stats["evictions"] > 0
