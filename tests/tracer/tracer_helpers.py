"""Helpers for the tracer tests: small models, their training steps, hook snapshots.

(A uniquely named module rather than ``conftest`` so that ``import`` is unambiguous when other
test directories have their own conftest.py.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.optim import optimizer as optim_mod

from pagemem.models import GPT, gpt_config


def make_gpt(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", **overrides))


def gpt_batch(model: GPT, batch: int = 2, seq: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.cfg.vocab, (batch, seq), generator=g)
    tgt = torch.randint(0, model.cfg.vocab, (batch, seq), generator=g)
    return idx, tgt


def gpt_step(model: GPT, batch: int = 2, seq: int = 16, optimizer: torch.optim.Optimizer | None = None
             ) -> Callable[[], float]:
    idx, tgt = gpt_batch(model, batch, seq)

    def step() -> float:
        loss = model(idx, tgt)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def hook_snapshot(model: nn.Module) -> dict[str, int]:
    """Count every hook a tracer could leave behind, on the model and globally."""
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            counts[f"{name}:{attr}"] = len(getattr(m, attr, {}) or {})
    for name, p in model.named_parameters():
        counts[f"{name}:post_acc"] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        counts[f"{name}:tensor_hooks"] = len(getattr(p, "_backward_hooks", None) or {})
    mm = torch.nn.modules.module
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        counts[attr] = len(getattr(mm, attr))
    counts["opt_pre"] = len(optim_mod._global_optimizer_pre_hooks)
    counts["opt_post"] = len(optim_mod._global_optimizer_post_hooks)
    counts["saved_tensor_hooks"] = int(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    return counts
