"""Gradients copied into host pages off the compute stream.

[Note: gradient copies]
Autograd's gradient for a parameter whose fp32 sum lives in host pages (optimizer states on
cpu or nvme) must cross to the host. Copied on the stream backward runs on, with the host
waiting, each copy would stall backward once per parameter. Instead ``GradCopies.put``
queues the copy on a side stream that first waits for the compute stream (so it reads the
finished gradient), records the gradient's memory as used there (so the caching allocator
does not hand it to backward before the copy read it), and records an event. The first
gradient of a step lands directly in the sum's pages; a later one lands in a pinned staging
buffer and is added on the host once its event has completed.

Nothing may read a parameter's sum before its copy landed: every reader calls
``landed(params)`` first (an update, a norm, clipping, scaling, moving the states, closing),
and the end of each backward waits for all, so after ``backward()`` returns every sum is
whole. A subscriber to the gradient hand-off (``handoff.py``) is told of a final unit before
its copies landed, and calls ``landed`` for the unit's parameters from its own thread.

While a copy is in flight its parameter is marked *copying* in the engine's gradient ledger
([Note: a gradient copy in flight] in ``grad_ledger.py``); its record stays here.

Without CUDA (gradients already on the host) the sum is added at once and nothing is queued.
``DEFER_ON_HOST`` makes host copies land only when ``landed`` is called, so the tests on a
machine without a GPU check that every reader waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger

DEFER_ON_HOST = False
"""Tests only: on the host, hold each copy until ``landed`` (see the Note)."""


@dataclass
class _InFlight:
    dst: torch.Tensor
    src: torch.Tensor
    """The staging buffer (or, deferred on the host, the gradient) to add or copy into ``dst``."""
    add: bool
    event: torch.cuda.Event | None


class GradCopies:
    def __init__(self, ledger: GradLedger | None = None) -> None:
        """``ledger``: where copies in flight are marked (default: a ledger of its own)."""
        self.ledger = ledger if ledger is not None else GradLedger()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._records: dict[int, _InFlight] = {}
        """Each copy in flight, by parameter (the ledger marks which are in flight)."""
        self._lock = threading.Lock()

    def record_in(self, ledger: GradLedger) -> None:
        """Mark copies in ``ledger`` from now on: the engine's, made after the bank made this
        (before any gradient, so nothing is in flight)."""
        assert not self.ledger.copies_in_flight(), "gradient copies in flight while changing ledgers"
        self.ledger = ledger

    def put(self, i: int, dst: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
        """Copy (``first``) or add parameter ``i``'s gradient ``grad`` into ``dst``, an fp32
        view of its sum's pages shaped like ``grad``: at once on the host, on a side stream
        behind an event on CUDA."""
        self.landed([i])
        if grad.device.type == "cuda" and dst.device.type == "cpu":
            side = self._side(grad.device)
            side.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.no_grad(), torch.cuda.stream(side):
                if first:
                    dst.copy_(grad, non_blocking=True)
                    staged = dst
                else:
                    staged = torch.empty(grad.shape, dtype=dst.dtype, pin_memory=True)
                    staged.copy_(grad, non_blocking=True)
                grad.record_stream(side)
                event = torch.cuda.Event()
                event.record(side)
            self._queued(i, _InFlight(dst, staged, not first, event))
        elif DEFER_ON_HOST and grad.device.type == "cpu":
            self._queued(i, _InFlight(dst, grad.detach().clone(), not first, None))
        else:
            _add_or_copy(dst, grad, add=not first)

    def landed(self, params: Iterable[int] | None = None) -> None:
        """Wait until the gradients of ``params`` (None: all) have landed in their pages."""
        if not self.ledger.copies_in_flight():  # a mark goes only once landed: none means nothing in flight
            return
        with self._lock:  # held while landing: another reader of the same sum waits for it whole
            keys = self.ledger.copying() if params is None else params
            for i in keys:
                if not self.ledger.is_copying(i):
                    continue
                c = self._records[i]
                if c.event is not None:
                    c.event.synchronize()
                if c.add or c.event is None:
                    _add_or_copy(c.dst, c.src, add=c.add)
                del self._records[i]
                self.ledger.copy_landed(i)

    def in_flight(self) -> int:
        """Copies queued and not yet waited for."""
        return self.ledger.copies_in_flight()

    def _queued(self, i: int, record: _InFlight) -> None:
        with self._lock:
            self._records[i] = record
            self.ledger.copy_started(i)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _add_or_copy(dst: torch.Tensor, grad: torch.Tensor, add: bool) -> None:
    with torch.no_grad():
        if add:
            dst.add_(grad.to(device=dst.device, dtype=dst.dtype))
        else:
            dst.copy_(grad)
