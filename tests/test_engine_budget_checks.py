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


@pytest.mark.parametrize("executor", ["plan", "demand"])
def test_a_least_the_first_iteration_may_raise_says_so(executor):
    """The least named at construction holds the largest unit, not yet the activations beside
    the units (the plan executor knows them after the first iteration) nor the units one op reads
    together (a tied weight, on demand): the message says it is a lower bound."""
    with pytest.raises(pagemem.OutOfMemory) as err:
        pagemem.Engine(model(), config(2 * PAGE, executor=executor))
    assert err.value.least_is_bound
    assert "at least gpu_bytes=" in str(err.value)


class TiedHead(nn.Module):
    """An embedding and an output layer sharing its weight, with a bias of its own: the output
    layer's op reads two units at once (its own, and the embedding's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 512)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def test_on_demand_an_op_reading_two_units_is_refused_naming_a_budget_that_works(tmp_path):
    """The least named at construction holds the largest unit; the output layer's op needs its
    unit and the tied embedding's together, so that budget failed in the first iteration with no
    budget named (found by a hostile user on a tied BERT). Following the leasts named ends in a
    run bit-identical to plain PyTorch."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from exactness import HP, assert_same, reference

    idx = [torch.randint(0, 512, (4, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def make():
        torch.manual_seed(0)
        return TiedHead()

    def loss(run, model, s):
        return nn.functional.cross_entropy(run(idx[s]).reshape(-1, 512), idx[s].reshape(-1))

    ref = reference(make, loss, 3)
    gpu_bytes, refusals = PAGE, []
    while True:
        model = make()
        store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu_bytes, cpu_bytes=256 * PAGE)
        try:
            with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP),
                                                            adam_threads=1, executor="demand")) as engine:
                for s in range(3):
                    engine.backward(loss(engine, model, s))
                    engine.step()
                got = engine.state_dict()
            break
        except pagemem.OutOfMemory as exc:
            assert exc.least_bytes is not None and exc.least_bytes > gpu_bytes, str(exc)
            assert exc.least_is_bound and "at least" in str(exc)
            refusals.append(exc)
            gpu_bytes = exc.least_bytes
            assert len(refusals) < 6
    assert any("every other resident layer is in use" in str(e) for e in refusals)
    assert_same(ref, got)
