"""The rules both framework integrations follow ([Note: a framework's knobs drive the engine]):
a property test of ``engine_config`` over the knobs a framework and a user may set, and the
optimizer translation. Needs no framework."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.integrations.framework import FrameworkKnobs, adamw_groups, engine_config, rebind_schedulers

NAMES = {"accumulation": "F.accumulation", "clip": "F.clip", "precision": "F.precision"}
STORE = pagemem.StoreConfig(gpu_backend="host", page_bytes=4096, gpu_bytes=1 << 20, cpu_bytes=1 << 20)
DTYPES = st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=200, deadline=None)
@given(acc=st.integers(1, 4), fw_dtype=st.sampled_from([None, torch.bfloat16]), clips=st.booleans(),
       cfg_acc=st.integers(1, 4), cfg_dtype=DTYPES, cfg_clip=st.sampled_from([None, 1.0]),
       overlap=st.sampled_from([None, False, True]), lock_free=st.booleans())
def test_engine_config_takes_the_frameworks_knobs_or_names_the_conflict(acc, fw_dtype, clips, cfg_acc, cfg_dtype,
                                                                       cfg_clip, overlap, lock_free):
    try:
        cfg = pagemem.EngineConfig(store=STORE, accumulation_steps=cfg_acc, compute_dtype=cfg_dtype,
                                   max_grad_norm=None if lock_free else cfg_clip, overlap_update=overlap,
                                   lock_free=lock_free)
    except pagemem.ConfigError:
        return  # a config the engine itself refuses
    knobs = FrameworkKnobs(accumulation_steps=acc, compute_dtype=fw_dtype, clips=clips, names=NAMES)
    dtype = fw_dtype if fw_dtype is not None else cfg_dtype
    conflicts = {
        "cfg.max_grad_norm": cfg.max_grad_norm is not None,
        "cfg.accumulation_steps": cfg_acc not in (1, acc),
        "cfg.compute_dtype": fw_dtype is not None and cfg_dtype not in (None, fw_dtype),
        "cfg.lock_free": lock_free and clips,
        "cfg.overlap_update": overlap is True and (clips or acc > 1),
        "F.precision": dtype == torch.float16,
    }
    try:
        got = engine_config(cfg, knobs, "cfg")
    except pagemem.ConfigError as exc:
        named = str(exc).split(":")[0]
        assert conflicts.get(named), (named, conflicts)  # refused, naming a setting that does conflict
        return
    assert not any(conflicts.values()), conflicts
    assert got.accumulation_steps == acc and got.compute_dtype == dtype
    assert got.overlap_update == (False if clips or acc > 1 else overlap)
    assert dataclasses.replace(got, accumulation_steps=cfg.accumulation_steps, compute_dtype=cfg.compute_dtype,
                               overlap_update=cfg.overlap_update) == cfg  # nothing else changed


def test_an_adamw_becomes_the_engines_groups_and_hyperparameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = [model[0].weight], [model[0].bias, *model[1].parameters()]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                                       "lr": 1e-4}], lr=3e-3, betas=(0.8, 0.9), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    hyper, groups, extras = adamw_groups(opt, "opt")
    assert hyper == pagemem.AdamW(lr=1.5e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)  # as the scheduler left it
    assert [g["params"] for g in groups] == [decay, no_decay]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1.5e-3, 0.1), (0.5e-4, 0.0)]
    assert extras == [{"initial_lr": 3e-3}, {"initial_lr": 1e-4}]
    other = torch.optim.AdamW(model.parameters())
    rebind_schedulers([sched, None], opt, other)
    assert sched.optimizer is other


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.Adam(ps), "opt: .*must be a torch.optim.AdamW, got torch.optim.adam.Adam"),
    (lambda ps: torch.optim.AdamW(ps, maximize=True), r"opt.param_groups\[0\].maximize"),
])
def test_what_the_engine_does_not_offer_is_refused(make, match):
    with pytest.raises(pagemem.ConfigError, match=match):
        adamw_groups(make(torch.nn.Linear(2, 2).parameters()), "opt")


def test_an_optimizer_that_stepped_is_refused():
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(pagemem.ConfigError, match="opt: the optimizer has stepped already"):
        adamw_groups(opt, "opt")
