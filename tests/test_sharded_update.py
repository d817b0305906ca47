"""[Note: sharded moments]: each rank's update of its share, from the same whole gradients,
gives the bits the replicated update gives on that share (master weights, both moments, the
compute copy), and the shares put together are the whole replicated update. The ranks are
simulated in one process: a bank per rank, the gather done by hand (``write_master_ranges``, as
``ranks/gather.py`` writes what arrives)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import pagemem
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.updates.update import Updater

PAGE = 4096
HP = pagemem.AdamW(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_model(sizes: list[tuple[int, int]], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(i, o) for i, o in sizes))


def make(sizes, seed, ranks, tier, clip, dtype, nvme_dir, own_dtype=torch.float32):
    model = make_model(sizes, seed).to(own_dtype)
    nvme = tier == "nvme"
    if nvme:
        os.makedirs(nvme_dir)
    store = pagemem.PageStore(pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=256 * PAGE,
                                                  cpu_bytes=4096 * PAGE, nvme_bytes=(4096 * PAGE) if nvme else 0,
                                                  nvme_path=nvme_dir if nvme else None))
    cfg = pagemem.EngineConfig(store=store.config, optimizer=HP, optimizer_tier=tier, max_grad_norm=clip,
                               adam_threads=1, compute_dtype=dtype)
    bank = ParamBank(model, store, dtype, tier, unit_bytes=4 * PAGE, ranks=ranks)
    updater = Updater(bank, store, cfg, lambda g: HP)
    updater.gather_masters = lambda params: None  # done by hand below
    return model, store, bank, updater


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 96), st.integers(1, 96)), min_size=1, max_size=4),
       world=st.integers(2, 4), seed=st.integers(0, 3), tier=st.sampled_from(["cpu", "nvme"]),
       clip=st.sampled_from([None, 0.05]), precision=st.sampled_from(["fp32", "bf16 over fp32", "bf16"]),
       steps=st.integers(1, 3))
def test_the_shares_updated_apart_are_the_replicated_update_bit_for_bit(sizes, world, seed, tier, clip, precision,
                                                                         steps):
    """fp32 and a bf16 model computing in bf16 shard the master weights too ([Note: sharded
    master weights]); a fp32 model computing in bf16 keeps its master whole on every rank."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    own = torch.bfloat16 if precision == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        ref = make(sizes, seed, (0, 1), tier, clip, dtype, d + "/ref", own)
        ranks = [make(sizes, seed, (r, world), tier, clip, dtype, d + f"/r{r}", own) for r in range(world)]
        for _, _, bank, _ in ranks:
            assert all(bank.master_sharded(i) == (precision != "bf16 over fp32") for i in range(len(bank.params)))
        try:
            n = len(ref[2].records)
            covered = [[0] * ref[2].params[i][1].numel() for i in range(n)]
            for r, (_, _, bank, _) in enumerate(ranks):
                for i in range(n):
                    a, b = bank.owned(i)
                    assert a % 64 == 0 and (b % 64 == 0 or b == ref[2].params[i][1].numel())
                    for e in range(a, b):
                        covered[i][e] += 1
            assert all(c == 1 for row in covered for c in row)  # every element on exactly one rank
            g = torch.Generator().manual_seed(seed + 100)
            for _ in range(steps):
                grads = [torch.randn(p.shape, generator=g) for _, p in ref[2].params]
                for _, _, bank, updater in [ref, *ranks]:
                    for i, grad in enumerate(grads):
                        updater.set_grad(i, grad)
                    assert updater.step()
                for r, (_, _, bank, _) in enumerate(ranks):  # the gather, by hand: every share to every rank
                    for other in ranks:
                        for i in range(n):
                            a, b = bank.owned(i)
                            if b > a and other[2] is not bank:
                                master = bank.host_state(i, "master").reshape(-1)
                                value = master if bank.master_sharded(i) else master[a:b]
                                other[2].write_master_ranges([(i, value, a)])
            for _, _, bank, _ in ranks:
                for i in range(n):
                    a, b = bank.owned(i)
                    whole = ref[2].host_state(i, "master").reshape(-1)
                    if bank.master_sharded(i):  # this rank's elements only, flat
                        assert torch.equal(bank.host_state(i, "master"), whole[a:b])
                        assert bank.master_whole_here(i) == (dtype == torch.float32)
                    else:
                        assert torch.equal(bank.host_state(i, "master").reshape(-1), whole)
                    assert torch.equal(bank.host_value(i, own), ref[2].host_value(i, own))
                    layer, k = bank.where(i)
                    rl, rk = ref[2].where(i)
                    assert torch.equal(layer.compute[k].to_torch(), rl.compute[rk].to_torch())
                    for kind in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(bank.host_state(i, kind), ref[2].host_state(i, kind).reshape(-1)[a:b])
                    assert bank.records[i].steps == ref[2].records[i].steps == steps
        finally:
            for _, store, _, updater in [ref, *ranks]:
                updater.close()
                store.close()


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)), min_size=1, max_size=5),
       world=st.integers(1, 4), data=st.data(), frozen=st.booleans())
