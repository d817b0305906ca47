"""What this machine has: host memory, free disk, whether a directory takes files.

A leaf (it imports no layer), so the tiers check budgets with it before allocating, the
scheduler's ``measure`` describes the machine with it and the engine asks it whether the trained
weights fit in host memory: one reader of ``/proc/meminfo`` for all of them.
"""

from __future__ import annotations

import errno
import os
import tempfile

import torch

_CGROUP_LIMITS = (
    # (limit, usage): cgroup v2, then v1, as a container sees its own group
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def meminfo(field: str) -> int | None:
    """Bytes of ``field`` (``MemTotal``, ``MemAvailable``) in ``/proc/meminfo``, or None where
    it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def cgroup_memory() -> list[tuple[int, int]]:
    """``(limit, usage)`` bytes of each memory cgroup (v2, then v1) this process sees that sets a
    limit; empty where there is none, or none can be read."""
    out = []
    for limit_path, usage_path in _CGROUP_LIMITS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            out.append((limit, usage))
    return out


def host_memory_available() -> int | None:
    """Bytes of host memory a new allocation can have now: ``MemAvailable``, less where a memory
    cgroup's limit leaves less; None where neither can be read."""
    best = meminfo("MemAvailable")
    for limit, usage in cgroup_memory():
        room = max(limit - usage, 0)
        best = room if best is None else min(best, room)
    return best


def disk_free(directory: str) -> tuple[int, int]:
    """``(bytes free to this user, filesystem id)`` of the filesystem holding ``directory``
    (the id tells which directories share one). Raises OSError where it cannot be read."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, os.stat(directory).st_dev


def unwritable(directory: str) -> str | None:
    """Why files cannot be made in ``directory`` (missing, not a directory, read-only, no
    permission), or None when they can: a file is created there and removed at once, the one
    test that holds for root, ACLs and read-only mounts alike."""
    if not os.path.isdir(directory):
        return "it is not an existing directory"
    try:
        fd, path = tempfile.mkstemp(prefix=".pagemem-probe-", dir=directory)
    except OSError as exc:
        code = exc.errno or errno.EIO
        return f"a file cannot be created there: {errno.errorcode.get(code, 'E?')} ({os.strerror(code)})"
    os.close(fd)
    os.unlink(path)
    return None


def device_memory_free(device: torch.device, wanted: int) -> tuple[int, int]:
    """``(free, total)`` bytes of the CUDA ``device``; when ``wanted`` is more than is free, the
    blocks torch's caching allocator keeps unused are given back first and it is asked again."""
    free, total = torch.cuda.mem_get_info(device)
    if wanted > free:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
    return free, total
