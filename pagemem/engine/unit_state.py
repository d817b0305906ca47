"""One paging unit's residency: its state and what that state holds.

``Residency`` (``residency.py``) is the only one that moves a unit from state to state; the
legal moves are written here, once, and asserted on every move.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class UnitState(enum.Enum):
    """[Note: unit states] Where a unit's compute copy stands with respect to the gpu:

    - ``HOME``: its parameters are placeholders and it holds no gpu pages it must give back (a
      *settled* unit keeps its only copy there, unbound);
    - ``STAGING``: copies to the gpu are in flight (``stage``), parameters still placeholders;
    - ``BOUND``: its parameters are views of its gpu pages;
    - ``ZOMBIE``: unbound, with gpu pages still to give back, because a tensor derived from an
      old view pins them (or a settled copy found no room at home); they go at the next chance.

    Legal moves (``UnitResidency.to`` asserts them)::

        HOME    -> STAGING, BOUND
        STAGING -> STAGING, BOUND, HOME, ZOMBIE
        BOUND   -> HOME, ZOMBIE
        ZOMBIE  -> HOME, BOUND, STAGING

    Only ``Residency`` moves a unit; others ask it (``is_bound``, ``resident_units``)."""

    HOME = "home"
    STAGING = "staging"
    BOUND = "bound"
    ZOMBIE = "zombie"


_LEGAL = {
    UnitState.HOME: frozenset({UnitState.STAGING, UnitState.BOUND}),
    UnitState.STAGING: frozenset({UnitState.STAGING, UnitState.BOUND, UnitState.HOME, UnitState.ZOMBIE}),
    UnitState.BOUND: frozenset({UnitState.HOME, UnitState.ZOMBIE}),
    UnitState.ZOMBIE: frozenset({UnitState.HOME, UnitState.BOUND, UnitState.STAGING}),
}


@dataclass
class UnitResidency:
    """One unit's residency: its state and what that state holds (see [Note: unit states])."""

    index: int
    state: UnitState = UnitState.HOME
    settled: bool = False
    """The gpu copy of the compute pages is the only one (the plan keeps the unit there)."""
    staged: list[Any] = field(default_factory=list)
    """Copies to the gpu started by ``stage`` and not yet bound (``MoveHandle``)."""
    staged_pages: int = 0
    leases: list[Any] = field(default_factory=list)
    """Leases of scattered pages lent to its parameters while bound."""
    bound_ptrs: dict[int, int] = field(default_factory=dict)
    """Parameter index -> the storage its data views while bound (for ``Residency.param_at``;
    one that differs was given other memory)."""
    versions: list[int] = field(default_factory=list)
    """Its parameters' version counters when bound: one that moved was written in place
    (``Residency.keep_writes``)."""

    def to(self, new: UnitState) -> None:
        if new not in _LEGAL[self.state]:
            raise AssertionError(f"unit {self.index}: {self.state.value} -> {new.value} is not a legal move")
        self.state = new

    @property
    def bound(self) -> bool:
        return self.state is UnitState.BOUND
