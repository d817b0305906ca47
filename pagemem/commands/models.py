"""The model ``pagemem train`` trains: the project's GPT, or a Hugging Face causal LM built from
its config (never downloaded: a model type's default config, or a local directory)."""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from pagemem.commands.train_config import ModelSettings
from pagemem.errors import ConfigError
from pagemem.models.gpt import GPT, GPTConfig

LossOf = Callable[[Callable[..., object], torch.Tensor], torch.Tensor]
"""``loss_of(run, batch)``: the next-token loss of ``batch`` (``[batch, seq + 1]`` ids) through
``run`` (the model or its engine)."""

_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def build(settings: ModelSettings, seed: int) -> tuple[nn.Module, LossOf, int, int]:
    """The model (initialised from ``seed``), its loss, its vocabulary size and longest sequence."""
    torch.manual_seed(seed)
    if settings.hf is None:
        gpt_fields = {f: getattr(settings, f) for f in GPTConfig.__dataclass_fields__}
        model = GPT(GPTConfig(**gpt_fields))
        vocab = settings.vocab

        def loss_of(run, x: torch.Tensor) -> torch.Tensor:
            logits = run(x[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))

        return model, loss_of, settings.vocab, settings.seq
    model = _hugging_face(settings.hf)

    def hf_loss_of(run, x: torch.Tensor) -> torch.Tensor:
        return run(input_ids=x, labels=x).loss  # the model shifts the labels

    cfg = model.config
    longest = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 1 << 20
    return model, hf_loss_of, int(cfg.vocab_size), int(longest) - 1


def _hugging_face(name: str) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf: needs transformers (pip install 'pagemem[hf]')") from None
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise ConfigError(f"model.hf: {name} has no config.json")
        if any(os.path.exists(os.path.join(name, w)) for w in _WEIGHTS):
            return transformers.AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.float32)
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(name))
    try:
        config = transformers.AutoConfig.for_model(name)
    except ValueError:
        raise ConfigError(f"model.hf: {name!r} is neither a directory nor a model type transformers knows "
                          "(gpt2, llama, mistral, qwen2, mixtral, ...)") from None
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise ConfigError(f"model.hf: {name!r} has no causal LM ({exc})") from None
