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


@pytest.mark.parametrize("checkpoint_activations", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("preset,overrides,dtype,batch,seq", CASES)
def test_synthetic_matches_traced_gpt(preset, overrides, dtype, batch, seq, checkpoint_activations):
    cfg = gpt_config(preset, checkpoint_activations=checkpoint_activations, **overrides)
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
    # checkpointed: every block's forward is recomputed in backward (15 ops; torch stops early)
    recomputed = [o for o in syn.ops if o.phase == "backward" and o.event.startswith("forward")]
    assert len(recomputed) == (15 * cfg.layers if checkpoint_activations else 0)
    assert syn.meta["config"]["checkpoint_activations"] is checkpoint_activations


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
    with pytest.raises(ConfigError, match="checkpoint_activations"):
        synthetic_transformer(checkpoint_activations=1)
    with pytest.raises(ConfigError, match="checkpoint_activations"):
        TransformerShape(checkpoint_activations="yes")
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


def _recompute_window(tr, i: int) -> list:
    """Ops from block i's first backward op (mlp.proj's backward_pre) to its first grad_ready."""
    start = next(o.op_id for o in tr.ops if o.event == "backward_pre" and o.module == f"blocks.{i}.mlp.proj")
    end = next(o.op_id for o in tr.ops if o.event == "grad_ready" and o.module == f"blocks.{i}.mlp.proj.bias")
    return list(tr.ops[start:end])


def test_checkpointed_backward_recomputes_each_block_before_its_backward():
    L = 3
    tr = synthetic_transformer(layers=L, hidden=64, heads=4, seq=16, batch=2, vocab=128, checkpoint_activations=True)
    forward_modules = [o.module for o in tr.ops if o.phase == "forward" and o.module.startswith("blocks.1")]
    for i in range(L):
        window = _recompute_window(tr, i)
        recompute = window[1:]
        assert window[0].event == "backward_pre" and all(o.phase == "backward" for o in window)
        assert all(o.event.startswith("forward") for o in recompute) and len(recompute) == 15
        # the block's forward again, up to mlp.proj's forward_pre, where the last saved tensor exists
        assert [o.module.replace(f"blocks.{i}", "blocks.1") for o in recompute] == forward_modules[:15]
        assert (recompute[-1].event, recompute[-1].module) == ("forward_pre", f"blocks.{i}.mlp.proj")
        # its parameters are accessed in forward and again in the recomputation
        qkv = tr.tensor(f"blocks.{i}.attn.qkv.weight")
        fpre = [o.op_id for o in recompute if o.module == f"blocks.{i}.attn.qkv"]
        assert set(fpre) <= set(qkv.accesses) and tr.ops[qkv.first_id].phase == "forward"
        # the checkpoint reads the block's input at the first backward op
        x_in = tr.tensor("embed" if i == 0 else f"blocks.{i - 1}:mlp_add")
        assert window[0].op_id in x_in.accesses
        # blocks run backward last-first: block i's recomputation follows block i+1's backward
        if i + 1 < L:
            later = tr.tensor(f"blocks.{i + 1}.ln1.weight.grad")
            assert later.accesses[-2] < window[0].op_id  # (the last access is the optimizer step)
    assert tr.ops[-1].non_model_bytes == 0  # everything recomputed was released


def test_checkpointing_keeps_one_block_input_per_block_and_cuts_peak_memory():
    b, s, d, f, L, it = 2, 128, 256, 1024, 8, 2
    kw = dict(layers=L, hidden=d, ffn=f, heads=8, seq=s, batch=b, dtype=torch.float16, vocab=64)
    plain, ck = synthetic_transformer(**kw), synthetic_transformer(**kw, checkpoint_activations=True)
    bsd, bsf = b * s * d * it, b * s * f * it
    # forward keeps one (b, s, d) tensor per block (its output: the next block's or ln_f's input) ...
    kept = [(t.name, t.shape, t.nbytes) for t in ck.of_kind("activation") if t.name.startswith("blocks.")]
    assert kept == [(f"blocks.{i}:mlp_add", (b, s, d), bsd) for i in range(L)]
    # ... instead of Table 1's 8 bsd + 2 bsf elements (flash attention)
    assert sum(t.nbytes for t in plain.of_kind("activation") if t.name.startswith("blocks.")) == L * (8 * bsd + 2 * bsf)
    end = next(o.op_id for o in ck.ops if o.event == "forward_post" and o.module == f"blocks.{L - 1}")
    live = sum(t.nbytes for t in ck.of_kind("activation") if t.first_id <= end <= t.end_id)
    assert live == (L + 1) * bsd + 8 * b * s + 8 * s  # + embed, tokens, positions (int64)
    # peak: the block inputs plus one recomputed block (7 bsd + 2 bsf) vs every block's activations
    expect_ck, expect_plain = (L + 7) * bsd + 2 * bsf, (8 * L + 1) * bsd + 2 * L * bsf
    assert abs(ck.peak_non_model_bytes - expect_ck) <= 0.03 * expect_ck
    assert abs(plain.peak_non_model_bytes - expect_plain) <= 0.03 * expect_plain
    assert ck.peak_non_model_bytes < 0.2 * plain.peak_non_model_bytes
    peak_op = max(ck.ops, key=lambda o: o.non_model_bytes)
    assert (peak_op.phase, peak_op.module) == ("backward", f"blocks.{L - 1}.mlp.fc")
    # same model states, same bytes
    names = lambda tr: [(t.name, t.nbytes) for t in tr.tensors if t.is_model_state]  # noqa: E731
    assert names(ck) == names(plain)


def test_gpt3_175b_table_4_with_checkpointing():
    # ANGEL-PTM Table 4: GPT-3 175B, 70 layers, 112 heads, hidden 14336, ffn 57344, seq 2048, batch 1, bf16
    kw = dict(layers=70, hidden=14336, ffn=57344, heads=112, seq=2048, batch=1, dtype=torch.bfloat16, vocab=50304)
    plain, ck = synthetic_transformer(**kw), synthetic_transformer(**kw, checkpoint_activations=True)
    bsd = 2048 * 14336 * 2
    assert 60e9 < plain.peak_non_model_bytes < 70e9
    # checkpointed: 70 block inputs (4.1 GB), one recomputed block and the loss's logits
    assert 70 * bsd < ck.peak_non_model_bytes < 6e9
    assert ck.peak_non_model_bytes < 0.1 * plain.peak_non_model_bytes
    assert ck.bytes_by_kind()["param"] == plain.bytes_by_kind()["param"]
    assert ck.ops[-1].non_model_bytes == 0 and ck.meta["config"]["checkpoint_activations"] is True
    # backward computes the blocks' forward again, less mlp.proj (a third of a block's FLOPs)
    fwd = math.fsum(o.duration for o in ck.ops if o.phase == "forward")
    bwd = math.fsum(o.duration for o in ck.ops if o.phase == "backward")
    assert 2.5 < bwd / fwd < 2.8


@settings(max_examples=30, deadline=None)
@given(configs)
def test_checkpointed_synthetic_invariants_and_json_round_trip(tmp_path_factory, c):
    hidden = c["heads"] * c["head_dim"]
    kw = dict(layers=c["layers"], hidden=hidden, ffn=c["ffn_mult"] * hidden, heads=c["heads"], seq=c["seq"],
              batch=c["batch"], dtype=c["dtype"], vocab=c["vocab"], tie_embeddings=c["tie"],
              attention=c["attention"], optimizer_model=c["optimizer"])
    tr = synthetic_transformer(**kw, checkpoint_activations=True)
    plain = synthetic_transformer(**kw)
    assert tr.meta["config"]["checkpoint_activations"] is True
    assert len(tr.ops) == len(plain.ops) + 15 * c["layers"]
    assert [(t.name, t.nbytes) for t in tr.tensors if t.is_model_state] == \
           [(t.name, t.nbytes) for t in plain.tensors if t.is_model_state]
    for t in tr.tensors:
        assert t.accesses and list(t.accesses) == sorted(set(t.accesses))
        if t.kind == "param":  # used in forward and in backward (blocks: twice in backward)
            assert tr.ops[t.first_id].phase == "forward" and tr.ops[t.end_id].phase != "forward"
    blocks = [t.name for t in tr.of_kind("activation") if t.name.startswith("blocks.")]
    assert blocks == [f"blocks.{i}:mlp_add" for i in range(c["layers"])]
    assert tr.ops[-1].non_model_bytes == 0
    assert tr.peak_non_model_bytes <= plain.peak_non_model_bytes
    path = tmp_path_factory.mktemp("rt") / "t.json"
    tr.save(path)
    back = type(tr).load(path)  # load validates the trace again
    assert back == tr
    assert back.fingerprint == tr.fingerprint
    assert back.to_dict() == tr.to_dict()
