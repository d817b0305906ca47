"""The engine's AdamW over page views: bit-identical to torch's fused AdamW on the flat tensor,
with lr schedules, global-norm clipping and the fp16 overflow skip; the worker pool's thread
layout and its failures."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemem.engine import (AdamW, Chunk, CpuAdam, PagedOptimizer, WorkerDied, clip_coefficient, sumsq,
                            total_sumsq)
from pagemem.engine.updates import adam as adam_mod
from pagemem.errors import ConfigError, InvalidRequest

EPS32 = torch.finfo(torch.float32).eps
PAGE = 1024


@pytest.fixture(scope="module")
def pool():
    with CpuAdam(2) as p:
        yield p


class Paged:
    """Flat fp32 optimizer state of ``n`` elements, stepped through chunk views of ``page``."""

    def __init__(self, p0: torch.Tensor, page: int = PAGE, amsgrad: bool = False) -> None:
        self.p = p0.clone()
        self.m, self.v = torch.zeros_like(p0), torch.zeros_like(p0)
        self.mx = torch.zeros_like(p0) if amsgrad else None
        self.page = page
        self.steps = 0

    def chunks(self, grad: torch.Tensor) -> list[Chunk]:
        n, k = self.p.numel(), self.page
        return [Chunk(self.p[a:a + k], grad[a:a + k], self.m[a:a + k], self.v[a:a + k],
                      None if self.mx is None else self.mx[a:a + k]) for a in range(0, n, k)]

    def step(self, pool: CpuAdam, grad: torch.Tensor, group, **kw):
        r = pool.step(self.chunks(grad), self.steps + 1, group, **kw)
        self.steps += r.taken
        return r

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.p, self.m, self.v, self.mx) if t is not None]


def torch_adamw(p0: torch.Tensor, hp: AdamW, **variant):
    param = torch.nn.Parameter(p0.clone())
    return param, torch.optim.AdamW([param], **hp.group(), **variant)


def torch_state(param, opt) -> list[torch.Tensor]:
    st_ = opt.state[param]
    return [param.detach()] + [st_[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in st_]


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------------------------- the config

def test_defaults_are_torch_adamw_defaults():
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert AdamW().group() == {k: ref[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}


@pytest.mark.parametrize("field, kwargs", [
    ("lr", dict(lr=-1e-3)), ("lr", dict(lr=float("nan"))), ("lr", dict(lr=True)), ("lr", dict(lr=torch.tensor(1e-3))),
    ("betas[0]", dict(betas=(1.0, 0.9))), ("betas[1]", dict(betas=(0.9, -0.1))), ("betas", dict(betas=(0.9,))),
    ("eps", dict(eps=-1.0)), ("eps", dict(eps=float("inf"))), ("weight_decay", dict(weight_decay=-0.01)),
    ("amsgrad", dict(amsgrad=1)),
])
def test_bad_hyperparameters_name_the_field(field, kwargs):
    with pytest.raises(ConfigError, match=rf"^{field.replace('[', '.').replace(']', '.')}: must be"):
        AdamW(**kwargs)


def test_from_group_reads_a_scheduled_group():
    group = {"params": [], "lr": 0.5, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.0,
             "amsgrad": True, "initial_lr": 1.0}
    assert AdamW.from_group(group) == AdamW(0.5, (0.8, 0.99), 1e-6, 0.0, True)
    with pytest.raises(ConfigError, match="maximize"):
        AdamW.from_group({**group, "maximize": True})


# ---------------------------------------------------------------------------------- fidelity

@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), page=st.integers(1, 80).map(lambda k: 16 * k), steps=st.integers(1, 4),
       amsgrad=st.booleans(), weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
       lr=st.sampled_from([1e-3, 3e-2]), seed=st.integers(0, 2**16))
def test_pages_are_bit_identical_to_fused_adamw(pool, n, page, steps, amsgrad, weight_decay, lr, seed):
    """Any 16-aligned chunking (last chunk partial) gives torch's fused AdamW bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    hp = AdamW(lr=lr, weight_decay=weight_decay, amsgrad=amsgrad)
    mine = Paged(p0, page, amsgrad)
    param, opt = torch_adamw(p0, hp, fused=True)
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        param.grad = g.clone()
        opt.step()
        assert mine.step(pool, g, hp).taken
    assert_identical(mine.snapshot(), torch_state(param, opt))


