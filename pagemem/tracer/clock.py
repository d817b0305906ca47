"""The op clock: the hook set that numbers the ops of a training iteration.

Logical time (op ids ``0, 1, 2, ...``) is whatever this clock counts. The tracer records a trace
with it (:class:`~pagemem.tracer.live.LiveSession` subscribes to one), and an executor that
follows a plan subscribes to a clock on the same model to fire each task at the op its trigger
names: the same hooks, so the same numbering, by construction.

>>> clock = OpClock(model)
>>> clock.subscribe(lambda op_id, edge, op: print(op_id, edge, op.event, op.name))
>>> with clock:              # install() ... remove(), also when the step raises
...     step()               # listeners hear "start" and "end" of every op, in order
>>> clock.reset()            # number the next iteration from 0 again

What is an op (in order of appearance, the same rules as the tracer's):

- ``forward_pre`` / ``forward_post``: every module's forward pre- and post-hook (phase
  ``backward`` while a checkpointed block recomputes its forward during backward);
- ``backward_pre`` / ``backward_post``: for a leaf module or one owning parameters, at its
  ``forward_post`` the autograd nodes that invocation created (found by walking back from its
  outputs, stopping at nodes older than its start) get a pre-hook (the first to fire is
  ``backward_pre``) and a post-hook (the last to fire is ``backward_post``); the graph is not
  modified and the hooks die with it;
- ``grad_ready``: ``register_post_accumulate_grad_hook`` on each trainable parameter;
- ``step``: global optimizer step hooks, for an optimizer holding this model's parameters (its
  ``end`` is the step's post-hook).

Every op has exactly one ``start`` and one ``end``; ops do not overlap: the ``end`` of op k comes
right before the ``start`` of op k+1 (or at a step's post-hook, :meth:`close`, :meth:`reset`,
:meth:`remove`); so a step whose closure runs the model (L-BFGS) ends where the closure's first op
starts. Listeners run inside the hooks (backward ones on autograd's threads), under
:attr:`OpClock.lock`. A clock belongs to the process that made it: in a forked child its hooks
do nothing (its lock may have been copied held; [Note: an engine belongs to its process] in
``pagemem/process.py``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import pagemem.process as process

EDGES: tuple[str, ...] = ("start", "end")
_INVOCATIONS = 1 << 40  # backward invocation keys, disjoint from module keys


@dataclass(frozen=True, slots=True)
class Op:
    """One numbered op, as listeners see it."""

    op_id: int
    event: str
    """``forward_pre``, ``forward_post``, ``backward_pre``, ``backward_post``, ``grad_ready``, ``step``."""
    phase: str
    """``forward``, ``backward`` (a recomputation in backward included) or ``step``."""
    name: str
    """The module's path (``""``: the model), the parameter's name (``grad_ready``), ``"optimizer"``."""
    target: Any = None
    """The ``nn.Module``, ``nn.Parameter`` or optimizer the op belongs to."""
    params: tuple[int, ...] = ()
    """Indices into :attr:`OpClock.params`: the module's own parameters, the parameter whose
    gradient is ready, or those the optimizer steps."""
    window: int = -1
    """Pairs a ``*_pre`` op with its ``*_post``: the module's index for forward ops, the backward
    invocation for backward ops (-1 for the others)."""
    output: Any = None
    """The module's output, at the ``start`` of a ``forward_post`` only (never kept)."""


Listener = Callable[[int, str, Op], None]


class _Invocation:
    __slots__ = ("key", "left", "started")

    def __init__(self, key: int, left: int) -> None:
        self.key = key
        self.left = left
        self.started = False


