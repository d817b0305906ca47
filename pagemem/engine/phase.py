"""The engine's phase in the training loop: one value, its counters, and its legal moves.

``Engine`` (``engine.py``, with its backward in ``backward.py``) is the only one that moves the
phase; the legal moves are written here, once, and asserted on every move. A move the table does
not hold is the engine's bug and raises ``AssertionError`` naming both phases; a user's misuse is
refused by the engine before it would move (``InvalidRequest``, ``StepFailed``).
"""

from __future__ import annotations

import enum

from pagemem.errors import InvalidRequest, StepFailed


class EnginePhase(enum.Enum):
    """[Note: engine phases] Where the engine stands between backward and the update:

    - ``IDLE``: no backward's gradients wait for an update (``micro == 0``). Gradients that
      ``engine.optimizer.step()`` kept (a torch optimizer leaves ``p.grad`` until
      ``zero_grad()``) still show as ``p.grad``, but an update has taken them.
    - ``ACCUMULATED``: the gradients of ``micro >= 1`` backwards since the last update (or since
      a ``zero_grad`` discarded every sum) wait in the sums.
    - ``BACKWARD``: ``engine.backward`` runs, from its start to its bookkeeping whole.
    - ``BACKWARD_BY_HABIT``: a ``loss.backward()`` began at its first gradient hook and autograd's
      end callback has not run. If that backward raised, the callback never runs: the next call
      into the engine finds it (no autograd node runs) and aborts it ([Note: backward by habit]).
    - ``STEPPING``: ``engine.step()`` updates; the gradients are consumed (the next backward
      starts new sums).
    - ``STEPPING_KEEP``: ``engine.optimizer.step()`` (called by the user, not through
      ``engine.step()``) updates; the gradients are kept until ``zero_grad()``.
    - ``BROKEN``: a backward failed and undoing it failed too ([Note: a failed backward is
      undone], ``updates/backward_undo.py``; ``broken`` says what): every call raises
      ``StepFailed`` until ``Engine.load``.
    - ``CLOSED``: ``close()`` ran; every call raises ``InvalidRequest``.

    A forward is no phase: nothing reads it, and one that raises changes nothing. A step that
    fails part-way goes back to where it began with its counters as they were; the update it
    leaves unfinished is the updater's ([Note: a step is a transaction], ``update.py``).

    Legal moves (``PhaseMachine._to`` asserts them; the method that makes each in brackets)::

        IDLE              -> BACKWARD, BACKWARD_BY_HABIT [begin_backward], STEPPING_KEEP [begin_step],
                             CLOSED [close]
        ACCUMULATED       -> BACKWARD, BACKWARD_BY_HABIT [begin_backward], STEPPING, STEPPING_KEEP
                             [begin_step], IDLE [discard], CLOSED [close]
        BACKWARD          -> ACCUMULATED [end_backward, abort_backward], IDLE, BROKEN [abort_backward],
                             CLOSED [close]
        BACKWARD_BY_HABIT -> ACCUMULATED [end_backward, abort_backward], IDLE, BROKEN [abort_backward],
                             CLOSED [close]
        STEPPING          -> IDLE [end_step, leave_step], ACCUMULATED [leave_step], CLOSED [close]
        STEPPING_KEEP     -> IDLE [end_step, leave_step], ACCUMULATED [leave_step]
        BROKEN            -> CLOSED [close]
        CLOSED            -> (none)

    ``STEPPING`` starts only from ``ACCUMULATED`` (``step()`` updates after ``accumulation_steps``
    backwards). ``optimizer.step()``, ``step()`` where it would update, and ``close()`` are
    refused during a backward (a hook of it calling them), before any move. A backward that no
    autograd node runs any more is closed with the engine: a backward by habit that raised and
    that no call has found yet (``engine.backward`` leaves none behind, unless a second Ctrl-C
    lands while it aborts). ``step()`` enters ``STEPPING`` and calls ``optimizer.step()`` (an lr
    scheduler wraps it, step hooks run in it), whose work sees ``STEPPING`` and consumes; all of
    ``step()`` runs shielded ([Note: Ctrl-C inside the engine]), so a Ctrl-C cannot leave the
    phase ``STEPPING``. A move into or out of a backward is made in the shielded method that does
    its bookkeeping (``backward.py``), the guard entered and exited with it. ``IDLE`` holds
    ``micro == 0`` and ``ACCUMULATED`` ``micro >= 1`` (asserted on every move); ``BROKEN`` alone
    has a reason. A backward that fails is undone: ``abort_backward`` goes back to where the
    backward began, ``ACCUMULATED`` with the earlier backwards' count or ``IDLE``; ``BROKEN`` only
    when the undo failed (``micro`` 0: nothing pending counts)."""

    IDLE = "idle"
    ACCUMULATED = "accumulated"
    BACKWARD = "backward"
    BACKWARD_BY_HABIT = "backward by habit"
    STEPPING = "stepping"
    STEPPING_KEEP = "stepping (keeping the gradients)"
    BROKEN = "broken"
    CLOSED = "closed"


