"""NVMe page files: one preallocated file per directory, owned by one live process.

[Note: page files of dead owners]
A store deletes its page files on close, at garbage collection and at interpreter exit, but a
process killed by a signal (SIGKILL, the OOM killer) leaves them behind, each as large as its
tier. So a page file carries its owner's pid in its name (``pagemem-<pid>-<12 hex>.pages``) and
its owner holds an ``flock`` on it for as long as the file is open. A new page file first sweeps
its directory: a file is removed only when its name has exactly that form, it is a regular
file, its pid names no live process, and the lock can be taken (nobody holds it open: not the
owner, not a process forked from it). Anything else (another user's process, a pid that lives
again, a file that merely looks alike) is left alone. A process forked from the owner closes its
copies of the descriptors at once and never removes the file ([Note: an engine belongs to its
process], ``pagemem/process.py``): the file lives as long as its owner, and once the owner is
dead its lock is free even while children of it live on.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat
import uuid
import weakref

import pagemem.process as process
from pagemem.errors import TierIOError
from pagemem.machine import disk_free
from pagemem.units import format_bytes

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_NAME = re.compile(r"pagemem-([1-9][0-9]{0,9})-[0-9a-f]{12}\.pages")


def errname(code: int) -> str:
    return f"{errno.errorcode.get(code, 'E?')} ({os.strerror(code)})"


def page_file_owner(name: str) -> int | None:
    """The owner's pid if ``name`` is a page file's name, else None."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Delete the page files in ``directory`` whose owners are dead (see the Note); return their
    paths. Never raises for a file it cannot inspect: that file is left."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = page_file_owner(name)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its owner (or a child) lives
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class PageFile:
    """One preallocated file of ``nbytes``, mode 0600, opened with O_DIRECT when supported."""

    def __init__(self, directory: str, nbytes: int, direct: bool) -> None:
        self.removed_stale = remove_stale(directory)
        self.path = os.path.join(directory, f"pagemem-{os.getpid()}-{uuid.uuid4().hex[:12]}.pages")
        self.nbytes = nbytes
        available, _fs = disk_free(directory)
        if nbytes > available:
            raise TierIOError(
                f"nvme: cannot preallocate {format_bytes(nbytes)} in {directory}: only "
                f"{format_bytes(available)} free ({errname(errno.ENOSPC)})", errno.ENOSPC)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fds = [fd]
        self._finalizer = process.finalize(self, _remove, self.path, self._fds)  # the owner's alone
        _open_files.add(self)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the owner's mark, until the fd closes
            _preallocate(fd, nbytes, self.path)
        except BaseException:
            self.close()
            raise
        self.direct = False
        self.fd = fd
        if direct and _O_DIRECT:
            dfd = _open_direct(self.path)
            if dfd is not None:
                self._fds.append(dfd)
                self.fd = dfd
                self.direct = True

    def close(self) -> None:
        """Close and delete the file (also done at garbage collection and interpreter exit); in a
        process forked from the owner, nothing (see the Note)."""
        self._finalizer()


_open_files: "weakref.WeakSet[PageFile]" = weakref.WeakSet()
"""Every page file this process holds open (a forked child drops its copies of them)."""


def _drop_inherited() -> None:
    """In a forked child: close this process's copies of the owner's page-file descriptors. The
    owner's own stay open and locked (a lock belongs to the open file, which the owner holds)."""
    files = list(_open_files)
    _open_files.clear()
    for f in files:
        fds, f._fds[:] = list(f._fds), []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited)


def _remove(path: str, fds: list[int]) -> None:
    try:  # unlinked while still locked, so no sweeper ever takes a live file for a stale one
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        fds.clear()


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, nbytes)  # filesystem without fallocate: a sparse file
            return
        raise TierIOError(
            f"nvme: cannot preallocate {format_bytes(nbytes)} for {path}: {errname(exc.errno or errno.EIO)}",
            exc.errno) from exc


def _open_direct(path: str) -> int | None:
    """Open ``path`` with O_DIRECT and prove an aligned read works; None if unsupported."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return None
    probe = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [probe], 0)
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.close()
    return fd
