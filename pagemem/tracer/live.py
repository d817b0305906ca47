"""Feeds a :class:`~pagemem.tracer.recorder.Recorder` while an unmodified ``nn.Module`` runs one
iteration. Everything installed here is removed by :meth:`LiveSession.stop`.

Ops are numbered by an :class:`~pagemem.tracer.clock.OpClock` (module forward hooks, the
autograd nodes of each module invocation, gradient-ready hooks, optimizer step hooks: see
:mod:`pagemem.tracer.clock`); the session listens to it and tells the recorder which op began and
which windows opened or closed. An op ends, for the recorder, when the next one begins (one
boundary, one timestamp), or at the end of an optimizer step. Besides the clock:

- saved-tensor hooks: a saved parameter (a tensor on a parameter's storage, the parameter itself
  or a view of it) is an access to it, anything else is an activation (deduplicated by storage,
  storages told apart by identity, see :mod:`pagemem.tracer.storages`; released when autograd
  frees it);
- at the end of an optimizer step, the optimizer's state tensors for this model's parameters.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pagemem.tracer.clock import Op, OpClock, iter_tensors
from pagemem.tracer.recorder import Recorder
from pagemem.tracer.storages import StorageIds, storage_of

__all__ = ["LiveSession", "SavedTensor", "dtype_name", "iter_tensors"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SavedTensor:
    """What the autograd graph holds instead of a saved tensor. Its death is the release."""

    __slots__ = ("tensor", "key", "params", "rec", "session")

    def __init__(self, tensor: torch.Tensor, key: object, params: tuple[int, ...] | None,
                 rec: Recorder, session: "LiveSession") -> None:
        self.tensor = tensor
        self.key = key
        self.params = params
        self.rec = rec
        self.session = session

    def unpack(self) -> torch.Tensor:
        """The tensor, recording the use while the session is active (for a caller that packs
        with its own hooks and hands the tracer what it does not handle itself)."""
        return self.session.unpack(self)

    def __del__(self) -> None:
        if self.key is not None:
            self.rec.release_activation(self.key)


class LiveSession:
    """Installs the hooks, owns the recorder, and collects optimizer states."""

    def __init__(self, model: nn.Module, params: Sequence[tuple[str, nn.Parameter]],
                 cuda_device: torch.device | None, clock: OpClock | None = None,
                 device_model_bytes: int | None = None) -> None:
        """``clock``: an installed clock someone else owns (an executor), listened to but never
        installed or removed here; ``params`` must then be the clock's."""
        self.model = model
        self.params = list(params)
        self.rec = Recorder(len(self.params), [p.requires_grad for _, p in self.params],
                            timed=True, cuda_device=cuda_device)
        self._own_clock = clock is None
        if clock is None:
            clock = OpClock(model, self.params, lock=self.rec.lock)
        else:
            self.rec.lock = clock.lock
        self.clock = clock
        self.param_index = self.clock.param_index
        self.active = False
        self.stepped = False
        self.optimizer_names: set[str] = set()
        self.states: dict[tuple[int, str], tuple[str, tuple[int, ...], int, list[int]]] = {}
        self.storages = StorageIds()
        self._param_of: dict[int, tuple[int, ...]] = {}  # storage serial -> parameters on it
        for i, (_, p) in enumerate(self.params):
            serial = self.storages.of(p) if p.numel() else None
            if serial is not None:
                self._param_of[serial] = self._param_of.get(serial, ()) + (i,)
        self._buffers = {s for s in map(self.storages.of, model.buffers()) if s is not None}
        self._cuda = cuda_device
        self._track_outputs = cuda_device is None
        if cuda_device is not None:
            self._param_bytes = (device_model_bytes if device_model_bytes is not None else
                                 sum(p.numel() * p.element_size() for _, p in self.params if p.is_cuda))
            self._grad_bytes: dict[int, int] = {}
            self._grad_total = 0
            self._optim_bytes = 0
            self.rec.probe = self._cuda_probe

    # ---- install / remove ------------------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._unsubscribe = self.clock.subscribe(self._on_op)
        if self._own_clock:
            self.clock.install()
        if self._cuda is not None:
            self._rescan_grads()
            self._optim_bytes = _state_bytes(optimizer) if optimizer is not None else 0
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self.active = True

    def stop(self) -> None:
        self.active = False
        if hasattr(self, "_unsubscribe"):
            self._unsubscribe()
        if self._own_clock:
            self.clock.remove()

    # ---- saved tensors ---------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> SavedTensor:
        rec = self.rec
        if not self.active or not rec.op_event:  # nothing to attribute a save to before the first op
            return SavedTensor(t.detach(), None, None, rec, self)
        with rec.lock:
            storage = storage_of(t)
            serial = None if storage is None else self.storages.serial(storage)
            owners = self._param_of.get(serial) if serial is not None else None
            if owners is None:
                owners = self._param_object(t)
            if owners is not None:
                rec.touch_params(owners)
                return SavedTensor(t.detach(), None, owners, rec, self)
            key: object
            if storage is not None:  # bytes from sizes alone: nothing here reads data (meta)
                nbytes = storage.nbytes()
                if serial in self._buffers or nbytes == 0:
                    return SavedTensor(t.detach(), None, None, rec, self)
                key = serial
            else:
                key, nbytes = object(), t.numel() * t.element_size()
            module = rec.op_module[-1] if rec.op_module else ""
            rec.save_activation(key, module, dtype_name(t.dtype), tuple(t.shape), nbytes)
            return SavedTensor(t.detach(), key, None, rec, self)

    def _param_object(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The parameter ``t`` is, or is a view of, whatever storage it has now (a parameter
        whose ``.data`` was replaced after the session started)."""
        index = self.param_index
        i = index.get(id(t))
        if i is None:
            base = t._base
            i = index.get(id(base)) if base is not None else None
        return (i,) if i is not None else None

    def unpack(self, packed: SavedTensor) -> torch.Tensor:
        if self.active:
            rec = self.rec
            with rec.lock:
                if packed.key is not None:
                    rec.use_activation(packed.key)
                elif packed.params:
                    rec.touch_params(packed.params, grads=True)
        return packed.tensor

    # ---- ops -------------------------------------------------------------------------------
    def _on_op(self, op_id: int, edge: str, op: Op) -> None:
        """The clock's listener (called under ``rec.lock``, the clock's lock)."""
        rec = self.rec
        ev = op.event
        if edge == "end":
            if ev == "step":  # the next op's start closes the others
                self._step_done(op)
            return
        if ev in ("backward_pre", "backward_post", "grad_ready"):
            rec.drop_recompute_windows()
        elif ev == "step":
            rec.close_windows()
        if self._cuda is not None and (ev == "step" or ev == "forward_pre" and rec.n_ops == 0):
            self._rescan_grads()
        rec.begin_op(ev, op.name, op.phase)
        if ev == "forward_pre":
            if op.params:
                rec.forward_enter(op.window, op.params, op.phase == "backward")
        elif ev == "forward_post":
            if op.params:
                rec.forward_exit(op.window)
            if self._track_outputs:
                self._output_bytes(op.output)
        elif ev == "backward_pre":
            rec.backward_enter(op.window, op.params)
        elif ev == "backward_post":
            rec.backward_exit(op.window)
        elif ev == "grad_ready":
            i = op.params[0]
            rec.touch_grad(i)
            if self._cuda is not None:
                self._count_grad(i, op.target.grad)
        elif ev == "step":
            rec.touch_params(op.params, grads=True)

    def _output_bytes(self, output: Any) -> None:
        live = self.rec.is_live
        seen: set[int] = set()
        extra = 0
        for t in iter_tensors(output):
            storage = storage_of(t)
            if storage is None:
                continue
            serial = self.storages.serial(storage)
            if serial not in seen and not live(serial):
                seen.add(serial)
                extra += storage.nbytes()
        if extra:
            self.rec.transient(extra)

    def _step_done(self, op: Op) -> None:
        """An optimizer step finished: record its state tensors, end its op."""
        opt = op.target
        for i in op.params:
            state = opt.state.get(self.params[i][1])
            if not state:
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    rec_state = self.states.setdefault(
                        (i, str(k)), (dtype_name(v.dtype), tuple(v.shape), v.numel() * v.element_size(), []))
                    rec_state[3].append(op.op_id)
        if self._cuda is not None:
            self._optim_bytes = _state_bytes(opt)
        self.rec.end_op()
        self.stepped = True
        self.optimizer_names.add(type(opt).__name__)

    # ---- CUDA memory -----------------------------------------------------------------------
    def _cuda_probe(self) -> int:
        dev = self._cuda
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return max(0, peak - self._param_bytes - self._grad_total - self._optim_bytes)

    def _count_grad(self, i: int, grad: torch.Tensor | None) -> None:
        nbytes = grad.numel() * grad.element_size() if grad is not None and grad.is_cuda else 0
        self._grad_total += nbytes - self._grad_bytes.get(i, 0)
        self._grad_bytes[i] = nbytes

    def _rescan_grads(self) -> None:
        for i, (_, p) in enumerate(self.params):
            self._count_grad(i, p.grad)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors on CUDA."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                total += v.numel() * v.element_size()
    return total
