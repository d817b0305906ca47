"""Every tier's budget checked against what the machine has, before anything is allocated.

[Note: budgets checked up front] ``build_tiers`` calls :func:`check_budgets` first, so a budget
the machine cannot hold raises ``ConfigError`` naming the field, the request and what is
available, having allocated nothing (no arena, no page file, no per-slot bookkeeping, no
thread):
- ``nvme_path``: every directory must take files (a probe file is created and removed), so a
  missing or read-only directory is named as such, not as a raw OSError or a misleading ENOSPC;
- ``nvme_bytes``: the page files on each filesystem must fit in its free space (directories on
  one filesystem add up);
- host memory (``MemAvailable``, or a memory cgroup's room where less) must hold the ``cpu``
  arena, the ``gpu`` arena when it is a host stand-in, the staging pages and the page tables'
  per-slot bookkeeping: each on its own first (naming its field), then together;
- a CUDA ``gpu`` arena must fit in the device's free memory.
What cannot be read (no ``/proc/meminfo``) is not checked. Locked-memory limits
(RLIMIT_MEMLOCK) are not checked: host pages are pinned only by ``cudaHostRegister``, which the
NVIDIA driver does not count against that limit, and a failed pin already falls back to pageable
memory with a warning (``arena.py``).
"""

from __future__ import annotations

import torch

from pagemem.checks import as_set
from pagemem.config import ALIGNMENT, MAX_PAGE_BYTES, StoreConfig
from pagemem.errors import ConfigError
from pagemem.machine import device_memory_free, disk_free, host_memory_available, unwritable
from pagemem.tiers.freelist import SlotFreeList
from pagemem.tiers.nvme import NvmeTier, slots_per_file
from pagemem.units import format_bytes


def _amount(n: int) -> str:
    return f"{format_bytes(n)} ({n} bytes)"


def check_budgets(config: StoreConfig, use_cuda: bool) -> None:
    """Raise ConfigError, naming the field, when ``config`` asks for more than the machine has."""
    _check_nvme(config)
    _check_host(config, use_cuda)
    if use_cuda:
        _check_device(config)


def _check_nvme(config: StoreConfig) -> None:
    for directory in config.nvme_paths:  # each gets a page file, even of 0 bytes
        why = unwritable(directory)
        if why is not None:
            raise ConfigError(f"nvme_path: page files cannot be made in {directory!r}: {why}")
    per_file = slots_per_file(config.pages("nvme"), len(config.nvme_paths)) * config.page_bytes
    if not per_file:
        return
    filesystems: dict[int, tuple[int, list[str]]] = {}
    for directory in config.nvme_paths:
        free, fs = disk_free(directory)
        filesystems.setdefault(fs, (free, []))[1].append(directory)
    for free, dirs in filesystems.values():
        need = per_file * len(dirs)
        if need > free:
            raise ConfigError(f"nvme_bytes: requested {_amount(config.nvme_bytes)}; its page files in "  # type: ignore[arg-type]
                              f"{', '.join(map(repr, dirs))} need {_amount(need)}, but that filesystem has "
                              f"{_amount(free)} free")


def _check_host(config: StoreConfig, use_cuda: bool) -> None:
    available = host_memory_available()
    if available is None:
        return
    pb, per_slot = config.page_bytes, SlotFreeList.HOST_BYTES_PER_SLOT
    needs = {  # field -> host bytes it takes: arenas, and the page tables' bookkeeping per slot
        "gpu_bytes": config.pages("gpu") * ((0 if use_cuda else pb) + per_slot),
        "cpu_bytes": config.pages("cpu") * (pb + per_slot),
        "staging_pages": config.staging_pages * pb,
        "nvme_bytes": config.pages("nvme") * NvmeTier.HOST_BYTES_PER_SLOT,
    }
    what = {"gpu_bytes": "the page table" if use_cuda else "a host-memory stand-in of the gpu arena",
            "cpu_bytes": "the cpu arena", "staging_pages": "staging pages",
            "nvme_bytes": "the nvme page table"}
    for name, need in needs.items():
        if need > available and name == "staging_pages":  # two fields: name both, and which was left as it was
            raise ConfigError(f"staging_pages, page_bytes: {as_set(config, 'staging_pages')} pages of "
                              f"{as_set(config, 'page_bytes')} ({format_bytes(pb)}) take {_amount(need)} of host memory for "
                              f"{what[name]}, but {_amount(available)} is available: lower page_bytes (from "
                              f"{ALIGNMENT} to {MAX_PAGE_BYTES}) or staging_pages (from 1 to 4096)")
        if need > available:
            raise ConfigError(f"{name}: requested {_amount(getattr(config, name))}, which takes {_amount(need)} of "
                              f"host memory for {what[name]}, but {_amount(available)} is available")
    total = sum(needs.values())
    if total > available:
        named = [n for n, v in needs.items() if v]
        parts = ", ".join(f"{n} {format_bytes(needs[n])}" for n in named)
        staging = f"; {as_set(config, 'staging_pages')} pages of {as_set(config, 'page_bytes')}" if "staging_pages" in named else ""
        raise ConfigError(f"{' + '.join(named)}: together they take {_amount(total)} of host memory ({parts}{staging}), "
                          f"but {_amount(available)} is available")


def _check_device(config: StoreConfig) -> None:
    need = config.pages("gpu") * config.page_bytes
    if not need:
        return
    device = torch.device("cuda", config.cuda_device)
    free, total = device_memory_free(device, need)
    if need > free:
        raise ConfigError(f"gpu_bytes: {_amount(need)} requested on {device}, but it has {_amount(free)} free "
                          f"of {format_bytes(total)}")
