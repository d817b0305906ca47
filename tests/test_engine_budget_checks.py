"""A gpu budget that cannot hold the largest paging unit (or the optimizer states kept on the
gpu beside it) is refused at construction, naming the least that works, with the model
untouched ([Note: gpu budgets refused early], ``pagemem/engine/units/budget_checks.py``). The refusal
after a traced iteration is tested in ``test_engine_pager.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagemem

PAGE = 64 * 1024


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))  # a 5-page unit in fp32


def config(gpu_bytes: int, **kw) -> pagemem.EngineConfig:
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=256 * PAGE)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=1e-3), adam_threads=1, **kw)


def refused_least(m: nn.Module, gpu_bytes: int, **kw) -> int:
    with pytest.raises(pagemem.OutOfMemory, match=r"^tier 'gpu' is out of memory for gpu_bytes: .*requested \d+ "
                                                  r"pages .* free \d+ pages .* smallest budget that works is (at least )?"
                                                  r"gpu_bytes=\d+") as err:
        pagemem.Engine(m, config(gpu_bytes, **kw))
    return err.value.least_bytes


def test_a_budget_below_the_largest_unit_is_refused_with_the_model_untouched():
    m = model()
    before = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}
    least = refused_least(m, 2 * PAGE)
    assert least == 5 * PAGE  # 256 KiB of weight and 1 KiB of bias: one unit of 5 pages
    for n, p in m.named_parameters():  # the same parameters, plain, with their values, no hooks
        assert p is before[n][0] and type(p) is nn.Parameter and torch.equal(p, before[n][1])
    assert not any(mod._forward_pre_hooks or mod._forward_hooks for mod in m.modules())
    assert refused_least(m, least - PAGE) == least  # a page less is refused too
    x = torch.randn(4, 256)
    with pagemem.Engine(m, config(least)) as engine:  # the least named works
        engine.backward(engine(x).square().mean())
        assert engine.step()


def test_optimizer_states_kept_on_the_gpu_count_beside_the_units():
    """fp32 with states on the gpu: weights, two moments and gradient sums, 16 bytes per
    parameter, never move; the least named is exactly what the bank then allocates."""
    m = model()
    least = refused_least(m, 8 * PAGE, optimizer_tier="gpu")
    n = sum(p.numel() for p in m.parameters())
    assert least == 4 * -(-(n * 4 + 256) // PAGE) * PAGE  # four chained fp32 kinds
    assert refused_least(m, least - PAGE, optimizer_tier="gpu") == least
    with pagemem.Engine(m, config(least, optimizer_tier="gpu")) as engine:
        engine.backward(engine(torch.randn(4, 256)).square().mean())
        assert engine.step()


def test_a_budget_that_holds_the_units_is_not_refused():
    with pagemem.Engine(model(), config(5 * PAGE)) as engine:
        assert engine.stats()["gpu_budget_bytes"] == 5 * PAGE


@pytest.mark.parametrize("executor,bound", [("plan", True), ("demand", False)])
def test_a_least_the_first_iteration_may_raise_says_so(executor, bound):
    """With the plan executor the least named at construction holds the units, not yet their
    activations (known after the first iteration): the message says it is a lower bound."""
    with pytest.raises(pagemem.OutOfMemory) as err:
        pagemem.Engine(model(), config(2 * PAGE, executor=executor))
    assert err.value.least_is_bound is bound
    assert ("at least gpu_bytes=" in str(err.value)) is bound
