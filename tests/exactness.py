"""Train a model in plain PyTorch and through the engine with the same arithmetic; compare.

``train_both`` is the harness of the exactness tests: ``make()`` builds the model (the same
values on every call), ``loss(run, model, s)`` gives step ``s``'s loss, where ``run`` is what
calls the model (the model itself, or the engine) and ``model`` the module (for terms over its
parameters). The reference is ``torch.optim.AdamW(fused=True)`` over the same parameter groups.
"""

from __future__ import annotations

from typing import Any, Callable

import dataclasses

import torch

import pagemem
from pagemem.engine.units.budget_checks import unit_cap
from pagemem.engine.units.homes import cpu_pages, host_need
from pagemem.sched import least_cpu_bytes, least_gpu_bytes
from pagemem.tracer import trace

PAGE = 64 * 1024
HOMES = "+homes"
"""An ``optimizer_tier`` ending in it (``"nvme+homes"``): compute copies and gradient sums on nvme
too, with a cpu budget of the least the engine accepts raised to the least the scheduler plans
with from the trace alone (whole layers' updates), unless ``cpu_bytes=`` says otherwise
([Note: homes on nvme])."""
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def reference(make: Callable[[], torch.nn.Module], loss: Callable, steps: int, groups=None,
              scheduler=None, max_grad_norm=None, hp: dict | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: backward, clip, step, zero_grad."""
    model = make()
    params = groups(model) if groups is not None else list(model.parameters())
    opt = torch.optim.AdamW(params, fused=True, **(hp or HP))
    sched = scheduler(opt) if scheduler is not None else None
    for s in range(steps):
        loss(model, model, s).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def gpu_budget(model: torch.nn.Module, loss: Callable, fraction: float) -> int:
    """The least gpu budget the scheduler accepts for a trace of one step of ``model`` (a copy
    the caller gives up), plus ``fraction`` of its parameters' bytes (see ``conftest``)."""
    tr = trace(model, lambda: loss(model, model, 0).backward()).with_non_model_peak_reserved()
    least = least_gpu_bytes(tr, page_bytes=PAGE)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return -(-(least + int(params * fraction)) // PAGE) * PAGE


def engine_config(model: torch.nn.Module, loss: Callable, tmp_path, optimizer_tier: str = "cpu",
                  executor: str = "plan", fraction: float = 1 / 3, **kw: Any) -> pagemem.EngineConfig:
    """A gpu budget of the least the scheduler accepts plus ``fraction`` of the parameters, so
    units move every iteration."""
    budget = gpu_budget(model, loss, fraction)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    homes = optimizer_tier.endswith(HOMES)
    if homes:  # everything on nvme, the cpu budget the least the engine accepts (its working set)
        optimizer_tier = optimizer_tier[:-len(HOMES)]
        kw["home_tier"] = "nvme"
    disk = optimizer_tier == "nvme" or kw.get("home_tier") == "nvme"
    asked = kw.pop("cpu_bytes", None)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                cpu_bytes=40 * nbytes + 64 * PAGE if asked is None else asked,
                                nvme_bytes=40 * nbytes + 64 * PAGE if disk else 0,
                                nvme_path=str(tmp_path) if disk else None)
    kw.setdefault("optimizer", pagemem.AdamW(**HP))
    kw.setdefault("adam_threads", 2)
    cfg = pagemem.EngineConfig(store=store, optimizer_tier=optimizer_tier, executor=executor, **kw)
    if homes and asked is None:  # the least the engine accepts, raised to what the scheduler plans with
        need = host_need(model, cfg, unit_cap(store))
        least = cpu_pages(need, optimizer_tier, "nvme", cfg.lock_free) * PAGE
        tr = trace(model, lambda: loss(model, model, 0).backward()).with_non_model_peak_reserved()
        planned = least_cpu_bytes(tr, optimizer_tier=optimizer_tier if optimizer_tier != "gpu" else "cpu",
                                  page_bytes=PAGE, home_tier="nvme", gpu_bytes=budget)
        model.zero_grad(set_to_none=True)
        cfg = dataclasses.replace(cfg, store=dataclasses.replace(store, cpu_bytes=max(least, planned + 4 * PAGE)))
    return cfg


def through_engine(make, loss, steps: int, tmp_path, optimizer_tier="cpu", executor="plan", groups=None,
                   scheduler=None, habit: bool = False, max_grad_norm=None, fraction: float = 1 / 3,
                   **kw: Any):
    """The same training through the engine. ``habit``: a plain PyTorch loop (``loss.backward()``,
    ``clip_grad_norm_`` through the engine, ``optimizer.step()``, ``optimizer.zero_grad()``)."""
    model = make()
    cfg = engine_config(make(), loss, tmp_path, optimizer_tier, executor, fraction,
                        max_grad_norm=None if habit else max_grad_norm, **kw)
    extra = {"param_groups": groups(model)} if groups is not None else {}
    engine = pagemem.Engine(model, cfg, **extra)
    try:
        sched = scheduler(engine.optimizer) if scheduler is not None else None
        for s in range(steps):
            if habit:
                loss(engine, model, s).backward()
                if max_grad_norm is not None:
                    engine.clip_grad_norm_(max_norm=max_grad_norm)
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            else:
                engine.backward(loss(engine, model, s))
                engine.step()
            if sched is not None:
                sched.step()
        return engine.state_dict(), engine.stats(), engine
    finally:
        engine.close()


def assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    bad = {k: float((got[k].float() - ref[k].float()).abs().max()) for k in ref if not torch.equal(got[k], ref[k])}
    assert not bad, bad


def train_both(make, loss, steps: int, tmp_path, **kw: Any):
    """Both trainings; asserts they are bit-identical and returns the engine's stats."""
    ref = reference(make, loss, steps, groups=kw.get("groups"), scheduler=kw.get("scheduler"),
                    max_grad_norm=kw.get("max_grad_norm"))
    got, stats, _ = through_engine(make, loss, steps, tmp_path, **kw)
    assert_same(ref, got)
    return stats


def same_loop(make, loss, loop, steps: int, tmp_path, optimizer_tier: str = "cpu", groups=None,
              reference_first: bool = False, engine_only: bool = False, **kw: Any):
    """Run ``loop(run, model, optimizer, s, loss)`` for ``steps`` steps in plain PyTorch (``run``
    the model, a fused ``torch.optim.AdamW``) and through the engine (``run`` the engine, its
    optimizer): the same loop code both ways. Asserts bit-identity; returns the engine's stats.
    ``reference_first``: only the plain PyTorch run; ``engine_only``: only the engine's (for
    loops that record what they see)."""
    if engine_only:
        model = make()
        cfg = engine_config(make(), loss, tmp_path, optimizer_tier, **kw)
        with pagemem.Engine(model, cfg) as engine:
            for s in range(steps):
                loop(engine, model, engine.optimizer, s, loss)
            return engine.stats()
    model = make()
    params = groups(model) if groups is not None else list(model.parameters())
    opt = torch.optim.AdamW(params, fused=True, **HP)
    for s in range(steps):
        loop(model, model, opt, s, loss)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if reference_first:
        return {}
    model = make()
    cfg = engine_config(make(), loss, tmp_path, optimizer_tier, **kw)
    extra = {"param_groups": groups(model)} if groups is not None else {}
    with pagemem.Engine(model, cfg, **extra) as engine:
        for s in range(steps):
            loop(engine, model, engine.optimizer, s, loss)
        got = engine.state_dict()
        stats = engine.stats()
    assert_same(ref, got)
    return stats
