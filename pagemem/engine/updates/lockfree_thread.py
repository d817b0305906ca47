"""The lock-free updater's updating thread: it walks the units, fetches each one's states from
nvme, takes its gradient sums, updates and publishes (``lockfree.py``'s [Note: the lock-free
updater]); a part of ``LockFreeUpdater``.

[Note: a fetch serves the bound's updates] With a bound ``b >= 1`` an update taken during an
iteration can hold at most ``b`` iterations without the compute waiting for it (the oldest must
be in the buffered parameters before the next iteration starts, and the iteration in progress
cannot be taken yet: its ``step()`` has not come), so if every update read and wrote its unit's
states, the disk would move ``1 / b`` state passes per iteration, however long a pass takes
(at ``max_staleness=1``: a whole pass per iteration, or the compute waiting at ``step()`` for
an update of two iterations; issue 33 measured 0.7 passes per iteration and 1.48x the in-memory
iteration, BENCHMARKS.md). So with a bound ``b >= 1`` a unit's states stay in cpu memory after
an update and serve its next ones: they are written back after every ``b + 1``-th update of
the unit (``_keeps``), the units staggered by their index so that their write-backs spread over
the iterations; the disk moves ``1 / (b + 1)`` of a pass per iteration, as the simulator's
lock-free mode assumed. Values are the same (the same AdamW steps on the same states): only
where the states are between updates changes. Cost: cpu memory for the kept units' states
(in the benchmark, at the end of an update, mostly one to three of its four units' states were
on the cpu, all four now and then; the budget check counts two); where a fetch finds no room,
the kept states of other units are written back first (``_fetch``), so a tight cpu budget
falls back to writing every update.
Without a bound (the paper's behaviour: an update takes every iteration since the last) and
at a bound of 0 (synchronous steps), every update writes back, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from pagemem.engine.gradients.grad_ledger import GradState
from pagemem.engine.updates.adam import fused_steps
from pagemem.engine.updates.state_pieces import with_grad
from pagemem.errors import OutOfMemory, TierIOError

if TYPE_CHECKING:
    import threading

    from pagemem.engine.gradients.grad_ledger import GradLedger
    from pagemem.engine.units.bank import ParamBank
    from pagemem.store import PageStore


class Packed(Mapping[int, torch.Tensor]):
    """[Note: an update published packed] Each parameter's tensor, a view of one flat tensor
    (``flat``: the parameters' elements one after the other, in order). The updating thread
    publishes an update so, that the compute side's drain is a few torch calls per unit instead
    of several per parameter and page: the prediction one add (``lockfree._predicted``), the
    cast one, the write one copy per run of adjacent pages ([Note: a packed write] in
    ``store/data.py``). Each torch call on the compute thread gives the GIL up and waits to take
    it back, while the updating thread's Python runs (issue 33)."""

    def __init__(self, shapes: dict[int, torch.Size], flat: torch.Tensor) -> None:
        self.shapes, self.flat = shapes, flat
        self._at: dict[int, int] = {}
        n = 0
        for i, shape in shapes.items():
            self._at[i] = n
            n += shape.numel()
        if n != flat.numel():
            raise ValueError(f"Packed: {n} elements for a flat tensor of {flat.numel()}")

    @classmethod
    def empty(cls, shapes: dict[int, torch.Size], dtype: torch.dtype) -> "Packed":
        return cls(shapes, torch.empty(sum(s.numel() for s in shapes.values()), dtype=dtype))

    def like(self, flat: torch.Tensor) -> "Packed":
        """The same parameters, their elements in ``flat``."""
        return Packed(self.shapes, flat)

    def __getitem__(self, i: int) -> torch.Tensor:
        a = self._at[i]
        return self.flat[a:a + self.shapes[i].numel()].view(self.shapes[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclasses.dataclass
class Published:
    unit: int
    iterations: int
    """How many submitted iterations of this unit's gradients the update applied."""
    values: Packed
    """Each parameter's new value: in the compute dtype (where the unit's are all one), or its
    fp32 master where ``drift`` is set."""
    drift: Packed | None
    """With ``staleness_correction="predict"``: each parameter's change per iteration in this update (fp32)."""


class UpdatingThread:
    """The updating thread's side of ``LockFreeUpdater`` (its state is the updater's)."""

    if TYPE_CHECKING:
        bank: ParamBank
        store: PageStore
        ledger: GradLedger
        predict: bool
        updates: int
        writebacks: int
        _cond: threading.Condition
        _stop: bool
        _error: BaseException | None
        _units: list
        _locks: list
        _published: Any
        _since_read: list
        _hps: Any

        def _fresh(self, u: int) -> bool: ...
        def _take_sum(self, i: int) -> torch.Tensor: ...
        def _chunks(self, params: list[int], grads: bool) -> Any: ...
        def bound(self) -> int | None: ...
        def _seam(self, where: str) -> None: ...

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not (order := self._ready()):
                        self._cond.wait()
                    if self._stop:
                        return
                writebacks: list = []
                fetch = self._fetch(order[0], writebacks)
                for n, u in enumerate(order):
                    fetched, fetch = fetch, (self._fetch(order[n + 1], writebacks) if n + 1 < len(order) else None)
                    writebacks.append(self._update(u, fetched))
                for u, handle in zip(order, writebacks):  # a failed write-back raises here (the states stay
                    if handle is not None:                 # valid on the cpu)
                        with saying(f"writing unit {u}'s optimizer states back to nvme"):
                            handle.wait()
        except BaseException as exc:  # surfaces in the training loop (check)
            self._error = exc
            with self._cond:
                self._cond.notify_all()

    def _ready(self) -> list[int]:
        """Units whose sums hold submitted iterations and nothing else, in reverse: none open in
        a backward, none holding gradients of the iteration not yet submitted (taking those
        would apply them before their ``step()``, counted as no iteration). Under the lock."""
        return [u.index for u in reversed(self._units) if u.untaken and not self._fresh(u.index)]

    def _fetch(self, u: int, writebacks: list) -> Any:
        """Start reading unit ``u``'s states from nvme into cpu memory (None where they are not
        on nvme). No cpu room: the pass's write-backs are waited for (their cpu pages go), then
        the states fetched for units that were not updated go back (their nvme copy is still
        good), and the compute copies a plan staged ahead on the cpu (their home is nvme): the
        cpu holds two units' states, as the budget check counted ([Note: homes on nvme])."""
        if self.bank.layers[u].state_tier != "nvme":
            return None
        states = self.bank.layers[u].states()
        try:
            return self.store.move(states, "cpu")
        except OutOfMemory:
            pass
        for handle in writebacks:
            if handle is not None:
                with saying("writing optimizer states back to nvme"):
                    handle.wait()
        try:
            return self.store.move(states, "cpu")
        except OutOfMemory:
            pass
        for layer in self.bank.layers:  # kept for their next update ([Note: a fetch serves the bound's updates])
            kept = layer.states()
            if layer.index != u and self._since_read[layer.index] and kept and self.store.tier_of(kept[0]) == "cpu":
                with saying(f"writing unit {layer.index}'s optimizer states back to nvme"):
                    self.store.move(kept, "nvme").wait()
                self._since_read[layer.index] = 0
                self.writebacks += 1
        try:
            return self.store.move(states, "cpu")
        except OutOfMemory:
            for layer in self.bank.layers:
                kept = layer.states()
                if layer.index != u and layer.state_tier == "nvme" and kept and self.store.tier_of(kept[0]) == "cpu" \
                        and "nvme" in self.store.tiers_of(kept[0]):
                    self.store.move(kept, "nvme").wait()  # the nvme copy is current: nothing is written
            self.bank.drop_cpu_copies()  # a plan stages compute pages in whatever room it finds
        return self.store.move(states, "cpu")

    def _update(self, u: int, fetched: Any) -> Any:
        """Unit ``u``'s update; returns its write-back to nvme (None where its states stay)."""
        layer = self.bank.layers[u]
        if fetched is not None:
            with saying(f"reading unit {u}'s optimizer states from nvme"):
                fetched.wait()
        self._seam("take")
        params = [i for i in layer.params if self.bank.is_trainable(i)]
        with self._cond:
            if self._fresh(u):  # open, or holding gradients not yet submitted (see _ready): it waits for the
                return None     # next pass (its states stay fetched)
            self.bank.grads_landed(params)  # copies of its last gradients may still be in flight (CUDA)
            k, self._units[u].untaken = self._units[u].untaken, 0
            hps = self._hps
            taken = [i for i in params if self.ledger.state(i) is GradState.HANDED_OFF]
            grads = {i: self._take_sum(i) for i in taken}
            for i in taken:
                self.ledger.move(i, GradState.NONE)
        if fetched is not None:  # the nvme copies go stale with the update: dropped first
            self.store.release(layer.states(), "nvme").wait()
        self._seam("update")
        shapes = {i: self.bank.params[i][1].shape for i in taken}  # [Note: an update published packed]
        dtypes = {self.bank.compute_dtype_of(i) for i in taken}
        values = Packed.empty(shapes, dtypes.pop() if len(dtypes) == 1 and not self.predict else torch.float32)
        drift = Packed.empty(shapes, torch.float32) if self.predict else None
        with self._locks[u]:
            chunks, leases = self._chunks(taken, False)  # the sums were taken (they may live on nvme)
            try:
                for i, pieces in chunks:
                    g = grads[i] if k == 1 else grads[i] / k
                    pieces = with_grad(pieces, g)
                    if drift is not None:  # the master before: the drift is taken for the unit at once, below
                        drift[i].copy_(_master(pieces).view(shapes[i]))
                    for _ in range(k):  # [Note: one step per iteration]
                        fused_steps([c for _, c in pieces], self.bank.records[i].steps + 1, hps[self.bank.group_of(i)],
                                    None)
                        self.bank.count_step(i)
                    values[i].copy_(_master(pieces).view(shapes[i]))  # cast where the compute dtype is not fp32
            finally:
                for lease in leases:
                    lease.release()
        if drift is not None:  # (new - before) / k, each element as per parameter; / 1 changes no bit
            torch.sub(values.flat, drift.flat, out=drift.flat)
            if k != 1:
                drift.flat.div_(k)
        # the write-back: the store orders the next read of these pages behind it. Submitted before
        # the update is published, so that a caller who waited for the publication (a checkpoint
        # reading the states) finds the move queued, not racing its lease on the pages
        writeback = None
        if fetched is not None and not self._keeps(u):
            writeback = self.store.move(layer.states(), "nvme")
            self.writebacks += 1
        self._seam("publish")
        with self._cond:
            self._published.append(Published(u, k, values, drift))
            self.updates += 1
            self._cond.notify_all()
        return writeback

    def _keeps(self, u: int) -> bool:
        """After an update of unit ``u`` (states on nvme): keep its states in cpu memory for its
        next update instead of writing them back ([Note: a fetch serves the bound's updates])."""
        b = self.bound()
        if not b:  # no bound, or a synchronous step: every update writes back (the stagger starts afresh)
            self._since_read[u] = None
            return False
        served = (u % (b + 1) if self._since_read[u] is None else self._since_read[u]) + 1
        self._since_read[u] = 0 if served > b else served
        return served <= b


def _master(pieces: list) -> torch.Tensor:
    """A parameter's fp32 master weights, flat (a view where it is one piece)."""
    return torch.cat([c.param for _, c in pieces]) if len(pieces) > 1 else pieces[0][1].param


@contextlib.contextmanager
def saying(what: str) -> Iterator[None]:
    """A ``TierIOError`` inside says ``what`` failed (the original chained)."""
    try:
        yield
    except TierIOError as exc:
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
        raise TierIOError(f"{what} failed ({exc}{notes})", exc.errno) from exc