@pytest.mark.parametrize("variant", [{}, {"foreach": False}])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_default_adamw_agrees_within_rounding(pool, variant, amsgrad):
    """The default (foreach) and the single-tensor AdamW order their ops differently. Each step's
    rounding of p's update is at most a few ulps of p plus a few ulps of the update (at most
    about lr), so after N steps |dp| <= N * eps32 * (|p| + lr); measured: under a fifth of that.
    The moments round alike in both (bound N * eps32 relative)."""
    steps, n = 12, 4 * PAGE + 77
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen) * torch.logspace(-2, 2, n)
    for lr in (1e-3, 1e-1):
        hp = AdamW(lr=lr, weight_decay=0.1, amsgrad=amsgrad)
        mine = Paged(p0, amsgrad=amsgrad)
        param, opt = torch_adamw(p0, hp, **variant)
        for _ in range(steps):
            g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 2, (1,), generator=gen).item()
            param.grad = g.clone()
            opt.step()
            mine.step(pool, g, hp)
        p, *moments = mine.snapshot()
        ref_p, *ref_moments = torch_state(param, opt)
        assert ((p - ref_p).abs() <= steps * EPS32 * (ref_p.abs() + lr)).all()
        for x, y in zip(moments, ref_moments):
            torch.testing.assert_close(x, y, rtol=steps * EPS32, atol=0)


def test_unaligned_chunks_stay_within_rounding(pool):
    """Chunks not aligned to 16 send elements through the kernel's scalar tail: no longer bit for
    bit, but within a rounding of the update per step."""
    n, steps, hp = 1001, 5, AdamW(lr=1e-2)
    p0 = torch.randn(n)
    mine = Paged(p0, page=7)
    param, opt = torch_adamw(p0, hp, fused=True)
    for _ in range(steps):
        g = torch.randn(n)
        param.grad = g.clone()
        opt.step()
        mine.step(pool, g, hp)
    assert ((mine.p - param.detach()).abs() <= steps * EPS32 * (param.detach().abs() + hp.lr)).all()


def test_lr_schedule_drives_the_facade(pool):
    """StepLR on PagedOptimizer changes each group's lr between steps, exactly as on torch's
    optimizer; its state saves and loads unchanged."""
    n = 3 * PAGE + 5
    p0a, p0b = torch.randn(n), torch.randn(n)
    base = AdamW(lr=0.1, weight_decay=0.05)
    user = [torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))]  # the facade's params
    pages = [Paged(p0a), Paged(p0b)]
    grads: list[torch.Tensor] = []

    def engine_step(opt: PagedOptimizer) -> None:
        for i, paged in enumerate(pages):
            paged.step(pool, grads[i].clone(), opt.hyper(i))

    facade = PagedOptimizer([{"params": [user[0]]}, {"params": [user[1]], "lr": 0.2}], base, step_fn=engine_step)
    sched = torch.optim.lr_scheduler.StepLR(facade, step_size=2, gamma=0.5)
    ref = [torch.nn.Parameter(p0a.clone()), torch.nn.Parameter(p0b.clone())]
    ref_opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]], "lr": 0.2}], **base.group(), fused=True)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    lrs = []
    for _ in range(5):
        grads[:] = [torch.randn(n), torch.randn(n)]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        facade.step()
        ref_sched.step()
        sched.step()
        lrs.append(facade.hyper(1).lr)
    assert lrs == [0.2, 0.1, 0.1, 0.05, 0.05]
    for paged, r in zip(pages, ref):
        assert_identical(paged.snapshot(), torch_state(r, ref_opt))
    again = PagedOptimizer([{"params": [user[0]]}, {"params": [user[1]], "lr": 0.2}], base, step_fn=engine_step)
    resumed = torch.optim.lr_scheduler.StepLR(again, step_size=2, gamma=0.5)
    resumed.load_state_dict(sched.state_dict())
    again.load_state_dict(facade.state_dict())
    assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in facade.param_groups]
    resumed.step()
    sched.step()
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_facade_refuses_bad_groups_and_an_unbound_step():
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="lr"):
        PagedOptimizer([param], AdamW(), step_fn=None).add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))],
                                                                         "lr": -1.0})
    opt = PagedOptimizer([param])
    assert len(opt.param_groups) == 1
    with pytest.raises(InvalidRequest, match="step_fn"):
        opt.step()
    calls = []
    opt.step_fn = calls.append
    assert opt.step(lambda: 3.0) == 3.0 and calls == [opt]


# ---------------------------------------------------------------------------------- clipping

