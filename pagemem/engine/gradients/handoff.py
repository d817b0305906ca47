"""Gradients leave autograd through one hand-off, and units whose gradients are final are queued.

[Note: the gradient hand-off]
Each trainable parameter has one post-accumulate hook (``Gradients.hand_off``): autograd's
gradient goes to the destination chosen when the engine was made (``gradients.py``:
``SyncDestination``, the fp32 sum on the gradients' tier, ``Updater.grad_ready``, or stepped at
once where that is exact; ``LockFreeDestination``, the lock-free updater's buffers) and
autograd's tensor is dropped; its state moves in the gradient ledger ([Note: gradient states]). The hand-off
counts them per unit: a unit is *final* in this backward once it has handed off as many
gradients as in the last complete backward (its structure repeats), or at the end of the
backward for the rest (the first backward, a unit some routing reached differently). Final
units are queued in the order they completed (``GradHandoff.queue``) and announced to
subscribers: the seam where an updater that works per unit, behind backward (the lock-free
updater), plugs in. A unit is final at most once per backward.

Where the gradient sum lives in host pages and autograd's gradient on CUDA, the copy runs on a
side stream behind an event ([Note: gradient copies] in ``grad_copies.py``): a subscriber waits
for a final unit's copies (``ParamBank.grads_landed``) from its own thread, and every copy has
landed when ``backward()`` returns.

Each parameter also has a hook before accumulation (``Engine._before_accumulate``), which carries
no gradient: it starts a backward the engine did not start (``loss.backward()``) and takes the
gradient handles down before autograd could add into one. Torch offers no earlier per-backward
event that every parameter's gradient passes (a hook on the model's output misses a loss term
over the parameters alone), so this second hook stays; the gradient still leaves autograd
through the one hand-off.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from pagemem.engine.units.unit import Unit


class GradHandoff:
    """Counts each unit's gradients of a backward on the unit (``grads_handed``, ``final``) and
    queues and announces the units as they become final (see the Note)."""

    def __init__(self, units: Sequence[Unit], unit_of: Sequence[int]) -> None:
        self.units = units
        self.unit_of = unit_of
        self.queue: deque[int] = deque()
        """Units final in the current (or last) backward, in the order they became final."""
        self.early = 0
        """Units that became final before their backward ended (over all backwards)."""
        self._listeners: list[Callable[[int], None]] = []
        self._order: list[Unit] = []
        """Units in the order they handed off their first gradient of this backward."""

    def subscribe(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Call ``listener(unit)`` when a unit becomes final; returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def begin(self) -> None:
        """A backward starts."""
        for u in self.units:
            u.grads_handed, u.final = 0, False
        self.queue.clear()
        self._order.clear()

    def handed(self, i: int) -> None:
        """Parameter ``i``'s gradient for this backward was handed off."""
        u = self.units[self.unit_of[i]]
        if not u.grads_handed:
            self._order.append(u)
        u.grads_handed += 1
        if not u.final and u.grads_expected == u.grads_handed:
            self.early += 1
            self._finish(u)

    def abort(self) -> None:
        """The backward failed: nothing of it counts (what the last complete one taught stays)."""
        self.begin()

    def end(self) -> None:
        """The backward ended: every unit that handed off a gradient is final now."""
        for u in self._order:
            if not u.final:
                self._finish(u)
        for u in self.units:
            u.grads_expected = u.grads_handed or None

    def _finish(self, u: Unit) -> None:
        u.final = True
        self.queue.append(u.index)
        for listener in tuple(self._listeners):
            listener(u.index)
