"""An unmodified Hugging Face GPT-2 built from a config (no downloads); skipped without transformers."""

from __future__ import annotations

import copy

import pytest
import torch

from tracer_helpers import hook_snapshot
from pagemem.tracer import synthetic_transformer, trace

transformers = pytest.importorskip("transformers")


def _gpt2():
    # Exact GELU: GPT-2's default "gelu_new" is composed in Python and keeps four b*s*ffn tensors
    # where Table 1 (and a fused GELU) keeps one.
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  activation_function="gelu")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_hf_gpt2_trace_matches_synthetic_bytes():
    model = _gpt2()
    twin = copy.deepcopy(model)
    before = hook_snapshot(model)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 512, (2, 16), generator=g)
    tr = trace(model, lambda: model(input_ids=idx, labels=idx).loss.backward())
    assert hook_snapshot(model) == before
    names = [lay.name for lay in tr.layers]
    assert names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    # lm_head shares the token embedding: one tensor, accessed by both modules
    wte = tr.tensor("transformer.wte.weight")
    head_ops = [o.op_id for o in tr.ops if o.module == "lm_head" and o.event in ("forward_pre", "backward_pre")]
    assert len(head_ops) == 2 and set(head_ops) <= set(wte.accesses)
    # parameter and gradient bytes equal the synthetic trace of the same shape exactly
    syn = synthetic_transformer(layers=2, hidden=64, heads=4, seq=16, batch=2, vocab=512, positions=64,
                                dtype=torch.float32)
    for kind in ("param", "grad", "optimizer_state"):
        assert tr.bytes_by_kind()[kind] == syn.bytes_by_kind()[kind]
    for i in range(2):
        hf = sum(tr.tensors[t].nbytes for t in tr.layers[2 + i].tensor_ids)
        assert hf == syn.layers[2 + i].nbytes
    a, b = tr.bytes_by_kind()["activation"], syn.bytes_by_kind()["activation"]
    # HF also copies q out of the fused qkv output (one more b*s*d per layer) and shifts the labels
    assert abs(a - b) <= 0.15 * a, (a, b)
    # the traced model still trains exactly like an untraced copy
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        m(input_ids=idx, labels=idx).loss.backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
