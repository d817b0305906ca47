"""The layout of sharded optimizer states ([Note: sharded states]): every rank's ranges partition
each parameter, cuts fall on multiples of 64 elements, and the ranks' shares are even to 64
elements per unit and parameter."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagemem.engine.units.shards import shard_states

PAGE = 4096


@st.composite
def models(draw):
    n_units = draw(st.integers(1, 6))
    units, numels, trainable, i = [], [], [], 0
    for _ in range(n_units):
        k = draw(st.integers(1, 5))
        units.append(list(range(i, i + k)))
        i += k
        numels += draw(st.lists(st.integers(0, 5000), min_size=k, max_size=k))
        trainable += draw(st.lists(st.booleans(), min_size=k, max_size=k))
    return units, numels, trainable


@settings(max_examples=300, deadline=None)
@given(models(), st.integers(1, 9))
def test_the_ranks_partition_every_parameter(model, world):
    units, numels, trainable = model
    shards = [shard_states(units, numels, trainable, PAGE, r, world) for r in range(world)]
    for i, n in enumerate(numels):
        if not trainable[i]:
            assert all(s.ranges[i] == (0, 0) for s in shards)
            continue
        owned = sorted(s.ranges[i] for s in shards if s.owned(i))
        assert sum(b - a for a, b in owned) == n
        at = 0
        for a, b in owned:  # disjoint, no gap
            assert a == at and b > a
            at = b
        assert all(a % 64 == 0 for a, _ in owned)  # where the fused kernel is bit-identical


@settings(max_examples=200, deadline=None)
@given(models(), st.integers(1, 9))
def test_shares_are_even_to_64_elements_per_unit_and_parameter(model, world):
    """Each unit's bytes are cut at 256-byte boundaries (64 elements) into runs as even as they
    allow; a run also holds the alignment gaps between parameters (under 64 elements each)."""
    units, numels, trainable = model
    shards = [shard_states(units, numels, trainable, PAGE, r, world) for r in range(world)]
    total = sum(n for n, t in zip(numels, trainable) if t)
    per_rank = [s.owned_elements for s in shards]
    assert sum(per_rank) == total
    for unit in units:
        mine = [sum(s.owned(i) for i in unit) for s in shards]
        assert max(mine) - min(mine) <= 64 + 64 * len(unit)


def test_small_units_spread_over_the_ranks():
    units = [[i] for i in range(8)]  # eight 100-element units over four ranks: the same elements each
    owned = [shard_states(units, [100] * 8, [True] * 8, PAGE, r, 4).owned_elements for r in range(4)]
    assert owned == [200] * 4
