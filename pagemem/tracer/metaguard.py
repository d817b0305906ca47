"""Tracing on ``meta``: refuse what needs tensor values, and choose kernels as cpu would.

A model built under ``torch.device("meta")`` has shapes and dtypes but no values, and that is
all a trace needs: which tensors each op touches and how many bytes they hold. Two things stand
between a meta run and the cpu trace of the same model, and :class:`MetaGuard` (a dispatch mode
and a function mode, entered only while :func:`pagemem.tracer.trace` runs ``step()`` on a meta
model) handles both:

- code that needs values: ``Tensor.item()``, ``bool()``/``if`` on a tensor, ops whose output
  shape follows the values (``nonzero``, ``masked_select``, ``unique``), ops returning a value
  computed from data (``equal``, ``allclose``), sampling (``multinomial``), copying a meta tensor
  out to a real device, or an op with no meta kernel. Each is refused with a
  :class:`TraceError` that names the op and where it ran, and says to trace on cpu.
- where meta and cpu differ (meta kernels follow CUDA): which kernel
  ``scaled_dot_product_attention`` runs, see [Note: meta traces as cpu], and the dtype of the
  statistics layer and batch norm save. Those are fixed to cpu's; the meta-vs-cpu trace tests
  (tests/tracer/test_trace_meta.py) would show another.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pagemem.tracer.errors import TraceError

__all__ = ["MetaGuard", "on_meta", "refuse_differing"]

_aten = torch.ops.aten
_SDP_CHOICE = _aten._fused_sdp_choice.default
_SDPA = torch.nn.functional.scaled_dot_product_attention
_FLASH = 1  # sdp::SDPBackend::flash_attention, what _fused_sdp_choice answers for it
_CPU_KERNELS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

_NEEDS_VALUES: dict[Any, str] = {
    _aten._local_scalar_dense.default:
        "reads a tensor's value into Python (Tensor.item(), bool(), int(), float(), an `if` on a tensor)",
    _aten.multinomial.default: "draws samples from a tensor's values",
}


_STATS_IN_INPUT_DTYPE = frozenset({_aten.native_layer_norm.default, _aten.native_batch_norm.default})


DIFFER_ON_META: tuple[type, ...] = (torch.nn.RNNBase, torch.nn.EmbeddingBag, torch.nn.MultiheadAttention)
"""Modules whose meta trace differs from their cpu trace (their kernels keep other tensors for
backward on meta: an LSTM's meta trace had twice the tensors and a quarter of the activation
bytes): a model holding one is refused on meta, never traced wrong."""


def refuse_differing(model: torch.nn.Module) -> None:
    """``TraceError`` naming the first module of ``model`` whose meta trace is known to differ."""
    for name, m in model.named_modules():
        if isinstance(m, DIFFER_ON_META):
            raise TraceError(f"{name or 'the model'} ({type(m).__name__}): its trace on meta differs from its trace on "
                             "cpu (its kernels keep other tensors for backward there); trace this model on cpu")


def on_meta(params: Any) -> bool:
    """Whether any of ``params`` (tensors) lives on ``meta``."""
    return any(p.is_meta for p in params)


def _why_refused(func: Any) -> str | None:
    """Why ``func`` cannot run without tensor values, or None if it can."""
    reason = _NEEDS_VALUES.get(func)
    if reason is not None:
        return reason
    tags = getattr(func, "tags", ())
    if torch.Tag.dynamic_output_shape in tags:
        return "has an output shape that depends on tensor values"
    if torch.Tag.data_dependent_output in tags:
        return "returns a value computed from tensor data"
    return None


class MetaGuard:
    """While entered (a context manager), refuses ops on meta tensors that need values and runs
    ``scaled_dot_product_attention`` as cpu would (see the module docs). The first refusal is
    kept in :attr:`refused`: the caller raises it after ``step()`` even if ``step()`` caught it.

    ``where()`` describes the op being traced, for the error message."""

    def __init__(self, where: Callable[[], str]) -> None:
        self.where = where
        self.refused: TraceError | None = None
        self._modes = ExitStack()
        self._pushed = threading.local()

    def __enter__(self) -> "MetaGuard":
        with ExitStack() as modes:
            modes.enter_context(_AsCpu())
            modes.enter_context(_MetaOps(self))
            # [Note: meta traces as cpu, in backward] autograd runs backward without the caller's
            # function modes (dispatch modes it keeps), so a checkpointed block recomputing its
            # forward there would run attention as meta does. A module's forward that starts
            # where _AsCpu is not active (there) pushes it for the forward's duration.
            modes.callback(register_module_forward_pre_hook(self._module_pre).remove)
            modes.callback(register_module_forward_hook(self._module_post, always_call=True).remove)
            self._modes = modes.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            stack = getattr(self._pushed, "stack", None)
            while stack:  # a recomputing module whose post-hook never ran
                stack.pop()[1].__exit__(None, None, None)
        finally:
            self._modes.close()

    def _module_pre(self, module: nn.Module, args: Any) -> None:
        if any(isinstance(m, _AsCpu) for m in _get_current_function_mode_stack()):
            return
        mode = _AsCpu()
        mode.__enter__()
        stack = getattr(self._pushed, "stack", None)
        if stack is None:
            stack = self._pushed.stack = []
        stack.append((module, mode))

    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = getattr(self._pushed, "stack", None)
        if stack and stack[-1][0] is module:
            stack.pop()[1].__exit__(None, None, None)

    def refuse(self, what: str) -> TraceError:
        err = TraceError(f"cannot trace on meta: {what}, at {self.where()}; meta tensors have no values. "
                         "Trace the model on cpu instead (build it on cpu, or run step() there), "
                         "or keep data-dependent code out of step()")
        if self.refused is None:
            self.refused = err
        return err


def _has_meta(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs)))


class _MetaOps(TorchDispatchMode):
    """Refuses what needs values; gives normalisation statistics cpu's dtype."""

    def __init__(self, guard: MetaGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _has_meta(args, kwargs):
            return func(*args, **kwargs)
        reason = _why_refused(func)
        if reason is not None:
            raise self.guard.refuse(f"{func} {reason}")
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:  # no meta kernel, or a copy out of meta ("no data")
            text = str(e).strip()
            first = text.splitlines()[0] if text else type(e).__name__
            raise self.guard.refuse(f"{func} cannot run on meta ({first})") from e
        if func in _STATS_IN_INPUT_DTYPE:
            # [Note: meta traces as cpu, statistics] the meta kernels of layer and batch norm
            # keep the saved mean and inverse std in float32 for a bfloat16/float16 input (as
            # CUDA does); cpu's keep them in the input's dtype, and autograd saves them
            dtype = args[0].dtype
            out = tuple(t.to(dtype) if i in (1, 2) and t.dtype != dtype else t for i, t in enumerate(out))
        return out


class _AsCpu(TorchFunctionMode):
    """[Note: meta traces as cpu] ``scaled_dot_product_attention`` picks its kernel by device,
    and on meta it always picks the math kernel (which saves the attention matrices), where cpu
    picks its flash kernel (which saves the output and the logsumexp): the two traces would
    differ by an attention matrix per layer. So on meta tensors this asks cpu's chooser (it reads
    shapes, dtypes and flags only) and, when cpu would run flash, runs the op cpu's composite runs
    then, whose meta kernels give the shapes cpu's give. Anything else runs unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA and _has_meta(args, kwargs):
            return _sdpa_as_cpu(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_as_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    choice = _SDP_CHOICE.redispatch(_CPU_KERNELS, query, key, value, attn_mask, dropout_p, is_causal,
                                    scale=scale, enable_gqa=enable_gqa)
    if choice != _FLASH:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as cpu's composite converts it
        full = torch.full((), float("-inf"), dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask.logical_not(), full, full.new_zeros(()))
    return _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                             attn_mask=attn_mask, scale=scale)[0]
