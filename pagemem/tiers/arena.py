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

from pagemem.machine import device_memory_free
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
        self.closed = False
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
        if self.closed:
            raise ValueError("the host arena is closed")
        return HostBuffer(self.tensor[offset:offset + nbytes], self.view[offset:offset + nbytes])

    def close(self) -> None:
        """Give the memory back now, even while views of it remain: unpin, then drop the physical
        pages (stale views read zeros, never another allocation's data); the address range is
        unmapped when the last tensor over it goes (never here: torch tensors made with
        ``torch.frombuffer`` hold the mmap object but no buffer export, so closing the mapping
        would leave them pointing at unmapped memory). Idempotent."""
        if self.closed:
            return
        self.closed = True
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        if self.pinned:
            _cuda_synchronize_all()  # no DMA may be in flight to memory being unpinned
            _cuda_host_unregister(self.tensor.data_ptr())
            self.pinned = False
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if dontneed is not None:
            mm.madvise(dontneed)
        try:
            self.view.release()
        except BufferError:  # something holds a buffer of this very view; the GC releases it
            pass
        self.view = memoryview(bytearray(0))
        self.tensor = torch.empty(0, dtype=torch.uint8)
        del mm  # unmapped by the garbage collector once no tensor refers to it


def _cuda_host_register(ptr: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable: pinned for every device
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


def _cuda_synchronize_all() -> None:
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)


class CudaArena:
    """``nbytes`` of device memory from one allocation on ``device``."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.closed = False
        free, total = device_memory_free(device, nbytes) if nbytes else (0, 0)
        if nbytes > free:
            raise MemoryError(
                f"gpu_bytes={format_bytes(nbytes)} does not fit on {device}: "
                f"{format_bytes(free)} free of {format_bytes(total)}"
            )
        try:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:  # fragmented, or taken since the check: a MemoryError as any tier's
            raise MemoryError(f"gpu_bytes={format_bytes(nbytes)} could not be allocated on {device}: {exc}") from exc

    def close(self) -> None:
        """Free the device memory now, even while views of it remain: they share the storage,
        which then holds no bytes, so none can reach memory the allocator hands out again (a
        kernel on one faults: the store never launches one). Waits for the device first: kernels
        on any stream may still use it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        tensor, self.tensor = self.tensor, torch.empty(0, dtype=torch.uint8, device=self.device)
        if tensor.numel():
            torch.cuda.synchronize(self.device)
            tensor.untyped_storage().resize_(0)  # frees the block; every view shares this storage
