"""Which units may be read right now: the scopes of the modules that are running.

[Note: the residency rule]
A parameter is resident whenever anything may read it. A module may read its own parameters
anywhere between its forward pre-hook and its forward post-hook, children's forwards included
(a class token concatenated after the patch embedding, layer scale after the MLP, a weight read
after an activation module, a parametrization), so its unit is *held* over that whole scope;
over a forward recomputed during backward (activation checkpointing); and over the span of
its backward (``backward_pre`` to ``backward_post``) while the budget allows (backward reads
parameters only through saved tensors, which are fetched again when unpacked, and a backward that
does not reach a module never ends its scope). Held units are never evicted, in
traced, planned and demand iterations alike. The tracer records the same scopes (it touches the
parameters of every open scope at every op: ``pagemem.tracer.recorder``), so a plan holds them
too and counts their memory. A read outside every scope (a parameter used outside its module, a
loss term over ``model.parameters()``, user code between steps) is not foreseen by any plan:
``pagemem.engine.units.guard`` fetches it on demand, counted, and an evicted parameter never holds
values (see [Note: evicted parameters]).

``Scopes`` follows the op clock's events the way the tracer's recorder does, so both agree on
what is open when, and counts the holds on the units themselves (``Unit.holds``: an open forward
scope, never evicted; ``Unit.soft_holds``: an open backward scope, kept while the budget allows,
since a backward that does not reach a module's parameters, ``autograd.grad`` with respect to
the inputs, never ends that module's backward scope, and only saved tensors read parameters
there, which are fetched again when unpacked).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagemem.engine.units.unit import Unit
from pagemem.tracer import Op


class Scopes:
    """The units held by open module scopes, kept from the op clock's events."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = units
        self._forward: list[tuple[int, tuple[int, ...], bool]] = []
        """(module key, units, opened during backward) of each open forward scope, outermost first."""
        self._backward: dict[int, tuple[int, ...]] = {}

    def on_op(self, op: Op, units: Iterable[int]) -> None:
        """An op starts (``units``: those of ``op.params``): open or close the scope it marks."""
        ev = op.event
        if ev in ("backward_pre", "backward_post", "grad_ready"):
            self._drop_recomputed()
        if ev == "forward_pre":
            if op.params:
                self._open_forward(op.window, tuple(units), op.phase == "backward")
        elif ev == "forward_post":
            self._close_forward(op.window)
        elif ev == "backward_pre":
            if op.params and op.window not in self._backward:
                self._backward[op.window] = held = tuple(units)
                for u in held:
                    self.units[u].soft_holds += 1
        elif ev == "backward_post":
            for u in self._backward.pop(op.window, ()):
                self.units[u].soft_holds = max(0, self.units[u].soft_holds - 1)
        elif ev == "step":
            self.clear()

    def clear(self) -> None:
        """Every scope closes (the iteration ended, or was abandoned)."""
        self._forward.clear()
        self._backward.clear()
        for u in self.units:
            u.holds = u.soft_holds = 0

    def _open_forward(self, key: int, units: tuple[int, ...], in_backward: bool) -> None:
        self._forward.append((key, units, in_backward))
        for u in units:
            self.units[u].holds += 1

    def _close_forward(self, key: int) -> None:
        """The module's forward ended; scopes opened inside it and never closed end too."""
        stack = self._forward
        for pos in range(len(stack) - 1, -1, -1):
            if stack[pos][0] == key:
                for _, units, _ in stack[pos:]:
                    self._release(units)
                del stack[pos:]
                return

    def _drop_recomputed(self) -> None:
        """Forward scopes opened during backward (a recomputation that stopped early) end."""
        if self._forward and self._forward[-1][2]:
            keep = []
            for entry in self._forward:
                if entry[2]:
                    self._release(entry[1])
                else:
                    keep.append(entry)
            self._forward[:] = keep

    def _release(self, units: Iterable[int]) -> None:
        for u in units:
            self.units[u].holds = max(0, self.units[u].holds - 1)
