"""Which ranks an engine trains over: the process group is the one source of rank and world size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pagemem.errors import ConfigError, warn


@dataclass(frozen=True)
class RankGroup:
    """The process group an engine is data parallel over, with what the engine needs of it.

    ``group`` is None for one process (no ``torch.distributed`` group initialised, or a group of
    one). ``device``: where collective buffers live (the host for gloo, the GPU for NCCL)."""

    group: Any
    rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def data_parallel(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls) -> "RankGroup":
        return cls(None, 0, 1, "none", torch.device("cpu"))

    @staticmethod
    def peek(process_group: Any) -> tuple[int, int]:
        """``(rank, world_size)`` that ``resolve`` will find, before the store is made (the
        budget checks count the sharded moments with it); ``(0, 1)`` where ``resolve`` will
        find one process or refuse the group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        group = dist.group.WORLD if process_group is None else process_group
        if not isinstance(group, dist.ProcessGroup):
            return 0, 1
        rank = dist.get_rank(group)
        return (rank, dist.get_world_size(group)) if rank >= 0 else (0, 1)

    @classmethod
    def resolve(cls, process_group: Any, gpu_device: torch.device) -> "RankGroup":
        """``process_group`` given (a ``torch.distributed.ProcessGroup``), or else the default
        group when one is initialised, else one process. ``gpu_device``: the engine's compute
        device (NCCL needs it to be a CUDA device)."""
        import torch.distributed as dist

        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
                    warn("pagemem: WORLD_SIZE is more than 1 but no torch.distributed process group is initialised: "
                         "this engine trains alone, not data parallel; call "
                         "torch.distributed.init_process_group before making the engine")
                return cls.single()
            process_group = dist.group.WORLD
        elif not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("process_group: given, but torch.distributed is not initialised in this process; "
                              "call torch.distributed.init_process_group first (torchrun sets its environment)")
        elif isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ConfigError("process_group: this process is not a member of the group it was given "
                              "(torch.distributed.new_group returns a placeholder to ranks outside it)")
        elif not isinstance(process_group, dist.ProcessGroup):
            raise ConfigError(f"process_group: must be a torch.distributed.ProcessGroup, got "
                              f"{type(process_group).__name__}")
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ConfigError("process_group: this process is not a member of the group it was given")
        world = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        if world == 1:
            return cls(None, 0, 1, backend, torch.device("cpu"))
        if backend == "nccl":
            if gpu_device.type != "cuda":
                raise ConfigError("process_group: an NCCL group needs the gpu tier on CUDA; use gloo without CUDA")
            device = gpu_device
        elif "gloo" in backend:
            device = torch.device("cpu")
        else:
            raise ConfigError(f"process_group: backend {backend!r} is not supported; must be 'gloo' or 'nccl'")
        return cls(process_group, rank, world, backend, device)