@settings(max_examples=200, deadline=None)
@given(norm=st.floats(0.0, 1e6, allow_subnormal=False), max_norm=st.floats(1e-3, 1e3))
def test_clip_coefficient_is_clip_grad_norms(norm, max_norm):
    """Given the same total norm, the coefficient scales gradients exactly as torch's does."""
    g = torch.randn(64)
    param = torch.nn.Parameter(torch.zeros(64))
    param.grad = g.clone()
    torch.nn.utils.clip_grads_with_norm_([param], max_norm, torch.tensor(norm, dtype=torch.float32))
    assert torch.equal(g.mul_(clip_coefficient(norm, max_norm)), param.grad)


def test_clipped_chunks_are_bit_identical_given_the_norm(pool):
    """With torch's own total norm, the clipped page-by-page update equals clip_grad_norm_ +
    fused AdamW bit for bit (the coefficient multiplies each gradient in place, in fp32)."""
    n, hp, max_norm = 5 * PAGE + 9, AdamW(lr=1e-2), 1.0
    p0 = torch.randn(n)
    mine = Paged(p0)
    param, opt = torch_adamw(p0, hp, fused=True)
    for step in range(1, 4):
        g = torch.randn(n) * 3
        param.grad = g.clone()
        norm = float(torch.nn.utils.clip_grad_norm_([param], max_norm))
        opt.step()
        coef = clip_coefficient(norm, max_norm)
        assert coef < 1.0
        adam_mod.wait_all([pool.step_chunk(c.param, c.grad, c.exp_avg, c.exp_avg_sq, step, hp, clip_coef=coef)
                           for c in mine.chunks(g)])
        assert torch.equal(g, param.grad)
    assert_identical(mine.snapshot(), torch_state(param, opt))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5000), page=st.integers(1, 200).map(lambda k: 16 * k), seed=st.integers(0, 2**16))