class OpClock:
    """Numbers the ops of ``model``'s iterations and tells every listener of each op's start and end.

    ``params`` are the parameters ops refer to by index (default ``model.named_parameters()``);
    ``lock`` the lock hooks and listeners run under (default a new ``threading.RLock``)."""

    def __init__(self, model: nn.Module, params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 lock: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.params = list(model.named_parameters() if params is None else params)
        self.param_index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self.lock = lock if lock is not None else threading.RLock()
        self._owner = process.current_pid()
        self.n_ops = 0
        """Ops numbered since the last :meth:`reset`: the next op's id."""
        self.current: Op | None = None
        """The op that has started and not ended."""
        self._listeners: list[Listener] = []
        self._handles: list[Any] = []
        self._active = False
        self._starts: dict[int, list[tuple[int, tuple[Any, ...]]]] = {}
        """Per open module invocation: the next node sequence number at its start, and weak
        references to its inputs with their versions (see ``_hook_backward``)."""
        self._inv = _INVOCATIONS
        self._stepping: dict[int, Op] = {}
        self._opt_params: dict[int, tuple[int, ...]] = {}

    # ---- listeners -------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(op_id, edge, op)`` at each op's ``"start"`` and ``"end"``, after the
        listeners subscribed before it. Returns a function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # ---- install / remove ------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._active

    def install(self) -> "OpClock":
        """Register the hooks (see the module docs). Raises ``RuntimeError`` if already installed."""
        if self._active:
            raise RuntimeError("this OpClock is already installed")
        try:
            for key, (path, module) in enumerate(self.model.named_modules()):
                owned = tuple(dict.fromkeys(self.param_index[id(p)] for p in module.parameters(recurse=False)
                                            if id(p) in self.param_index))
                backward = bool(owned) or next(module.children(), None) is None
                # the pre-hook runs before the module's other pre-hooks (old-style weight_norm computes
                # its weight in one), the post-hook after the forward hooks registered before it
                self._handles.append(module.register_forward_pre_hook(self._make_pre(path, owned, key, backward),
                                                                      prepend=True))
                self._handles.append(module.register_forward_hook(self._make_post(path, owned, key, backward)))
            for i, (name, p) in enumerate(self.params):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_ready(i, name)))
            self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
            self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        except BaseException:
            self.remove()
            raise
        self._active = True
        return self

    def remove(self, *, quiet: bool = False) -> None:
        """End the open op, remove every hook (idempotent; autograd-node hooks of a graph still
        alive fall silent). The hooks go even if a listener raises at that last ``end``; ``quiet``
        drops such an exception (used when another one is already on its way)."""
        try:
            if self._active:
                with self.lock:
                    self.close()
        except Exception:
            if not quiet:
                raise
        finally:
            self._active = False
            while self._handles:
                self._handles.pop().remove()
            self._starts.clear()
            self._stepping.clear()

    def __enter__(self) -> "OpClock":
        return self.install()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.remove(quiet=exc_type is not None)

    def _live(self) -> bool:
        """The hooks count: installed, and in the process that made the clock."""
        return self._active and process.is_owner(self._owner)

    # ---- numbering -------------------------------------------------------------------------
    def close(self) -> None:
        """End the open op, if any (e.g. at the end of an iteration)."""
        with self.lock:
            op, self.current = self.current, None
            if op is not None:
                self._emit(op.op_id, "end", op)

    def reset(self) -> None:
        """End the open op and number the next op 0 (a new iteration)."""
        with self.lock:
            self.close()
            self.n_ops = 0
            self._starts.clear()
            self._stepping.clear()

    def mark(self, event: str, name: str, phase: str, target: Any = None, params: tuple[int, ...] = ()) -> Op:
        """Number an op no hook sees (e.g. the modelled optimizer step a trace ends with)."""
        with self.lock:
            return self._start(event, name, phase, target, params)

    def _start(self, event: str, name: str, phase: str, target: Any, params: tuple[int, ...],
               window: int = -1, output: Any = None) -> Op:
        self.close()
        op = Op(self.n_ops, event, phase, name, target, params, window, output)
        self.n_ops += 1
        self.current = replace(op, output=None) if output is not None else op
        self._emit(op.op_id, "start", op)
        return op

    def _emit(self, op_id: int, edge: str, op: Op) -> None:
        for listener in tuple(self._listeners):
            listener(op_id, edge, op)

    # ---- module hooks ----------------------------------------------------------------------
    def _make_pre(self, path: str, owned: tuple[int, ...], key: int, backward: bool) -> Callable[..., None]:
        graph_task = torch._C._current_graph_task_id
        next_seq = torch._C._autograd._get_sequence_nr
        starts = self._starts

        def pre(module: nn.Module, args: Any) -> None:
            if not self._live():
                return
            with self.lock:
                phase = "backward" if graph_task() != -1 else "forward"
                self._start("forward_pre", path, phase, module, owned, key)
                if backward:
                    # weakly: a recomputation stopped early never runs the post-hook, and a strong
                    # reference would keep the inputs' saved tensors (parameter views) alive
                    inputs = tuple((weakref.ref(t), t._version) for t in iter_tensors(args) if t.grad_fn is not None)
                    starts.setdefault(key, []).append((next_seq(), inputs))

        return pre

    def _make_post(self, path: str, owned: tuple[int, ...], key: int, backward: bool) -> Callable[..., None]:
        graph_task = torch._C._current_graph_task_id
        next_seq = torch._C._autograd._get_sequence_nr
        starts = self._starts

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self._live():
                return
            with self.lock:
                phase = "backward" if graph_task() != -1 else "forward"
                self._start("forward_post", path, phase, module, owned, key, output)
                if backward:
                    stack = starts.get(key)
                    if stack:
                        lo, inputs = stack.pop()
                        if torch.is_grad_enabled():
                            came_from = [t.grad_fn for ref, version in inputs
                                         if (t := ref()) is not None and t._version == version]
                            self._hook_backward(path, module, owned, output, lo, next_seq(), came_from)

        return post

    def _hook_backward(self, path: str, module: nn.Module, owned: tuple[int, ...], output: Any, lo: int, hi: int,
                       came_from: list[Any]) -> None:
        """Hook the autograd nodes this module invocation created: those reached from its outputs
        before its inputs' nodes, numbered in ``[lo, hi)`` (see [Note: nodes an invocation made])."""
        # [Note: nodes an invocation made]
        # Autograd numbers the nodes it makes per thread. A forward on one thread is one run of
        # numbers, and an invocation's nodes are those numbered from its start to its end. But a
        # checkpointed block recomputes its forward inside backward, on autograd's thread for the
        # device (CUDA's device thread, not the caller's): numbers of that thread's own, unrelated
        # to those of the nodes its inputs came from. Bounding the walk below alone then walked
        # on through the inputs into the whole graph before the block, hooking its nodes as the
        # recomputed module's, and the ops of backward came in another order each iteration. So
        # the walk stops at the nodes the inputs came from (an input changed in place since the
        # start is left out: its node now is one the invocation made), and at numbers outside
        # the run.
        stops = {id(fn) for fn in came_from if fn is not None}  # alive in came_from: ids stay theirs
        stack = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        nodes = []
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in stops:
                continue
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad" or not lo <= node._sequence_nr() < hi:
                continue
            nodes.append(node)
            stack.extend(fn for fn, _ in node.next_functions)
        if not nodes:
            return
        self._inv += 1
        inv = _Invocation(self._inv, len(nodes))

        def node_pre(grad_outputs: Any) -> None:
            if self._live() and not inv.started:
                with self.lock:
                    inv.started = True
                    self._start("backward_pre", path, "backward", module, owned, inv.key)

        def node_post(grad_inputs: Any, grad_outputs: Any) -> None:
            if not self._live():
                return
            with self.lock:
                inv.left -= 1
                if inv.left == 0:
                    self._start("backward_post", path, "backward", module, owned, inv.key)

        for node in nodes:
            node.register_prehook(node_pre)
            node.register_hook(node_post)

    def _make_ready(self, i: int, name: str) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            if not self._live():
                return
            with self.lock:
                self._start("grad_ready", name, "backward", p, (i,))

        return ready

    # ---- optimizer -------------------------------------------------------------------------
    def owned_by(self, opt: torch.optim.Optimizer) -> tuple[int, ...]:
        """Indices of this model's parameters that ``opt`` holds."""
        cached = self._opt_params.get(id(opt))
        if cached is None:
            idx = (self.param_index.get(id(p)) for g in opt.param_groups for p in g["params"])
            cached = tuple(dict.fromkeys(i for i in idx if i is not None))
            self._opt_params[id(opt)] = cached
        return cached

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._live():
            return
        owned = self.owned_by(opt)
        if not owned:
            return
        with self.lock:
            self._stepping[id(opt)] = self._start("step", "optimizer", "step", opt, owned)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._live():
            return
        op = self._stepping.pop(id(opt), None)
        if op is None:
            return
        with self.lock:
            if self.current is not None and self.current.op_id == op.op_id:
                self.close()


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
