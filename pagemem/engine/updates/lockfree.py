"""The lock-free updater: optimizer states updated behind the compute (ANGEL-PTM §4.3, Algorithm 2).

[Note: the lock-free updater]
With ``EngineConfig(lock_free=True)`` the update leaves the iteration. ``step()`` only *submits*
the iteration's gradients; one updating thread walks the units in reverse, over and over, and
for each unit with submitted gradients: fetches its fp32 master weights and Adam moments (from
nvme, the next unit's fetch in flight meanwhile), takes its gradient sums, updates, writes the
states back and *publishes* the new compute-dtype values. The compute side never waits for the
SSD: it reads the buffered parameters (the units' compute pages) as they are.

The two buffers of Algorithm 2 are the engine's own pages, each with one writer at a time:
- **buffered gradients** are the fp32 gradient sums (fp32, not the compute dtype: summing
  several iterations in bf16 would round). The hand-off adds into them; the updating thread
  *takes* a unit's sums (copies them out, and the next gradient replaces instead of adding)
  only while no backward is adding to that unit: a unit is *open* from its first gradient of a
  backward until it is final (the hand-off's queue) or the backward ends. So every gradient is
  applied exactly once, and a unit's update covers whole iterations. Each parameter's part is
  its gradient state in the engine's ledger ([Note: gradient states] in ``grad_ledger.py``):
  ``ACCUMULATING`` while its unit is open, ``SUMMED`` once it is final (the iteration's
  gradients, not yet submitted), ``HANDED_OFF`` once ``step()`` submitted them, ``NONE`` once
  taken;
- **buffered parameters** are the compute pages. A published update is written into them on
  the compute thread at the start of the next iteration (``before_iteration``), when no op reads
  them and every copy of them to the gpu is ordered behind the write by the store: a unit's
  buffered parameters are always the cast of one whole update, never a mix of two.

[Note: one step per iteration] An update that finds the gradients of ``k`` iterations in a
unit's sums takes ``k`` AdamW steps with their mean (``k = 1``: the sum itself, bit for bit), so
the learning rate keeps its meaning per iteration and a parameter's step count is the number of
iterations it had gradients in, as in synchronous training (one step with the mean, tried
first, fell further behind: half the steps on the 300-step task); the hyperparameters are those
``param_groups`` held at the newest of those ``step()`` calls. *Staleness* is how many submitted iterations with gradients for
a unit its buffered parameters lack when an iteration starts (``stats()["staleness"]``: mean,
max, histogram). ``max_staleness``: the compute side waits at an iteration's start until no
unit lags more than that (0: every update lands first, which is synchronous training, bit for
bit); None never waits (the paper's behaviour); the default is 1 after 20 synchronous steps
([Note: the lock-free default] in ``staleness.py``). Refused with it: clipping by the global norm and
loss scaling (both need every unit's gradient before any update), updates during backward, and
optimizer states on the gpu. ``zero_grad`` cannot take back gradients that share a sum with
submitted ones: it is refused while the iteration has gradients. A failed backward can: the sums
it added to were kept before it added ([Note: a failed backward is undone] in
``backward_undo.py``), and are restored, submitted gradients and all. ``save()`` drains: it waits until
every submitted iteration is applied and published, so a checkpoint is a synchronous one. A
failing or dead updating thread raises in the training loop at the next call (its error
chained), never hangs: every wait checks it. The updating thread's side, and [Note: a fetch
serves the bound's updates] (states kept in cpu memory between a unit's updates under a bound),
are in ``lockfree_thread.py``.

[Note: predicting past the staleness] A unit that lags ``s`` iterations computes its gradients at
weights ``s`` updates old, and AdamW loses quality with even one (on ``bench_lockfree.py``'s
branching task, plain PyTorch one step late ends 2% above synchronous). With
``staleness_correction="predict"`` (the default) the updating thread publishes with each update
its change per iteration (``drift = (new - old) / k``, fp32), and the drain buffers
``new + s * drift``, ``s`` being the submitted iterations the update lacks at that moment: the
weights synchronous training would hold if the next ``s`` updates repeated this one (weight
prediction, as PipeMare and SpecTrain do for pipeline staleness). Only the buffered copy is
predicted; master weights and moments are the updates as applied, so ``max_staleness=0`` and a
checkpoint (drained to ``s = 0``) are synchronous, bit for bit. A unit is predicted when its
update is drained, for the lag it has then; until its next update its buffered parameters stay.
Both halves of a unit come from one update, so prediction cannot tear it. ``"none"`` buffers the
update as applied. Cost: an fp32 copy of each parameter's master while its update runs, and the
published values kept in fp32 until drained.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any, Callable

import torch

from pagemem.engine.interrupts import shielded
from pagemem.engine.updates.adam import AdamW
from pagemem.engine.updates.adam_threads import Workers
from pagemem.engine.updates.backward_undo import HOLDS, BackwardUndo
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.gradients.grad_ledger import FRESH, GradLedger, GradState
from pagemem.engine.updates.lockfree_thread import Packed, Published, UpdatingThread
from pagemem.engine.updates.staleness import staleness_bound
from pagemem.errors import InvalidRequest, StepFailed, TierIOError, warn
from pagemem.store import PageStore

SHARED_SUMS = ("zero_grad: with lock_free the gradients of this iteration share sums with those already handed "
               "to the updating thread, and cannot be discarded alone")
"""Why discarding this iteration's gradients is refused (see the Note)."""

