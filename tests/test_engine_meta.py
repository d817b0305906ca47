"""A model built on ``meta`` gets its first values from ``Engine(init=)``, one module at a time:
the same weights as the model built eagerly, and the same training."""

from __future__ import annotations

import pytest
import torch

import pagemem
from pagemem.models.gpt import GPT, GPTConfig, init_module
from test_engine_fidelity import PAGE, batches, gpu_budget, loss_of, reference

CFG = GPTConfig(layers=3, hidden=64, heads=4, vocab=128, seq=32)


def config(budget: int, optimizer_tier: str = "cpu", compute_dtype=torch.float32) -> pagemem.EngineConfig:
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget, cpu_bytes=64 << 20, copy_threads=0)
    return pagemem.EngineConfig(store=store, optimizer_tier=optimizer_tier, compute_dtype=compute_dtype,
                                adam_threads=1, optimizer=pagemem.AdamW(lr=3e-3, weight_decay=0.1))


def on_meta() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def eager(seed: int = 5) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


@pytest.mark.parametrize("optimizer_tier,dtype", [("cpu", torch.float32), ("gpu", torch.float32),
                                                  ("cpu", torch.bfloat16)])
def test_a_gpt_built_on_meta_gets_the_weights_the_eager_gpt_gets_for_the_same_seed(optimizer_tier, dtype):
    expected = eager().state_dict()
    cfg = config(gpu_budget(eager()) + (8 << 20), optimizer_tier, dtype)
    model = on_meta()
    torch.manual_seed(5)
    with pagemem.Engine(model, cfg, init=init_module(CFG)) as engine:
        got = engine.state_dict()
        assert model.head.weight is model.wte.weight  # still tied
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_host_memory_holds_one_module_at_a_time():
    """When ``init`` runs on a module, no other module's parameters hold memory of their size."""
    model = on_meta()
    seen = []
    inner = init_module(CFG)

    def init(name, module):
        own = {id(p) for p in module.parameters(recurse=False)}
        for other in model.parameters():
            if id(other) not in own:
                assert other.is_meta or other.untyped_storage().nbytes() <= other.element_size(), name
        assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters(recurse=False))
        seen.append(name)
        inner(name, module)

    with pagemem.Engine(model, config(gpu_budget(eager())), init=init):
        pass
    owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    assert seen == [n for n in owners if n != "head"]  # head's weight is wte's: set once, by its first owner


def test_a_model_initialized_on_meta_trains_exactly_as_plain_pytorch_from_the_same_weights():
    budget = gpu_budget(eager())
    model = on_meta()
    torch.manual_seed(7)
    with pagemem.Engine(model, config(budget), init=init_module(CFG)) as engine:
        start = engine.state_dict()
        for idx, targets in batches(6):
            engine.backward(loss_of(engine, idx, targets))
            engine.step()
        got = engine.state_dict()
        assert engine.stats()["iterations"]["planned"] == 5
    plain = eager()
    plain.load_state_dict(start)
    expected = reference(plain, 6, dict(lr=3e-3, weight_decay=0.1))
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_init_is_refused_where_it_cannot_be_followed():
    budget = gpu_budget(eager())
    with pytest.raises(pagemem.InvalidRequest, match="init: initializes a model built on 'meta'"):
        pagemem.Engine(eager(), config(budget), init=init_module(CFG))
    with pytest.raises(pagemem.InvalidRequest, match="pass init="):
        pagemem.Engine(on_meta(), config(budget))

    def replaces(name, module):
        for pname, p in list(module.named_parameters(recurse=False)):
            setattr(module, pname, torch.nn.Parameter(torch.zeros(p.shape)))

    with pytest.raises(pagemem.InvalidRequest, match="must be set in place"):
        pagemem.Engine(on_meta(), config(budget), init=replaces)

    def moves(name, module):
        for p in module.parameters(recurse=False):
            p.data = p.data.double()

    with pytest.raises(pagemem.InvalidRequest, match="must be set in place"):
        pagemem.Engine(on_meta(), config(budget), init=moves)


def test_first_values_from_a_state_dict_on_a_meta_model_buffers_included(tmp_path):
    """[Note: first values]: a state dict is a source like the module or an init function; a
    model built on meta takes every parameter and buffer from it and trains as plain PyTorch."""
    from exactness import assert_same, engine_config, reference

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
            self.register_buffer("shift", torch.zeros(32))

        def forward(self, x):
            return self.lin(x + self.shift)

    def make():
        torch.manual_seed(0)
        m = WithBuffer()
        m.shift.fill_(0.5)
        return m

    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def loss(run, model, s):
        return run(xs[s]).pow(2).mean()

    want = reference(make, loss, 3)
    state = make().state_dict()
    with torch.device("meta"):
        model = WithBuffer()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path), values=state) as engine:
        assert torch.equal(model.shift.cpu(), state["shift"])
        for s in range(3):
            engine.backward(loss(engine, model, s))
            engine.step()
        assert_same(want, engine.state_dict())
    with torch.device("meta"):
        model = WithBuffer()
    bad = {k: v for k, v in state.items() if k != "lin.bias"}
    with pytest.raises(pagemem.ConfigError, match="lin.bias"):
        pagemem.Engine(model, engine_config(make(), loss, tmp_path), values=bad)
    with pytest.raises(pagemem.ConfigError, match="one way"):
        pagemem.Engine(make(), engine_config(make(), loss, tmp_path), values=state, init=lambda n, m: None)