_P = EnginePhase
LEGAL: dict[EnginePhase, frozenset[EnginePhase]] = {
    _P.IDLE: frozenset({_P.BACKWARD, _P.BACKWARD_BY_HABIT, _P.STEPPING_KEEP, _P.CLOSED}),
    _P.ACCUMULATED: frozenset({_P.BACKWARD, _P.BACKWARD_BY_HABIT, _P.STEPPING, _P.STEPPING_KEEP, _P.IDLE, _P.CLOSED}),
    _P.BACKWARD: frozenset({_P.ACCUMULATED, _P.IDLE, _P.BROKEN, _P.CLOSED}),
    _P.BACKWARD_BY_HABIT: frozenset({_P.ACCUMULATED, _P.IDLE, _P.BROKEN, _P.CLOSED}),
    _P.STEPPING: frozenset({_P.IDLE, _P.ACCUMULATED, _P.CLOSED}),
    _P.STEPPING_KEEP: frozenset({_P.IDLE, _P.ACCUMULATED}),
    _P.BROKEN: frozenset({_P.CLOSED}),
    _P.CLOSED: frozenset(),
}
"""The legal moves of [Note: engine phases]."""

BACKWARDS = frozenset({_P.BACKWARD, _P.BACKWARD_BY_HABIT})
STEPS = frozenset({_P.STEPPING, _P.STEPPING_KEEP})


