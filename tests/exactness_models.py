"""Small models that read their parameters where the engine's old rule did not look."""

from __future__ import annotations

import torch
from torch import nn


class ParamAfterChild(nn.Module):
    """Reads its own weight after calling a parameter-free child (the issue's smallest case)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.act = nn.GELU()
        self.w = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)) @ self.w)


class Block(nn.Module):
    """A pre-norm MLP block with layer scale (``gamma`` read after the MLP child)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.gamma = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * self.gamma


class TinyViT(nn.Module):
    """Patch embedding, a class token and position embedding read after it, blocks with layer
    scale, a head on the class token."""

    def __init__(self, width: int = 64, patches: int = 16, patch_dim: int = 48, depth: int = 3,
                 classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, width)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, patches + 1, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(x[:, 0])


class WeightNormed(nn.Module):
    """Linear layers under ``weight_norm``: the new parametrization and the old pre-hook."""

    def __init__(self, width: int = 64, old: bool = False) -> None:
        super().__init__()
        wn = torch.nn.utils.weight_norm if old else torch.nn.utils.parametrizations.weight_norm
        self.a = wn(nn.Linear(width, 2 * width))
        self.b = wn(nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Shared(nn.Module):
    """One module called twice, a parameter read in the loss too (``scale``)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.g = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(torch.relu(self.f(torch.relu(self.f(x))))) * self.scale


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update ``B @ A`` (LoRA)."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) / width ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(width, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRANet(nn.Module):
    """Three LoRA layers over a frozen embedding-like input projection."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width // 2, width)
        self.inp.requires_grad_(False)
        self.layers = nn.ModuleList(LoRALinear(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x[..., : self.inp.in_features])
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class OnBackward(torch.autograd.Function):
    """Identity whose backward first takes one item of ``pending``: an exception is raised, a
    callable is called (to raise, or to call into the engine from inside a backward)."""

    pending: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if OnBackward.pending:
            item = OnBackward.pending.pop()
            if isinstance(item, BaseException):
                raise item
            item()
        return g
