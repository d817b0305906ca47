"""The model ``pagemem train`` trains: the project's GPT, or a Hugging Face causal LM built from
its config (never downloaded: a model type's default config, or a local directory).

[Note: a Hugging Face directory's weights] A directory with safetensors weights in Hugging
Face's layout (``model.safetensors``, or shards and ``model.safetensors.index.json``) gives the
model built from its ``config.json`` with its parameters on ``meta``, and the directory as the
engine's ``values`` ([Note: values from safetensors]): host memory never holds the model twice.
Its buffers are made as the model's code makes them (a rotary embedding's ``inv_freq``, which no
weights file holds); those the files hold are set from them. Other weights (``pytorch_model.bin``)
are loaded whole with ``from_pretrained``; none, the model is initialised afresh.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pagemem.commands.train_config import ModelSettings
from pagemem.engine.checkpoints.safetensors_layout import INDEX, SINGLE
from pagemem.errors import ConfigError
from pagemem.models.gpt import GPT, GPTConfig

LossOf = Callable[[Callable[..., object], torch.Tensor], torch.Tensor]
"""``loss_of(run, batch)``: the next-token loss of ``batch`` (``[batch, seq + 1]`` ids) through
``run`` (the model or its engine)."""

_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Built:
    """What ``pagemem train`` trains: the model, its loss, its vocabulary size and longest
    sequence, and where its values come from (``values``: a weights path for
    ``Engine(values=)``, its parameters then on ``meta``; None: the model holds them)."""

    model: nn.Module
    loss_of: LossOf
    vocab: int
    longest: int
    values: str | None = None


def build(settings: ModelSettings, seed: int, weights: bool = True) -> Built:
    """The model (initialised from ``seed``, or to take a directory's safetensors weights: see
    [Note: a Hugging Face directory's weights]); ``weights=False``: such a model initialised
    afresh instead, off ``meta`` (a stand-in of the same shapes, to size budgets with)."""
    torch.manual_seed(seed)
    if settings.hf is None:
        gpt_fields = {f: getattr(settings, f) for f in GPTConfig.__dataclass_fields__}
        model = GPT(GPTConfig(**gpt_fields))
        vocab = settings.vocab

        def loss_of(run, x: torch.Tensor) -> torch.Tensor:
            logits = run(x[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))

        return Built(model, loss_of, settings.vocab, settings.seq)
    model, values = _hugging_face(settings.hf, weights)

    def hf_loss_of(run, x: torch.Tensor) -> torch.Tensor:
        return run(input_ids=x, labels=x).loss  # the model shifts the labels

    cfg = model.config
    longest = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 1 << 20
    return Built(model, hf_loss_of, int(cfg.vocab_size), int(longest) - 1, values)


def shapes_only(settings: ModelSettings, seed: int) -> nn.Module:
    """The model with its parameters on ``meta`` (no memory, nothing drawn): to count its bytes,
    or for ``Engine.load`` to fill from a checkpoint. Buffers are made as the model's code makes
    them (a Hugging Face model's rotary ``inv_freq``); the project's GPT has none."""
    if settings.hf is None:
        with torch.device("meta"):
            return build(settings, seed, weights=False).model
    with parameters_on_meta():
        return build(settings, seed, weights=False).model


def has_safetensors(directory: str) -> bool:
    """Whether ``directory`` holds safetensors weights in Hugging Face's layout."""
    return any(os.path.isfile(os.path.join(directory, n)) for n in (SINGLE, INDEX))


def _hugging_face(name: str, weights: bool) -> tuple[nn.Module, str | None]:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf: needs transformers (pip install 'pagemem[hf]')") from None
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise ConfigError(f"model.hf: {name} has no config.json")
        config = transformers.AutoConfig.from_pretrained(name)
        if has_safetensors(name):  # in float32, as from_pretrained below (the engine computes as configured)
            if not weights:
                return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), None
            with parameters_on_meta():
                return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), name
        if any(os.path.exists(os.path.join(name, w)) for w in _PICKLED):
            return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), None
        return transformers.AutoModelForCausalLM.from_config(config), None
    try:
        config = transformers.AutoConfig.for_model(name)
    except ValueError:
        raise ConfigError(f"model.hf: {name!r} is neither a directory nor a model type transformers knows "
                          "(gpt2, llama, mistral, qwen2, mixtral, ...)") from None
    try:
        return transformers.AutoModelForCausalLM.from_config(config), None
    except ValueError as exc:
        raise ConfigError(f"model.hf: {name!r} has no causal LM ({exc})") from None


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside goes to ``meta`` at once (no memory; its
    initialisation then computes nothing), keeping its dtype and ``requires_grad``; buffers are
    made as usual. Not thread-safe: it swaps ``nn.Module.register_parameter`` meanwhile."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
