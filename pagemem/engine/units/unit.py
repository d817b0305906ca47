"""A paging unit, the one owner of what the engine keeps per unit.

[Note: the unit owns its state]
A paging unit is a run of consecutive modules owning parameters, merged up to a size cap
(``records.paging_units``). Everything the engine knows of one unit lives on its ``Unit``: its
pages by kind (compute copy, fp32 master, moments, gradient sums), where its optimizer states
are (``state_tier``), its residency (``state``, with what that state holds: copies staged,
leases, the storages its parameters view, their version counters, when it was last used), how
many module scopes hold it (``holds``, ``soft_holds``), whether its gradients of a backward are
final (``grads_handed``, ``grads_expected``, ``final``) and how far the lock-free updater is
behind on it (``untaken``, ``lag``). The bank makes the units; the residency is the only one that
moves ``state``; the scopes count holds; the hand-off counts gradients; the lock-free updater
counts iterations (under its lock); the bank moves the states. Others read them through the unit
(``bound``, ``settled``, ``held``); no parallel list repeats them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagemem.store import PagedTensor


class UnitState(enum.Enum):
    """[Note: unit states] Where a unit's compute copy stands with respect to the gpu:

    - ``HOME``: its parameters are placeholders; its compute copy is on the cpu and it holds no
      gpu pages it must give back;
    - ``STAGING``: copies to the gpu are in flight (``stage``), parameters still placeholders;
    - ``BOUND``: its parameters are views of a gpu replica (the cpu copy stays);
    - ``ZOMBIE``: unbound, with a gpu replica still to give back, because a tensor derived from
      an old view pins it; it goes at the next chance;
    - ``KEPT``: its parameters are views of its only copy, on the gpu (*settled*: a layer the
      plan keeps there for good, so each update refreshes one copy; or the compute copy is the
      master, home on the gpu);
    - ``PARKED``: unbound, its only copy on the gpu: a master home on the gpu between bindings,
      or a kept unit evicted that found no room at home (it goes home at the next chance).

    Legal moves (``Unit.to`` asserts them)::

        HOME    -> STAGING, BOUND, PARKED
        STAGING -> STAGING, BOUND, HOME, ZOMBIE, PARKED
        BOUND   -> HOME, ZOMBIE
        ZOMBIE  -> HOME, BOUND, STAGING, PARKED
        KEPT    -> HOME, PARKED
        PARKED  -> KEPT, HOME

    Only ``Residency`` moves a unit; others ask it (``is_bound``, ``resident_units``)."""

    HOME = "home"
    STAGING = "staging"
    BOUND = "bound"
    ZOMBIE = "zombie"
    KEPT = "kept"
    PARKED = "parked"


_LEGAL = {
    UnitState.HOME: frozenset({UnitState.STAGING, UnitState.BOUND, UnitState.PARKED}),
    UnitState.STAGING: frozenset({UnitState.STAGING, UnitState.BOUND, UnitState.HOME, UnitState.ZOMBIE,
                                  UnitState.PARKED}),
    UnitState.BOUND: frozenset({UnitState.HOME, UnitState.ZOMBIE}),
    UnitState.ZOMBIE: frozenset({UnitState.HOME, UnitState.BOUND, UnitState.STAGING, UnitState.PARKED}),
    UnitState.KEPT: frozenset({UnitState.HOME, UnitState.PARKED}),
    UnitState.PARKED: frozenset({UnitState.KEPT, UnitState.HOME}),
}


@dataclass(eq=False)
class Unit:
    """One paging unit (see [Note: the unit owns its state])."""

    index: int
    name: str
    params: list[int]
    """Indices into ``ParamBank.params``."""
    compute: list[PagedTensor]
    master: list[PagedTensor | None]
    """None for a frozen parameter (see [Note: frozen parameters]); the same as ``compute`` where
    the compute copy is the master."""
    exp_avg: list[PagedTensor | None]
    exp_avg_sq: list[PagedTensor | None]
    grad: list[PagedTensor | None]
    """fp32 gradient sums on ``grad_tier_beside(state_tier)`` (valid for the parameters that got
    a gradient this step)."""
    state_tier: str
    """Where its optimizer states are: the optimizer tier, or the gpu while a plan keeps the
    unit there (``ParamBank.place_states``)."""
    state: UnitState = UnitState.HOME
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
    last_used: int = 0
    """When it was last bound or asked for (the residency's clock): the least recently used
    bound unit is evicted first."""
    holds: int = 0
    """Open forward scopes holding it: never evicted ([Note: the residency rule], ``scopes.py``)."""
    soft_holds: int = 0
    """Open backward scopes holding it: evicted only when nothing else can go."""
    grads_handed: int = 0
    """Gradients it handed off in the running (or last) backward ([Note: the gradient hand-off])."""
    grads_expected: int | None = None
    """Gradients it handed off in the last complete backward (None: it handed off none)."""
    final: bool = False
    """All its gradients of the running (or last) backward are handed off."""
    untaken: int = 0
    """Submitted iterations whose gradients sit in its sums, not yet taken by the lock-free
    updater's thread ([Note: the lock-free updater])."""
    lag: int = 0
    """Submitted iterations its buffered parameters (the compute pages) lack: its staleness."""

    def to(self, new: UnitState) -> None:
        if new not in _LEGAL[self.state]:
            raise AssertionError(f"unit {self.index}: {self.state.value} -> {new.value} is not a legal move")
        self.state = new

    @property
    def bound(self) -> bool:
        """Its parameters view gpu pages (a replica, or its only copy)."""
        return self.state is UnitState.BOUND or self.state is UnitState.KEPT

    @property
    def settled(self) -> bool:
        """Its only compute copy is on the gpu."""
        return self.state is UnitState.KEPT or self.state is UnitState.PARKED

    @property
    def held(self) -> bool:
        return self.holds > 0

    def states(self) -> list[PagedTensor]:
        """The optimizer-state tensors the unit has (master weights and moments), kind by kind."""
        return [t for t in (*self.master, *self.exp_avg, *self.exp_avg_sq) if t is not None]
