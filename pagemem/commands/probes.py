"""What this machine offers pagemem, one probe each: the GPUs through NVML and their PCIe links'
theoretical bandwidth, Linux AIO, O_DIRECT in a directory. A probe reports what is missing and
why; it never raises for it. ``pagemem doctor`` turns the answers into rows, ``pagemem io-tune``
asks them which I/O engines can run."""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Any

PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.877e9}
"""Bytes per second per lane and direction by PCIe generation, after line encoding (8b/10b up
to gen2, 128b/130b from gen3; gen6 taken as twice gen5): approximate, protocol overhead aside."""

BLOCK = 4096
"""The block the O_DIRECT probe writes and reads back (pagemem's alignment)."""


def pcie_bytes_per_s(gen: int | None, width: int | None) -> float | None:
    """A PCIe link's theoretical bandwidth per direction, or None for an unknown generation or
    width."""
    if gen not in PCIE_LANE_BYTES_PER_S or not isinstance(width, int) or width <= 0:
        return None
    return PCIE_LANE_BYTES_PER_S[gen] * width


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it; a field NVML cannot tell is None."""

    index: int
    name: str
    memory_bytes: int | None
    pcie_gen_max: int | None
    """The most the GPU and this system's slot allow together."""
    pcie_width_max: int | None
    pcie_gen_now: int | None
    """The link now: drivers slow an idle link down, so this may be below the max."""
    pcie_width_now: int | None

    @property
    def link_bytes_per_s(self) -> float | None:
        """The link's theoretical bandwidth per direction at its maximum generation and width."""
        return pcie_bytes_per_s(self.pcie_gen_max, self.pcie_width_max)


def nvml_gpus(nvml: Any = None) -> tuple[list[Gpu], str | None]:
    """The GPUs NVML sees, and None; or no GPUs and why NVML could not tell (not installed, no
    driver). ``nvml``: the ``pynvml`` module, or a stand-in with its functions."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return [], f"pynvml (nvidia-ml-py) cannot be imported: {exc}"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no driver here
        return [], f"NVML cannot start ({type(exc).__name__}: {exc})"
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _ask(nvml.nvmlDeviceGetName, h)
            memory = _ask(nvml.nvmlDeviceGetMemoryInfo, h)
            gpus.append(Gpu(
                index=i, name=name.decode() if isinstance(name, bytes) else str(name or "unknown"),
                memory_bytes=getattr(memory, "total", None),
                pcie_gen_max=_ask(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width_max=_ask(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                pcie_gen_now=_ask(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_width_now=_ask(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)))
        return gpus, None
    except Exception as exc:
        return [], f"NVML failed listing the GPUs ({type(exc).__name__}: {exc})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _ask(fn: Any, handle: Any) -> Any:
    """``fn(handle)``, or None where NVML does not support it on this GPU."""
    try:
        return fn(handle)
    except Exception:
        return None


def aio_unavailable() -> str | None:
    """Why pagemem's Linux AIO engine cannot start here (libaio does not load, ``io_setup``
    fails), or None when it starts."""
    from pagemem.tiers.io.aio import AioEngine
    from pagemem.tiers.io.base import EngineUnavailable

    try:
        AioEngine(1).close()
    except EngineUnavailable as exc:
        return str(exc)
    return None


def o_direct_fails(directory: str) -> str | None:
    """Why O_DIRECT does not work in ``directory``, or None when it does: a new file is opened
    there with O_DIRECT, one aligned block is written, read back and compared, and the file is
    removed."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this platform has no O_DIRECT"
    path = os.path.join(directory, f".pagemem-direct-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    wbuf, rbuf = mmap.mmap(-1, BLOCK), mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    try:
        wbuf.write(bytes(range(256)) * (BLOCK // 256))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o600)
        except OSError as exc:
            return f"open with O_DIRECT fails: {_errname(exc)}"
        try:
            written = os.pwritev(fd, [wbuf], 0)
            if written != BLOCK:
                return f"an O_DIRECT write of {BLOCK} bytes wrote {written}"
            got = os.preadv(fd, [rbuf], 0)
            if got != BLOCK or rbuf[:] != wbuf[:]:
                return f"an O_DIRECT read of {BLOCK} bytes returned {got} bytes that differ from those written"
        except OSError as exc:
            return f"an aligned O_DIRECT write and read of {BLOCK} bytes fails: {_errname(exc)}"
        finally:
            os.close(fd)
    finally:
        wbuf.close()
        rbuf.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


def _errname(exc: OSError) -> str:
    code = exc.errno or errno.EIO
    return f"{errno.errorcode.get(code, 'E?')} ({os.strerror(code)})"
