"""Hooks that feed a :class:`~pagemem.tracer.recorder.Recorder` while an unmodified
``nn.Module`` runs one iteration. Everything installed here is removed by :meth:`LiveSession.stop`.

What is hooked, and why:

- forward pre/post hooks on every module: ``forward_pre``/``forward_post`` ops, and the forward
  window of modules owning parameters;
- for a leaf module or one owning parameters, at ``forward_post`` the autograd nodes it created
  (found by walking back from its outputs, stopping at nodes older than the module's start) get a pre-hook
  (the first to fire is ``backward_pre``) and a post-hook (the last to fire is
  ``backward_post``). The graph is not modified; the hooks die with it;
- ``register_post_accumulate_grad_hook`` on each trainable parameter: ``grad_ready``;
- saved-tensor hooks: a saved parameter is an access to it, anything else is an activation
  (deduplicated by storage; released when autograd frees it);
- global optimizer step hooks: a ``step`` op for an optimizer holding this model's parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pagemem.tracer.recorder import Recorder


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a module output (nested tuples, lists and dicts, three levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x, depth + 1)


class _Packed:
    """What the autograd graph holds instead of a saved tensor. Its death is the release."""

    __slots__ = ("tensor", "key", "params", "rec")

    def __init__(self, tensor: torch.Tensor, key: object, params: tuple[int, ...] | None,
                 rec: Recorder) -> None:
        self.tensor = tensor
        self.key = key
        self.params = params
        self.rec = rec

    def __del__(self) -> None:
        if self.key is not None:
            self.rec.release_activation(self.key)


class _Invocation:
    __slots__ = ("key", "left", "started")

    def __init__(self, key: int, left: int) -> None:
        self.key = key
        self.left = left
        self.started = False


class LiveSession:
    """Installs the hooks, owns the recorder, and collects optimizer states."""

    def __init__(self, model: nn.Module, params: Sequence[tuple[str, nn.Parameter]],
                 cuda_device: torch.device | None) -> None:
        self.model = model
        self.params = list(params)
        self.param_index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self.rec = Recorder(len(self.params), [p.requires_grad for _, p in self.params],
                            timed=True, cuda_device=cuda_device)
        self.active = False
        self.stepped = False
        self.optimizer_names: set[str] = set()
        self.states: dict[tuple[int, str], tuple[str, tuple[int, ...], int, list[int]]] = {}
        self._handles: list[Any] = []
        self._starts: dict[int, list[int]] = {}
        self._inv_counter = 1 << 40  # invocation keys, disjoint from module keys
        self._stepping: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._opt_params: dict[int, tuple[int, ...]] = {}
        self._param_ptr: dict[int, tuple[int, ...]] = {}
        for i, (_, p) in enumerate(self.params):
            if p.numel():
                ptr = p.untyped_storage().data_ptr()
                self._param_ptr[ptr] = self._param_ptr.get(ptr, ()) + (i,)
        self._buffer_ptr = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._cuda = cuda_device
        self._track_outputs = cuda_device is None
        if cuda_device is not None:
            self._param_bytes = sum(p.numel() * p.element_size() for _, p in self.params if p.is_cuda)
            self._grad_bytes: dict[int, int] = {}
            self._grad_total = 0
            self._optim_bytes = 0
            self.rec.probe = self._cuda_probe

    # ---- install / remove ------------------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer | None) -> None:
        for key, (path, module) in enumerate(self.model.named_modules()):
            owned = tuple(dict.fromkeys(
                self.param_index[id(p)] for p in module.parameters(recurse=False) if id(p) in self.param_index))
            backward = bool(owned) or next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(self._make_pre(path, owned, key, backward)))
            self._handles.append(module.register_forward_hook(self._make_post(path, owned, key, backward)))
        for i, (name, p) in enumerate(self.params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_ready(i, name)))
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        if self._cuda is not None:
            self._rescan_grads()
            self._optim_bytes = _state_bytes(optimizer) if optimizer is not None else 0
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self.active = True

    def stop(self) -> None:
        self.active = False
        while self._handles:
            self._handles.pop().remove()
        self._starts.clear()
        self._stepping.clear()

    # ---- saved tensors ---------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Packed:
        rec = self.rec
        if not self.active or not rec.op_event:  # nothing to attribute a save to before the first op
            return _Packed(t.detach(), None, None, rec)
        with rec.lock:
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                ptr, nbytes = None, t.numel() * t.element_size()
            key: object
            if ptr is not None:
                owners = self._param_ptr.get(ptr)
                if owners is not None:
                    rec.touch_params(owners)
                    return _Packed(t.detach(), None, owners, rec)
                if ptr in self._buffer_ptr or nbytes == 0:
                    return _Packed(t.detach(), None, None, rec)
                key = ptr
            else:
                key = object()
            module = rec.op_module[-1] if rec.op_module else ""
            rec.save_activation(key, module, dtype_name(t.dtype), tuple(t.shape), nbytes)
            return _Packed(t.detach(), key, None, rec)

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if self.active:
            rec = self.rec
            with rec.lock:
                if packed.key is not None:
                    rec.use_activation(packed.key)
                elif packed.params:
                    rec.touch_params(packed.params, grads=True)
        return packed.tensor

    # ---- module hooks ----------------------------------------------------------------------
    def _make_pre(self, path: str, owned: tuple[int, ...], key: int, backward: bool) -> Callable[..., None]:
        rec = self.rec
        graph_task = torch._C._current_graph_task_id
        next_seq = torch._C._autograd._get_sequence_nr
        starts = self._starts

        def pre(module: nn.Module, args: Any) -> None:
            if not self.active:
                return
            with rec.lock:
                in_backward = graph_task() != -1
                if self._cuda is not None and rec.n_ops == 0:
                    self._rescan_grads()
                rec.begin_op("forward_pre", path, "backward" if in_backward else "forward")
                if owned:
                    rec.forward_enter(key, owned, in_backward)
                if backward:
                    starts.setdefault(key, []).append(next_seq())

        return pre

    def _make_post(self, path: str, owned: tuple[int, ...], key: int, backward: bool) -> Callable[..., None]:
        rec = self.rec
        graph_task = torch._C._current_graph_task_id
        starts = self._starts

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active:
                return
            with rec.lock:
                in_backward = graph_task() != -1
                rec.begin_op("forward_post", path, "backward" if in_backward else "forward")
                if owned:
                    rec.forward_exit(key)
                if backward:
                    stack = starts.get(key)
                    if stack:
                        lo = stack.pop()
                        if torch.is_grad_enabled():
                            self._hook_backward(path, owned, output, lo)
                if self._track_outputs:
                    self._output_bytes(output)

        return post

    def _output_bytes(self, output: Any) -> None:
        live = self.rec.is_live
        seen: set[int] = set()
        extra = 0
        for t in iter_tensors(output):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            ptr = storage.data_ptr()
            if ptr not in seen and not live(ptr):
                seen.add(ptr)
                extra += storage.nbytes()
        if extra:
            self.rec.transient(extra)

    def _hook_backward(self, path: str, owned: tuple[int, ...], output: Any, lo: int) -> None:
        """Hook the autograd nodes this module invocation created (sequence number >= lo)."""
        stack = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        nodes = []
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < lo:
                continue
            nodes.append(node)
            stack.extend(fn for fn, _ in node.next_functions)
        if not nodes:
            return
        self._inv_counter += 1
        inv = _Invocation(self._inv_counter, len(nodes))
        rec = self.rec

        def node_pre(grad_outputs: Any) -> None:
            if self.active and not inv.started:
                with rec.lock:
                    inv.started = True
                    rec.drop_recompute_windows()
                    rec.begin_op("backward_pre", path, "backward")
                    rec.backward_enter(inv.key, owned)

        def node_post(grad_inputs: Any, grad_outputs: Any) -> None:
            if not self.active:
                return
            with rec.lock:
                inv.left -= 1
                if inv.left == 0:
                    rec.drop_recompute_windows()
                    rec.begin_op("backward_post", path, "backward")
                    rec.backward_exit(inv.key)

        for node in nodes:
            node.register_prehook(node_pre)
            node.register_hook(node_post)

    def _make_ready(self, i: int, name: str) -> Callable[[torch.Tensor], None]:
        rec = self.rec

        def ready(p: torch.Tensor) -> None:
            if not self.active:
                return
            with rec.lock:
                rec.drop_recompute_windows()
                rec.begin_op("grad_ready", name, "backward")
                rec.touch_grad(i)
                if self._cuda is not None:
                    self._count_grad(i, p.grad)

        return ready

    # ---- optimizer -------------------------------------------------------------------------
    def _owned_by(self, opt: torch.optim.Optimizer) -> tuple[int, ...]:
        cached = self._opt_params.get(id(opt))
        if cached is None:
            idx = (self.param_index.get(id(p)) for g in opt.param_groups for p in g["params"])
            cached = tuple(dict.fromkeys(i for i in idx if i is not None))
            self._opt_params[id(opt)] = cached
        return cached

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        owned = self._owned_by(opt)
        if not owned:
            return
        rec = self.rec
        with rec.lock:
            rec.close_windows()
            if self._cuda is not None:
                self._rescan_grads()
            op = rec.begin_op("step", "optimizer", "step")
            rec.touch_params(owned, grads=True)
            self._stepping[id(opt)] = (op, owned)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        entry = self._stepping.pop(id(opt), None)
        if entry is None or not self.active:
            return
        op, owned = entry
        rec = self.rec
        with rec.lock:
            for i in owned:
                state = opt.state.get(self.params[i][1])
                if not state:
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1:
                        rec_state = self.states.setdefault(
                            (i, str(k)), (dtype_name(v.dtype), tuple(v.shape), v.numel() * v.element_size(), []))
                        rec_state[3].append(op)
            if self._cuda is not None:
                self._optim_bytes = _state_bytes(opt)
            rec.end_op()
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
