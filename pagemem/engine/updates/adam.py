"""AdamW over optimizer pages: the engine's update, one page view at a time.

fp32 master weights, moments and gradients live in pages; :class:`CpuAdam` steps each page's
views with torch's fused AdamW kernel (``torch._fused_adamw_``, CPU since torch 2.4) on worker
threads that each run torch with one intra-op thread (``adam_threads``), so page updates overlap
with I/O and backward and the whole update runs at memory bandwidth.

**Fidelity.** The fused kernel is elementwise: per-chunk calls equal one call over the whole
tensor, so N steps are bit-identical to ``torch.optim.AdamW(fused=True)`` on the flat tensor,
provided every chunk but a tensor's last holds a multiple of 16 elements. The kernel works in
vectors plus a scalar tail that rounds differently on about 1% of its elements (measured here:
chunks of 7 or 12 elements differ, of 8, 16, 1000 do not); torch splits a call between threads at
64-byte units (16 fp32), so only the tensor's own end is ever a tail, and 16-element-aligned
chunks keep it that way (a 4 MiB page is 2**20 elements). Hence also: several parameters packed
into one flat page match torch's fused AdamW over that flat tensor, not over the separate
parameters, in the scalar tail (under 16 elements) of each. The default ``torch.optim.AdamW``
(foreach) and ``foreach=False`` give the same moments (bit for bit, measured) but order the
update of ``p`` differently: a fraction of an ulp of ``p`` (plus of ``lr``) per step.

**Global checks.** Clipping by global norm and the fp16 overflow skip need every gradient
before any page may change: ``step`` first reduces all gradient chunks (:func:`sumsq`), then
skips or steps them all. The per-chunk sum of squares is accumulated in fp32 over rows of 1024
elements (torch's vectorised norm, at bandwidth) and in fp64 across rows and chunks. fp64
throughout costs 6x (1.1 ms against 0.18 ms per 4 MiB page on one core, measured here: the
conversion is compute-bound); fp32 throughout, as ``torch.linalg.vector_norm`` (and so
``clip_grad_norm_``) does, lost 2.6e-5 of the norm of one 2**20-element page, the rows 1e-9.
A chunk whose fp32 rows overflow (``|g|`` above about 5e17) is recomputed in fp64, so the sum is
non-finite exactly when some gradient is inf or nan: the overflow test of ``GradScaler``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pagemem.checks import check_bool, check_int, check_rate
from pagemem.engine.updates.adam_threads import Workers, WorkerDied, usable_cores
from pagemem.errors import ConfigError, InvalidRequest

ALIGN = 16
"""Elements: chunks of a tensor must start at multiples of this for bit-identity (see above)."""
_ROW = 1024


def _check_real(name: str, value: object, lo: float, hi: float | None = None, hi_open: bool = False) -> float:
    """A finite real in ``[lo, hi]`` (``[lo, hi)`` with ``hi_open``; no upper bound when None)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{name}: must be a finite number {allowed}, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class AdamW:
    """Hyperparameters of ``torch.optim.AdamW``, same defaults and meaning: decoupled weight decay
    (``p *= 1 - lr * weight_decay``), bias-corrected moments, optional AMSGrad."""

    lr: float = 1e-3
    """The learning rate (``pagemem train``: the peak of its schedule)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment averages."""
    eps: float = 1e-8
    """Added to the second moment's square root, for stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay (``p *= 1 - lr * weight_decay`` each step)."""
    amsgrad: bool = False
    """Keep the maximum of the second moments (refused by the lock-free updater)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lr", _check_real("lr", self.lr, 0.0))
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ConfigError(f"betas: must be a pair of numbers in [0.0, 1.0), got {self.betas!r}")
        set_(self, "betas", tuple(_check_real(f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
                                  for i, b in enumerate(self.betas)))
        set_(self, "eps", _check_real("eps", self.eps, 0.0))
        set_(self, "weight_decay", _check_real("weight_decay", self.weight_decay, 0.0))
        check_bool("amsgrad", self.amsgrad)

    def group(self) -> dict[str, Any]:
        """The hyperparameters as a ``param_groups`` entry (without ``params``)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "amsgrad": self.amsgrad}

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> AdamW:
        """Validated hyperparameters of a ``param_groups`` entry as an lr scheduler left it; other
        keys (``params``, ``initial_lr``) are ignored, AdamW's variants torch allows are refused."""
        if group.get("maximize", False) or not group.get("decoupled_weight_decay", True):
            raise ConfigError("maximize / decoupled_weight_decay: only AdamW minimising is supported")
        return cls(group["lr"], group["betas"], group["eps"], group["weight_decay"], group.get("amsgrad", False))


