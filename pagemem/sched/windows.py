"""Where in logical time each layer is used: its compute windows and its gradient span.

A layer's window is a maximal run of ops that access its parameters with no other layer's
parameters accessed in between (e.g. a transformer block's forward; its backward, with the
forward recomputation under activation checkpointing; a tied embedding's uses as input and as
output head are separate windows). Ops of the optimizer ``step`` phase are not compute and are
left out: the scheduler plans updates itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagemem.tracer import Trace


@dataclass(frozen=True, slots=True)
class Window:
    layer: int
    start: int
    end: int
    accesses: tuple[int, ...]
    """The ops in ``[start, end]`` that access the layer's parameters."""


@dataclass(frozen=True, slots=True)
class GradSpan:
    """The ops that read or write the layer's gradients during backward: the gradient buffer
    must exist from ``first`` to ``last``; ``window`` is the index (among the layer's windows)
    of the window whose compute allocates it."""

    layer: int
    first: int
    last: int
    window: int
    accesses: tuple[int, ...]


@dataclass(frozen=True)
class Usage:
    windows: tuple[tuple[Window, ...], ...]
    """Per layer, its windows in time order."""
    grads: tuple[GradSpan | None, ...]
    """Per layer, its gradient span (None for a layer without gradients)."""
    n_ops: int

    @classmethod
    def from_trace(cls, trace: Trace) -> "Usage":
        n = len(trace.ops)
        compute_op = np.array([op.phase != "step" for op in trace.ops], dtype=bool)
        n_layers = len(trace.layers)
        param_ops: list[set[int]] = [set() for _ in range(n_layers)]
        grad_ops: list[set[int]] = [set() for _ in range(n_layers)]
        for rec in trace.tensors:
            if rec.layer is None:
                continue
            if rec.kind == "param":
                param_ops[rec.layer].update(a for a in rec.accesses if compute_op[a])
            elif rec.kind == "grad":
                grad_ops[rec.layer].update(a for a in rec.accesses if compute_op[a])
        for layer, ops in enumerate(grad_ops):
            # a parameter read where the trace did not see it (outside its module, through an op
            # that saved nothing): its gradient's first op stands for that read, so the layer has
            # a window that produces its gradients
            if ops and (not param_ops[layer] or min(param_ops[layer]) > min(ops)):
                param_ops[layer].add(min(ops))
        # users[t]: how many layers access parameters at op t
        users = np.zeros(n + 1, dtype=np.int32)
        for ops in param_ops:
            if ops:
                users[np.fromiter(ops, dtype=np.int64)] += 1
        windows = []
        for layer, ops in enumerate(param_ops):
            windows.append(tuple(_split(layer, sorted(ops), users)))
        grads = []
        for layer, ops in enumerate(grad_ops):
            if not ops:
                grads.append(None)
                continue
            acc = tuple(sorted(ops))
            owner = max((i for i, w in enumerate(windows[layer]) if w.start <= acc[0]), default=None)
            if owner is None:
                raise ValueError(f"layer {layer}: gradients used at op {acc[0]} before any use of its parameters")
            grads.append(GradSpan(layer, acc[0], acc[-1], owner, acc))
        return cls(tuple(windows), tuple(grads), n)

    def all_windows(self) -> list[Window]:
        """Every window of every layer, ordered by start (then layer)."""
        return sorted((w for ws in self.windows for w in ws), key=lambda w: (w.start, w.layer))


def _split(layer: int, ops: list[int], users: np.ndarray) -> list[Window]:
    """Cut a layer's sorted access ops where another layer is used in between."""
    if not ops:
        return []
    # others[t] = number of ops < t where a layer other than this one is used
    mine = np.zeros_like(users)
    mine[np.asarray(ops)] = 1
    others = np.concatenate(([0], np.cumsum((users - mine) > 0)))
    out, run = [], [ops[0]]
    for prev, op in zip(ops, ops[1:]):
        if others[op] - others[prev + 1] > 0:
            out.append(Window(layer, run[0], run[-1], tuple(run)))
            run = []
        run.append(op)
    out.append(Window(layer, run[0], run[-1], tuple(run)))
    return out