def test_global_norm_by_chunks(pool, n, page, seed):
    """The chunked norm is the fp64 norm to 1e-6 (fp32 within rows of 1024, fp64 across)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100
    exact = g.double().norm().item()
    got = math.sqrt(total_sumsq(adam_mod.wait_all([pool.sumsq(g[a:a + page]) for a in range(0, n, page)])))
    assert got == pytest.approx(exact, rel=1e-6)


def test_a_precomputed_sum_of_squares_gives_the_same_step(pool):
    """The engine may reduce each gradient page as it lands and pass the total to step()."""
    n, hp = 3 * PAGE + 1, AdamW(lr=1e-2)
    p0, g = torch.randn(n), torch.randn(n) * 4
    a, b = Paged(p0), Paged(p0)
    ga, gb = g.clone(), g.clone()
    total = total_sumsq(adam_mod.wait_all([pool.sumsq(c.grad) for c in b.chunks(gb)]))
    ra = a.step(pool, ga, hp, max_grad_norm=1.0, grad_scale=2.0)
    rb = b.step(pool, gb, hp, max_grad_norm=1.0, grad_scale=2.0, grad_sumsq=total)
    assert ra == rb and ra.clip_coef < 1.0
    assert_identical(a.snapshot(), b.snapshot())


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_step_clips_like_clip_grad_norm(pool, max_norm):
    """CpuAdam.step(max_grad_norm) against clip_grad_norm_ + fused AdamW. torch's fp32 norm is
    off by up to ~3e-5 relative on large tensors (its own reduction), so the coefficients differ
    by that much. Adam's step m/sqrt(v) ignores the gradients' scale (but for eps), so a
    coefficient off by d moves p by about d * lr per step: bound 1e-4 * lr per step (measured
    2.4e-5 * lr over 4 steps). With no clipping (coefficient 1) it is bit for bit."""
    n, hp, steps = 6 * PAGE + 3, AdamW(lr=1e-2), 4
    p0 = torch.randn(n)
    mine = Paged(p0)
    param, opt = torch_adamw(p0, hp, fused=True)
    for _ in range(steps):
        g = torch.randn(n)
        exact = g.double().norm().item()
        param.grad = g.clone()
        ref_norm = float(torch.nn.utils.clip_grad_norm_([param], max_norm))
        opt.step()
        r = mine.step(pool, g, hp, max_grad_norm=max_norm)
        assert r.taken and r.grad_norm == pytest.approx(exact, rel=1e-6)
        assert r.grad_norm == pytest.approx(ref_norm, rel=1e-4)
        assert r.clip_coef == pytest.approx(min(1.0, max_norm / (ref_norm + 1e-6)), rel=1e-4)
    if max_norm > 1e6:
        assert_identical(mine.snapshot(), torch_state(param, opt))
    else:
        assert ((mine.p - param.detach()).abs() <= steps * (EPS32 * param.detach().abs() + hp.lr * 1e-4)).all()


# ---------------------------------------------------------------------------------- fp16 overflow skip

@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_overflow_skips_like_grad_scaler(pool, bad, amsgrad):
    """Scaled gradients, one step with an inf/nan in one chunk: GradScaler + fused AdamW skips
    it (no parameter or state changes, the step count stays) and halves its scale; so does
    CpuAdam.step, and every other step is bit for bit the same."""
    n, hp = 4 * PAGE + 11, AdamW(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    p0 = torch.randn(n)
    mine = Paged(p0, amsgrad=amsgrad)
    param, opt = torch_adamw(p0, hp, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    scaler.scale(torch.ones(()))  # creates the scale
    scales = []
    for i in range(6):
        scale = scaler.get_scale()
        scales.append(scale)
        g = torch.randn(n) * scale
        if i in (2, 3):
            g[2 * PAGE + 5 * i] = bad
        param.grad = g.clone()
        before = mine.snapshot()
        scaler.step(opt)
        scaler.update()
        r = mine.step(pool, g, hp, grad_scale=scale)
        assert r.taken == (i not in (2, 3))
        if not r.taken:
            assert_identical(mine.snapshot(), before)
        assert mine.steps == opt.state[param]["step"].item() == i + 1 - min(2, max(0, i - 1))
        assert_identical(mine.snapshot(), torch_state(param, opt))
    assert scales == [2.0 ** 12, 2.0 ** 12, 2.0 ** 13, 2.0 ** 12, 2.0 ** 11, 2.0 ** 11]  # halved after each skip


def test_a_full_page_norm_is_accurate():
    """On one 4 MiB page (2**20 elements) the fp32 rows keep the sum of squares within 1e-7 of
    fp64; a single fp32 reduction over the page (torch.linalg.vector_norm) was off by 2.6e-5."""
    g = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 3 + 1
    assert float(sumsq(g)) == pytest.approx(g.double().square().sum().item(), rel=1e-7)


def test_scaled_and_clipped_like_unscale_clip_step(pool):
    """fp16 recipe: scaler.unscale_, clip_grad_norm_, scaler.step. With a power-of-two scale the
    unscaling is exact, so only the norms differ (torch's fp32 reduction): within 1e-4 of lr per step."""
    n, hp, steps = 4 * PAGE + 3, AdamW(lr=1e-2, weight_decay=0.1), 4
    p0 = torch.randn(n)
    mine = Paged(p0)
    param, opt = torch_adamw(p0, hp, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))
    for i in range(steps):
        scale = scaler.get_scale()
        g = torch.randn(n) * scale
        if i == 1:
            g[5] = float("inf")
        param.grad = g.clone()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([param], 1.0)
        scaler.step(opt)
        scaler.update()
        assert mine.step(pool, g, hp, grad_scale=scale, max_grad_norm=1.0).taken == (i != 1)
    assert mine.steps == opt.state[param]["step"].item() == steps - 1
    assert ((mine.p - param.detach()).abs() <= steps * (EPS32 * param.detach().abs() + hp.lr * 1e-4)).all()


def test_large_finite_gradients_are_not_an_overflow(pool):
    """fp32 squares of |g| = 1e30 overflow, but the chunk is recomputed in fp64: finite, no skip."""
    g = torch.full((3 * PAGE,), 1e30)
    assert math.isfinite(sumsq(g)) and float(sumsq(g)) == pytest.approx(3 * PAGE * 1e60)
    mine = Paged(torch.zeros(3 * PAGE))
    assert mine.step(pool, g, AdamW(), grad_scale=1.0).taken


# ---------------------------------------------------------------------------------- the pool

def test_workers_run_one_torch_thread_and_leave_the_rest_alone():
    before = torch.get_num_threads()
    with CpuAdam(3) as p:
        assert p.threads == 3
        assert set(adam_mod.wait_all([p.submit(torch.get_num_threads) for _ in range(12)])) == {1}
        assert torch.get_num_threads() == before
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [before]  # the process-wide default was put back


def test_threads_default_to_usable_cores():
    import os

    with CpuAdam() as p:
        assert p.threads == len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="threads"):
        CpuAdam(0)