class PhaseMachine:
    """The engine's phase, the reason it is broken, and the counters the phase is read from (see
    [Note: engine phases]). Every move is a method; each asserts the table."""

    __slots__ = ("now", "broken", "micro", "per_step", "taken")

    def __init__(self, now: EnginePhase = EnginePhase.IDLE, micro: int = 0, broken: str | None = None) -> None:
        self.now = now
        self.broken = broken
        """Why training cannot go on (``BROKEN`` only)."""
        self.micro = micro
        """Backwards ended since the last update or the last ``zero_grad`` that discarded every
        sum (``ACCUMULATED`` while above 0)."""
        self.per_step: int | None = None
        """Backwards per step, as the last update saw them (None before any)."""
        self.taken = False
        """Whether the last update updated (an fp16 overflow skips one; ``step()`` returns it)."""
        self._check()

    def __repr__(self) -> str:
        return f"PhaseMachine({self.now.name}, micro={self.micro})"

    # ------------------------------------------------------------------ reading it

    @property
    def in_backward(self) -> bool:
        """A backward through the engine began and has not ended (or been found failed)."""
        return self.now in BACKWARDS

    @property
    def consuming(self) -> bool:
        """``engine.step()`` is updating: the update consumes the gradients."""
        return self.now is EnginePhase.STEPPING

    def require_usable(self, what: str) -> None:
        """Refuse ``what`` after ``close()`` (``InvalidRequest``) or once broken (``StepFailed``)."""
        if self.now is EnginePhase.CLOSED:
            raise InvalidRequest(f"{what}: this engine is closed")
        if self.now is EnginePhase.BROKEN:
            raise StepFailed(f"{what}: {self.broken}")

    # ------------------------------------------------------------------ moves

    def begin_backward(self, implicit: bool) -> None:
        """A backward starts: ``engine.backward`` or (``implicit``) a backward by habit."""
        self._to(EnginePhase.BACKWARD_BY_HABIT if implicit else EnginePhase.BACKWARD)

    def end_backward(self) -> None:
        """The backward ended, its bookkeeping whole: its gradients are summed."""
        self._require(BACKWARDS, "end_backward")
        self.micro += 1
        self._to(EnginePhase.ACCUMULATED)

    def abort_backward(self, broken: str | None) -> int:
        """The backward failed part-way and was undone: back to where it began, the step's
        earlier backwards counted; ``broken``: the undo failed, why training cannot go on (no
        backward counts then). Returns how many earlier backwards' gradients were kept (0 when
        broken)."""
        self._require(BACKWARDS, "abort_backward")
        if broken is not None:
            self.micro = 0
            self.broken = broken
            self._to(EnginePhase.BROKEN)
            return 0
        self._to(EnginePhase.ACCUMULATED if self.micro else EnginePhase.IDLE)
        return self.micro

    def begin_step(self, consume: bool) -> None:
        """An update starts: ``engine.step()`` (``consume``) or ``engine.optimizer.step()``."""
        self._to(EnginePhase.STEPPING if consume else EnginePhase.STEPPING_KEEP)
        self.taken = False

    def end_step(self, taken: bool) -> None:
        """The update landed whole (``taken``: it updated): the next backward begins a step."""
        self._require(STEPS, "end_step")
        if self.micro:
            self.per_step = self.micro  # the backwards one step took: the next takes as many
        self.micro = 0
        self.taken = taken
        self._to(EnginePhase.IDLE)

    def leave_step(self, consume: bool) -> None:
        """The update begun by ``begin_step(consume)`` is over: if it did not land (it raised, or
        never ran), back to where it began, with the counters as they were."""
        if self.now is (EnginePhase.STEPPING if consume else EnginePhase.STEPPING_KEEP):
            self._to(EnginePhase.ACCUMULATED if self.micro else EnginePhase.IDLE)

    def discard(self) -> None:
        """``zero_grad`` discarded every gradient sum: no backward's gradients are pending."""
        self._require(frozenset(EnginePhase) - {EnginePhase.BROKEN, EnginePhase.CLOSED}, "discard")
        self.micro = 0
        if self.now is EnginePhase.ACCUMULATED:
            self._to(EnginePhase.IDLE)

    def close(self) -> None:
        self._to(EnginePhase.CLOSED)

    # ------------------------------------------------------------------ the table

    def _require(self, allowed: frozenset[EnginePhase], move: str) -> None:
        if self.now not in allowed:
            raise AssertionError(f"engine phase: {move} in {self.now.name}, which is not "
                                 f"{' or '.join(sorted(p.name for p in allowed))}")

    def _to(self, new: EnginePhase) -> None:
        if new not in LEGAL[self.now]:
            raise AssertionError(f"engine phase: {self.now.name} -> {new.name} is not a legal move")
        self.now = new
        self._check()

    def _check(self) -> None:
        now = self.now
        if (self.micro < 0 or (now is EnginePhase.IDLE and self.micro)
                or (now is EnginePhase.ACCUMULATED and not self.micro)
                or (now is EnginePhase.BROKEN and self.broken is None)
                or (self.broken is not None and now not in (EnginePhase.BROKEN, EnginePhase.CLOSED))):
            raise AssertionError(f"engine phase: {now.name} with micro={self.micro}, broken={self.broken!r}")