TORCH_FLAGS = {"maximize": False, "decoupled_weight_decay": True, "fused": True, "foreach": None,
               "capturable": False, "differentiable": False}
"""What ``torch.optim.AdamW``'s groups say besides the hyperparameters, as the engine computes."""


class PagedOptimizer(torch.optim.Optimizer):
    """The ``torch.optim.Optimizer`` the user holds while the engine keeps the state in pages.

    ``param_groups`` are ordinary dicts (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``amsgrad``), so ``torch.optim.lr_scheduler`` schedulers drive them and save and load their
    own state unchanged; the engine reads each group's :meth:`hyper` when it steps. ``step()``
    runs the optional closure, then calls ``step_fn(self)``, which the engine binds."""

    def __init__(self, params: Iterable, defaults: AdamW | None = None,
                 step_fn: Callable[[PagedOptimizer], None] | None = None,
                 zero_grad_fn: Callable[[], None] | None = None, states: Any = None,
                 before_zero_grad_fn: Callable[[], None] | None = None) -> None:
        self.step_fn = step_fn
        self.zero_grad_fn = zero_grad_fn
        self.before_zero_grad_fn = before_zero_grad_fn
        """Called before ``zero_grad`` sets any ``p.grad``: the engine finds a failed
        ``loss.backward()`` first, so that what it puts back up is what is discarded."""
        self.states = states
        """Reads and writes the per-parameter states where the engine keeps them (``read()``,
        ``write(state)``, keyed by torch's parameter numbers); None: this object's own."""
        self._sealed = False
        # the flags a torch.optim.AdamW that loads this optimizer's state dict needs to compute
        # as the engine does (its fused kernel, decoupled weight decay)
        super().__init__(params, {**(defaults or AdamW()).group(), **TORCH_FLAGS})
        self._sealed = True

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.AdamW.state_dict()``: ``param_groups``, and per parameter (numbered
        as torch numbers them) its ``step``, ``exp_avg`` and ``exp_avg_sq``, read from the pages
        into host memory, so a plain ``torch.optim.AdamW`` can load it (and this optimizer can
        load one of its)."""
        out = super().state_dict()
        if self.states is not None:
            out["state"] = self.states.read()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW`` (or this optimizer's) state dict: the groups'
        hyperparameters, and each parameter's moments and step into the pages."""
        state = state_dict.get("state", {})
        if self.states is not None:
            self.states.check_same(state_dict)  # with several ranks: every rank loads the same one
        super().load_state_dict({**state_dict, "state": {}})
        if self.states is not None:
            self.states.write(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; the engine then discards the gradient sums of
        the parameters whose ``p.grad`` became None (``zero_fn``), or zeroes them."""
        if self.before_zero_grad_fn is not None:
            self.before_zero_grad_fn()
        super().zero_grad(set_to_none)
        if self.zero_grad_fn is not None:
            self.zero_grad_fn()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._sealed and self.step_fn is not None:
            raise InvalidRequest("add_param_group: the engine's parameters and their groups are fixed when it is "
                                 "made; pass param_groups= to pagemem.Engine")
        super().add_param_group(param_group)
        try:
            AdamW.from_group(self.param_groups[-1])
        except ConfigError:
            self.param_groups.pop()
            raise

    def hyper(self, index: int = 0) -> AdamW:
        """Group ``index``'s hyperparameters now (after any scheduler), validated."""
        return AdamW.from_group(self.param_groups[index])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.step_fn is None:
            raise InvalidRequest("PagedOptimizer.step: no engine drives this optimizer (step_fn is None)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_fn(self)
        return loss


# ---------------------------------------------------------------------------------- one chunk

def _check_tensors(tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
    param = tensors["param"]
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous():
            raise InvalidRequest(f"{name}: must be a contiguous float32 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.shape != param.shape or t.device != param.device:
            raise InvalidRequest(f"{name}: shape {tuple(t.shape)} on {t.device} differs from param's "
                                 f"{tuple(param.shape)} on {param.device}")
    return param


def fused_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int, hp: AdamW, grad_scale: float | None = None, *,
               max_exp_avg_sq: torch.Tensor | None = None, clip_coef: float | None = None) -> None:
    """One AdamW update of one chunk in the calling thread (on a CUDA chunk: enqueued on the
    current stream). ``step`` is the 1-based number of this update (torch's ``state['step']``
    after its increment). ``clip_coef`` first multiplies ``grad`` in place, as
    ``clip_grad_norm_`` does; ``grad_scale`` divides it inside the kernel and leaves ``grad``
    unscaled, as ``GradScaler`` with a fused optimizer does. Arguments are not checked here."""
    fused_steps([Chunk(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)], step, hp, grad_scale, clip_coef)


def fused_steps(chunks: Sequence[Chunk], step: int, hp: AdamW, grad_scale: float | None = None,
                clip_coef: float | None = None) -> None:
    """:func:`fused_step` of several chunks of one device (the pieces of one parameter, say) in
    one kernel call. Arguments are not checked here."""
    dev = chunks[0].param.device
    grads = [c.grad for c in chunks]
    with torch.no_grad():
        if clip_coef is not None and clip_coef != 1.0:
            for g in grads:
                g.mul_(clip_coef)
        step_t = torch.full((), float(step), dtype=torch.float32, device=dev)
        torch._fused_adamw_(
            [c.param for c in chunks], grads, [c.exp_avg for c in chunks], [c.exp_avg_sq for c in chunks],
            [c.max_exp_avg_sq for c in chunks] if hp.amsgrad else [], [step_t] * len(chunks),
            lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps,
            amsgrad=hp.amsgrad, maximize=False,
            grad_scale=None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=dev),
            found_inf=None)


def sumsq(grad: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a chunk as a 0-dim float64 tensor on its device: fp32 over rows of 1024,
    fp64 across them (see the module notes); non-finite exactly when some element is inf or nan."""
    x = grad.detach().reshape(-1)
    if x.is_cuda:  # no host round trip on the GPU; fp64 there is cheap
        return torch.linalg.vector_norm(x, dtype=torch.float64).square()
    n = x.numel()
    k = n - n % _ROW
    total = torch.zeros((), dtype=torch.float64)
    if k:
        total += torch.linalg.vector_norm(x[:k].view(-1, _ROW), dim=1).double().square().sum()
    if k < n:
        total += torch.linalg.vector_norm(x[k:]).double().square()
    if math.isinf(total):  # an inf, or finite values whose fp32 squares overflowed: decide in fp64
        total = torch.linalg.vector_norm(x, dtype=torch.float64).square()
    return total


def total_sumsq(parts: Iterable[torch.Tensor]) -> float:
    """Add per-chunk sums of squares in fp64, in the order given (one host sync per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in parts:
        by_device.setdefault(t.device, []).append(t)
    return math.fsum(float(torch.stack(ts).sum()) for ts in by_device.values())


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s coefficient ``min(max_norm / (total_norm + 1e-6), 1)``, computed as
    it does: with the norm rounded to fp32 and fp32 arithmetic."""
    norm = torch.tensor(total_norm, dtype=torch.float32)
    return float(torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))


# ---------------------------------------------------------------------------------- the pool

@dataclass(frozen=True, slots=True)
class Chunk:
    """Views of one page's worth of an optimizer shard: master weights, gradient, moments."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`CpuAdam.step` did. ``taken`` False: an inf/nan gradient under loss scaling,
    nothing changed and the step counter must not advance."""

    taken: bool
    grad_norm: float | None = None
    """Global norm of the unscaled gradients (before clipping), when it was computed."""
    clip_coef: float | None = None


def _done(result: Any = None) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut


def join_all(futures: Sequence[Future]) -> BaseException | None:
    """Wait for every future, even through a signal handler's exception (a ``KeyboardInterrupt``
    or ``SystemExit`` while waiting is raised once all are done), so no task still writes the
    caller's tensors when it returns; the first task's error, or None."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # the first is raised; a second while waiting still waits
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    return next((f.exception() for f in futures if f.exception() is not None), None)


def wait_all(futures: Sequence[Future]) -> list[Any]:
    """Results of all futures; waits for every one before raising the first error, so no task
    still runs on the caller's tensors when it sees the error."""
    error = join_all(futures)
    if error is not None:
        raise error
    return [f.result() for f in futures]


def _on_stream(stream: "torch.cuda.Stream", fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    with torch.cuda.stream(stream):
        return fn(*args, **kwargs)


class CpuAdam:
    """AdamW updates of page views on ``threads`` workers (default: the usable cores), each with
    one torch thread. CPU chunks run on the workers; CUDA chunks are enqueued on the current
    stream by the calling thread (their futures are complete once enqueued). Chunks that run at
    the same time must not overlap in memory. A context manager; :meth:`close` joins the threads."""

    def __init__(self, threads: int | None = None) -> None:
        if not hasattr(torch, "_fused_adamw_"):
            raise InvalidRequest(f"torch {torch.__version__} has no _fused_adamw_ (CPU needs torch >= 2.4)")
        self._workers = Workers(usable_cores() if threads is None else threads, name="pagemem-adam")

    @property
    def threads(self) -> int:
        return self._workers.threads

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run any callable on a worker (one torch thread). CUDA work it launches goes on the
        caller's current stream, after what the caller queued there (torch's current stream is
        per thread: a worker's own would be the device's default stream)."""
        if torch.cuda.is_initialized():
            return self._workers.submit(_on_stream, torch.cuda.current_stream(), fn, *args, **kwargs)
        return self._workers.submit(fn, *args, **kwargs)

    def step_chunk(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, step: int, group: AdamW | Mapping[str, Any],
                   grad_scale: float | None = None, *, max_exp_avg_sq: torch.Tensor | None = None,
                   clip_coef: float | None = None) -> Future:
        """Queue one chunk's update (see :func:`fused_step`); bad arguments raise here at once,
        errors while it runs come out of the future."""
        hp = group if isinstance(group, AdamW) else AdamW.from_group(group)
        step, grad_scale = self._check_args(step, grad_scale, clip_coef)
        chunk = self._check_chunk(Chunk(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq), hp)
        return self._run([chunk], step, hp, grad_scale, clip_coef)

    @staticmethod
    def _check_args(step: int, grad_scale: float | None, clip_coef: float | None) -> tuple[int, float | None]:
        check_int("step", step, 1)
        if grad_scale is not None:
            grad_scale = check_rate("grad_scale", grad_scale)
        if clip_coef is not None and (isinstance(clip_coef, bool) or not isinstance(clip_coef, (int, float))):
            raise ConfigError(f"clip_coef: must be a number, got {clip_coef!r}")
        return step, grad_scale

    @staticmethod
    def _check_chunk(c: Chunk, hp: AdamW) -> Chunk:
        if hp.amsgrad and c.max_exp_avg_sq is None:
            raise InvalidRequest("max_exp_avg_sq: required with amsgrad")
        _check_tensors({"param": c.param, "grad": c.grad, "exp_avg": c.exp_avg, "exp_avg_sq": c.exp_avg_sq,
                        "max_exp_avg_sq": c.max_exp_avg_sq if hp.amsgrad else None})
        return c

    def _run(self, chunks: list[Chunk], *args: Any) -> Future:
        """One kernel call over ``chunks`` (one device): on a worker, or enqueued here for CUDA."""
        if not chunks[0].param.is_cuda:
            return self._workers.submit(fused_steps, chunks, *args)
        fut: Future = Future()
        try:
            fused_steps(chunks, *args)
        except Exception as e:
            fut.set_exception(e)
        else:
            fut.set_result(None)
        return fut

    def sumsq(self, grad: torch.Tensor) -> Future:
        """Queue one chunk's sum of squares (:func:`sumsq`); the future gives a 0-dim fp64 tensor."""
        if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or not grad.is_contiguous():
            raise InvalidRequest("grad: must be a contiguous float32 tensor")
        return _done(sumsq(grad)) if grad.is_cuda else self._workers.submit(sumsq, grad)

    def step(self, chunks: Sequence[Chunk], step: int, group: AdamW | Mapping[str, Any], *,
             max_grad_norm: float | None = None, grad_scale: float | None = None,
             grad_sumsq: float | None = None) -> StepResult:
        """One AdamW update of every chunk, waiting for all of them.

        With ``grad_scale`` (fp16 loss scaling) the gradients are scaled by it: an inf or nan in
        any of them skips the update as ``GradScaler`` does (nothing changes; the caller keeps its
        step counter), else the kernel unscales them. With ``max_grad_norm`` the gradients are
        clipped by their global norm with ``clip_grad_norm_``'s coefficient first. Both need the
        sum of squares of every gradient chunk (as given, scaled): pass ``grad_sumsq``
        (:func:`total_sumsq` of :meth:`sumsq` issued as each gradient page landed, while it was
        hot) to skip the extra pass here."""
        hp = group if isinstance(group, AdamW) else AdamW.from_group(group)
        if max_grad_norm is not None:
            max_grad_norm = check_rate("max_grad_norm", max_grad_norm)
        if grad_scale is not None:
            grad_scale = check_rate("grad_scale", grad_scale)
        if grad_sumsq is not None and (isinstance(grad_sumsq, bool) or not isinstance(grad_sumsq, (int, float))):
            raise ConfigError(f"grad_sumsq: must be a number, got {grad_sumsq!r}")
        step, _ = self._check_args(step, None, None)
        chunks = [self._check_chunk(c, hp) for c in chunks]  # all checked before any runs
        norm = coef = None
        if max_grad_norm is not None or grad_scale is not None:
            total = grad_sumsq if grad_sumsq is not None else total_sumsq(
                wait_all([self.sumsq(c.grad) for c in chunks]))
            norm = math.sqrt(total) / (grad_scale or 1.0)
            if grad_scale is not None and not math.isfinite(total):
                return StepResult(False, norm)
            if max_grad_norm is not None:
                coef = clip_coefficient(norm, max_grad_norm)
        wait_all([self._run(batch, step, hp, grad_scale, coef) for batch in self._batches(chunks)])
        return StepResult(True, norm, coef)

    def _batches(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Consecutive runs of chunks of one device, one kernel call each: about 4 per worker, so
        a worker slowed by a neighbour is balanced by the others, while Python's cost per page
        (about 30 us for a lone page: queue, wake-up, dispatch) is paid once per run."""
        runs: list[list[Chunk]] = []
        for c in chunks:
            if runs and runs[-1][-1].param.device == c.param.device:
                runs[-1].append(c)
            else:
                runs.append([c])
        want = 4 * self.threads
        out = []
        for run in runs:
            k = 1 if run[0].param.is_cuda else min(len(run), max(1, want * len(run) // len(chunks)))
            out += [run[i * len(run) // k:(i + 1) * len(run) // k] for i in range(k)]
        return out

    @property
    def broken(self) -> WorkerDied | None:
        """The error that broke the pool (a worker died), or None."""
        return self._workers.broken

    def close(self) -> None:
        self._workers.close()

    def __enter__(self) -> CpuAdam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
