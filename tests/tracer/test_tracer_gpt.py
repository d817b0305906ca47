"""Tracing the project's GPT: records, logical time, tied weights, checkpointing, optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from tracer_helpers import gpt_batch, gpt_step, make_gpt
from pagemem.tracer import Trace, TraceOptions, trace


def _ops_by(tr: Trace, event: str, module: str) -> list[int]:
    return [o.op_id for o in tr.ops if o.event == event and o.module == module]


def test_records_describe_the_iteration(tiny):
    tr = trace(tiny, gpt_step(tiny))
    assert [o.op_id for o in tr.ops] == list(range(len(tr.ops)))
    assert [t.tensor_id for t in tr.tensors] == list(range(len(tr.tensors)))
    names = [n for n, _ in tiny.named_parameters()]
    params = tr.of_kind("param")
    assert [t.name for t in params] == names
    for t, (_, p) in zip(params, tiny.named_parameters()):
        assert t.shape == tuple(p.shape) and t.dtype == "float32"
        assert t.nbytes == p.numel() * 4
    grads = tr.of_kind("grad")
    assert [g.name for g in grads] == [f"{n}.grad" for n in names]
    assert all(tr.tensors[g.param_id].name + ".grad" == g.name for g in grads)
    for t in tr.tensors:
        assert t.accesses == tuple(sorted(set(t.accesses)))
        assert t.first_id == t.accesses[0] and t.end_id == t.accesses[-1]
    acts = tr.of_kind("activation")
    assert acts and all(a.nbytes > 0 for a in acts)
    # phases come in order: forward, then backward, then the (modelled) optimizer step
    phases = [o.phase for o in tr.ops]
    last_fwd = max(i for i, p in enumerate(phases) if p == "forward")
    first_bwd = phases.index("backward")
    assert last_fwd < first_bwd and phases[-1] == "step"
    assert tr.ops[0].event == "forward_pre" and tr.ops[0].module == ""
    # every parameter is accessed in forward and in backward; every gradient in backward
    for t in params:
        assert phases[t.first_id] == "forward"
        assert any(phases[a] == "backward" for a in t.accesses)
    for g in grads:
        assert phases[g.first_id] == "backward"
        assert tr.ops[g.end_id].event == "step"
        ready = [o.op_id for o in tr.ops if o.event == "grad_ready" and o.module == g.name[: -len(".grad")]]
        assert len(ready) == 1 and ready[0] in g.accesses
    # activations are saved in forward and used again in backward
    for a in acts:
        assert phases[a.first_id] == "forward"
    big = [a for a in acts if a.nbytes >= 2 * 16 * 64 * 4]
    # (the loss backward runs in the interval of the root's forward_post, the last forward op)
    assert big and all(a.end_id >= last_fwd for a in big)
    # layers: embeddings, each block, the final LayerNorm, in order of first use
    assert [lay.name for lay in tr.layers] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f"]
    assert [lay.first_id for lay in tr.layers] == sorted(lay.first_id for lay in tr.layers)
    owned = sorted(t for lay in tr.layers for t in lay.tensor_ids)
    assert owned == [t.tensor_id for t in params]
    assert tr.layers[2].nbytes == sum(p.numel() * 4 for p in tiny.blocks[0].parameters())


def test_module_accesses_are_the_op_windows(tiny):
    tr = trace(tiny, gpt_step(tiny))
    w = tr.tensor("blocks.1.attn.qkv.weight")
    fpre, fpost = _ops_by(tr, "forward_pre", "blocks.1.attn.qkv"), _ops_by(tr, "forward_post", "blocks.1.attn.qkv")
    bpre, bpost = _ops_by(tr, "backward_pre", "blocks.1.attn.qkv"), _ops_by(tr, "backward_post", "blocks.1.attn.qkv")
    assert len(fpre) == len(fpost) == len(bpre) == len(bpost) == 1
    step = _ops_by(tr, "step", "optimizer")
    assert w.accesses == tuple(range(fpre[0], fpost[0] + 1)) + tuple(range(bpre[0], bpost[0] + 1)) + tuple(step)
    g = tr.tensor("blocks.1.attn.qkv.weight.grad")
    assert g.first_id == bpre[0] and g.accesses[-1] == step[0]


def test_tied_embedding_is_one_tensor_used_twice(tiny):
    assert tiny.head.weight is tiny.wte.weight
    tr = trace(tiny, gpt_step(tiny))
    assert "head.weight" not in {t.name for t in tr.tensors}
    wte = tr.tensor("wte.weight")
    for event in ("forward_pre", "backward_pre"):
        for module in ("wte", "head"):
            assert _ops_by(tr, event, module)[0] in wte.accesses
    grad = tr.tensor("wte.weight.grad")
    assert grad.first_id == _ops_by(tr, "backward_pre", "head")[0]  # written by the head's backward first
    assert [tr.tensors[i].name for i in tr.layers[0].tensor_ids] == ["wte.weight"]


def test_untied_head_has_its_own_layer():
    model = make_gpt(tie_embeddings=False)
    tr = trace(model, gpt_step(model))
    head = tr.tensor("head.weight")
    assert head.nbytes == model.cfg.vocab * model.cfg.hidden * 4
    assert [lay.name for lay in tr.layers][-1] == "head"
    assert _ops_by(tr, "backward_pre", "head")[0] not in tr.tensor("wte.weight").accesses


def test_checkpointing_reaccesses_parameters_in_backward():
    plain = make_gpt()
    ck = make_gpt(checkpoint_activations=True)
    tr_plain = trace(plain, gpt_step(plain))
    tr_ck = trace(ck, gpt_step(ck))
    for tr, expect in ((tr_plain, False), (tr_ck, True)):
        w = tr.tensor("blocks.0.attn.qkv.weight")
        recomputed = [a for a in w.accesses if tr.ops[a].phase == "backward" and tr.ops[a].event.startswith("forward")]
        assert bool(recomputed) is expect
    # the recomputation happens before the block's own backward, and the forward use is separate from it
    w = tr_ck.tensor("blocks.0.mlp.fc.weight")
    fwd = [a for a in w.accesses if tr_ck.ops[a].phase == "forward"]
    rec = [a for a in w.accesses if tr_ck.ops[a].phase == "backward" and tr_ck.ops[a].event == "forward_pre"]
    bwd = _ops_by(tr_ck, "backward_pre", "blocks.0.mlp.fc")
    assert max(fwd) < rec[0] < bwd[0]
    # checkpointing keeps fewer activations alive at the end of forward
    assert tr_ck.peak_non_model_bytes < tr_plain.peak_non_model_bytes


def test_traced_optimizer_states_and_step():
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    tr = trace(model, gpt_step(model), opt)  # step() does not step: trace() does
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert tr.meta["optimizer"] == "traced AdamW"
    step = [o for o in tr.ops if o.phase == "step"]
    assert len(step) == 1 and step[0].event == "step" and step[0].cpu_time is not None
    states = tr.of_kind("optimizer_state")
    assert sorted(s.name for s in states) == sorted(
        f"{n}.{k}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq"))
    for s in states:
        p = tr.tensors[s.param_id]
        assert s.nbytes == p.nbytes and s.shape == p.shape and s.accesses == (step[0].op_id,)
        assert s.layer == p.layer
    # parameters are produced by the step: their cpu_time is its pro-rated share
    share = sum(t.cpu_time for t in tr.of_kind("param"))
    assert math.isclose(share, step[0].cpu_time, rel_tol=1e-9)


def test_optimizer_stepped_inside_step_is_traced_once():
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr = trace(model, gpt_step(model, optimizer=opt))  # not passed, still seen
    assert [o.event for o in tr.ops].count("step") == 1
    assert tr.meta["optimizer"] == "traced SGD"
    assert {s.name.rsplit(".", 1)[1] for s in tr.of_kind("optimizer_state")} == {"momentum_buffer"}


def test_modelled_optimizer_when_none_is_traced(tiny):
    tr = trace(tiny, gpt_step(tiny))
    assert tr.meta["optimizer"] == "modelled adam"
    states = tr.of_kind("optimizer_state")
    assert sum(s.nbytes for s in states) == 2 * sum(t.nbytes for t in tr.of_kind("param"))
    assert tr.ops[-1].event == "step" and tr.ops[-1].cpu_time is None and tr.ops[-1].duration > 0
    half = make_gpt().to(torch.bfloat16)
    tr_half = trace(half, gpt_step(half))
    assert sum(s.nbytes for s in tr_half.of_kind("optimizer_state")) == 6 * sum(
        t.nbytes for t in tr_half.of_kind("param"))  # fp32 master + m + v = 12 bytes per 2-byte element
    none = trace(tiny, gpt_step(tiny), options=TraceOptions(optimizer_model="none"))
    assert not none.of_kind("optimizer_state") and all(o.phase != "step" for o in none.ops)
    assert none.meta["optimizer"] == "none"


def test_non_model_memory_covers_live_activations(tiny):
    tr = trace(tiny, gpt_step(tiny, batch=4, seq=32))
    live = [0] * (len(tr.ops) + 1)
    for a in tr.of_kind("activation"):
        live[a.first_id] += a.nbytes
        live[a.end_id + 1] -= a.nbytes
    running = 0
    for op in tr.ops:
        running += live[op.op_id]
        assert op.non_model_bytes >= running
    assert tr.ops[-1].non_model_bytes == 0  # everything saved was released by the end of backward
    fwd_end = max(o.op_id for o in tr.ops if o.phase == "forward")
    assert tr.ops[fwd_end].non_model_bytes >= sum(a.nbytes for a in tr.of_kind("activation")) - 16
    assert tr.meta["non_model_memory"] == "saved_tensors"


def test_durations_are_measured_on_cpu(tiny):
    tr = trace(tiny, gpt_step(tiny))
    measured = [o for o in tr.ops if o.phase != "step"]
    assert all(o.cpu_time is not None and o.gpu_time is None and o.duration == o.cpu_time for o in measured)
    assert all(o.duration >= 0 for o in tr.ops)
    assert math.fsum(o.duration for o in measured) <= tr.meta["wall_seconds"]
    acts = tr.of_kind("activation")
    assert all(a.cpu_time == tr.ops[a.first_id].cpu_time for a in acts)
    assert all(t.gpu_time is None for t in tr.tensors)


def test_same_model_twice_has_the_same_fingerprint(tiny):
    a = trace(tiny, gpt_step(tiny))
    b = trace(tiny, gpt_step(tiny))
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 32
    cmp = a.compare(b)
    assert cmp.same_access_order and cmp.holds and cmp.first_divergent_op is None
    bigger = trace(tiny, gpt_step(tiny, batch=8))  # same order, more memory
    cmp = a.compare(bigger)
    assert cmp.same_access_order and not cmp.holds and cmp.non_model_ratio > 2 and "non-model" in cmp.reason
    assert bigger.compare(a).holds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_times_and_allocator_memory():
    model = make_gpt().cuda()
    idx = torch.randint(0, model.cfg.vocab, (2, 16), device="cuda")
    tr = trace(model, lambda: model(idx, idx).backward())
    assert tr.meta["non_model_memory"] == "cuda_allocator"
    measured = [o for o in tr.ops if o.phase != "step"]
    assert all(o.gpu_time is not None and o.duration == o.gpu_time for o in measured)
    assert max(o.non_model_bytes for o in tr.ops) > 0


def test_saves_before_the_model_runs_are_not_attributed(tiny):
    idx, tgt = gpt_batch(tiny)
    scale = torch.ones((), requires_grad=True)

    def step():
        s2 = scale * scale  # saved for backward before the model's first op
        (tiny(idx, tgt) * s2).backward()

    tr = trace(tiny, step)
    assert all(a.first_id >= 0 for a in tr.of_kind("activation"))
    assert scale.grad is not None


def test_layer_tensors_group_model_states(tiny):
    tr = trace(tiny, gpt_step(tiny))
    block = tr.layer_tensors(2)
    assert {t.kind for t in block} == {"param", "grad", "optimizer_state"}
    assert all(t.name.startswith("blocks.0.") for t in block)
    assert sum(t.nbytes for t in block if t.kind == "param") == tr.layers[2].nbytes


def test_reentrant_checkpointing_is_traced_and_gradients_unchanged():
    import copy

    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return x.square().mean()

    torch.manual_seed(0)
    model = Stack()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    tr = trace(model, lambda: model(x).backward())
    twin(x.detach().clone().requires_grad_()).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    w = tr.tensor("blocks.1.0.weight")
    events = [(tr.ops[a].event, tr.ops[a].phase) for a in w.accesses]
    assert events[:2] == [("forward_pre", "forward"), ("forward_post", "forward")]
    assert events[2:4] == [("forward_pre", "backward"), ("forward_post", "backward")]  # recomputed
    assert ("backward_pre", "backward") in events[4:]
    assert [lay.name for lay in tr.layers] == ["blocks.0", "blocks.1", "blocks.2"]
