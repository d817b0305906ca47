"""A checkpoint's files: durable writes read back, directory fsyncs, reads that name the file,
and every OS failure as a pagemem error naming the file.

[Note: checkpoint I/O errors] A write or fsync that fails (ENOSPC, EIO, ...) raises
``TierIOError`` (an ``OSError``) naming the file; a file a reader needs that is missing, is not a
file, or is not what was written raises ``CorruptCheckpoint`` naming it; any other read failure
is a ``TierIOError``. No bare ``OSError``, ``FileNotFoundError`` or ``JSONDecodeError`` leaves
a save or a load.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from typing import Iterator

from pagemem.errors import CorruptCheckpoint, PageMemError, TierIOError

TMP_MARK = ".tmp-"
"""In the name of a file or directory a save is still writing (``step-N.tmp-*``, ``latest.tmp-*``)."""


def errname(code: int) -> str:
    return f"{errno.errorcode.get(code, 'E?')} ({os.strerror(code)})"


@contextmanager
def io_errors(what: str, path: str) -> Iterator[None]:
    """An ``OSError`` inside becomes a ``TierIOError`` saying ``what`` failed on ``path``."""
    try:
        yield
    except PageMemError:
        raise
    except OSError as exc:
        code = exc.errno or errno.EIO
        raise TierIOError(f"checkpoint: {what} {path} failed: {errname(code)}", code) from exc


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to a new file at ``path``, fsync it, and read it back (TierIOError if it
    does not read back as written)."""
    with io_errors("writing", path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            back = f.read()
    if back != data:
        raise TierIOError(f"checkpoint: {path} does not read back as written ({len(back)} of {len(data)} bytes "
                          "equal or present)", errno.EIO)


def fsync_dir(path: str) -> None:
    _fsync(path, os.O_DIRECTORY, "syncing directory")


def fsync_file(path: str) -> None:
    """Flush a written file to disk (``TierIOError`` naming it when that fails)."""
    _fsync(path, os.O_CLOEXEC, "syncing")


def _fsync(path: str, flags: int, what: str) -> None:
    with io_errors(what, path):
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_file(path: str, limit: int | None = None) -> bytes:
    """The bytes of the checkpoint file ``path`` (at most ``limit``): CorruptCheckpoint when it
    is missing or not a file, TierIOError when reading fails."""
    try:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing") from None
    except (IsADirectoryError, NotADirectoryError):
        raise CorruptCheckpoint(path, "not a file") from None
    except OSError as exc:
        code = exc.errno or errno.EIO
        raise TierIOError(f"checkpoint: reading {path} failed: {errname(code)}", code) from exc


def file_size(path: str) -> int:
    """The size of the checkpoint file ``path`` (CorruptCheckpoint when missing or not a file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing") from None
    except OSError as exc:
        code = exc.errno or errno.EIO
        raise TierIOError(f"checkpoint: reading {path} failed: {errname(code)}", code) from exc
    if not os.path.isfile(path):
        raise CorruptCheckpoint(path, "not a file")
    return st.st_size


def remove(path: str) -> None:
    """Remove the file or directory ``path`` if it is there (cleanup: never raises)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def remove_leftovers(root: str) -> None:
    """Remove what saves that crashed left in ``root`` (``step-N.tmp-*`` directories and
    ``latest.tmp-*`` files)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if TMP_MARK in name:
            remove(os.path.join(root, name))
