"""What a backward overwrote, kept until it ends, so that a backward that fails is undone.

[Note: a failed backward is undone]
A backward that raises part-way (an error in a hook or an autograd function of the user's, a
Ctrl-C, an I/O error) leaves the engine as if its batch had been skipped, in every mode. A
backward writes into three things that existed before it:

- a gradient sum that holds gradients which still count: the step's earlier backwards'
  (``accumulation_steps > 1``, or a gradient assigned by hand), or, with ``lock_free``, those
  of iterations submitted to the updating thread and not yet taken ([Note: the lock-free
  updater]): the hand-off adds into it;
- a parameter's fp32 master weights, Adam moments and step count, updated during the last
  backward of a step (``overlap_update``, [Note: which updates may overlap backward]; on a
  worker or in the hook, [Note: updates in the hook]), and its compute copy refreshed from them;
- its gradient state in the ledger ([Note: gradient states]).

So one journal per backward (``BackwardUndo``, begun by ``Updater.begin_backward``) keeps, before
the first write of the backward into each: the state the parameter's gradient was in (``touch``),
the sum's bytes where it held gradients that count (``keep_sum``), and the master weights,
moments and step count before an update during backward (``keep_states``); copies in host memory
(pinned where they come off a CUDA device, copied on the stream that writes next, so the copy
is ordered before the write). Nothing is written before what it overwrites is kept: a keep that
raises leaves the pages as they were, and the journal knows it. If the backward ends, the
journal is dropped (``end``; an update still queued behind a backward that ended keeps nothing:
no failure of a backward can reach it). If it fails, the engine waits for every write of it
(updates running on workers, gradient copies in flight), then ``restore`` writes the kept bytes
back, the compute copy refreshed from the restored master through the same path an update
takes, the step counts back, and every gradient state touched moves back to the state it was
in; the phase keeps the earlier backwards' count and ``p.grad`` shows their sums again (every
``p.grad`` autograd left goes). A failed ``loss.backward()`` is found at the next call into the
engine ([Note: backward by habit]); ``optimizer.zero_grad()`` finds it before it sets ``p.grad``
to None, but a ``model.zero_grad()`` in between cannot be seen (the handles were down). A sum the failed
backward wrote that held nothing that counts (its state was ``NONE``) is not kept: the next
gradient replaces it. Weights after a failed backward and the rest of training are bit for bit
those of plain PyTorch that never saw the failed batch.

What it costs (``Engine.stats()``: ``backward_undo_bytes`` now, ``backward_undo_peak_bytes``
the most held at once): 4 bytes per element of each sum that held gradients that count when the
backward first added to it (every trainable element, in each backward of an accumulation after
the first; with ``lock_free``, those of units whose submitted gradients the updating thread had
not taken yet), plus 12 bytes per element updated during backward (every element updated early,
at the last backward of a step with ``overlap_update``), plus one copy of each of those bytes per
backward. The peak is thus at most 16 bytes per trainable parameter, in host memory outside the
store's budgets, for the length of one backward.

What cannot be undone makes the engine refuse to go on (``BROKEN``, [Note: engine phases]):
only a restore that itself fails (the pages cannot be read or written, a gradient copy that
cannot be waited for), since the pages are then neither the old nor the new values.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.updates.state_pieces import StatePiece, lend

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank
    from pagemem.store import PageStore

HOLDS = (GradState.SUMMED, GradState.HANDED_OFF)
"""The states in which a sum holds gradients that count when a backward first adds to it."""

RESTORE_SEAM: Callable[[int], None] | None = None
"""Tests only: called with each parameter as ``restore`` writes it back (to make it fail)."""


_ALIGN = 64


class _Arena:
    """Host memory the journal's copies are carved from, kept from one backward to the next: a
    fresh allocation per copy (hundreds of MB per backward with ``overlap_update``) cost a page
    fault per page, every backward, more than the copy itself. A bump allocator over one buffer;
    what does not fit takes a buffer of its own, and the next backward starts with one buffer
    as large as everything this one used."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._main: torch.Tensor | None = None
        self._extra: list[torch.Tensor] = []
        self._used = 0
        self._wanted = 0
        self._pinned = False

    def take(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """An uninitialised flat tensor of ``numel`` elements, until :meth:`reset`."""
        nbytes = numel * dtype.itemsize
        with self._lock:
            self._wanted += -(-nbytes // _ALIGN) * _ALIGN
            main = self._main
            if main is not None and self._pinned == pinned and self._used + nbytes <= main.numel():
                start = self._used
                self._used = -(-(start + nbytes) // _ALIGN) * _ALIGN
                return main[start:start + nbytes].view(dtype)
            self._pinned = self._pinned or pinned
            out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._extra.append(out)
            return out.view(dtype)

    def reset(self) -> None:
        """Every tensor taken is dropped: the next backward reuses the memory."""
        with self._lock:
            if self._extra:  # grow once to what this backward needed, for the next
                size = max(self._wanted, self._main.numel() if self._main is not None else 0)
                self._main = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._extra.clear()
            self._used = self._wanted = 0

    @property
    def nbytes(self) -> int:
        """Host memory held between backwards."""
        return self._main.numel() if self._main is not None else 0


def _aside(pieces: list[tuple[int, torch.Tensor]], arena: _Arena) -> torch.Tensor:
    """A flat host copy of a tensor given as flat pieces ``(first element, view)``, from
    ``arena``: pinned and queued on the current stream where they are on a CUDA device (ordered
    before the kernels queued after it), else a plain copy."""
    cuda = pieces[0][1].device.type == "cuda"
    out = arena.take(sum(v.numel() for _, v in pieces), pieces[0][1].dtype, cuda)
    with torch.no_grad():
        for start, v in pieces:
            out[start:start + v.numel()].copy_(v, non_blocking=cuda)
    return out


class BackwardUndo:
    """One backward's journal (see the Note). Safe to add to from several threads (the compute
    thread, the Adam workers running updates during backward, the hand-off of the lock-free
    updater)."""

    def __init__(self, bank: "ParamBank", store: "PageStore") -> None:
        self.bank = bank
        self.store = store
        self._lock = threading.Lock()
        self._before: dict[int, GradState] = {}
        """Each parameter this backward touched: its gradient's state before."""
        self._sums: dict[int, torch.Tensor] = {}
        """Each sum kept: its bytes before, flat fp32."""
        self._states: dict[int, tuple[int, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
        """Each parameter updated during this backward: its step count, and per piece of its
        states (first element, master, exp_avg, exp_avg_sq) before."""
        self._cuda = False
        self._arena = _Arena()
        self.bytes = 0
        """Bytes the journal holds now."""
        self.peak_bytes = 0
        """The most it held at once."""
        self.active = False
        """A backward is journalled (between ``begin`` and ``end`` or ``restore``)."""

    # ------------------------------------------------------------------ the backward's writes

    def begin(self) -> None:
        """A backward starts: nothing is kept yet."""
        self._drop()
        self.active = True

    def touch(self, i: int, before: GradState) -> bool:
        """Parameter ``i``'s gradient was in ``before`` when this backward first moved it; call
        before anything of it is written. True at the first touch in this backward."""
        with self._lock:
            if not self.active or i in self._before:
                return False
            self._before[i] = before
            return True

    def keep_sum(self, i: int) -> None:
        """Keep parameter ``i``'s gradient sum, which holds gradients that count, before this
        backward first adds to it."""
        if not self.active:
            return
        self.bank.grads_landed([i])  # a gradient assigned by hand may still be landing in it
        with self._grad_pieces(i) as pieces:
            if not pieces:  # none of a sharded sum's elements is this rank's ([Note: sharded gradient sums])
                return
            cuda = pieces[0][1].device.type == "cuda"
            kept = _aside(pieces, self._arena)
        self._add(self._sums, i, kept, kept.nbytes, cuda)

    def keep_states(self, i: int, pieces: list[StatePiece]) -> None:
        """Keep parameter ``i``'s master weights, moments and step count, in ``pieces`` (views
        of its pages, as the update lends them), before an update during backward writes them."""
        if not self.active:
            return
        kept = [(start, *(_aside([(0, x)], self._arena) for x in (c.param, c.exp_avg, c.exp_avg_sq)))
                for start, c in pieces]
        nbytes = sum(t.nbytes for _, *ts in kept for t in ts)
        cuda = pieces[0][1].param.device.type == "cuda"
        self._add(self._states, i, (self.bank.records[i].steps, kept), nbytes, cuda)

    def _add(self, where: dict, i: int, value: object, nbytes: int, cuda: bool) -> None:
        with self._lock:
            if not self.active or i in where:  # ended meanwhile (an update behind a backward that ended), or
                return                         # kept already in this backward: the first copy is from before it
            where[i] = value
            self._cuda |= cuda
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    # ------------------------------------------------------------------ its end

    def end(self) -> None:
        """The backward ended: what it wrote counts, and the journal is dropped."""
        self._drop()

    def restore(self, ledger: GradLedger) -> tuple[int, int]:
        """The backward failed and none of its writes is still running: write back what was
        kept (master weights, moments, step counts, compute copies refreshed; gradient sums)
        and move every gradient state it touched back (see the Note), then drop the journal.
        Returns (parameters whose update during backward was undone, sums restored). Raises if
        a page cannot be read or written: then nothing is certain (the engine breaks)."""
        try:
            if self._cuda:
                torch.cuda.synchronize()  # the copies aside, and the writes they came before, are done
            for i, (steps, kept) in sorted(self._states.items()):
                self._restore_states(i, steps, kept)
            for i, old in sorted(self._sums.items()):
                if RESTORE_SEAM is not None:
                    RESTORE_SEAM(i)
                with self._grad_pieces(i) as pieces, torch.no_grad():
                    for start, v in pieces:
                        v.copy_(old[start:start + v.numel()])
            for i, old in sorted(self._before.items()):
                if ledger.state(i) is not old:
                    ledger.move(i, old)
            return len(self._states), len(self._sums)
        finally:
            self._drop()

    def _restore_states(self, i: int, steps: int, kept: list) -> None:
        if RESTORE_SEAM is not None:
            RESTORE_SEAM(i)
        [(_, pieces)], leases = lend(self.bank, self.store, [i])
        try:
            starts = [start for start, _ in pieces]
            assert starts == [start for start, *_ in kept], "the states' pieces changed during the backward"
            with torch.no_grad():
                for (start, c), (_, master, exp_avg, exp_avg_sq) in zip(pieces, kept):
                    c.param.copy_(master)
                    c.exp_avg.copy_(exp_avg)
                    c.exp_avg_sq.copy_(exp_avg_sq)
            self.bank.set_step_count(i, steps)
            for start, c in pieces:  # as the update refreshed it ([Note: compute dtypes])
                self.bank.refresh_compute(i, c.param, start)
        finally:
            for lease in leases:
                lease.release()

    @contextmanager
    def _grad_pieces(self, i: int) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Parameter ``i``'s gradient sum as flat fp32 views of its pages: ``(first element, view)``."""
        with self.bank.grad_pieces(i) as pieces:
            yield pieces

    def _drop(self) -> None:
        with self._lock:
            self._before.clear()
            self._sums.clear()
            self._states.clear()
            if self._cuda:
                torch.cuda.synchronize()  # no copy into the arena still runs when it is reused
            self._cuda = False
            self.bytes = 0
            self.active = False
            self._arena.reset()

    def stats(self) -> dict[str, int]:
        return {"backward_undo_bytes": self.bytes, "backward_undo_peak_bytes": self.peak_bytes,
                "backward_undo_arena_bytes": self._arena.nbytes}
