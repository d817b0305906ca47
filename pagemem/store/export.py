"""A page's bytes written into a file the caller owns (a checkpoint), verified, with their checksum.

[Note: exported pages are verified] A copy in memory is written from its buffer and checksummed
on the way; a page that lives only on NVMe is copied from the page file by the kernel
(``copy_file_range``, never read through Python) and must match the checksum the tier recorded
when it wrote it. Either way the range written is read back from the destination and hashed:
a page whose bytes on disk went bad since they were written (or a write that did not land as
sent) raises ``CorruptPage`` naming both files, so a checkpoint never records a bad page under
a good checksum. ``copy_file_range`` refuses some pairs of files (another filesystem: EXDEV;
an old kernel or a filesystem without it: ENOSYS, EINVAL, EOPNOTSUPP); the rest of the page is
then copied through a bounded buffer (``COPY_CHUNK`` bytes at a time). A failed write (ENOSPC,
EIO) raises ``TierIOError`` naming the destination. The caller synchronizes the store first (no
operation may be in flight on the page).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

import xxhash

from pagemem.errors import CorruptPage, PageMemError, TierIOError

if TYPE_CHECKING:
    from pagemem.store.store import PageStore

COPY_CHUNK = 1 << 20
"""Bytes the buffered fallback copies at a time (the most it holds in memory)."""

FALLBACK_ERRNOS = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP,
                             errno.EPERM, errno.EBADF, errno.ETXTBSY})
"""``copy_file_range`` failures that mean "not between these files": copy through a buffer."""


def export_page(store: "PageStore", page_id: int, fd: int, offset: int, name: str = "") -> int:
    """Write logical page ``page_id`` at ``offset`` of the open file ``fd`` (called ``name`` in
    errors), read it back and return the XXH3-64 checksum of its bytes. Raises CorruptPage when
    the bytes are not the page's, TierIOError when the write fails."""
    pb = store.page_bytes
    dst = name or f"fd {fd}"
    try:
        copies = store.copies(page_id)
        memory = next((n for n in ("cpu", "gpu") if n in copies), None)
        if memory is not None:
            data = store.tier(memory).buffer(copies[memory]).cpu().numpy().tobytes()
            expected, source = xxhash.xxh3_64_intdigest(data), f"tier {memory!r} slot {copies[memory]}"
            _write_all(fd, data, offset)
            tier, slot = memory, copies[memory]
        else:
            tier, slot = "nvme", copies["nvme"]
            nvme = store.tier("nvme")
            src, src_offset = nvme.locate(slot)
            source = f"{src.path} at offset {src_offset}"
            if nvme.is_torn(slot):
                raise CorruptPage("nvme", slot, 0, 0, f"{source}: its last write failed, so its bytes may be "
                                  f"partial; not copied to {dst}")
            expected = nvme.digest(slot)
            if expected is None and nvme.checksums:  # never written: it reads as zeros, whatever the disk holds
                data = bytes(pb)
                expected = xxhash.xxh3_64_intdigest(data)
                _write_all(fd, data, offset)
            else:
                copy_range(src.path, src_offset, fd, offset, pb)
        back = _read_all(fd, pb, offset)
    except PageMemError:
        raise
    except OSError as exc:
        code = exc.errno or errno.EIO
        raise TierIOError(f"checkpoint page {page_id} -> {dst} at offset {offset}: "
                          f"{errno.errorcode.get(code, 'E?')} ({os.strerror(code)}); the page itself is unchanged",
                          code) from exc
    actual = xxhash.xxh3_64_intdigest(back)
    if expected is not None and actual != expected:  # None: nvme checksums off, nothing to check against
        raise CorruptPage(tier, slot, expected, actual, f"{source}, copied to {dst} at offset {offset}")
    return actual


def copy_range(src_path: str, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_path`` at ``src_offset`` to ``dst_fd`` at ``dst_offset``: by
    ``copy_file_range`` where the kernel allows it between these files, else through a buffer."""
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        kernel = hasattr(os, "copy_file_range")
        while done < nbytes and kernel:
            try:
                n = os.copy_file_range(src, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
            except OSError as exc:
                if exc.errno not in FALLBACK_ERRNOS:
                    raise
                n = 0
            if n <= 0:  # refused, or nothing copied: the buffered copy finds out why (or does it)
                kernel = False
            done += max(n, 0)
        while done < nbytes:
            chunk = os.pread(src, min(COPY_CHUNK, nbytes - done), src_offset + done)
            if not chunk:
                raise OSError(errno.EIO, f"{src_path} ends at offset {src_offset + done}, "
                              f"{nbytes - done} bytes short of the page")
            _write_all(dst_fd, chunk, dst_offset + done)
            done += len(chunk)
    finally:
        os.close(src)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """``pwrite`` all of ``data`` (a short write continues; none at all is ENOSPC)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


def _read_all(fd: int, nbytes: int, offset: int) -> bytes:
    chunks, left = [], nbytes
    while left:
        b = os.pread(fd, left, offset + nbytes - left)
        if not b:
            raise OSError(errno.EIO, f"read back {nbytes - left} of {nbytes} bytes")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)
