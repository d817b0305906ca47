"""Measure this machine into a :class:`~pagemem.sched.hardware.HardwareProfile`.

Each figure is the median of ``repeats`` timed runs after a warm-up, on buffers every byte of
which was written before timing:

- ``h2d`` / ``d2h``: pinned host <-> device copies with CUDA; without CUDA the GPU tier is a host
  stand-in, so a host ``memcpy`` (``Tensor.copy_``) of ``copy_bytes`` stands in for both.
- ``host_memory``: that host ``memcpy``, bytes read + written (twice the bytes copied).
- ``nvme_read`` / ``nvme_write``: ``PageStore`` moves of cpu tensors of one 4 MiB page each to the
  nvme tier under ``nvme_path`` and back, at I/O depth 8, O_DIRECT, checksums on, after one
  untimed pass that lays the file out (as ``benchmarks/bench_nvme.py`` does); ``nvme_host``:
  the bytes of those moves per second of the process's CPU time.
- ``cpu_adam``: ``torch.optim.AdamW(fused=True)`` (``foreach`` where fused is not available) on
  one fp32 CPU parameter of ``adam_elements`` elements with its gradient set; the rate is
  elements per second of ``step()``. ``gpu_adam`` is the same on the GPU, or the CPU rate without
  one.
- ``network``: two ``torch.distributed`` gloo processes on loopback; all-gather and
  reduce-scatter of a ``network_bytes`` shard per rank; bus bandwidth ``(W - 1) * shard / time``.
  The profile keeps the lower of the two as both ``nvlink_bytes_per_s`` and
  ``internode_bytes_per_s`` (one machine has one level to measure), with no collective
  latencies: the rate of shards that large already includes them.
- ``flops`` / ``hbm``: a square matmul (bf16 8192 on CUDA, fp32 2048 on CPU) and a device copy
  (bytes read + written per second), for synthetic traces built with the profile's cost model.
- ``window_host_seconds``: without CUDA, what ``window_host`` measures (the engine's executor, a
  layer above this one: ``pagemem profile`` passes ``pagemem.engine.paging.measure.window_host_seconds``);
  0 with CUDA, or when none is given.

Without CUDA the machine counts as one rank per server (``ranks_per_server = 1``), and the
gpu tier's compute, the host copies standing for h2d / d2h, the CPU side of disk I/O and CPU
Adam as one processor (``shared_processor``): they run on the same cores.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import torch

from pagemem.checks import check_int
from pagemem.machine import meminfo
from pagemem.sched.hardware import HOST_STAND_IN_SHARED, HardwareProfile
from pagemem.units import parse_size

PAGE = 4 << 20
DEPTH = 8


def _median_rate(amount: float, run: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    run()  # warm-up
    sync()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        rates.append(amount / (time.perf_counter() - t0))
    return statistics.median(rates)


def _filled(nbytes: int, **kw: Any) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, **kw)
    t.fill_(0x5A)  # touch every page
    return t


def host_copy(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of a host-to-host ``copy_`` of ``nbytes``."""
    src, dst = _filled(nbytes), _filled(nbytes)
    return _median_rate(nbytes, lambda: dst.copy_(src), repeats)


def cuda_copy(nbytes: int, repeats: int = 5, count: int = 1) -> tuple[float, float]:
    """(h2d, d2h) bytes per second between pinned host memory and the current CUDA device;
    each timed run issues ``count`` copies of ``nbytes`` back to back (many, for small sizes, so
    that the timer's and the synchronisation's overhead does not dominate)."""
    host = _filled(nbytes, pin_memory=True)
    dev = _filled(nbytes, device="cuda")
    sync = torch.cuda.synchronize

    def copies(dst: torch.Tensor, src: torch.Tensor) -> None:
        for _ in range(count):
            dst.copy_(src, non_blocking=True)

    h2d = _median_rate(nbytes * count, lambda: copies(dev, host), repeats, sync)
    d2h = _median_rate(nbytes * count, lambda: copies(host, dev), repeats, sync)
    return h2d, d2h


