"""NVMe tier bandwidth: CPU->NVMe and NVMe->CPU page moves next to fio in the same run.

For each queue depth (1, 4, 8, 32) the store moves a set of cpu-tier tensors to the nvme tier
and back (4 MiB pages, one request per page: ``tiers/nvme.py``'s ``MAX_REQUEST_BYTES``; checksums on, O_DIRECT), with the AIO engine and
with the thread-pool engine. fio runs the same traffic on the same directory: libaio, direct=1,
the same block size, depth and bytes. A third anchor is a bare loop over pagemem's AIO engine
(no store, no checksums) on a file in the same directory: on this project's virtual machines fio
reads well below what such a loop gets, so the loop shows what the store itself costs. All measure
steady state: the file has been written once
before the timed passes (a fresh preallocated file pays for converting unwritten extents on its
first write). Runs alternate (fio, aio, threads) and repeat; the table shows medians and each
engine's ratio to fio (the median over repeats of each run's ratio to the fio run beside it).
Goal: >= 0.9 of fio at depth >= 8, both directions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from common import table, write_json

import torch

from pagemem import PageStore, StoreConfig
from pagemem.units import format_bytes, parse_size

DEPTHS = (1, 4, 8, 32)


def fio(directory: str, rw: str, bs: int, depth: int, size: int) -> float:
    """fio's bandwidth in GB/s for one sequential job on the file ``fio.pages`` in ``directory``."""
    cmd = ["fio", "--name=anchor", f"--directory={directory}", "--filename=fio.pages", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={depth}", "--ioengine=libaio", "--direct=1", f"--size={size}",
           "--numjobs=1", "--output-format=json", "--fallocate=native"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def fio_run(directory: str, depth: int, size: int, page: int) -> tuple[float, float]:
    fio(directory, "write", page, depth, size)  # lay the file out: steady state from here
    write = fio(directory, "write", page, depth, size)
    read = fio(directory, "read", page, depth, size)
    os.unlink(os.path.join(directory, "fio.pages"))
    return write, read


def raw_aio_run(directory: str, depth: int, source: torch.Tensor, page: int) -> tuple[float, float]:
    """A bare submit/complete loop over the AIO engine: write then read ``source`` in pages."""
    import mmap
    import threading

    from pagemem.tiers.io.aio import AioEngine

    size = source.numel()
    path = os.path.join(directory, "raw.pages")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, size)
    os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    torch.frombuffer(buf, dtype=torch.uint8).copy_(source)
    view = memoryview(buf)
    engine = AioEngine(depth)

    def one_pass(write: bool) -> float:
        left, done_all, lock = [size // page], threading.Event(), threading.Lock()

        def done(n: int) -> None:
            assert n == page, n
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done_all.set()

        t0 = time.perf_counter()
        for i in range(size // page):
            engine.submit(write, fd, i * page, view[i * page:(i + 1) * page], done)
        done_all.wait()
        return size / (time.perf_counter() - t0) / 1e9

    try:
        one_pass(True)  # lay the file out
        return one_pass(True), one_pass(False)
    finally:
        engine.close()
        view.release()
        os.close(fd)
        os.unlink(path)


def pagemem_run(directory: str, engine: str, depth: int, source: torch.Tensor, page: int) -> tuple[float, float, dict]:
    """Move ``source``'s bytes, as cpu tensors of one page each, to nvme and back; GB/s each way."""
    size = source.numel()
    pages = size // page
    cfg = StoreConfig(page_bytes=page, cpu_bytes=size, nvme_bytes=size, nvme_path=directory,
                      io_engine=engine, io_depth=depth)
    with PageStore(cfg) as store:
        tensors = [store.allocate((page,), torch.uint8, tier="cpu") for _ in range(pages)]
        for i, t in enumerate(tensors):  # touch every byte before timing
            t.copy_(source[i * page:(i + 1) * page])
        store.move(tensors, "nvme").wait()  # lay the file out: steady state from here
        store.move(tensors, "cpu").wait()
        t0 = time.perf_counter()
        store.move(tensors, "nvme").wait()
        write = size / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        store.move(tensors, "cpu").wait()
        read = size / (time.perf_counter() - t0) / 1e9
        info = store.tier("nvme").describe()
    return write, read, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the drive to test (default: a temp dir)")
    parser.add_argument("--size", default="1GiB", help="bytes per run (default 1GiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    args = parser.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (make installs it where it can: apt-get install fio)")
    size, page = parse_size(args.size), 4 << 20
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    depths = [int(d) for d in args.depths.split(",")]
    directory = args.dir or tempfile.mkdtemp(prefix="pagemem-bench-nvme-")
    runs: dict = {}
    info = {}
    try:
        for rep in range(args.repeats):
            for depth in depths:
                r = runs.setdefault(depth, {f"{k}_{d}": [] for k in ("fio", "raw", "aio", "threads")
                                            for d in ("write", "read")})
                w, rd = fio_run(directory, depth, size, page)
                r["fio_write"].append(w)
                r["fio_read"].append(rd)
                w, rd = raw_aio_run(directory, depth, source, page)
                r["raw_write"].append(w)
                r["raw_read"].append(rd)
                for engine in ("aio", "threads"):
                    w, rd, info[engine] = pagemem_run(directory, engine, depth, source, page)
                    r[f"{engine}_write"].append(w)
                    r[f"{engine}_read"].append(rd)
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    rows, out = [], []
    for depth in depths:
        r = runs[depth]
        m = {k: statistics.median(v) for k, v in r.items()}
        for direction, label in (("write", "CPU->NVMe"), ("read", "NVMe->CPU")):
            fio_bw = m[f"fio_{direction}"]
            # ratio of each repeat to the fio run just before it, then the median: robust to drift
            ratio = {e: statistics.median(a / f for a, f in zip(r[f"{e}_{direction}"], r[f"fio_{direction}"]))
                     for e in ("aio", "threads")}
            vs_raw = statistics.median(a / f for a, f in zip(r[f"aio_{direction}"], r[f"raw_{direction}"]))
            aio, thr, raw = m[f"aio_{direction}"], m[f"threads_{direction}"], m[f"raw_{direction}"]
            rows.append([label, depth, f"{fio_bw:.2f}", f"{raw:.2f}", f"{aio:.2f}", f"{ratio['aio']:.2f}",
                         f"{vs_raw:.2f}", f"{thr:.2f}", f"{ratio['threads']:.2f}"])
            out.append({"direction": label, "depth": depth, "fio_gbps": fio_bw, "raw_aio_gbps": raw,
                        "aio_gbps": aio, "aio_ratio": ratio["aio"], "aio_vs_raw": vs_raw,
                        "threads_gbps": thr, "threads_ratio": ratio["threads"],
                        "samples": {k: v for k, v in r.items() if k.endswith(direction)}})
    print()
    print(table(["direction", "depth", "fio GB/s", "raw loop GB/s", "store aio GB/s", "aio/fio", "aio/raw",
                 "store threads GB/s", "threads/fio"], rows,
                f"pagemem nvme tier vs fio: {format_bytes(size)} per run, 4 MiB requests, O_DIRECT, "
                f"checksums on, median of {args.repeats}"))
    goal = all(r["aio_ratio"] >= 0.9 for r in out if r["depth"] >= 8)
    print(f"\ngoal (aio >= 0.9 x fio at depth >= 8, both directions): {'met' if goal else 'NOT met'}")
    path = write_json("bench_nvme", {"size": size, "page_bytes": page, "repeats": args.repeats,
                                     "backend": info, "results": out, "goal_met": goal})
    print("wrote", path)


if __name__ == "__main__":
    main()
