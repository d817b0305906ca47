"""An engine's collectives: on their own thread, in one order on every rank, bounded in time.

[Note: collectives]
Every collective an engine issues goes through ``Collectives``: queued to one thread (so the
caller may fill the next batch while the last one is on the wire), run there asynchronously and
waited for with the group's op timeout (``EngineConfig.collective_timeout_s``), and waited for
by the caller a second at a time, with a margin over it. Every rank calls them in the same order,
from the same code path, with sizes every rank computes alike; the engine agrees with a
collective on anything one rank alone could decide (which parameters have gradients).

Each engine operation (averaging gradients, a save, the buffers before a forward, ...) starts
with ``begin``: one small all-reduce of its header (this rank's count of operations, the
operation, how many values follow; always 48 bytes), then the operation's own small values (min
and max over ranks). A rank that
is at another operation (``save()`` called on rank 0 alone, by habit) is found there, at once,
on every rank, instead of pairing its collectives with another operation's (gloo reduces two
buffers of different meaning without a word). A collective that fails or times out, a header
that differs, a peer that closed its engine or stopped beating while this rank waits, or a
signal (Ctrl-C) held for more than ``GIVE_UP_ON_SIGNAL_S`` of waiting, raise ``RankFailed``
naming the ranks to blame ([Note: naming the rank that failed], ``liveness.py``), and every
later call raises it again at once: the group is out of step.

Bytes are counted as the ring algorithm sends them per rank (``pagemem.sched.network.bus_bytes``,
what the simulator charges: ``2 (W - 1) / W`` of an all-reduced buffer, ``(W - 1) / W`` of a
broadcast one); gloo and NCCL choose their own algorithm per size.

Batch size (``BATCH_BYTES``): gloo's all-reduce on the 2-core development VM cost 1.5 ms per call
whatever its size up to 64 KiB with 2 ranks (5.7 ms with 4), 4.1 ms for 4 MiB (1.0 GB/s) and
13.6 ms for 16 MiB (1.24 GB/s); 16 MiB (four 4 MiB pages) keeps the per-call cost near a tenth of
a batch's time, and two batches in flight (filling one while the other is reduced) hold 32 MiB of
host memory. ``benchmarks/bench_ranks.py`` measures it again.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable

import torch

from pagemem.engine.ranks.group import RankGroup
from pagemem.engine.interrupts import signal_held
from pagemem.engine.ranks.liveness import Liveness
from pagemem.errors import InvalidRequest, RankFailed
from pagemem.sched.network import bus_bytes

BATCH_BYTES = 16 << 20
_WAIT_MARGIN_S = 30.0
GIVE_UP_ON_SIGNAL_S = 5.0
OPERATIONS = ("checking every rank's engine", "comparing every rank's parameter values", "rank 0's buffers",
              "averaging gradients", "saving a checkpoint", "saving weights", "loading a checkpoint",
              "clipping gradients", "reading the optimizer state", "loading the optimizer state", "updating",
              "reading the weights", "gathering a unit", "reducing a unit's gradients", "reducing gradients",
              "reading gradient norms", "reading the gradients", "choosing how an iteration is paged",
              "agreeing on ready gradients")
"""The engine's operations (``begin``): a header names one by its index here."""
_GATHER_HINT = ("; with shard_parameters=True each unit's fetch is a collective too: every rank must run the same "
                "modules in the same order (no module skipped by one rank's batch) and read parameters between "
                "steps on every rank alike")
_serials = itertools.count()
"""Engines made in this process, in order: every rank makes its engines in the same order, so the
n-th has the same serial everywhere (its heartbeat keys)."""

Pending = tuple[str, "Future[Any]"]