def test_the_budget_counts_a_ranks_share_as_the_bank_lays_it_out(sizes, world, data, frozen):
    """``host_need`` (what the budget checks refuse against) counts exactly the pages a rank's
    bank takes: whole master weights and gradient sums, its share of the moments."""
    from pagemem.engine.units.budget_checks import unit_cap
    from pagemem.engine.units.homes import cpu_pages, host_need

    rank = data.draw(st.integers(0, world - 1))
    model = make_model(sizes, 0)
    if frozen:
        model[0].weight.requires_grad_(False)
    store_cfg = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=64 * PAGE, cpu_bytes=8192 * PAGE)
    cfg = pagemem.EngineConfig(store=store_cfg, optimizer=HP, optimizer_tier="cpu", adam_threads=1)
    need = host_need(model, cfg, unit_cap(store_cfg), (rank, world))
    with pagemem.PageStore(store_cfg) as store:
        bank = ParamBank(model, store, None, "cpu", unit_bytes=unit_cap(store_cfg), ranks=(rank, world))
        used = store.stats().tiers["cpu"].used_bytes // PAGE
        assert used == cpu_pages(need, "cpu", "cpu")
        whole = host_need(model, cfg, unit_cap(store_cfg))
        assert need.states <= whole.states
        del bank


def test_a_ranks_share_of_a_large_layer_is_half_its_moments_and_master():
    """fp32: the master weights are sharded as the moments are ([Note: sharded master weights]);
    a fp32 model computing in bf16 keeps its master whole on every rank."""
    from pagemem.engine.units.budget_checks import unit_cap
    from pagemem.engine.units.homes import host_need

    model = make_model([(256, 256)], 0)  # 256 KiB of fp32 weights: 64 pages per state
    store_cfg = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=64 * PAGE, cpu_bytes=8192 * PAGE)
    cfg = pagemem.EngineConfig(store=store_cfg, optimizer=HP, optimizer_tier="cpu", adam_threads=1)
    whole = host_need(model, cfg, unit_cap(store_cfg))
    halves = [host_need(model, cfg, unit_cap(store_cfg), (r, 2)) for r in range(2)]
    state = whole.states // 3
    assert all(h.states % 3 == 0 for h in halves)
    shares = [h.states // 3 for h in halves]  # each rank's pages of one state
    # the bytes split evenly (cut at 256-byte boundaries): each rank's share ends in a page of its
    # own, so the ranks' pages add up to the whole's plus at most one per rank but the first
    assert state <= sum(shares) <= state + 1 and max(shares) - min(shares) <= 1
    mixed = dataclasses.replace(cfg, compute_dtype=torch.bfloat16)
    halves = [host_need(model, mixed, unit_cap(store_cfg), (r, 2)) for r in range(2)]
    assert [h.states - state for h in halves] == [2 * s for s in shares]  # the master whole, the moments shared