_POLL_SECONDS = 0.05
"""How often a waiting compute side checks that the updating thread is alive."""

SEAM: Callable[[str], None] | None = None
"""Tests only: called at the seams of both sides (see ``LockFreeUpdater``), to inject delays."""


class LockFreeUpdater(UpdatingThread):
    """The updating thread and both buffers' bookkeeping (see the Note)."""

    def __init__(self, bank: ParamBank, store: PageStore, chunks: Callable[[list[int]], Any],
                 take_sum: Callable[[int], torch.Tensor], max_staleness: int | None,
                 predict: bool = False, ledger: GradLedger | None = None, undo: BackwardUndo | None = None,
                 synchronous_steps: int = 0) -> None:
        """``chunks(params)``: the updater's state pieces and leases (``Updater.chunks``);
        ``take_sum(i)``: a copy of parameter ``i``'s gradient sum, flat; ``ledger``: each
        parameter's gradient state (moved under this updater's lock); ``undo``: the running
        backward's journal (``Updater.undo``; [Note: a failed backward is undone]);
        ``synchronous_steps``: the first steps wait for every update ([Note: the lock-free
        default] in ``staleness.py``). The seams of
        both sides (``"take"``, ``"update"``, ``"publish"``, ``"accumulate"``, ``"drain"``) call ``SEAM``."""
        self.bank, self.store = bank, store
        self.ledger = ledger if ledger is not None else GradLedger([n for n, _ in bank.params], bank.layer_of)
        self.undo = undo if undo is not None else BackwardUndo(bank, store)
        self._chunks, self._take_sum = chunks, take_sum
        self.max_staleness = max_staleness
        self.synchronous_steps = synchronous_steps
        self.predict = predict
        n = len(bank.layers)
        self._units = bank.layers
        """Each unit's ``untaken`` and ``lag`` are counted here, under ``_cond``."""
        self._cond = threading.Condition()
        """Held while a gradient state moves here or a unit's counts change, and by the updating
        thread while it takes a unit's sums."""
        self._hps: list[AdamW] = []
        self._published: deque[Published] = deque()
        self._locks = [threading.Lock() for _ in range(n)]
        self._since_read: list[int | None] = [None] * n
        """Per unit: updates its states served since they were read from nvme, where they are
        kept in cpu memory (0: written back; None: not counted yet, the next count starts at the
        unit's stagger; [Note: a fetch serves the bound's updates]). The updating thread's alone."""
        self.writebacks = 0
        """Write-backs of a unit's states to nvme (each one reads them in again later)."""
        self._stop = False
        self._error: BaseException | None = None
        self.iterations = 0
        self.updates = 0
        self.staleness: Counter = Counter()
        """How many (unit, iteration start) pairs saw each staleness."""
        self.waited_s = 0.0
        """Seconds the compute side waited for the updating thread (bounds, reads, drains)."""
        self.drained = 0
        self.drain_s = 0.0
        """Published updates written into the buffered parameters, and the compute side's
        seconds doing it (``_write``; the simulator's per-update drain cost: ``sim_lockfree.py``)."""
        # one torch thread, as the Adam workers: two intra-op pools on the same cores thrash
        self._worker = Workers(1, name="pagemem-lockfree")
        self._running = self._worker.submit(self._run)

    # ------------------------------------------------------------------ the hand-off side

    def accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient of this backward (the hand-off): into its sum."""
        with self._cond:  # opens its unit; waits while the updating thread takes the unit's sums
            before = self.ledger.move(i, GradState.ACCUMULATING)
            touched = self.undo.touch(i, before)
        if touched and before in HOLDS:  # its unit is open now: the updating thread leaves the sum alone
            self.undo.keep_sum(i)  # [Note: a failed backward is undone]
        _seam("accumulate")
        self.bank.accumulate_grad(i, grad, first=before is GradState.NONE)

    def unit_final(self, u: int) -> None:
        """Unit ``u`` has all its gradients of this backward: it closes."""
        with self._cond:
            self.ledger.move_all(GradState.ACCUMULATING, GradState.SUMMED, unit=u)
            self._cond.notify_all()

    def end_backward(self) -> None:
        """The backward ended: every unit closes."""
        with self._cond:
            self.ledger.move_all(GradState.ACCUMULATING, GradState.SUMMED)
            self._cond.notify_all()

    def abort_backward(self) -> tuple[int, int]:
        """The backward failed (its gradient copies landed): its sums are restored and its units
        close as they were before it, sums shared with submitted iterations included ([Note: a
        failed backward is undone]); while they are restored its units stay open, so the updating
        thread takes none half restored. Returns ``BackwardUndo.restore``'s counts. If the
        restore raises, the backward's gradients stay and the error propagates (the engine breaks)."""
        with self._cond:
            try:
                return self.undo.restore(self.ledger)
            except BaseException:
                self.ledger.move_all(GradState.ACCUMULATING, GradState.SUMMED)
                raise
            finally:
                self._cond.notify_all()

    def has_fresh(self) -> bool:
        """Gradients since the last ``submit`` (they share sums with submitted ones)."""
        return self.ledger.count(*FRESH) > 0

    def _fresh(self, u: int) -> bool:
        """Unit ``u`` holds gradients of the iteration not yet submitted (open, or summed)."""
        return self.ledger.unit_holds(u, *FRESH)

    def submit(self, hps: list[AdamW]) -> bool:
        """``step()``: this iteration's gradients go to the updating thread, with the
        hyperparameters to update them with. False when there were none."""
        self.check()
        with self._cond:
            if self.ledger.count(GradState.ACCUMULATING):
                raise InvalidRequest("step(): called during backward; with lock_free the sums of a unit a backward "
                                     "adds to cannot be handed to the updating thread")
            submitted = self.ledger.move_all(GradState.SUMMED, GradState.HANDED_OFF)
            if not submitted:
                return False
            for u in {self.bank.layer_of[i] for i in submitted}:
                self._units[u].untaken += 1
                self._units[u].lag += 1
            self._hps = list(hps)
            self.iterations += 1
            # the updating thread is woken by after_step, once the drain is done ([Note: the drain
            # before the wake-up]); any wait of the compute side wakes it too
        return True

    # ------------------------------------------------------------------ the compute side

    def after_step(self) -> None:
        """``step()`` returns: what the updating thread has published is written into the
        buffered parameters, without waiting ([Note: reads between steps])."""
        # [Note: reads between steps]
        # Between step() and the next forward a loop reads parameters (an EMA, logging, an
        # evaluation, a direct call of the model, torch.func). Outside the engine's calls every
        # parameter is guarded ([Note: evicted parameters] in ``guard.py``), so each such read
        # passes the engine first. After a step whose bound is 0 (max_staleness=0, or one of the
        # first synchronous_steps: [Note: the lock-free default]) the read waits until its unit's update
        # has landed and is written into the buffered parameters (``settle``): reads are
        # synchronous training's, bit for bit, while a loop that reads nothing overlaps the
        # update with its own work until the next forward waits for the rest. Otherwise step()
        # writes what has been published by then and reads take the buffered parameters as they
        # are: the latest update published (predicted past its lag, as the next forward sees
        # it), never older than the last forward's. (A state dict, the engine's or the model's,
        # drains every update first: ``quiesce``.)
        #
        # [Note: the drain before the wake-up]
        # ``submit`` does not wake the updating thread: this drain runs first, then it is woken.
        # Both sides are Python on one GIL; woken at once, the updating thread starts its pass
        # (submitting reads: Python per page) while this drain's torch calls give the GIL up and
        # wait to take it back (issue 33: the drain took 8 ms of the compute thread's cpu and
        # 4 ms blocked per iteration; drained first, 2.6 and 0.1, A/B under load). Nothing waits
        # on the order: a wait of the compute side (``_drain_until``)
        # wakes the thread itself, so a step() that raised between ``submit`` and here delays
        # the pass until the next wait at most.
        try:
            self.drain(limit=None)
        finally:
            with self._cond:
                self._cond.notify_all()

    def bound(self) -> int | None:
        """The most iterations a unit may lag now ([Note: the lock-free default])."""
        return staleness_bound(self.iterations, self.max_staleness, self.synchronous_steps)

    def before_read(self, unit: int) -> None:
        """A parameter of ``unit`` is read between steps: after a step whose bound was 0
        (``max_staleness=0``, or one of the synchronous steps) it waits for the unit's updates
        (``settle``); otherwise it reads the buffered parameters as they are ([Note: reads
        between steps])."""
        if staleness_bound(self.iterations - 1, self.max_staleness, self.synchronous_steps) == 0:
            self.settle(unit)

    @shielded
    def settle(self, unit: int) -> None:
        """Wait until ``unit``'s submitted updates are in its buffered parameters (a read of
        one of its parameters between steps under ``max_staleness=0``: see the Note). Shielded
        as the engine's calls are: a Ctrl-C waits for the write under way ([Note: Ctrl-C inside
        the engine])."""
        self._drain_until(lambda: self._units[unit].lag == 0 or self._fresh(unit))

    def before_iteration(self, first_of_step: bool = True) -> None:
        """An iteration starts: write what was published into the buffered parameters, wait
        while a unit lags more than ``max_staleness``, record each unit's staleness (at the
        first forward of a step only: the histogram counts steps, as ``iterations`` does)."""
        self.drain(limit=self.bound())
        if not first_of_step:
            return
        for unit in self._units:
            if any(self.bank.is_trainable(i) for i in unit.params):
                self.staleness[unit.lag] += 1

    def drain(self, limit: int | None = None) -> None:
        """Write every published update into the compute pages; with ``limit``, wait (writing
        as updates arrive) until no unit lags more than ``limit`` iterations."""
        self._drain_until(lambda: limit is None or self._lag() <= limit)

    def _drain_until(self, done: Callable[[], bool]) -> None:
        """Write published updates as they arrive until none is ready and ``done()`` (under the
        lock) holds."""
        while True:
            self.check()
            with self._cond:
                ready = list(self._published)
                self._published.clear()
                if not ready and done():
                    return
                if not ready:
                    t0 = time.perf_counter()
                    self._cond.notify_all()  # it may not be woken yet ([Note: the drain before the wake-up])
                    self._cond.wait(_POLL_SECONDS)
                    self.waited_s += time.perf_counter() - t0
                    continue
            self._write(ready)

    def _write(self, ready: list) -> None:
        """Published updates into the buffered parameters, each predicted for the lag it has now.
        If one raises (Ctrl-C, a failed write), it and those after it go back to the front of
        the queue, in order: the next drain writes them (a write is whole values, so writing
        one again is harmless), and no unit's lag is left waiting for an update nobody holds."""
        for n, p in enumerate(ready):
            t0 = time.perf_counter()
            try:
                _seam("drain")
                with self._cond:
                    ahead = self._units[p.unit].lag - p.iterations  # submitted iterations this update lacks
                values = _predicted(p, ahead)
                self.bank.refresh_unit(values, getattr(values, "flat", None))
            except BaseException:
                with self._cond:
                    self._published.extendleft(reversed(ready[n:]))
                raise
            with self._cond:
                self._units[p.unit].lag -= p.iterations
                self.drained += 1
                self.drain_s += time.perf_counter() - t0

    def _lag(self) -> int:
        """The most submitted iterations a unit lacks, over units the updating thread can take
        (one holding gradients of the unsubmitted iteration waits for its ``step()``)."""
        return max((u.lag for u in self._units if not self._fresh(u.index)), default=0)

    def quiesce(self) -> None:
        """Wait until every submitted iteration is applied and in the buffered parameters;
        refused while the current iteration has gradients (they share sums with submitted ones:
        call ``step()`` first)."""
        if self.has_fresh():
            raise InvalidRequest("with lock_free, the weights are whole between step() and the next backward: "
                                 "call step() first (this iteration's gradients share sums with submitted ones)")
        self.drain(limit=0)

    def check(self) -> None:
        """Raise if the updating thread failed or died."""
        if self._error is not None:
            if isinstance(self._error, TierIOError):  # not retried: the thread that would retry it has ended
                raise StepFailed(f"the lock-free updater stopped: {self._error}; its thread has ended, so step() "
                                 "again cannot retry it and every later call raises: load the last checkpoint "
                                 "once the disk works") from self._error
            raise StepFailed(f"the lock-free updater failed ({type(self._error).__name__}: {self._error}); "
                             "load the last checkpoint") from self._error
        if self._running.done() and not self._stop:
            exc = self._running.exception()
            raise StepFailed(f"the lock-free updater's thread ended ({exc!r}); load the last checkpoint") from exc

    def _seam(self, where: str) -> None:
        """The updating thread's seams (``SEAM``, tests only)."""
        _seam(where)

    def unit_lock(self, u: int) -> threading.Lock:
        """Held while unit ``u``'s master weights and moments change (readers take it too)."""
        return self._locks[u]

    def stats(self) -> dict[str, Any]:
        seen = sum(self.staleness.values())
        return {"iterations": self.iterations, "updates": self.updates,
                "mean": sum(k * c for k, c in self.staleness.items()) / seen if seen else 0.0,
                "max": max(self.staleness, default=0), "histogram": dict(sorted(self.staleness.items())),
                "waited_s": self.waited_s, "writebacks": self.writebacks, "drained": self.drained,
                "drain_s": self.drain_s}

    def close(self) -> None:
        """Apply what was submitted, then stop the thread (raises its error, if any)."""
        try:
            if not self._running.done() and self._error is None:
                self.drain(limit=0)  # units holding unsubmitted gradients keep what was applied
                lagging = [u.index for u in self._units if u.lag and self._fresh(u.index)]
                if lagging:
                    warn(f"pagemem: closed with gradients of an iteration without step(): {len(lagging)} "
                                  "unit(s) keep their last applied weights (their sums mixed submitted and "
                                  "unsubmitted gradients)")
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._worker.close()
        self.check()

def _predicted(p: Published, ahead: int) -> Packed:
    """The values to buffer for update ``p`` when ``ahead`` submitted iterations are not in it
    ([Note: predicting past the staleness]): the update itself, or extrapolated by its drift,
    in one torch call for the unit ([Note: an update published packed])."""
    if p.drift is None or ahead <= 0:
        return p.values
    return p.values.like(torch.add(p.values.flat, p.drift.flat, alpha=ahead))


def _seam(where: str) -> None:
    if SEAM is not None:
        SEAM(where)
