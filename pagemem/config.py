"""Configuration of a :class:`pagemem.PageStore`: one frozen dataclass, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Sequence

from pagemem.checks import as_set, check_bool, check_choice, check_int
from pagemem.errors import ConfigError
from pagemem.units import format_bytes, parse_size

ALIGNMENT = 4096
"""Page sizes and arena offsets are multiples of this (O_DIRECT and CUDA both want it)."""

MAX_PAGE_BYTES = 1 << 30
"""The largest page (1 GiB): a page is one disk request and one staging buffer, and every tier
holds whole pages, so a larger one would only make each budget coarser."""

IOEngineName = Literal["auto", "aio", "threads"]
GpuBackendName = Literal["auto", "cuda", "host"]


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and backends of a page store. Sizes are int bytes or strings like ``"4MiB"``.

    A tier's capacity is its byte budget rounded down to whole pages; a budget of 0 disables it.
    """

    page_bytes: int | str = "4MiB"
    """Size of every page: a multiple of 4096 bytes, from 4 KiB to 1 GiB."""
    gpu_bytes: int | str = 0
    """Budget of the ``gpu`` tier (one device allocation, or a host stand-in without CUDA)."""
    cpu_bytes: int | str = 0
    """Budget of the ``cpu`` tier (pinned when CUDA is present)."""
    nvme_bytes: int | str = 0
    """Budget of the ``nvme`` tier, preallocated as files under ``nvme_path``."""
    nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None
    """Directory for the page files; several directories (one per drive) stripe the pages."""
    io_engine: IOEngineName = "auto"
    """``aio`` (Linux AIO via libaio), ``threads`` (pread/pwrite pool) or ``auto`` (aio if it works)."""
    io_depth: int = 32
    """Most NVMe requests in flight at once (1..1024)."""
    direct_io: bool = True
    """Open page files with O_DIRECT where the filesystem supports it."""
    checksums: bool = True
    """Hash every page written to NVMe and verify it on read."""
    staging_pages: int = 8
    """Pinned bounce pages for gpu<->nvme moves (1..4096)."""
    gpu_backend: GpuBackendName = "auto"
    """``cuda`` (needs CUDA), ``host`` (host-memory stand-in) or ``auto`` (cuda when present)."""
    cuda_device: int = 0
    """CUDA device index for the ``gpu`` tier."""
    pin_cpu: bool = True
    """Pin the ``cpu`` arena when CUDA is present (falls back to pageable with a warning)."""
    copy_threads: int = 2
    """Host threads copying between host-memory arenas (0..64). 0: each copy runs on the thread
    that issues it, which is faster on a host stand-in with few cores, where copy threads only
    compete with compute for the same cores (``benchmarks/bench_engine.py`` measures both)."""
    nvme_bandwidth: int | str | None = None
    """Testing knob: deliver nvme reads and writes no faster than this many bytes per second
    together, as a slower SSD would (``tiers/io/throttle.py``); None: the disk's own speed."""
    nvme_paths: tuple[str, ...] = field(init=False, repr=False)
    """``nvme_path`` normalised to a tuple of directories (derived)."""

    def __post_init__(self) -> None:
        page = self.page_bytes if isinstance(self.page_bytes, int) and not isinstance(self.page_bytes, bool) \
            else parse_size(self.page_bytes, "page_bytes")
        if page <= 0 or page % ALIGNMENT or page > MAX_PAGE_BYTES:
            raise ConfigError(
                f"page_bytes: must be a positive multiple of {ALIGNMENT} bytes, at most {MAX_PAGE_BYTES} "
                f"({format_bytes(MAX_PAGE_BYTES)}), got {self.page_bytes!r}"
                + (f" ({format_bytes(page)})" if isinstance(self.page_bytes, str) or page > MAX_PAGE_BYTES else "")
            )
        object.__setattr__(self, "page_bytes", page)
        for name in ("gpu_bytes", "cpu_bytes", "nvme_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        if self.nvme_bandwidth is not None:
            object.__setattr__(self, "nvme_bandwidth", parse_size(self.nvme_bandwidth, "nvme_bandwidth"))
            check_int("nvme_bandwidth", self.nvme_bandwidth, 1)
        check_choice("io_engine", self.io_engine, ("auto", "aio", "threads"))
        check_choice("gpu_backend", self.gpu_backend, ("auto", "cuda", "host"))
        check_int("io_depth", self.io_depth, 1, 1024)
        check_int("staging_pages", self.staging_pages, 1, 4096)
        check_int("cuda_device", self.cuda_device, 0, 1023)
        check_int("copy_threads", self.copy_threads, 0, 64)
        for name in ("direct_io", "checksums", "pin_cpu"):
            check_bool(name, getattr(self, name))
        paths = _normalise_paths(self.nvme_path)
        if self.nvme_bytes and not paths:
            raise ConfigError(f"nvme_path: required when nvme_bytes > 0 (a directory for the page files); "
                              f"{as_set(self, 'nvme_path')}, nvme_bytes={self.nvme_bytes}")
        for p in paths:
            if not os.path.isdir(p):
                raise ConfigError(f"nvme_path: {p!r} is not an existing directory")
        object.__setattr__(self, "nvme_paths", paths)

    def pages(self, tier: str) -> int:
        """Whole pages that fit in ``tier``'s budget."""
        return getattr(self, f"{tier}_bytes") // self.page_bytes


def _normalise_paths(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (os.fspath(value),)
    try:
        paths = tuple(os.fspath(p) for p in value)  # type: ignore[union-attr]
    except TypeError:
        raise ConfigError(f"nvme_path: expected a directory or a list of directories, got {value!r}") from None
    if len(set(paths)) != len(paths):
        raise ConfigError(f"nvme_path: a directory is listed twice in {paths!r}")
    return paths

