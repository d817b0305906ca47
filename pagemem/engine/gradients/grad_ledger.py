"""Each parameter's gradient: its state and its legal moves, in one ledger per engine.

The updater (``update.py``), the gradient handles (``grads.py``), the gradient copies
(``grad_copies.py``) and the lock-free updater (``lockfree.py``) ask the ledger whether a
parameter has a gradient and where it is, and move it only through the ledger; the legal moves
are written here, once, and asserted on every move. What goes with a state (an early update's
future, a copy's record, a handle tensor) stays with its owner, keyed by parameter.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Iterable, Sequence


class GradState(enum.Enum):
    """[Note: gradient states] Where parameter ``i``'s gradient is, between autograd and the update:

    - ``NONE``: no gradient this step. The sum's pages hold nothing that counts (the next
      gradient replaces them); ``p.grad`` is None.
    - ``ACCUMULATING``: a gradient of the running backward was handed off for it and added to
      the sum (or its add queued, below), and its unit is not final yet: more of this backward
      may come. With ``lock_free`` its unit is *open*: the updating thread does not take it.
    - ``SUMMED``: no backward adds to the sum now: it holds every gradient since the last update
      took them (the sync updater's next update steps it; with ``lock_free``, the current
      iteration's, not yet submitted). Readable (norms, clipping, an op on it materialised), and
      a torch-style ``optimizer.step()`` leaves it summed: it keeps ``p.grad`` until
      ``zero_grad``, and the next backward adds to it.
    - ``UPDATING``: its update started during backward (``overlap_update``; the future is the
      updater's). It cannot be read, discarded or assigned; ``step()`` waits for it.
    - ``APPLIED``: a torch-style ``optimizer.step()`` (one that keeps gradients) took it from
      ``UPDATING``: applied, ``p.grad`` still shows it, but no sum is left that a backward
      could add to (the next backward is refused) or that could be read.
    - ``HANDED_OFF``: with ``lock_free``, ``step()`` submitted it to the updating thread's
      buffers, which have not taken it yet; a new gradient adds to the same sum.

    ``p.grad`` shows a handle for the states ``SHOWN`` lists (``GradLedger.pending``). A step
    that consumes gradients (``engine.step()``) and the updating thread taking a sum move them
    back to ``NONE``: consumed is no gradient.

    Legal moves (``GradLedger.move`` asserts them)::

        NONE         -> ACCUMULATING (handed off in a backward), SUMMED (assigned to p.grad by hand)
        ACCUMULATING -> ACCUMULATING (another of the same backward), SUMMED (its unit final, the
                        backward ended; assigned by hand; a failed backward undone), UPDATING (its
                        update started), NONE (a failed backward undone; a consuming step),
                        HANDED_OFF (a failed backward undone, lock-free)
        SUMMED       -> ACCUMULATING (a later backward adds), SUMMED (assigned by hand, zeroed),
                        NONE (a consuming step, zero_grad, a failed backward undone), HANDED_OFF
                        (submitted; a failed backward undone)
        UPDATING     -> APPLIED (a step that keeps gradients), NONE (a consuming step, a failed
                        backward undone), SUMMED (a failed backward undone)
        APPLIED      -> SUMMED (assigned by hand), NONE (zero_grad, the next step)
        HANDED_OFF   -> ACCUMULATING (the next iteration adds), NONE (the updating thread took it)

    A failed backward moves every gradient it touched back to the state it was in before that
    backward ([Note: a failed backward is undone] in ``updates/backward_undo.py``): the moves
    marked "a failed backward undone" above.

    [Note: a gradient copy in flight] Independently of its state, a parameter is marked
    *copying* while its gradient's add into host pages runs on the side stream ([Note:
    gradient copies]): the mark is set by the copy and cleared by its landing, nothing else. It
    is not one more state because the copy overlaps moves of the gradient: an update started
    during backward lands it from a worker, a lock-free unit becomes final before its copies
    land, a gradient assigned by hand may be discarded before a reader waited for it.
    """

    NONE = "none"
    ACCUMULATING = "accumulating"
    SUMMED = "summed"
    UPDATING = "updating"
    APPLIED = "applied"
    HANDED_OFF = "handed off"


_S = GradState
_LEGAL = {
    _S.NONE: frozenset({_S.ACCUMULATING, _S.SUMMED}),
    _S.ACCUMULATING: frozenset({_S.ACCUMULATING, _S.SUMMED, _S.UPDATING, _S.NONE, _S.HANDED_OFF}),
    _S.SUMMED: frozenset({_S.ACCUMULATING, _S.SUMMED, _S.NONE, _S.HANDED_OFF}),
    _S.UPDATING: frozenset({_S.APPLIED, _S.NONE, _S.SUMMED}),
    _S.APPLIED: frozenset({_S.SUMMED, _S.NONE}),
    _S.HANDED_OFF: frozenset({_S.ACCUMULATING, _S.NONE}),
}

SHOWN = (_S.ACCUMULATING, _S.SUMMED, _S.UPDATING, _S.APPLIED)
"""The states whose gradient ``p.grad`` shows (a handle) between backwards: a gradient no update
has consumed nor, lock-free, been handed."""
FRESH = (_S.ACCUMULATING, _S.SUMMED)
"""Lock-free: the gradients of the iteration not yet submitted (they share sums with submitted ones)."""


class GradLedger:
    """Every parameter's gradient state (see [Note: gradient states]). Safe to use from several
    threads (the compute thread, the Adam workers landing copies, the lock-free updating thread)."""

    def __init__(self, names: Sequence[str] = (), unit_of: Sequence[int] = ()) -> None:
        """``names[i]``: parameter ``i``'s name (for errors); ``unit_of[i]``: its paging unit
        (for ``unit_holds``)."""
        self.names = list(names)
        self.unit_of = list(unit_of)
        self._lock = threading.Lock()
        self._state: dict[int, GradState] = {}
        """Parameter -> its state; absent: ``NONE``."""
        self._by_state: dict[GradState, set[int]] = {s: set() for s in GradState if s is not _S.NONE}
        self._by_unit: dict[GradState, Counter] = {s: Counter() for s in GradState if s is not _S.NONE}
        self._copying: set[int] = set()

    def name(self, i: int) -> str:
        return repr(self.names[i]) if i < len(self.names) else f"#{i}"

    # ------------------------------------------------------------------ states

    def state(self, i: int) -> GradState:
        return self._state.get(i, _S.NONE)

    def move(self, i: int, new: GradState) -> GradState:
        """Move parameter ``i``'s gradient to ``new``; returns the state it was in."""
        with self._lock:
            return self._move(i, new)

    def move_all(self, old: GradState | Iterable[GradState], new: GradState, unit: int | None = None) -> list[int]:
        """Move every parameter in ``old`` (a state or several, not ``NONE``; ``unit``: of that
        unit only) to ``new``; returns them, in order. Each move is checked before any is made."""
        olds = (old,) if isinstance(old, GradState) else tuple(old)
        assert _S.NONE not in olds, "move_all: parameters without a gradient are not listed"
        with self._lock:
            moved = sorted(i for s in olds for i in self._by_state[s] if unit is None or self.unit_of[i] == unit)
            for i in moved:
                self._check(i, self._state[i], new)
            for i in moved:
                self._move(i, new)
            return moved

    def holding(self, *states: GradState) -> list[int]:
        """The parameters in any of ``states`` (not ``NONE``), in order."""
        with self._lock:
            return sorted(i for s in states for i in self._by_state[s])

    def count(self, *states: GradState) -> int:
        with self._lock:
            return sum(len(self._by_state[s]) for s in states)

    def unit_holds(self, u: int, *states: GradState) -> bool:
        """Some parameter of unit ``u`` is in one of ``states``."""
        with self._lock:
            return any(self._by_unit[s][u] for s in states)

    def pending(self) -> list[int]:
        """The parameters with a gradient ``p.grad`` shows (``SHOWN``), in order."""
        return self.holding(*SHOWN)

    def _move(self, i: int, new: GradState) -> GradState:
        old = self._state.get(i, _S.NONE)
        self._check(i, old, new)
        u = self.unit_of[i] if i < len(self.unit_of) else -1
        if old is not _S.NONE:
            self._by_state[old].discard(i)
            self._by_unit[old][u] -= 1
        if new is _S.NONE:
            self._state.pop(i, None)
        else:
            self._state[i] = new
            self._by_state[new].add(i)
            self._by_unit[new][u] += 1
        return old

    def _check(self, i: int, old: GradState, new: GradState) -> None:
        if new not in _LEGAL[old]:
            raise AssertionError(f"gradient of parameter {self.name(i)}: {old.value} -> {new.value} is not a legal move")

    # ------------------------------------------------------------------ copies in flight

    def copy_started(self, i: int) -> None:
        """Parameter ``i``'s gradient is being added into host pages on the side stream (see
        [Note: a gradient copy in flight])."""
        with self._lock:
            if i in self._copying:
                raise AssertionError(f"gradient of parameter {self.name(i)}: a copy is already in flight")
            self._copying.add(i)

    def copy_landed(self, i: int) -> None:
        with self._lock:
            if i not in self._copying:
                raise AssertionError(f"gradient of parameter {self.name(i)}: no copy is in flight")
            self._copying.discard(i)

    def is_copying(self, i: int) -> bool:
        return i in self._copying

    def copying(self) -> list[int]:
        with self._lock:
            return sorted(self._copying)

    def copies_in_flight(self) -> int:
        return len(self._copying)
