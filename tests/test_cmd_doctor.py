"""``pagemem doctor``: every check against an independent reading of the same fact, the
missing and failing paths (no libaio, no O_DIRECT, a GPU through a stand-in NVML, little host
memory), and bad input as one line with exit status 2."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import sys
import types

import pytest
import torch

from pagemem import machine
from pagemem.commands import doctor as doctor_cmd
from pagemem.commands import probes
from pagemem.tiers.io.base import EngineUnavailable
from pagemem.tiers.pagefile import _open_direct
from tests.conftest import aio_available, exit_status

NAMES = ("cuda", "memlock", "host_memory", "libaio", "direct_io", "io_engine", "disk", "torch")


def doctor(*argv: str) -> int:
    return exit_status("doctor", *argv)


def report_of(tmp_path, *argv: str) -> dict:
    out = tmp_path / "doctor.json"
    assert doctor("--nvme_path", str(tmp_path), "--json", str(out), *argv) == 0
    return json.loads(out.read_text())


def checks_of(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def pagemem_direct_io(directory) -> bool:
    """pagemem's own O_DIRECT test (the page file's), as the oracle for the doctor's."""
    path = os.path.join(directory, "probe")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    fd = _open_direct(path)
    os.unlink(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def test_every_check_is_a_row_and_agrees_with_the_machine(tmp_path, capsys):
    report = report_of(tmp_path)
    text = capsys.readouterr().out
    by = checks_of(report)
    assert set(NAMES) <= set(by) and any(n.startswith("gpu") for n in by)
    for c in report["checks"]:
        assert set(c) == {"name", "status", "finding", "action", "data"}
        assert c["status"] in ("ok", "missing", "warning")
        assert c["status"] == "ok" or c["action"], c  # what to do, wherever something is amiss
        assert c["finding"] in text and c["name"] in text
    assert report["nvme_path"] == str(tmp_path) and report["nvme_path_temporary"] is False
    assert report["can_run"] is True and "pagemem will use:" in text

    cuda = torch.cuda.is_available()
    assert (by["cuda"]["status"] == "ok") == cuda
    assert report["will_use"]["gpu_backend"] == ("cuda" if cuda else "host")
    if not cuda:
        assert "host-memory stand-in" in by["cuda"]["finding"]
    assert (by["libaio"]["status"] == "ok") == aio_available()
    direct = pagemem_direct_io(tmp_path)
    assert (by["direct_io"]["status"] == "ok") == direct and report["will_use"]["direct_io"] == direct
    assert report["will_use"]["io_engine"] == ("aio" if aio_available() and direct else "threads")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert by["memlock"]["data"]["soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert by["memlock"]["data"]["hard"] == (None if hard == resource.RLIM_INFINITY else hard)
    assert by["host_memory"]["data"]["mem_available"] == pytest.approx(machine.meminfo("MemAvailable"), rel=0.2)
    assert by["disk"]["data"]["free_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.05)
    with open("/proc/mounts") as f:
        assert by["disk"]["data"]["filesystem"] in {line.split()[2] for line in f}
    assert by["torch"]["data"]["torch"] == torch.__version__ and by["torch"]["data"]["cpus"] == os.cpu_count()
    assert os.listdir(tmp_path) == ["doctor.json"]  # the O_DIRECT probe left nothing


def test_without_nvme_path_a_temporary_directory_is_checked_and_removed(capsys):
    assert doctor() == 0
    text = capsys.readouterr().out
    line = text.splitlines()[0]
    assert "a temporary directory" in line
    assert not os.path.exists(line.split("page files in ")[1].split(" (")[0])


def test_without_libaio_the_row_is_missing_and_auto_takes_threads(tmp_path, monkeypatch):
    def no_libaio():
        raise EngineUnavailable("cannot load libaio: libaio.so.1: cannot open shared object file")

    monkeypatch.setattr("pagemem.tiers.io.aio._load_libaio", no_libaio)
    report = report_of(tmp_path)
    by = checks_of(report)
    assert by["libaio"]["status"] == "missing" and "libaio.so.1" in by["libaio"]["finding"]
    assert "libaio1" in by["libaio"]["action"]
    assert report["will_use"]["io_engine"] == "threads" and "libaio unavailable" in by["io_engine"]["finding"]


def test_where_o_direct_fails_it_is_a_warning_and_pagemem_still_runs(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *rest, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    report = report_of(tmp_path)
    by = checks_of(report)
    assert by["direct_io"]["status"] == "warning" and "EINVAL" in by["direct_io"]["finding"]
    assert by["direct_io"]["action"]
    assert report["will_use"]["direct_io"] is False and report["will_use"]["io_engine"] == "threads"
    assert os.listdir(tmp_path) == ["doctor.json"]


def fake_nvml(init_error: Exception | None = None) -> types.SimpleNamespace:
    """An NVML with two GPUs: an H100 on PCIe gen5 x16 (idle at gen1), and one whose link NVML
    does not report."""

    class NVMLError(Exception):
        pass

    def unsupported(_h):
        raise NVMLError("Not Supported")

    def init():
        if init_error is not None:
            raise init_error

    table = {0: (b"NVIDIA H100 PCIe", 80 << 30, 5, 16, 1, 16), 1: ("Mystery GPU", 16 << 30, None, None, None, None)}

    def field(i):
        return lambda h: table[h][i] if table[h][i] is not None else unsupported(h)

    return types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=field(0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=table[h][1]),
        nvmlDeviceGetMaxPcieLinkGeneration=field(2), nvmlDeviceGetMaxPcieLinkWidth=field(3),
        nvmlDeviceGetCurrPcieLinkGeneration=field(4), nvmlDeviceGetCurrPcieLinkWidth=field(5))


def test_gpus_through_nvml_name_memory_link_and_its_bandwidth(tmp_path, monkeypatch, capsys):
    gpus, why = probes.nvml_gpus(fake_nvml())
    assert why is None and [g.name for g in gpus] == ["NVIDIA H100 PCIe", "Mystery GPU"]
    h100, other = gpus
    assert (h100.memory_bytes, h100.pcie_gen_max, h100.pcie_width_max, h100.pcie_gen_now) == (80 << 30, 5, 16, 1)
    assert h100.link_bytes_per_s == pytest.approx(16 * 3.938e9)
    assert other.pcie_gen_max is None and other.link_bytes_per_s is None
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())  # the whole command, through the stand-in
    by = checks_of(report_of(tmp_path))
    assert by["gpu0"]["status"] == "ok" and "63.0 GB/s" in by["gpu0"]["finding"]
    assert "gen5 x16" in by["gpu0"]["finding"] and "now gen1 x16" in by["gpu0"]["finding"]
    assert by["gpu0"]["data"]["link_bytes_per_s"] == pytest.approx(63.008e9)
    assert by["gpu1"]["status"] == "warning" and by["gpu1"]["action"]


def test_nvml_that_cannot_start_is_a_missing_row_not_an_error():
    gpus, why = probes.nvml_gpus(fake_nvml(RuntimeError("NVML Shared Library Not Found")))
    assert gpus == [] and "Shared Library Not Found" in why
    (row,) = doctor_cmd.gpu_checks(gpus, why)
    assert row.name == "gpu" and row.status == "missing" and row.action


@pytest.mark.parametrize("gen,width,gb_per_s", [(3, 16, 15.76), (4, 16, 31.504), (5, 8, 31.504), (6, 16, 126.032),
                                                 (4, 4, 7.876), (7, 16, None), (None, 16, None), (4, 0, None)])
def test_pcie_bandwidth_per_generation_and_width(gen, width, gb_per_s):
    got = probes.pcie_bytes_per_s(gen, width)
    assert got == (None if gb_per_s is None else pytest.approx(gb_per_s * 1e9))


def test_cgroup_limits_and_little_host_memory(tmp_path, monkeypatch):
    (tmp_path / "max").write_text(str(3 << 30))
    (tmp_path / "current").write_text(str(1 << 30))
    monkeypatch.setattr(machine, "_CGROUP_LIMITS", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    monkeypatch.setattr(machine, "meminfo", lambda field: 64 << 30)
    row = doctor_cmd.host_memory_check()
    assert row.status == "ok" and row.data["cgroup"] == [{"limit": 3 << 30, "usage": 1 << 30}]
    assert row.data["available"] == 2 << 30 and "cgroup limit 3.0 GiB" in row.finding
    (tmp_path / "current").write_text(str((3 << 30) - (100 << 20)))
    row = doctor_cmd.host_memory_check()
    assert row.status == "warning" and row.data["available"] == 100 << 20 and row.action


def test_memlock_soft_and_hard_limits(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 << 10, resource.RLIM_INFINITY))
    row = doctor_cmd.memlock_check()
    assert row.status == "ok" and row.data == {"soft": 64 << 10, "hard": None}
    assert "RLIMIT_MEMLOCK 64.0 KiB (hard unlimited)" in row.finding


@pytest.mark.parametrize("where", ["missing", "file", "/proc"])
def test_a_bad_nvme_path_is_one_line_and_exit_2(tmp_path, capsys, where):
    path = {"missing": str(tmp_path / "nope"), "file": str(tmp_path / "f"), "/proc": "/proc"}[where]
    (tmp_path / "f").write_text("x")
    assert doctor("--nvme_path", path, "--json", str(tmp_path / "d.json")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "nvme_path" in err and "Traceback" not in err
    assert not (tmp_path / "d.json").exists()


def test_an_unwritable_json_is_one_line_and_exit_2(tmp_path, capsys):
    assert doctor("--nvme_path", str(tmp_path), "--json", str(tmp_path / "no" / "d.json")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("pagemem doctor: ConfigError: json:")


def test_an_unknown_flag_is_a_usage_error(capsys):
    assert doctor("--nvme-path", "/tmp") == 2
    assert "unrecognized arguments" in capsys.readouterr().err
