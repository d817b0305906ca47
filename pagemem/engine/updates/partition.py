"""Cores for the host stand-in's "gpu" and for everything else ([Note: a core partition]).

[Note: a core partition]
On a GPU machine the compute runs on the GPU and the updating thread, Adam and the I/O on host
cores: neither slows the other. The host stand-in computes on the same cores as they do, so the
updater's work takes time from the "gpu" instead (BENCHMARKS.md, lock-free updater). A
``CorePartition`` gives the compute (the calling thread, with ``torch.set_num_threads`` of its
cores) some cores and every ``pagemem-`` thread (the lock-free updater, Adam workers, copy and
I/O threads) the others, with ``os.sched_setaffinity`` per thread. A thread started later
inherits its starter's cores, so ``apply`` is called again once the engine has started its
threads (after the first steps). What it emulates: compute and updater on separate processors.
What it does not: the GPU's speed, the memory bandwidth both sides still share, and the GIL,
which the compute's Python and the updater's Python still take turns on.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from pagemem.errors import ConfigError

PREFIX = "pagemem-"
"""The engine's threads are named so (``adam_threads.py``, ``lockfree.py``, ``tiers/``)."""


@dataclass(frozen=True)
class CorePartition:
    """``compute``: the cores of the thread that calls ``apply`` (the stand-in "gpu");
    ``others``: the cores of every ``pagemem-`` thread. Disjoint, both non-empty."""

    compute: frozenset[int]
    others: frozenset[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", frozenset(self.compute))
        object.__setattr__(self, "others", frozenset(self.others))
        if not self.compute or not self.others:
            raise ConfigError(f"compute, others: both need a core, got compute={sorted(self.compute)}, "
                              f"others={sorted(self.others)}")
        if self.compute & self.others:
            raise ConfigError(f"compute, others: must not share cores, both hold {sorted(self.compute & self.others)}")

    @classmethod
    def split(cls, compute_cores: int | None = None) -> "CorePartition":
        """The usable cores, the first ``compute_cores`` (default: half, at least one) for the
        compute and the rest for the others. Refused with fewer than two usable cores."""
        cores = sorted(os.sched_getaffinity(0))
        n = max(1, len(cores) // 2) if compute_cores is None else compute_cores
        if len(cores) < 2 or not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < len(cores):
            raise ConfigError(f"compute_cores: must be an integer in [1, {len(cores) - 1}] (this process may run "
                              f"on {len(cores)} core(s): {cores}), got {compute_cores!r}")
        return cls(frozenset(cores[:n]), frozenset(cores[n:]))

    def apply(self) -> int:
        """Pin the calling thread to ``compute`` (and torch's threads to as many) and every live
        ``pagemem-`` thread to ``others``; returns how many of those were pinned."""
        os.sched_setaffinity(0, self.compute)  # 0: the calling thread (Linux)
        torch.set_num_threads(len(self.compute))
        placed = 0
        for t in threading.enumerate():
            if t.name.startswith(PREFIX) and t.native_id is not None and t.is_alive():
                try:
                    os.sched_setaffinity(t.native_id, self.others)
                    placed += 1
                except ProcessLookupError:  # it ended meanwhile
                    pass
        return placed

    @contextlib.contextmanager
    def applied(self) -> Iterator["CorePartition"]:
        """``apply`` now; on exit the calling thread gets its cores and torch threads back (the
        engine's threads end with the engine). Call ``apply`` again inside for threads started
        meanwhile."""
        cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
        try:
            self.apply()
            yield self
        finally:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)


def host_partition(lock_free: bool, on_host: bool) -> CorePartition | None:
    """The partition ``pagemem train`` uses: with the lock-free updater on the host stand-in and
    at least two usable cores, ``CorePartition.split()``; otherwise None (a GPU computes apart)."""
    if not (lock_free and on_host) or len(os.sched_getaffinity(0)) < 2:
        return None
    return CorePartition.split()