def nvme(path: str, nbytes: int, repeats: int = 3, depth: int = DEPTH, *, page_bytes: int = PAGE,
         engine: str = "auto") -> tuple[float, float, dict[str, Any]]:
    """(read, write) bytes per second of ``PageStore`` moves between the cpu and nvme tiers of
    ``nbytes // page_bytes`` pages (at least one) through I/O engine ``engine``, and the nvme
    tier's description (with its ``page_bytes`` and the ``pages`` moved), and ``host_bytes_per_s``:
    bytes moved per second of this process's CPU time (every thread: checksums, submission,
    completion)."""
    from pagemem import PageStore, StoreConfig

    pages = max(1, nbytes // page_bytes)
    size = pages * page_bytes
    cfg = StoreConfig(page_bytes=page_bytes, cpu_bytes=size, nvme_bytes=size, nvme_path=path, io_depth=depth,
                      io_engine=engine)
    reads, writes = [], []
    with PageStore(cfg) as store:
        tensors = [store.allocate((page_bytes,), torch.uint8, tier="cpu") for _ in range(pages)]
        g = torch.Generator().manual_seed(0)
        for t in tensors:
            t.copy_(torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g))
        store.move(tensors, "nvme").wait()  # lay the file out: steady state from here
        store.move(tensors, "cpu").wait()
        cpu0 = time.process_time()
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.move(tensors, "nvme").wait()
            writes.append(size / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            store.move(tensors, "cpu").wait()
            reads.append(size / (time.perf_counter() - t0))
        cpu = time.process_time() - cpu0
        tier = store.tier("nvme")
        info = {k: v for k, v in tier.describe().items() if k != "files"}
        info["page_bytes"], info["pages"] = tier.page_bytes, pages
    info["samples_read"], info["samples_write"] = reads, writes
    info["host_bytes_per_s"] = 2 * repeats * size / max(cpu, 1e-9)
    return statistics.median(reads), statistics.median(writes), info


def adam(elements: int, device: str = "cpu", repeats: int = 5) -> tuple[float, str]:
    """Elements per second of one AdamW step on ``device``, and the implementation used."""
    p = torch.zeros(elements, dtype=torch.float32, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()  # creates (and so touches) the moments
        impl = "fused"
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
        opt.step()
        impl = "foreach"
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    steps = 5

    def run() -> None:
        for _ in range(steps):
            opt.step()

    return _median_rate(elements * steps, run, repeats, sync), impl


def matmul_flops(repeats: int = 5) -> float:
    """FLOP/s of a square matmul: bf16 8192 on CUDA, fp32 2048 on the CPU."""
    cuda = torch.cuda.is_available()
    n = 8192 if cuda else 2048
    kw = {"device": "cuda", "dtype": torch.bfloat16} if cuda else {"dtype": torch.float32}
    a, b = torch.randn(n, n, **kw), torch.randn(n, n, **kw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return _median_rate(2 * n**3, lambda: torch.mm(a, b), repeats, sync)


def device_memory(nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by a copy in device memory (host memory without CUDA)."""
    cuda = torch.cuda.is_available()
    kw = {"device": "cuda"} if cuda else {}
    src, dst = _filled(nbytes, **kw), _filled(nbytes, **kw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return _median_rate(2 * nbytes, lambda: dst.copy_(src), repeats, sync)


# ---------------------------------------------------------------------------------------- network

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _net_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        n = nbytes // 4
        shard = torch.full((n,), float(rank + 1))
        gathered = torch.zeros(world * n)
        full = torch.full((world * n,), 1.0)
        part = torch.zeros(n)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        result = {}
        for name, op in (("all_gather", lambda: gather(gathered, shard)),
                         ("reduce_scatter", lambda: scatter(part, full))):
            op()  # warm-up: connections, buffers
            rates = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                rates.append((world - 1) * n * 4 / (time.perf_counter() - t0))
            result[name] = statistics.median(rates)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def network(nbytes: int, repeats: int = 5, world: int = 2, timeout: float = 300.0) -> dict[str, float]:
    """Bus bandwidth (bytes/s) of gloo all-gather and reduce-scatter between ``world`` local
    processes over loopback, ``nbytes`` per rank. The processes are fresh interpreters
    (``python -m pagemem.commands.measure``), so callers need no ``__main__`` guard."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="pagemem-net-") as d:
        out = os.path.join(d, "result.json")
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "pagemem.commands.measure", "net-worker", str(rank),
                                   str(world), str(port), str(nbytes), str(repeats), out], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world)]
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError("network measurement failed:\n" + "\n".join(o[-2000:] for o in outputs))
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------- machine

def machine_facts(nvme_path: str | None = None) -> dict[str, Any]:
    """What this machine is: CPU, cores, memory, OS, torch, CUDA device, the disk under ``nvme_path``."""
    facts: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": _mem_total(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if nvme_path:
        facts["disk"] = disk_info(nvme_path)
    return facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    return meminfo("MemTotal")


def disk_info(path: str) -> dict[str, Any]:
    """The device, mount point and filesystem type holding ``path`` (from ``/proc/mounts``), and
    the device's model and whether it is rotational where ``/sys/block`` says."""
    path = os.path.realpath(path)
    best = ("", "", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[1]):
                    best = (dev, mnt, fs)
    except OSError:
        pass
    info: dict[str, Any] = {"device": best[0], "mount": best[1], "filesystem": best[2]}
    name = os.path.basename(best[0])
    for key, rel in (("rotational", "queue/rotational"), ("model", "device/model")):
        try:
            with open(f"/sys/block/{name}/{rel}") as f:
                info[key] = f.read().strip()
        except OSError:
            pass
    return info


# ---------------------------------------------------------------------------------------- all

def measure(nvme_path: str | None = None, *, name: str = "measured", nvme_bytes: int | str = "1GiB",
            copy_bytes: int | str = "256MiB", adam_elements: int = 16_000_000,
            network_bytes: int | str = "64MiB", repeats: int = 3,
            log: Callable[[str], None] | None = None,
            window_host: Callable[[], tuple[float, dict[str, Any]]] | None = None) -> HardwareProfile:
    """Measure this machine (see the module docs); ``nvme_path`` is a directory on the drive to
    test (default: a temporary directory). Takes a minute or two. ``window_host``: measures the
    executor's host seconds per moved window, and says how (used without CUDA)."""
    say = log or (lambda _msg: None)
    check_int("adam_elements", adam_elements, 1)
    check_int("repeats", repeats, 1)
    nvme_n = parse_size(nvme_bytes, "nvme_bytes")
    copy_n = parse_size(copy_bytes, "copy_bytes")
    net_n = parse_size(network_bytes, "network_bytes")
    cuda = torch.cuda.is_available()
    how: dict[str, Any] = {}

    host = host_copy(copy_n, repeats)
    how["host_memory"] = f"host memcpy (Tensor.copy_) of {copy_n} bytes, bytes read + written"
    if cuda:
        h2d, d2h = cuda_copy(copy_n, repeats)
        how["h2d/d2h"] = f"pinned host <-> {torch.cuda.get_device_name(0)} copies of {copy_n} bytes"
    else:
        h2d = d2h = host
        how["h2d/d2h"] = f"no CUDA: host memcpy (Tensor.copy_) of {copy_n} bytes stands in for both"
    say(f"h2d {h2d / 1e9:.2f} GB/s, d2h {d2h / 1e9:.2f} GB/s, host memory {2 * host / 1e9:.2f} GB/s")

    tmp = None
    if nvme_path is None:
        nvme_path = tmp = tempfile.mkdtemp(prefix="pagemem-profile-")
    try:
        read, write, info = nvme(nvme_path, nvme_n, repeats)
        disk = machine_facts(nvme_path).get("disk", {})
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    how["nvme"] = (f"PageStore cpu <-> nvme moves of {nvme_n} bytes in 4 MiB pages, depth {DEPTH}, O_DIRECT, "
                  f"checksums on, under {nvme_path}")
    how["nvme_backend"] = info
    how["nvme_host"] = "the same moves: bytes read and written per second of this process's CPU time"
    say(f"nvme read {read / 1e9:.2f} GB/s, write {write / 1e9:.2f} GB/s, "
        f"{info['host_bytes_per_s'] / 1e9:.2f} GB per CPU second")

    cpu_adam, impl = adam(adam_elements, "cpu", repeats)
    how["cpu_adam"] = f"torch.optim.AdamW({impl}) step on {adam_elements} fp32 elements, {torch.get_num_threads()} threads"
    if cuda:
        gpu_adam, gimpl = adam(adam_elements, "cuda", repeats)
        how["gpu_adam"] = f"torch.optim.AdamW({gimpl}) step on {adam_elements} fp32 elements on CUDA"
    else:
        gpu_adam = cpu_adam
        how["gpu_adam"] = "no CUDA: the CPU rate (the GPU tier is host memory)"
    say(f"adam cpu {cpu_adam / 1e9:.2f} G el/s ({impl}), gpu {gpu_adam / 1e9:.2f} G el/s")

    net = network(net_n, max(repeats, 3))
    how["network"] = (f"gloo all_gather / reduce_scatter, 2 processes on loopback, {net_n} bytes per rank: "
                      f"all_gather {net['all_gather'] / 1e9:.3f} GB/s, reduce_scatter "
                      f"{net['reduce_scatter'] / 1e9:.3f} GB/s bus bandwidth; the lower is kept, for NVLink and "
                      f"the NICs alike, with no latencies (included in that rate)")
    bus = min(net["all_gather"], net["reduce_scatter"])
    say(f"network all_gather {net['all_gather'] / 1e9:.2f} GB/s, reduce_scatter {net['reduce_scatter'] / 1e9:.2f} GB/s")

    flops = matmul_flops(repeats)
    hbm = device_memory(copy_n, repeats)
    how["flops"] = "bf16 8192^3 matmul on CUDA" if cuda else "fp32 2048^3 matmul on the CPU (no GPU)"
    how["hbm"] = f"device copy of {copy_n} bytes, bytes read + written" if cuda else \
        f"host copy of {copy_n} bytes, bytes read + written (no GPU)"
    say(f"matmul {flops / 1e12:.3f} TFLOP/s, memory {hbm / 1e9:.2f} GB/s")

    window = 0.0
    if window_host is not None and not cuda:
        window, how["window_host"] = window_host()
        say(f"executor host time {window * 1e3:.3f} ms per moved window")
    else:
        how["window_host"] = "0: the host queues the executor's work ahead of the GPU" if cuda else "not measured"

    facts = machine_facts()
    facts["disk"] = disk
    if not cuda:
        how["shared_processor"] = ("no CUDA: the gpu tier's compute, the copies that stand for PCIe, the CPU side "
                                   "of disk I/O and CPU Adam share this machine's cores, one task at a time")
    facts["method"] = how
    facts["repeats"] = repeats
    return HardwareProfile(
        name=name, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        nvlink_bytes_per_s=bus, internode_bytes_per_s=bus, collective_latency_s=0.0, internode_latency_s=0.0,
        nvme_read_bytes_per_s=read, nvme_write_bytes_per_s=write,
        cpu_adam_elements_per_s=cpu_adam, gpu_adam_elements_per_s=gpu_adam,
        flops_per_s=flops, hbm_bytes_per_s=hbm, host_memory_bytes_per_s=2 * host,
        nvme_host_bytes_per_s=info["host_bytes_per_s"], window_host_seconds=window,
        ranks_per_server=torch.cuda.device_count() if cuda else 1,
        shared_processor=() if cuda else HOST_STAND_IN_SHARED, facts=facts)


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "net-worker":
    _net_worker(*(int(a) for a in sys.argv[2:7]), sys.argv[7])