def test_a_failing_chunk_surfaces_and_the_pool_closes(monkeypatch):
    """A kernel error in one chunk comes out of step() once every chunk has finished; the pool
    keeps working and closes."""
    real = adam_mod.fused_steps
    finished = []

    def flaky(chunks, *args):
        ptrs = [c.param.data_ptr() for c in chunks]
        if victim in ptrs:
            raise RuntimeError("planted kernel failure")
        if min(ptrs) > victim:
            time.sleep(0.2)  # still running when the failure is known
        real(chunks, *args)
        finished.extend(ptrs)

    monkeypatch.setattr(adam_mod, "fused_steps", flaky)
    p = CpuAdam(2)
    mine = Paged(torch.randn(5 * PAGE))
    chunks = mine.chunks(torch.randn(5 * PAGE))
    victim = chunks[2].param.data_ptr()
    with pytest.raises(RuntimeError, match="planted"):
        p.step(chunks, 1, AdamW())
    assert len(finished) == 4  # the others all ran before the error was raised
    assert p.submit(lambda: 42).result(timeout=10) == 42 and p.broken is None
    p.close()
    p.close()
    with pytest.raises(InvalidRequest, match="closed"):
        p.submit(lambda: 0)


def test_a_dead_worker_fails_its_task_and_the_queue():
    """A worker ended by a BaseException fails the task it ran and every queued one with
    WorkerDied instead of leaving them to hang; later submissions are refused; close() joins."""
    p = CpuAdam(1)
    gate = threading.Event()
    blocker = p.submit(gate.wait, 10)
    killer = p.submit(lambda: (_ for _ in ()).throw(SystemExit(3)))
    queued = [p.submit(lambda: 1) for _ in range(3)]
    gate.set()
    assert blocker.result(timeout=10) is True
    with pytest.raises(WorkerDied) as err:
        killer.result(timeout=10)
    assert isinstance(err.value.__cause__, SystemExit)
    for f in queued:
        with pytest.raises(WorkerDied):
            f.result(timeout=10)
    with pytest.raises(WorkerDied):
        p.submit(lambda: 1)
    assert p.broken is not None
    p.close()


def test_bad_chunks_are_refused_before_anything_runs(pool):
    mine = Paged(torch.randn(3 * PAGE), amsgrad=False)
    g = torch.randn(3 * PAGE)
    chunks = mine.chunks(g)
    before = mine.snapshot()
    bad = chunks[:2] + [Chunk(chunks[2].param, chunks[2].grad.double(), chunks[2].exp_avg, chunks[2].exp_avg_sq)]
    with pytest.raises(InvalidRequest, match="grad: must be a contiguous float32"):
        pool.step(bad, 1, AdamW())
    assert_identical(mine.snapshot(), before)
    with pytest.raises(InvalidRequest, match="differs"):
        pool.step_chunk(mine.p[:10], g[:11], mine.m[:10], mine.v[:10], 1, AdamW())
    with pytest.raises(InvalidRequest, match="max_exp_avg_sq"):
        pool.step_chunk(mine.p, g, mine.m, mine.v, 1, AdamW(amsgrad=True))
    with pytest.raises(ConfigError, match="step"):
        pool.step_chunk(mine.p, g, mine.m, mine.v, 0, AdamW())
    with pytest.raises(ConfigError, match="max_grad_norm"):
        pool.step(chunks, 1, AdamW(), max_grad_norm=0.0)
    assert_identical(mine.snapshot(), before)


# ---------------------------------------------------------------------------------- the GPU path

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amsgrad", [False, True])
def test_cuda_pages_are_bit_identical_to_fused_cuda_adamw(pool, amsgrad):
    n, hp = 5 * PAGE + 3, AdamW(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    p0 = torch.randn(n, device="cuda")
    mine = Paged(p0, amsgrad=amsgrad)
    param, opt = torch_adamw(p0, hp, fused=True)
    for i in range(4):
        g = torch.randn(n, device="cuda")
        if i == 2:
            g[7] = float("inf")
        param.grad = g.clone()
        scale = 1024.0
        g.mul_(scale)
        if i != 2:
            opt.step()
        r = mine.step(pool, g, hp, grad_scale=scale, max_grad_norm=1e9)
        assert r.taken == (i != 2)
    torch.cuda.synchronize()
    assert_identical(mine.snapshot(), torch_state(param, opt))
