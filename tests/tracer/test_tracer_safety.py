"""Hooks never leak, training is unchanged, and bad input gets a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tracer_helpers import gpt_batch, gpt_step, hook_snapshot, make_gpt
from pagemem.errors import ConfigError, PageMemError
from pagemem.tracer import TraceError, TraceOptions, trace


def _train(model, opt, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        idx, tgt = gpt_batch(model, seed=10 + s)
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpoint_activations", [False, True])
def test_traced_model_trains_exactly_as_before(checkpoint_activations):
    model = make_gpt(checkpoint_activations=checkpoint_activations)
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    before = hook_snapshot(model)
    # the traced iteration itself computes the same loss and gradients as an untraced one
    idx, tgt = gpt_batch(model)
    losses = []
    trace(model, lambda: losses.append(model(idx, tgt)) or losses[-1].backward(), opt)
    loss_twin = twin(idx, tgt)
    loss_twin.backward()
    opt_twin.step()
    assert losses[0].item() == loss_twin.item()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    opt.zero_grad(set_to_none=True)
    opt_twin.zero_grad(set_to_none=True)
    assert hook_snapshot(model) == before
    assert _train(model, opt, 3) == _train(twin, opt_twin, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "backward", "after"])
def test_hooks_removed_when_the_iteration_raises(where):
    model = make_gpt()
    before = hook_snapshot(model)
    idx, tgt = gpt_batch(model)

    def step():
        if where == "forward":
            model.blocks[1].register_forward_hook(_raise)  # user hook, removed below
        loss = model(idx, tgt)
        if where == "backward":
            loss.register_hook(lambda g: (_ for _ in ()).throw(Boom()))
        loss.backward()
        if where == "after":
            raise Boom()

    with pytest.raises(Boom):
        trace(model, step)
    model.blocks[1]._forward_hooks.clear()
    assert hook_snapshot(model) == before
    # and the tracer works again afterwards
    tr = trace(model, gpt_step(model))
    assert tr.of_kind("param")
    assert hook_snapshot(model) == before


def _raise(*args):
    raise Boom()


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


def test_model_without_parameters_is_refused():
    with pytest.raises(TraceError, match="no parameters"):
        trace(NoParams(), lambda: None)


def test_frozen_model_is_refused():
    model = make_gpt()
    model.requires_grad_(False)
    with pytest.raises(TraceError, match="requires grad"):
        trace(model, gpt_step(model))


def test_iteration_without_backward_is_refused(tiny):
    idx, tgt = gpt_batch(tiny)
    before = hook_snapshot(tiny)
    with pytest.raises(TraceError, match="no backward"):
        trace(tiny, lambda: tiny(idx, tgt))
    with pytest.raises(TraceError, match="no backward"):
        trace(tiny, lambda: tiny(idx, tgt), torch.optim.SGD(tiny.parameters(), lr=0.1))
    assert hook_snapshot(tiny) == before


def test_iteration_that_never_runs_the_model_is_refused(tiny):
    with pytest.raises(TraceError, match="never ran GPT.forward"):
        trace(tiny, lambda: None)


def test_bad_arguments_raise_config_error(tiny):
    with pytest.raises(ConfigError, match="model"):
        trace(object(), lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step"):
        trace(tiny, 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optimizer"):
        trace(tiny, lambda: None, "adam")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="none of the model's parameters"):
        trace(tiny, lambda: None, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(ConfigError, match="optimizer_model"):
        TraceOptions(optimizer_model="lion")
    with pytest.raises(ConfigError, match="layer_types"):
        TraceOptions(layer_types=(int,))
    assert issubclass(TraceError, PageMemError)


def test_traces_do_not_nest(tiny):
    inner_error = []

    def step():
        try:
            trace(tiny, lambda: None)
        except TraceError as e:
            inner_error.append(str(e))
        tiny(*gpt_batch(tiny)).backward()

    trace(tiny, step)
    assert inner_error and "nest" in inner_error[0]


def test_graph_outliving_the_trace_still_backpropagates(tiny):
    """A graph built under the tracer but run after it finished works and records nothing."""
    idx, tgt = gpt_batch(tiny)
    kept = []

    def step():
        tiny(idx, tgt).backward()
        kept.append(tiny(idx, tgt))  # a second forward whose backward runs after tracing

    tr = trace(tiny, step)
    n_ops = len(tr.ops)
    tiny.zero_grad()
    kept[0].backward()
    ref = make_gpt()
    ref(idx, tgt).backward()
    for p, q in zip(tiny.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad)
    assert len(tr.ops) == n_ops
