"""``pagemem doctor``: what this machine offers and what pagemem will use.

One row per check (``ok``, ``missing`` or ``warning``), with the finding and, where something is
missing or amiss, what to do: CUDA and each GPU (NVML: name, memory, PCIe generation and width,
the link's theoretical bandwidth), locked-memory and host-memory limits, Linux AIO, O_DIRECT in
``--nvme_path`` (a block really written and read back), that directory's filesystem and free
space, torch and the CPUs; then what pagemem takes with its defaults (``gpu_backend`` and
``io_engine`` "auto"). ``--json FILE`` writes the same. Missing optional parts are warnings: the
exit status is 0 whenever pagemem can run, and 2 with one line for an ``--nvme_path`` where page
files cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagemem.commands import probes
from pagemem.errors import ConfigError
from pagemem.machine import (
    cgroup_memory,
    disk_free,
    host_memory_available,
    meminfo,
    unwritable,
)
from pagemem.units import format_bytes

OK, MISSING, WARNING = "ok", "missing", "warning"
LOW_HOST_MEMORY = 1 << 30
LOW_DISK = 1 << 30


@dataclass(frozen=True)
class Check:
    """One row: what was checked, how it stands, what was found, what to do about it."""

    name: str
    status: str
    finding: str
    action: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvme_path", default=None,
                        help="directory for the nvme tier's page files to check (default: a temporary directory)")
    parser.add_argument("--json", metavar="FILE", help="also write the checks as JSON")


def run(args: argparse.Namespace) -> int:
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ConfigError(f"json: the directory of {args.json!r} does not exist")
    if args.nvme_path is not None:
        why = unwritable(args.nvme_path)
        if why is not None:
            raise ConfigError(f"nvme_path: page files cannot be made in {args.nvme_path!r}: {why}")
        report = diagnose(args.nvme_path)
    else:
        tmp = tempfile.mkdtemp(prefix="pagemem-doctor-")
        try:
            report = diagnose(tmp, temporary=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(render(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as exc:
            raise ConfigError(f"json: cannot write {args.json!r} ({exc.strerror})") from None
        print(f"wrote {args.json}")
    return 0


def diagnose(nvme_path: str, temporary: bool = False) -> dict[str, Any]:
    """Every check on this machine with page files in ``nvme_path`` (``temporary``: one made for
    the check), and what pagemem will use: ``{"nvme_path", "nvme_path_temporary", "checks":
    [Check as dict], "will_use": {config field: value}, "can_run"}``."""
    gpus, nvml_why = probes.nvml_gpus()
    aio_why = probes.aio_unavailable()
    direct_why = probes.o_direct_fails(nvme_path)
    engine, engine_reason = _auto_engine(direct_why is None)
    checks = [cuda_check(), *gpu_checks(gpus, nvml_why), memlock_check(), host_memory_check(),
              aio_check(aio_why), direct_io_check(nvme_path, direct_why),
              Check("io_engine", OK, f"io_engine 'auto' takes {engine}: {engine_reason}",
                    data={"io_engine": engine, "reason": engine_reason}),
              disk_check(nvme_path), torch_check()]
    cuda = torch.cuda.is_available()
    will_use = {"gpu_backend": "cuda" if cuda else "host", "pin_cpu": cuda, "io_engine": engine,
                "direct_io": direct_why is None, "checksums": "xxh3_64"}
    return {"nvme_path": os.path.abspath(nvme_path), "nvme_path_temporary": temporary,
            "checks": [asdict(c) for c in checks],
            "will_use": will_use, "can_run": True}


def _auto_engine(direct: bool) -> tuple[str, str]:
    """The engine ``io_engine='auto'`` builds here, and why (pagemem's own choice)."""
    from pagemem.tiers.io.base import make_engine

    engine, reason = make_engine("auto", 1, direct)
    engine.close()
    return engine.name, reason


def cuda_check() -> Check:
    built = torch.version.cuda
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return Check("cuda", OK, f"torch {torch.__version__} with CUDA {built}: {n} device(s); the gpu tier "
                     f"is device memory on cuda:0 ({torch.cuda.get_device_name(0)})",
                     data={"cuda": built, "devices": n})
    why = "a CPU-only build of torch" if built is None else f"torch built for CUDA {built}, but no usable device/driver"
    return Check("cuda", MISSING, f"no CUDA ({why}): the gpu tier will be a host-memory stand-in "
                 "(gpu_backend 'host'), and the cpu arena is not pinned",
                 "pagemem runs as it is; to use a GPU, install the NVIDIA driver and a CUDA build of torch",
                 data={"cuda": built, "devices": 0})


def gpu_checks(gpus: list[probes.Gpu], why: str | None) -> list[Check]:
    """A row per GPU NVML sees, or one row saying why it sees none."""
    if not gpus:
        return [Check("gpu", MISSING, f"no GPU through NVML: {why or 'it lists no device'}",
                      "pagemem needs none; for GPU training install the NVIDIA driver (NVML comes with it)")]
    rows = []
    for g in gpus:
        link = g.link_bytes_per_s
        now = f"gen{g.pcie_gen_now} x{g.pcie_width_now}" if g.pcie_gen_now else "unknown"
        text = (f"{g.name}, {format_bytes(g.memory_bytes) if g.memory_bytes else 'memory unknown'}, "
                f"PCIe gen{g.pcie_gen_max} x{g.pcie_width_max} (now {now}; idle links run slower): "
                + (f"{link / 1e9:.1f} GB/s per direction, theoretical" if link else "link bandwidth unknown"))
        data = {**asdict(g), "link_bytes_per_s": link}
        if link is None:
            rows.append(Check(f"gpu{g.index}", WARNING, text, "NVML cannot tell this GPU's PCIe link; "
                              "measure it with `pagemem io-tune`", data))
        else:
            rows.append(Check(f"gpu{g.index}", OK, text, data=data))
    return rows


def memlock_check() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def text(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else format_bytes(v)

    return Check("memlock", OK, f"RLIMIT_MEMLOCK {text(soft)} (hard {text(hard)}); pagemem pins host pages with "
                 "cudaHostRegister, which the NVIDIA driver does not count against it (and a failed pin falls "
                 "back to pageable memory with a warning)",
                 data={"soft": None if soft == resource.RLIM_INFINITY else soft,
                       "hard": None if hard == resource.RLIM_INFINITY else hard})


def host_memory_check() -> Check:
    total, available = meminfo("MemTotal"), meminfo("MemAvailable")
    groups = cgroup_memory()
    room = host_memory_available()
    cg = "; ".join(f"cgroup limit {format_bytes(lim)}, {format_bytes(use)} used" for lim, use in groups) \
        or "no cgroup memory limit"
    data = {"mem_total": total, "mem_available": available,
            "cgroup": [{"limit": lim, "usage": use} for lim, use in groups], "available": room}
    if room is None:
        return Check("host_memory", WARNING, "host memory cannot be read (no /proc/meminfo)",
                     "budgets cannot be checked up front; size cpu_bytes by hand", data)
    text = (f"MemTotal {format_bytes(total or 0)}, MemAvailable {format_bytes(available or 0)}, {cg}: "
            f"{format_bytes(room)} for the cpu arena, staging pages and page tables (pinned with CUDA)")
    if room < LOW_HOST_MEMORY:
        return Check("host_memory", WARNING, text, f"less than {format_bytes(LOW_HOST_MEMORY)} is available: "
                     "free memory, or keep cpu_bytes small", data)
    return Check("host_memory", OK, text, data=data)


def aio_check(why: str | None) -> Check:
    if why is None:
        return Check("libaio", OK, "libaio loads and pagemem's aio engine starts (io_setup)")
    return Check("libaio", MISSING, f"the aio engine cannot start: {why}",
                 "install the system libaio (apt-get install libaio1, libaio1t64 on Ubuntu 24.04); "
                 "until then pagemem uses its threads engine (pread/pwrite on a thread pool)")


def direct_io_check(directory: str, why: str | None) -> Check:
    if why is None:
        return Check("direct_io", OK, f"a {probes.BLOCK}-byte block written and read back with O_DIRECT in "
                     f"{directory}", data={"direct_io": True})
    return Check("direct_io", WARNING, f"O_DIRECT does not work in {directory}: {why}",
                 "page files there go through the page cache and io_engine 'auto' takes threads; "
                 "put nvme_path on a local disk filesystem (ext4, xfs)", data={"direct_io": False, "why": why})


def disk_check(directory: str) -> Check:
    from pagemem.commands.measure import disk_info

    info = disk_info(directory)
    free, _ = disk_free(directory)
    data = {**info, "free_bytes": free}
    text = (f"{directory} is on {info.get('filesystem') or 'an unknown filesystem'} "
            f"({info.get('device') or '?'} at {info.get('mount') or '?'}), {format_bytes(free)} free")
    if info.get("rotational") == "1":
        text += "; the kernel calls it rotational"
    if free < LOW_DISK:
        return Check("disk", WARNING, text, f"less than {format_bytes(LOW_DISK)} free: nvme_bytes must fit; "
                     "free space or choose another nvme_path", data)
    return Check("disk", OK, text, data=data)


def torch_check() -> Check:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    return Check("torch", OK, f"torch {torch.__version__}, {cpus} CPUs ({usable} usable by this process), "
                 f"{torch.get_num_threads()} torch threads",
                 data={"torch": torch.__version__, "cpus": cpus, "usable_cpus": usable,
                       "torch_threads": torch.get_num_threads()})


def render(report: dict[str, Any]) -> str:
    """The report as a table, each non-ok row followed by what to do, and what pagemem will use."""
    checks = report["checks"]
    width = max(len(c["name"]) for c in checks)
    temporary = " (a temporary directory; give --nvme_path to check yours)" if report["nvme_path_temporary"] else ""
    lines = [f"pagemem doctor: page files in {report['nvme_path']}{temporary}", f"  {'check':<{width}}  {'status':<7}  finding"]
    for c in checks:
        lines.append(f"  {c['name']:<{width}}  {c['status']:<7}  {c['finding']}")
        if c["action"]:
            lines.append(f"  {'':<{width}}  {'':<7}  -> {c['action']}")
    use = report["will_use"]
    lines.append("pagemem will use: " + ", ".join(f"{k}={v}" for k, v in use.items()))
    missing = [c["name"] for c in checks if c["status"] != OK]
    lines.append("pagemem can run here" + (f" (not ok: {', '.join(missing)})" if missing else ""))
    return "\n".join(lines)
