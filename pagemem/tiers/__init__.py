"""Tiers: ``gpu``, ``cpu`` and ``nvme`` page slots behind one interface, and their construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagemem.config import StoreConfig
from pagemem.errors import ConfigError, FirstError, InvalidRequest
from pagemem.tiers.arena import CudaArena, HostArena, HostBuffer
from pagemem.tiers.base import TIER_NAMES, Tier
from pagemem.tiers.pagefile import remove_stale
from pagemem.tiers.budgets import check_budgets
from pagemem.tiers.copy import CudaCopyEngine, HostCopyEngine
from pagemem.tiers.fence import Fence
from pagemem.tiers.memory import MemoryTier
from pagemem.tiers.nvme import NvmeTier, TornSlot
from pagemem.tiers.staging import StagingPool

__all__ = ["Tier", "MemoryTier", "NvmeTier", "TierSet", "HostBuffer", "StagingPool", "Fence", "TornSlot",
           "TIER_NAMES", "build_tiers"]


@dataclass
class TierSet:
    """The three tiers of a store, the staging pool, and the engines they share."""

    gpu: MemoryTier
    cpu: MemoryTier
    nvme: NvmeTier
    staging: StagingPool
    cuda: bool
    _closers: list = field(default_factory=list, repr=False)

    def __getitem__(self, name: str) -> Tier:
        if name not in TIER_NAMES:
            raise InvalidRequest(f"tier: must be one of 'gpu', 'cpu', 'nvme', got {name!r}")
        return getattr(self, name)

    def __iter__(self):
        return iter((self.gpu, self.cpu, self.nvme))

    def close(self) -> None:
        """Stop the engines (waiting for work in flight), then give back memory and files; every
        part is closed even if one raises, then the first error is raised
        ([Note: closing releases everything])."""
        closers, self._closers = list(reversed(self._closers)), []
        with FirstError() as step:
            for close in closers:
                step(close)


def build_tiers(config: StoreConfig) -> TierSet:
    """Preallocate every tier's arena or files as ``config`` says."""
    cuda_seen = torch.cuda.is_available()
    if config.gpu_backend == "cuda" and not cuda_seen:
        raise ConfigError("gpu_backend: 'cuda' needs a CUDA device, and torch sees none; use 'auto' or 'host'")
    use_cuda = cuda_seen and config.gpu_backend != "host"
    if use_cuda and config.cuda_device >= torch.cuda.device_count():
        raise ConfigError(
            f"cuda_device: must be in [0, {torch.cuda.device_count() - 1}], got {config.cuda_device}")
    if config.pages("nvme"):
        for directory in config.nvme_paths:  # dead owners' page files first: their space counts as free
            remove_stale(directory)
    check_budgets(config, use_cuda)  # [Note: budgets checked up front]: before anything is allocated
    pb = config.page_bytes
    # closed in reverse: engines first (they wait for work in flight), then memory
    memory: list = []
    engines: list = []
    try:
        host_copier = HostCopyEngine(config.copy_threads)
        engines.append(host_copier.close)
        if use_cuda:
            device = torch.device("cuda", config.cuda_device)
            gpu_arena = CudaArena(config.pages("gpu") * pb, device)
            memory.append(gpu_arena.close)
            cuda_copier = CudaCopyEngine(device)
            engines.append(cuda_copier.close)
            gpu = MemoryTier("gpu", gpu_arena, pb, cuda_copier,
                             f"cuda ({torch.cuda.get_device_name(device)})", host_addressable=False)
            memory[-1] = gpu.close  # the tier's arena at close time (resize() replaces it)
        else:
            why = "gpu_backend='host'" if cuda_seen else "no CUDA"
            gpu = MemoryTier("gpu", HostArena(config.pages("gpu") * pb, pin=False), pb, host_copier,
                             f"host-memory stand-in ({why})", host_addressable=False)
            memory.append(gpu.close)
        pin = use_cuda and config.pin_cpu
        cpu_arena = HostArena(config.pages("cpu") * pb, pin=pin)
        cpu = MemoryTier("cpu", cpu_arena, pb, host_copier,
                         "pinned host memory" if cpu_arena.pinned else "pageable host memory",
                         host_addressable=True)
        memory.append(cpu.close)
        nvme = NvmeTier(config.nvme_paths, config.pages("nvme"), pb, engine=config.io_engine,
                        io_depth=config.io_depth, direct=config.direct_io, checksums=config.checksums,
                        bandwidth=config.nvme_bandwidth)
        engines.append(nvme.close)
        staging = StagingPool(config.staging_pages, pb, pin=pin)
        memory.append(staging.close)
    except BaseException:
        with FirstError() as step:
            for close in reversed(memory + engines):
                step(close)
        raise
    closers = memory + engines
    return TierSet(gpu, cpu, nvme, staging, use_cuda, closers)
