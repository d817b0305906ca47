"""Moving one page's bytes from a slot in one tier to a slot in another.

Host-addressable tiers (cpu) are read or written directly by the other tier: gpu->cpu is a
D2H copy, cpu->nvme an I/O write, and so on. Between two tiers neither of which is host memory
(gpu<->nvme) the page bounces through a pinned staging page.
"""

from __future__ import annotations

from pagemem.tiers import StagingPool, Tier
from pagemem.tiers.base import PageDone


class Mover:
    def __init__(self, staging: StagingPool) -> None:
        self.staging = staging

    def transfer(self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, done: PageDone) -> None:
        """Copy page ``src:src_slot`` to ``dst:dst_slot`` asynchronously; ``done(error)`` after."""
        if dst.host_addressable:
            src.start_read(src_slot, dst.host_buffer(dst_slot), done)
        elif src.host_addressable:
            dst.start_write(dst_slot, src.host_buffer(src_slot), done)
        else:
            self._bounce(src, src_slot, dst, dst_slot, done)

    def _bounce(self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, done: PageDone) -> None:
        def staged(bufs) -> None:
            buf = bufs[0]

            def written(error: BaseException | None) -> None:
                self.staging.release(bufs)
                done(error)

            def read(error: BaseException | None) -> None:
                if error is not None:
                    written(error)
                else:
                    dst.start_write(dst_slot, buf, written)

            src.start_read(src_slot, buf, read)

        self.staging.acquire(1, staged)