class Collectives:
    """The collectives of one engine over its ranks (see the Note)."""

    def __init__(self, ranks: RankGroup, timeout_s: float) -> None:
        if not ranks.data_parallel:
            raise ValueError("Collectives: needs a group of more than one rank")
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.calls = 0
        """Collectives issued."""
        self.sent_bytes = 0
        """Bytes this rank sent, as the ring algorithm sends them."""
        self.header_bytes = 0
        """Of ``sent_bytes``, those of the operations' headers and agreed values (``begin``)."""
        self.wait_seconds = 0.0
        """Time callers waited for collectives to finish."""
        self.failed: RankFailed | None = None
        self.operations = 0
        """Operations begun (``begin``)."""
        self.liveness = Liveness(ranks, next(_serials))
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pagemem-collectives-r{ranks.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)

    def _issue(self, what: str, start: Callable[[], Any], sent: int) -> Pending:
        """Queue one collective: ``start()`` launches it (``async_op=True``) on the thread, which
        waits for it with the op timeout."""
        if self.failed is not None:
            raise RankFailed(f"{what}: refused: an earlier collective failed ({self.failed})", self.failed.ranks)
        self.liveness.entered += 1
        self.calls += 1
        self.sent_bytes += sent
        timeout = timedelta(seconds=self.timeout_s)

        def run() -> None:
            work = start()
            if work is not None:
                work.wait(timeout)

        fut: Future[Any] = Future()
        self._jobs.put((run, fut))
        return what, fut

    def wait(self, pending: Pending) -> None:
        """Wait for one issued collective; ``RankFailed`` if it failed, ran out of time, or the
        ranks it waits for closed their engines or died (see the Note)."""
        what, fut = pending
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    fut.result(timeout=1.0)
                    return
                except FutureTimeout:
                    waited = time.perf_counter() - t0
                    if waited > self.timeout_s + _WAIT_MARGIN_S:
                        self._fail(what, None)
                    if signal_held() and waited > GIVE_UP_ON_SIGNAL_S:
                        self._fail(what, None, f"a signal (Ctrl-C) arrived while waiting {waited:.0f} s")
                    gone = self.liveness.closed_or_dead()
                    if gone:
                        self._fail(what, None, gone)
        except RankFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a collective's failure, whatever torch raised
            self._fail(what, exc)
        except BaseException:  # a second Ctrl-C left it in flight: this rank is out of step for good
            self.failed = RankFailed(f"rank {self.ranks.rank}: interrupted while waiting for {what} (collective "
                                     f"{self.liveness.entered}); it may still run: the ranks are out of step")
            raise
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def settle(self, left: "list[Pending | None]") -> None:
        """After a failure part-way through batches: wait for what is still in flight, quietly
        (the first error is the one raised), so nothing writes into buffers a later call sees."""
        for pending in left:
            if pending is not None and self.failed is None:
                try:
                    self.wait(pending)
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass

    def _fail(self, what: str, exc: BaseException | None, why: str | None = None) -> None:
        diagnosis, blamed = self.liveness.diagnose()
        if why is not None:
            cause = why
        elif exc is not None:
            text = f"{type(exc).__name__}: {exc}".strip()
            cause = text.splitlines()[0] if text else type(exc).__name__
        else:
            cause = f"no answer within {self.timeout_s:g} s"
        err = RankFailed(f"rank {self.ranks.rank} of {self.ranks.world_size}: {what} (collective "
                         f"{self.liveness.entered}) failed: {diagnosis} ({cause})", blamed)
        self.failed = err
        raise err from exc

    def begin(self, op: str, values: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Begin the engine operation ``op`` (one of ``OPERATIONS``): its header (this rank's count
        of operations, the operation, how many values), always the same size, then ``values``
        reduced over the ranks; returns the maximum and the minimum over ranks of each value.
        ``RankFailed`` when another rank is at another operation (see the Note): found by the
        header, before any collective whose size could differ (gloo aborts the process on one)."""
        values = list(values or [])
        self.operations += 1
        head = [self.operations, OPERATIONS.index(op), len(values)]
        top, low = self._max_min(head, op)
        if top != head or low != head:
            names = sorted({OPERATIONS[c] for c in (top[1], low[1]) if 0 <= c < len(OPERATIONS)} - {op})
            err = RankFailed(f"rank {self.ranks.rank} of {self.ranks.world_size}: the ranks are at different "
                             f"operations: this rank at {op!r} (its operation {self.operations}), others at "
                             f"{' or '.join(repr(x) for x in names) or repr(op)} (operations {low[0]} to {top[0]}); "
                             "every rank must call the engine alike (save(), save_weights(), backward and forward "
                             "under autograd on every rank; a backward that raised on some ranks only puts them out "
                             "of step: see those ranks' errors)" + (_GATHER_HINT if "gathering a unit" in (op, *names) else ""))
            self.failed = err
            raise err
        return self._max_min(values, op) if values else ([], [])

    def same_everywhere(self, op: str, values: list[int], refusal: str) -> None:
        """Begin ``op`` with ``values`` that every rank must share; ``InvalidRequest`` (on every
        rank alike, the ranks still in step) saying ``refusal`` where they differ."""
        top, low = self.begin(op, values)
        if top != low:
            raise InvalidRequest(f"{refusal} (rank {self.ranks.rank} of {self.ranks.world_size})")

    def fail_out_of_step(self, why: str) -> None:
        """The ranks agreed on an operation but not on where they are in training: ``RankFailed``,
        and every later call refuses (the engine breaks)."""
        self.failed = RankFailed(f"rank {self.ranks.rank} of {self.ranks.world_size}: {why}")
        raise self.failed

    def _max_min(self, values: list[int], what: str) -> tuple[list[int], list[int]]:
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=self.ranks.device)
        self.header_bytes += bus_bytes("all_reduce", t.numel() * t.element_size(), self.ranks.world_size)
        self.reduce_now(t, what, "max")
        n = len(values)
        return [int(x) for x in t[:n]], [-int(x) for x in t[n:]]

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, t: torch.Tensor, what: str, op: str = "sum") -> Pending:
        """Start reducing ``t`` in place over the ranks (``op``: sum, max or min)."""
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        group = self.ranks.group
        return self._issue(what, lambda: dist.all_reduce(t, reduce_op, group=group, async_op=True),
                           bus_bytes("all_reduce", t.numel() * t.element_size(), self.ranks.world_size))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, what: str) -> Pending:
        """Start gathering every rank's ``t`` (the same shape on every rank) into ``out``, one
        tensor per rank in rank order: the bits as sent (a sum of zero-padded shares would turn
        ``-0.0`` into ``0.0``)."""
        import torch.distributed as dist

        group = self.ranks.group
        return self._issue(what, lambda: dist.all_gather(out, t, group=group, async_op=True),
                           bus_bytes("all_gather", t.numel() * t.element_size(), self.ranks.world_size))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, what: str) -> Pending:
        """Start summing every rank's ``t`` (``world_size`` chunks of ``out``'s size, in rank
        order) and leaving this rank's chunk of the sum in ``out``."""
        import torch.distributed as dist

        group = self.ranks.group
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
        return self._issue(what, lambda: scatter(out, t, group=group, async_op=True),
                           bus_bytes("reduce_scatter", out.numel() * out.element_size(), self.ranks.world_size))

    def reduce_now(self, t: torch.Tensor, what: str, op: str = "sum") -> torch.Tensor:
        """``all_reduce`` and wait; returns ``t``."""
        self.wait(self.all_reduce(t, what, op))
        return t

    def broadcast(self, t: torch.Tensor, src: int, what: str) -> None:
        """Rank ``src``'s ``t`` into every rank's ``t``, in place (and waited for)."""
        import torch.distributed as dist

        group = self.ranks.group
        g_src = dist.get_global_rank(group, src) if group is not dist.group.WORLD else src
        nbytes = t.numel() * t.element_size()
        self.wait(self._issue(what, lambda: dist.broadcast(t, g_src, group=group, async_op=True),
                              (self.ranks.world_size - 1) * nbytes // self.ranks.world_size))

    def broadcast_bytes(self, data: bytes | None, src: int, what: str) -> bytes:
        """Rank ``src``'s ``data`` on every rank (others pass None)."""
        dev = self.ranks.device
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
        self.broadcast(size, src, what)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if self.ranks.rank == src and data
               else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
        if buf.numel():
            self.broadcast(buf, src, what)
        return bytes(buf.cpu().numpy().tobytes())

    def stats(self) -> dict[str, Any]:
        return {"rank": self.ranks.rank, "world_size": self.ranks.world_size, "backend": self.ranks.backend,
                "collectives": self.calls, "sent_bytes": self.sent_bytes, "header_bytes": self.header_bytes,
                "collective_wait_seconds": self.wait_seconds}

    def close(self) -> None:
        """Stop the thread (a collective stuck after a failure is left to the group's timeout)."""
        self._jobs.put(None)
        self._thread.join(timeout=None if self.failed is None else 1.0)
        self.liveness.close()
