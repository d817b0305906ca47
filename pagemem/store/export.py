"""A page's bytes written into a file the caller owns (a checkpoint), with their checksum.

A copy in memory is written from its buffer and checksummed on the way; a page that lives only
on NVMe is copied from the page file by the kernel (``copy_file_range``, never read through
Python) and keeps the checksum the tier recorded when it wrote it. The caller synchronizes the
store first (no operation may be in flight on the page).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from pagemem.store.store import PageStore


def export_page(store: "PageStore", page_id: int, fd: int, offset: int) -> int:
    """Write logical page ``page_id`` at ``offset`` of the open file ``fd``; return the XXH3-64
    checksum of the bytes written."""
    copies = store.copies(page_id)
    memory = next((n for n in ("cpu", "gpu") if n in copies), None)
    if memory is not None:
        data = store.tier(memory).buffer(copies[memory]).cpu().numpy().tobytes()
        os.pwrite(fd, data, offset)
        return xxhash.xxh3_64_intdigest(data)
    nvme = store.tier("nvme")
    src, src_offset = nvme.locate(copies["nvme"])
    _copy_range(src.path, src_offset, fd, offset, store.page_bytes)
    digest = nvme.digest(copies["nvme"])
    # with the tier's checksums off there is none to carry over: read the copy back
    return digest if digest is not None else xxhash.xxh3_64_intdigest(os.pread(fd, store.page_bytes, offset))


def _copy_range(src_path: str, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
    src = os.open(src_path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.copy_file_range(src, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
            if n <= 0:
                raise OSError(f"copy_file_range copied nothing at {done} of {nbytes} bytes")
            done += n
    finally:
        os.close(src)
