"""What the framework integration tests share: a small Hugging Face GPT-2, its data, and an engine
config whose gpu budget is the least the scheduler accepts plus a third of the parameters (pages
move every iteration; ``exactness.engine_config``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from exactness import engine_config

GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQ = 16
BATCH = 2


def gpt2() -> torch.nn.Module:
    """The same small GPT-2 on every call (dropout off: both runs then do the same arithmetic)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))


def sequences(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, GPT2["vocab_size"], (SEQ,), generator=g) for _ in range(n)]


def config_for(tmp_path, optimizer_tier: str = "cpu", **kw):
    """An engine config for :func:`gpt2` at batch ``BATCH``, pages moving (states on ``cpu``: one
    config for every test, traced once; it names no path)."""
    if optimizer_tier == "cpu" and not kw:
        return _cpu_config()
    return _config(tmp_path, optimizer_tier, **kw)


def _config(tmp_path, optimizer_tier: str, **kw):
    data = torch.stack(sequences(BATCH))

    def loss(run, model, s):
        return run(input_ids=data, labels=data).loss

    return engine_config(gpt2(), loss, tmp_path, optimizer_tier, **kw)


@functools.cache
def _cpu_config():
    return _config(None, "cpu")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Both runs on one intra-op thread: the reference and the engine's compute must split their
    matmuls alike to agree bit for bit, and on a loaded 2-core machine more threads make plain
    PyTorch ten times slower (the engine's Adam workers are its config's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def differing(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """Keys whose tensors differ, with the largest difference (empty: bit for bit)."""
    assert got.keys() == ref.keys()
    return {k: float((got[k].float() - ref[k].float()).abs().max()) for k in ref if not torch.equal(got[k], ref[k])}
