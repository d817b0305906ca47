"""Moving page bytes between tiers: the one path every move, copy, read and write takes.

A transfer copies runs of adjacent slots in one tier to runs of adjacent slots in another.
Between two memory tiers a run costs one copy (one CUDA copy, or one host copy), so moving a
layer of adjacent pages costs one call, not one per page. A host-addressable tier (cpu) is read
or written directly by the other tier: gpu->cpu is a D2H copy, cpu->nvme an I/O write. Between
two tiers neither of which is host memory (gpu<->nvme) each page bounces through a pinned
staging page. A run between the cpu and the disk is one call too: the disk tier reads or writes
it with a few requests, each page still checksummed alone ([Note: runs of pages in one request]
in ``tiers/nvme.py``); gpu<->nvme pages bounce one at a time.

``fetch`` and ``put`` move single pages between a tier and a host buffer: reads of disk pages
into staging (``to_torch``) and writes from staging (``copy_``) use them, the same calls the
moves make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagemem.tiers import StagingPool, Tier
from pagemem.tiers.arena import HostBuffer
from pagemem.tiers.completion import Once

RunDone = Callable[[BaseException | None], None]


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` adjacent slots from ``src_slot`` in the source to ``dst_slot`` in the destination."""

    src_slot: int
    dst_slot: int
    count: int


def runs_of(pairs: list[tuple[int, int]], coalesce: bool) -> list[Run]:
    """Group ``(src_slot, dst_slot)`` pairs into runs adjacent on both sides (in the given order)."""
    out: list[Run] = []
    start_s = start_d = count = None
    for s, d in pairs:
        if count is not None and coalesce and s == start_s + count and d == start_d + count:
            count += 1
            continue
        if count is not None:
            out.append(Run(start_s, start_d, count))
        start_s, start_d, count = s, d, 1
    if count is not None:
        out.append(Run(start_s, start_d, count))
    return out


class Mover:
    def __init__(self, staging: StagingPool) -> None:
        self.staging = staging

    @staticmethod
    def coalesces(src: Tier, dst: Tier) -> bool:
        """True when runs of adjacent slots between these tiers move in one call: one copy
        between memory tiers, one span of I/O between host memory and the disk."""
        return (src.resident and dst.resident) or (src.host_spans and dst.host_addressable) \
            or (dst.host_spans and src.host_addressable)

    def transfer(self, src: Tier, dst: Tier, run: Run, done: RunDone, after=None) -> None:
        """Copy ``run`` from ``src`` to ``dst`` asynchronously; ``done(error)`` once, after.
        ``after``: a fence the copy must wait for (the producer of a gpu source)."""
        if run.count > 1 and src.host_spans:
            src.start_read_span(run.src_slot, run.count, dst.host_buffer(run.dst_slot, run.count), done)
            return
        if run.count > 1 and dst.host_spans:
            dst.start_write_span(run.dst_slot, run.count, src.host_buffer(run.src_slot, run.count), done)
            return
        if run.count > 1:
            if dst.host_addressable:
                src.read_span(run.src_slot, run.count, dst.span(run.dst_slot, run.count), done, after=after)
            else:
                dst.write_span(run.dst_slot, run.count, src.span(run.src_slot, run.count), done)
            return
        s, d = run.src_slot, run.dst_slot
        if dst.host_addressable:
            src.start_read(s, dst.host_buffer(d), done, after=after)
        elif src.host_addressable:
            dst.start_write(d, src.host_buffer(s), done)
        else:
            self._bounce(src, s, dst, d, done, after)

    def fetch(self, src: Tier, slot: int, into: HostBuffer, done: RunDone, after=None) -> None:
        """Read one page into a host buffer (checksum-verified for disk pages)."""
        src.start_read(slot, into, done, after=after)

    def put(self, dst: Tier, slot: int, src: HostBuffer, done: RunDone) -> None:
        """Write one page from a host buffer."""
        dst.start_write(slot, src, done)

    def _bounce(self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, done: RunDone, after) -> None:
        # runs on whichever thread frees a staging page: nothing may escape it, and the staging
        # page goes back exactly once ([Note: no operation is lost], tiers/completion.py)
        def staged(bufs: list[HostBuffer]) -> None:
            buf = bufs[0]

            def finish(error: BaseException | None) -> None:
                self.staging.release(bufs)
                done(error)

            written = Once(finish, done)

            def read(error: BaseException | None) -> None:
                if error is not None:
                    written(error)
                    return
                try:
                    self.put(dst, dst_slot, buf, written)
                except BaseException as exc:
                    written(exc)

            try:
                self.fetch(src, src_slot, buf, read, after)
            except BaseException as exc:
                written(exc)

        self.staging.acquire(1, staged)
