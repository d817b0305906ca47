"""``trace(model, step)``: run one training iteration under the tracer and return its Trace."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from pagemem.errors import ConfigError
from pagemem.tracer.builder import ParamSpec, StateSpec, build_trace
from pagemem.tracer.cost import CostModel
from pagemem.tracer.errors import TraceError
from pagemem.tracer.layers import candidate_layers
from pagemem.tracer.clock import OpClock
from pagemem.tracer.live import LiveSession, SavedTensor, dtype_name
from pagemem.tracer.metaguard import MetaGuard, on_meta, refuse_differing
from pagemem.tracer.optstate import OPTIMIZER_MODELS, modelled_states
from pagemem.tracer.tracedata import Trace

_tracing = False


@dataclass(frozen=True)
class TraceOptions:
    """Knobs of :func:`trace`."""

    optimizer_model: str = "adam"
    """States to record when no optimizer step is traced: ``"adam"`` (mixed-precision Adam, see
    :mod:`pagemem.tracer.optstate`; adds a modelled ``step`` op), ``"master_adam"`` (fp32 master
    copy and moments for every dtype) or ``"none"`` (no step op)."""
    layer_types: tuple[type, ...] = ()
    """Module classes that form layers (e.g. ``(GPT2Block,)``); empty: found automatically
    (see :mod:`pagemem.tracer.layers`)."""
    cost: CostModel = field(default_factory=CostModel)
    """Estimates the duration of a modelled optimizer step."""

    def __post_init__(self) -> None:
        if self.optimizer_model not in OPTIMIZER_MODELS:
            raise ConfigError(f"optimizer_model: must be one of {OPTIMIZER_MODELS}, got {self.optimizer_model!r}")
        if not isinstance(self.layer_types, tuple) or not all(
                isinstance(t, type) and issubclass(t, nn.Module) for t in self.layer_types):
            raise ConfigError(f"layer_types: must be a tuple of nn.Module subclasses, got {self.layer_types!r}")
        if not isinstance(self.cost, CostModel):
            raise ConfigError(f"cost: must be a CostModel, got {type(self.cost).__name__}")


def trace(model: nn.Module, step: Callable[[], object], optimizer: torch.optim.Optimizer | None = None,
          *, options: TraceOptions | None = None) -> Trace:
    """Run ``step()`` (one forward + backward of ``model``, optionally an optimizer step) once
    under the tracer and return the :class:`Trace` of that iteration.

    If ``optimizer`` is given and ``step()`` did not step it, ``optimizer.step()`` is called (and
    traced) afterwards. Optimizer steps inside ``step()`` are traced whether or not ``optimizer``
    is passed. Without any traced step, optimizer states follow ``options.optimizer_model``.

    A model on ``meta`` (built under ``torch.device("meta")``, no memory for its values) gives
    the trace its cpu twin gives: the same tensors, accesses and layers, activation bytes from
    shapes. What needs values there (``.item()``, an ``if`` on a tensor, ``nonzero``, sampling,
    an op without a meta kernel) raises :class:`TraceError` naming it, even if ``step()``
    catches it (see :mod:`pagemem.tracer.metaguard`): trace such a model on cpu.

    Every hook is removed before this returns or raises; an exception from ``step()`` propagates
    unchanged. Raises :class:`ConfigError` for bad arguments and :class:`TraceError` when the
    iteration cannot be traced (no parameters, no forward, no backward, a refused op on meta).
    """
    global _tracing
    options = options or TraceOptions()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise ConfigError(f"step: expected a callable taking no arguments, got {type(step).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(options, TraceOptions):
        raise ConfigError(f"options: expected TraceOptions, got {type(options).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise TraceError(f"{type(model).__name__} has no parameters: there is nothing to trace")
    if not any(p.requires_grad for _, p in params):
        raise TraceError(f"no parameter of {type(model).__name__} requires grad: an iteration has no backward")
    ids = {id(p) for _, p in params}
    if optimizer is not None and not any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError("optimizer: it holds none of the model's parameters")
    if _tracing:
        raise TraceError("trace() is already running; traces cannot nest")

    devices = Counter(p.device for _, p in params)
    device = devices.most_common(1)[0][0]
    cuda = _cuda_device_of(devices)
    meta = on_meta(p for _, p in params)
    if meta:
        refuse_differing(model)  # before anything is hooked
    session = LiveSession(model, params, cuda)
    guard = MetaGuard(lambda: _where(session)) if meta else None
    _tracing = True
    t0 = time.perf_counter()
    try:
        session.start(optimizer)
        with torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack), guard or nullcontext():
            step()
            if optimizer is not None and not session.stepped and _ran_backward(session):
                optimizer.step()
        session.rec.finish()
    except Exception as e:
        if guard is not None and guard.refused is not None and e is not guard.refused:
            raise guard.refused from e  # step() caught the refusal and failed later
        raise
    finally:
        session.stop()
        _tracing = False
    if guard is not None and guard.refused is not None:
        raise guard.refused  # step() caught it: what it recorded after is not the cpu trace
    wall = time.perf_counter() - t0
    return _build(model, session, params, device, cuda, options, wall)


def _cuda_device_of(devices: Counter) -> torch.device | None:
    """The CUDA device holding parameters (timed with CUDA events), or None."""
    return next((d for d in devices if d.type == "cuda"), None)


def _where(session: LiveSession) -> str:
    """The op being traced, for an error message."""
    rec = session.rec
    if not rec.op_event:
        return "the start of step(), before the model's first op"
    return (f"op {rec.n_ops - 1} ({rec.op_event[-1]} of {rec.op_module[-1] or '<model>'}, "
            f"{rec.op_phase[-1]} phase)")


def _ran_backward(session: LiveSession) -> bool:
    return "backward" in session.rec.op_phase


def _build(model: nn.Module, session: LiveSession, params: list[tuple[str, nn.Parameter]],
           device: torch.device, cuda: torch.device | None, options: TraceOptions, wall: float,
           layers: Sequence[tuple[str, Sequence[int]]] | None = None,
           param_nbytes: Sequence[int] | None = None) -> Trace:
    rec = session.rec
    if not any(e == "forward_pre" and ph == "forward" for e, ph in zip(rec.op_event, rec.op_phase)):
        raise TraceError(f"step() never ran {type(model).__name__}.forward: call the model inside step()")
    if not _ran_backward(session):
        raise TraceError("step() ran no backward pass through the model: call loss.backward() inside step()")

    nbytes = param_nbytes if param_nbytes is not None else [p.numel() * p.element_size() for _, p in params]
    specs = [ParamSpec(name, dtype_name(p.dtype), tuple(p.shape), nb, p.requires_grad)
             for (name, p), nb in zip(params, nbytes)]
    cpu = rec.cpu_durations()
    gpu_list = rec.gpu_durations()
    gpu: list[float | None] = list(gpu_list) if gpu_list is not None else [None] * rec.n_ops
    cpu_opt: list[float | None] = list(cpu)
    durations = [g if g is not None else c for c, g in zip(cpu, gpu)]

    states = [StateSpec(i, k, dt, shape, nb, acc) for (i, k), (dt, shape, nb, acc) in session.states.items()]
    if session.stepped:
        opt_desc = "traced " + ", ".join(sorted(session.optimizer_names))
    elif options.optimizer_model != "none":
        trainable = [i for i, s in enumerate(specs) if s.requires_grad]
        op = rec.begin_op("step", "optimizer", "step")
        rec.touch_params(trainable, grads=True)
        rec.end_op()
        state_bytes = 0
        for i in trainable:
            for st in modelled_states(options.optimizer_model, specs[i].dtype, specs[i].shape):
                states.append(StateSpec(i, st.key, st.dtype, st.shape, st.nbytes, [op]))
                state_bytes += st.nbytes
        pbytes = sum(specs[i].nbytes for i in trainable)
        durations.append(options.cost.adam_step_seconds(pbytes, pbytes, state_bytes))
        cpu_opt.append(None)
        gpu.append(None)
        opt_desc = f"modelled {options.optimizer_model.replace('_', ' ')}"
    else:
        opt_desc = "none"
    states.sort(key=lambda s: s.param)

    dtypes = Counter(s.dtype for s in specs)
    meta = {
        "source": "trace",
        "model": type(model).__name__,
        "device": str(device),
        "dtype": dtypes.most_common(1)[0][0],
        "torch": torch.__version__,
        "optimizer": opt_desc,
        "non_model_memory": "cuda_allocator" if cuda is not None else "saved_tensors",
        "wall_seconds": wall,
        "cost_model": options.cost.to_dict(),
    }
    candidates = list(layers) if layers is not None else candidate_layers(model, session.param_index,
                                                                          options.layer_types)
    return build_trace(rec, specs, states, candidates, meta, durations, cpu_opt, gpu)


class Recording:
    """One iteration recorded on an :class:`OpClock` an executor owns and has installed: the
    executor runs the iteration and numbers its ops; this records them, and :meth:`finish`
    returns the :class:`Trace`, numbered exactly as the executor's later iterations will be.

    An executor that installs saved-tensor hooks of its own hands the tracer what it packs:
    ``pack(t)`` for a tensor that is not a parameter (returns a :class:`SavedTensor`, whose
    ``unpack()`` gives the tensor back), ``touch_params(indices)`` when it saves parameters
    itself, and ``touch_params(indices, grads=True)`` when backward unpacks them.

    ``layers`` fixes the layers (module path, indices into ``clock.params``; each parameter in
    exactly one); ``param_nbytes`` the bytes each parameter occupies where the executor keeps it
    (default: ``numel * itemsize``). With ``cuda_device``, non-model bytes are the caching
    allocator's peak per op less the model's device bytes: the parameters' sizes, or
    ``device_model_bytes`` where the executor keeps the model in memory of its own (a page arena
    allocated through torch, parameters that are views of it or placeholders). The iteration's optimizer step is not recorded: end the
    recording before it; ``options.optimizer_model`` models it.
    """

    def __init__(self, model: nn.Module, clock: OpClock, *,
                 layers: Sequence[tuple[str, Sequence[int]]] | None = None,
                 param_nbytes: Sequence[int] | None = None, options: TraceOptions | None = None,
                 cuda_device: torch.device | None = None, device_model_bytes: int | None = None) -> None:
        if _tracing:
            raise TraceError("trace() is already running; traces cannot nest")
        if not clock.installed:
            raise TraceError("Recording: the clock must be installed by its owner first")
        self._model = model
        self._params = list(clock.params)
        self._options = options or TraceOptions()
        self._layers = layers
        self._nbytes = list(param_nbytes) if param_nbytes is not None else None
        if self._nbytes is not None and len(self._nbytes) != len(self._params):
            raise ConfigError(f"param_nbytes: expected {len(self._params)} entries, got {len(self._nbytes)}")
        self._cuda = cuda_device
        self._session = LiveSession(model, self._params, cuda_device, clock=clock, device_model_bytes=device_model_bytes)
        self._t0 = time.perf_counter()
        self._session.start(None)
        self._open = True

    @property
    def rec(self):
        """The recorder (its ``lock`` is the clock's)."""
        return self._session.rec

    @property
    def live_bytes(self) -> int:
        """Non-model bytes live now, as recorded (saved activations)."""
        return self._session.rec.live_bytes

    def pack(self, t: torch.Tensor) -> SavedTensor:
        return self._session.pack(t)

    def touch_params(self, indices: Sequence[int], grads: bool = False) -> None:
        if self._open and self._session.active and self.rec.op_event:
            with self.rec.lock:
                self.rec.touch_params(tuple(indices), grads=grads)

    def finish(self) -> Trace:
        """Stop recording and build the trace. Raises :class:`TraceError` when the iteration
        had no forward or no backward."""
        session = self._session
        try:
            with session.rec.lock:
                session.rec.finish()
        finally:
            self.abandon()
        wall = time.perf_counter() - self._t0
        devices = Counter(p.device for _, p in self._params)
        device = devices.most_common(1)[0][0]
        return _build(self._model, session, self._params, device, self._cuda, self._options, wall,
                      self._layers, self._nbytes)

    def abandon(self) -> None:
        """Stop recording without a trace (idempotent)."""
        if self._open:
            self._open = False
            self._session.stop()
