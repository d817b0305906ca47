"""Synthetic traces: agreement with a traced GPT, ANGEL-PTM Table 1, and GPT-3 175B."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer_helpers import gpt_step
from pagemem.errors import ConfigError
from pagemem.models import GPT, gpt_config
from pagemem.tracer import CostModel, TransformerShape, synthetic_from_config, synthetic_transformer, trace

CASES = [
    ("tiny", {}, torch.float32, 2, 16),
    ("tiny", {"tie_embeddings": False}, torch.float32, 3, 8),
    ("tiny", {"ffn": 64, "layers": 3}, torch.float32, 2, 32),
    ("tiny", {"hidden": 32, "heads": 2, "vocab": 64}, torch.bfloat16, 4, 16),
    ("small", {"layers": 2}, torch.float32, 1, 64),
]


def _model_states(tr):
    return [(t.name, t.kind, t.dtype, t.shape, t.nbytes, t.accesses, t.param_id, t.layer)
            for t in tr.tensors if t.kind != "activation"]


@pytest.mark.parametrize("preset,overrides,dtype,batch,seq", CASES)
def test_synthetic_matches_traced_gpt(preset, overrides, dtype, batch, seq):
    cfg = gpt_config(preset, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    traced = trace(model, gpt_step(model, batch, seq))
    syn = synthetic_from_config(cfg, batch=batch, seq=seq, dtype=dtype)
    # every parameter, gradient and (modelled) optimizer state: same name, bytes and accesses
    assert _model_states(traced) == _model_states(syn)
    assert traced.bytes_by_kind()["param"] == syn.bytes_by_kind()["param"] == sum(
        p.numel() * p.element_size() for p in model.parameters())
    # the same op sequence and the same layers
    assert [(o.event, o.module, o.phase) for o in traced.ops] == [(o.event, o.module, o.phase) for o in syn.ops]
    assert [(lay.name, lay.tensor_ids, lay.first_id, lay.nbytes) for lay in traced.layers] == \
           [(lay.name, lay.tensor_ids, lay.first_id, lay.nbytes) for lay in syn.layers]
    # activation bytes within 10%
    a, b = traced.bytes_by_kind()["activation"], syn.bytes_by_kind()["activation"]
    assert abs(b - a) <= 0.10 * a, (a, b)


def test_synthetic_optimizer_states_match_a_traced_adamw():
    cfg = gpt_config("tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    traced = trace(model, gpt_step(model), torch.optim.AdamW(model.parameters()))
    syn = synthetic_from_config(cfg, batch=2, seq=16)
    key = lambda tr: sorted((t.name, t.nbytes, t.shape) for t in tr.of_kind("optimizer_state"))  # noqa: E731
    assert key(traced) == key(syn)


def _block_bytes(tr, i: int, kind: str) -> int:
    if kind == "activation":
        return sum(t.nbytes for t in tr.of_kind(kind) if t.name.startswith(f"blocks.{i}:"))
    return sum(t.nbytes for t in tr.of_kind(kind) if t.name.startswith(f"blocks.{i}."))


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_per_layer_footprint_follows_table_1(attention):
    b, s, d, f, a = 2, 128, 256, 1024, 8
    tr = synthetic_transformer(layers=3, hidden=d, ffn=f, heads=a, seq=s, batch=b, dtype=torch.float16,
                               attention=attention)
    # Table 1, Parameters (fp16 params + fp16 grads): 16 d^2 + 8 d f, plus biases and LayerNorms
    small = 2 * 2 * (3 * d + d + f + d + 4 * d)
    assert _block_bytes(tr, 1, "param") + _block_bytes(tr, 1, "grad") == 16 * d * d + 8 * d * f + small
    # Table 1, Optimizers (fp32 master, m, v): 48 d^2 + 24 d f, plus the small tensors
    assert _block_bytes(tr, 1, "optimizer_state") == 48 * d * d + 24 * d * f + 3 * small
    # Table 1, Activations, forward copies (half of its fwd+bwd bytes): 20bsd + 4bs^2 + 4bsf bytes,
    # less the two Linear outputs feeding residual Adds (2 x 2bsd), with the heads in the s^2 terms
    scores = 2 * 2 * b * a * s * s if attention == "math" else 0
    assert _block_bytes(tr, 1, "activation") == 20 * b * s * d - 4 * b * s * d + scores + 4 * b * s * f


def test_gpt3_175b_synthetic_trace():
    tr = synthetic_transformer(layers=96, hidden=12288, heads=96, seq=2048, batch=1, dtype=torch.float16)
    cfg = gpt_config("gpt3-175b")
    assert sum(t.nbytes for t in tr.of_kind("param")) == 2 * cfg.param_count()
    assert 174e9 < cfg.param_count() < 176e9
    assert sum(t.nbytes for t in tr.of_kind("optimizer_state")) == 12 * cfg.param_count()
    assert len(tr.layers) == 96 + 3 and [lay.name for lay in tr.layers][2:5] == ["blocks.0", "blocks.1", "blocks.2"]
    # per-op durations are FLOP based: forward ~ 2 * params * tokens / rate
    fwd = math.fsum(o.duration for o in tr.ops if o.phase == "forward")
    assert 0.9 < fwd / (2 * cfg.param_count() * 2048 / CostModel().flops_per_second) < 1.3
    bwd = math.fsum(o.duration for o in tr.ops if o.phase == "backward")
    assert 1.8 < bwd / fwd < 2.2
    assert all(o.gpu_time == o.duration and o.cpu_time is None for o in tr.ops)
    # every parameter is used in forward and in backward, every activation released in backward
    for t in tr.of_kind("param"):
        assert tr.ops[t.first_id].phase == "forward" and any(tr.ops[x].phase == "backward" for x in t.accesses)
    assert tr.ops[-1].non_model_bytes == 0
    assert tr.peak_non_model_bytes >= sum(t.nbytes for t in tr.of_kind("activation"))


def test_flops_rate_is_a_parameter():
    slow = synthetic_transformer(layers=2, hidden=512, heads=8, seq=256, batch=2,
                                 cost=CostModel(flops_per_second=1e12, bytes_per_second=1e11))
    fast = synthetic_transformer(layers=2, hidden=512, heads=8, seq=256, batch=2)
    assert slow.iteration_seconds > 50 * fast.iteration_seconds
    assert slow.fingerprint == fast.fingerprint
    assert slow.meta["cost_model"]["flops_per_second"] == 1e12


def test_bad_synthetic_configuration_is_refused():
    with pytest.raises(ConfigError, match="heads"):
        synthetic_transformer(hidden=100, heads=3)
    with pytest.raises(ConfigError, match="layers"):
        synthetic_transformer(layers=0)
    with pytest.raises(ConfigError, match="dtype"):
        synthetic_transformer(dtype=torch.int32)
    with pytest.raises(ConfigError, match="attention"):
        synthetic_transformer(attention="sparse")
    with pytest.raises(ConfigError, match="positions"):
        synthetic_transformer(seq=1024, positions=512)
    with pytest.raises(ConfigError, match="checkpoint"):
        synthetic_from_config(gpt_config("tiny", checkpoint_activations=True), batch=1)
    with pytest.raises(ConfigError, match="flops_per_second"):
        CostModel(flops_per_second=0)
    assert TransformerShape(dtype=torch.bfloat16).dtype == "bfloat16"


configs = st.builds(
    dict,
    layers=st.integers(1, 4), heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([4, 8]),
    ffn_mult=st.integers(0, 4), seq=st.integers(1, 32), batch=st.integers(1, 4), vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), tie=st.booleans(),
    attention=st.sampled_from(["flash", "math"]), optimizer=st.sampled_from(["adam", "none"]),
)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_synthetic_invariants_and_json_round_trip(tmp_path_factory, c):
    hidden = c["heads"] * c["head_dim"]
    tr = synthetic_transformer(layers=c["layers"], hidden=hidden, ffn=c["ffn_mult"] * hidden, heads=c["heads"],
                               seq=c["seq"], batch=c["batch"], dtype=c["dtype"], vocab=c["vocab"],
                               tie_embeddings=c["tie"], attention=c["attention"], optimizer_model=c["optimizer"])
    n_params = sum(1 for t in tr.tensors if t.kind == "param")
    assert n_params == 2 + 12 * c["layers"] + 2 + (0 if c["tie"] else 1)
    for t in tr.tensors:
        if t.kind != "activation":
            assert t.nbytes == math.prod(t.shape) * t.torch_dtype.itemsize
        assert t.accesses and list(t.accesses) == sorted(set(t.accesses))
    assert (c["optimizer"] == "none") == (tr.ops[-1].event != "step")
    path = tmp_path_factory.mktemp("rt") / "t.json"
    tr.save(path)
    back = type(tr).load(path)
    assert back == tr
    assert back.fingerprint == tr.fingerprint
    assert back.to_dict() == tr.to_dict()
