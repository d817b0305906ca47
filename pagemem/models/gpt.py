"""A plain GPT (decoder-only transformer) in PyTorch, the project's reference model.

Per block: LayerNorm -> fused QKV Linear -> causal attention -> output Linear -> residual,
then LayerNorm -> Linear(hidden, ffn) -> GELU -> Linear(ffn, hidden) -> residual. Token and
position embeddings, a final LayerNorm, and an output head tied to the token embedding.
All Linear layers and LayerNorms carry biases, so the parameter bytes follow ANGEL-PTM Table 1
plus the small tensors it leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pagemem.checks import check_int
from pagemem.errors import ConfigError
from pagemem.ownership import owning_modules


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    layers: int = 12
    """Transformer blocks."""
    hidden: int = 768
    """Width of the residual stream (the embedding size)."""
    heads: int = 12
    """Attention heads per block (they divide hidden)."""
    ffn: int = 0
    """FFN width; 0 means 4 * hidden."""
    vocab: int = 50304
    """Vocabulary size (token ids 0 to vocab - 1)."""
    seq: int = 1024
    """Longest sequence (number of position embeddings)."""
    tie_embeddings: bool = True
    """The output head shares the token embedding's weight."""
    checkpoint_activations: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint)."""

    def __post_init__(self) -> None:
        for name, lo in (("layers", 1), ("hidden", 1), ("heads", 1), ("vocab", 1), ("seq", 1), ("ffn", 0)):
            check_int(name, getattr(self, name), lo)
        if self.hidden % self.heads:
            raise ConfigError(f"heads: must divide hidden={self.hidden}, got {self.heads}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)

    def param_count(self) -> int:
        """Number of parameters of :class:`GPT` built from this config (closed form)."""
        h, f = self.hidden, self.ffn
        block = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        head = 0 if self.tie_embeddings else self.vocab * h
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h + head


_PRESETS = {
    "tiny": GPTConfig(layers=2, hidden=64, heads=4, vocab=512, seq=64),
    "small": GPTConfig(layers=8, hidden=256, heads=8, vocab=8192, seq=256),
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12, vocab=50304, seq=1024),
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16, vocab=50304, seq=1024),
    "gpt-1.3b": GPTConfig(layers=24, hidden=2048, heads=16, vocab=50304, seq=2048),
    "gpt-6.7b": GPTConfig(layers=32, hidden=4096, heads=32, vocab=50304, seq=2048),
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, vocab=50304, seq=2048),
    # ANGEL-PTM Table 4. The extracted table garbles two rows: GPT3-13B reads hidden 5140 /
    # ffn 20506 (not divisible by its 40 heads; 5120 / 20480 is GPT-3 13B), and GPT3-30B reads
    # 64 layers / 36 heads (36 layers / 64 heads gives its 30B parameters). "GPT3-28B" (Tables 4
    # and 5: 26 layers of hidden 8192) holds 21.4B parameters by the closed form, not 28B.
    "angel-gpt3-1.7b": GPTConfig(layers=24, hidden=2304, heads=24, ffn=9216, vocab=50304, seq=2048),
    "angel-gpt3-13b": GPTConfig(layers=40, hidden=5120, heads=40, ffn=20480, vocab=50304, seq=2048),
    "angel-gpt3-28b": GPTConfig(layers=26, hidden=8192, heads=128, ffn=32768, vocab=50304, seq=2048),
    "angel-gpt3-30b": GPTConfig(layers=36, hidden=8192, heads=64, ffn=32768, vocab=50304, seq=2048),
    "angel-gpt3-55b": GPTConfig(layers=68, hidden=8192, heads=128, ffn=32768, vocab=50304, seq=2048),
    "angel-gpt3-120b": GPTConfig(layers=64, hidden=12288, heads=96, ffn=49152, vocab=50304, seq=2048),
    "angel-gpt3-175b": GPTConfig(layers=70, hidden=14336, heads=112, ffn=57344, vocab=50304, seq=2048),
}


def gpt_config(name: str, **overrides: object) -> GPTConfig:
    """A named preset (``tiny``, ``small``, ``gpt2``, ``gpt2-medium``, ``gpt-1.3b``, ``gpt-6.7b``,
    ``gpt3-175b``, and ANGEL-PTM Table 4's ``angel-gpt3-1.7b`` .. ``angel-gpt3-175b``), with fields
    optionally overridden."""
    try:
        base = _PRESETS[name]
    except KeyError:
        raise ConfigError(f"model: unknown preset {name!r}; choose one of {', '.join(_PRESETS)}") from None
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    if "hidden" in overrides and "ffn" not in overrides:
        fields["ffn"] = 0
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def init_module(cfg: GPTConfig) -> Callable[[str, nn.Module], None]:
    """GPT-2's initialization of one module's own parameters, in place: Linear and Embedding
    weights normal(0, 0.02), the residual output projections' (``*.proj``) scaled by
    1 / sqrt(2 * layers), biases zero, LayerNorms at identity. :class:`GPT` applies it to each
    module that owns parameters, in module order; ``pagemem.Engine(meta_gpt, config,
    init=init_module(cfg))`` does the same to a GPT built on ``meta`` (the same weights for the
    same seed)."""
    proj_std = 0.02 / math.sqrt(2 * cfg.layers)

    def init(name: str, module: nn.Module) -> None:
        with torch.no_grad():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=proj_std if name.endswith("proj") else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    return init


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One transformer layer: the unit pagemem moves as a group."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None)`` returns logits, or the mean
    cross-entropy loss when ``targets`` is given."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        device = torch.get_default_device()
        with torch.device("meta"):  # no memory, no random draws: init_module draws every value
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        if cfg.tie_embeddings:  # after to_empty, which gives each parameter its own memory
            self.head.weight = self.wte.weight
        if device.type == "meta":
            return
        init = init_module(cfg)
        for name, module, _own in owning_modules(self):  # the order pagemem.Engine(init=) follows
            init(name, module)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.shape
        if s > self.cfg.seq:
            raise ValueError(f"sequence length {s} exceeds the model's seq={self.cfg.seq}")
        pos = torch.arange(s, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.cfg.checkpoint_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
