"""Arenas: the one preallocated block of memory behind each memory tier.

A host arena is an anonymous mmap: page-aligned (as O_DIRECT needs), populated at start-up,
and sized exactly as asked. With CUDA it is pinned with ``cudaHostRegister`` rather than
through PyTorch's caching host allocator, which rounds pinned blocks up to a power of two.
"""

from __future__ import annotations

import mmap
import warnings
from typing import NamedTuple

import torch

from pagemem.units import format_bytes


class HostBuffer(NamedTuple):
    """Host memory seen two ways: a uint8 tensor for copies, a memoryview for the I/O engines."""

    tensor: torch.Tensor
    view: memoryview


class HostArena:
    """``nbytes`` of host memory from one anonymous mmap, optionally pinned for CUDA."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = False
        if nbytes == 0:
            self._mmap = None
            self.view = memoryview(bytearray(0))
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._mmap = mmap.mmap(-1, nbytes, flags=flags)
        except OSError as exc:
            raise MemoryError(f"cannot map {format_bytes(nbytes)} of host memory: {exc}") from exc
        self.view = memoryview(self._mmap)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if pin:
            self.pinned = _cuda_host_register(self.tensor.data_ptr(), nbytes)

    def buffer(self, offset: int, nbytes: int) -> HostBuffer:
        return HostBuffer(self.tensor[offset:offset + nbytes], self.view[offset:offset + nbytes])

    def close(self) -> None:
        """Unpin. The mapping itself goes when the last view of it does."""
        if self.pinned:
            _cuda_host_unregister(self.tensor.data_ptr())
            self.pinned = False


def _cuda_host_register(ptr: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        warnings.warn(
            f"pagemem: could not pin {format_bytes(nbytes)} of host memory ({err}); "
            "using pageable memory, so GPU<->CPU copies will be slower",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class CudaArena:
    """``nbytes`` of device memory from one allocation on ``device``."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        free, total = torch.cuda.mem_get_info(device) if nbytes else (0, 0)
        if nbytes > free:
            raise MemoryError(
                f"gpu_bytes={format_bytes(nbytes)} does not fit on {device}: "
                f"{format_bytes(free)} free of {format_bytes(total)}"
            )
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def close(self) -> None:
        pass
