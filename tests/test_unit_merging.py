"""Paging units: consecutive modules merged up to a cap that follows the gpu budget, never past
64 MiB ([Note: how far units merge] in ``engine/units/budget_checks.py``) nor 8 modules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.engine.units.budget_checks import UNIT_CAP_MOST, unit_cap
from pagemem.engine.units.records import MODULES_PER_UNIT_MOST, paging_units

MiB = 1 << 20


def store(gpu_bytes: int, page_bytes: int = 4 * MiB) -> pagemem.StoreConfig:
    return pagemem.StoreConfig(gpu_backend="host", page_bytes=page_bytes, gpu_bytes=gpu_bytes, cpu_bytes=page_bytes)


def test_a_large_gpu_budget_merges_no_further_than_64_mib():
    assert unit_cap(store(84 << 30)) == UNIT_CAP_MOST == 64 * MiB
    assert unit_cap(store(256 * MiB)) == 16 * MiB  # a sixteenth of a small budget
    assert unit_cap(store(4 * MiB)) == 4 * MiB  # never under a page


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 200 * MiB), min_size=1, max_size=40),
       budget_pages=st.integers(1, 1 << 15))
def test_units_cover_the_modules_in_order_each_one_module_or_within_the_cap(sizes, budget_pages):
    cap = unit_cap(store(budget_pages * 4 * MiB))
    modules = [(f"m{i}", [i]) for i in range(len(sizes))]
    units = paging_units(modules, sizes, cap)
    assert [i for _, idx in units for i in idx] == list(range(len(sizes)))
    for _, idx in units:
        assert len(idx) == 1 or sum(sizes[i] for i in idx) <= min(cap, UNIT_CAP_MOST)
        assert len(idx) <= MODULES_PER_UNIT_MOST  # one parameter per module here
    # greedy: a unit's next module did not fit in it
    for (_, a), (_, b) in zip(units, units[1:]):
        assert sum(sizes[i] for i in a) + sizes[b[0]] > cap or len(a) == MODULES_PER_UNIT_MOST


def test_a_warm_up_over_many_small_modules_moves_a_few_times_the_model_not_once_per_module():
    """The warm-up fetches a unit once per module of it that runs (forward and backward): with a
    large budget, 200 small blocks once made one unit, which moved 870 times the model's bytes
    in one warm-up. Now at most twice the module bound times the units' pages."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)) for _ in range(100)])
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=64 << 10, gpu_bytes=1 << 30, cpu_bytes=64 << 20)
    with pagemem.Engine(model, pagemem.EngineConfig(store=store, optimizer_tier="cpu",
                                                    optimizer=pagemem.AdamW(lr=1e-3))) as engine:
        x = torch.randn(4, 32)
        engine.backward(engine(x).square().mean())
        engine.step()
        moved = engine.stats()["moved_bytes"].get("cpu->gpu", 0)
        footprint = sum(engine.store.page_count(u.compute) for u in engine.bank.layers) * store.page_bytes
    assert 0 < moved <= 2 * MODULES_PER_UNIT_MOST * footprint
