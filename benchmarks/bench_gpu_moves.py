"""GPU<->CPU page moves against a plain pinned ``copy_`` of the same bytes (needs CUDA).

The store moves tensors between its ``gpu`` tier (one device allocation) and its pinned ``cpu``
tier, page by page on its H2D / D2H streams; the anchor, measured in the same run, is one
``copy_`` between a pinned host tensor and a device tensor of the same total size. Reports each
direction's GB/s, the ratio, and the PCIe link's theoretical bandwidth read through NVML (the
physical limit). Goal: >= 0.9 of the anchor.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import table, write_json

import torch

from pagemem import PageStore, StoreConfig
from pagemem.units import parse_size


def anchor(size: int, repeats: int) -> tuple[float, float]:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.random_()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d, d2h = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(size / (time.perf_counter() - t0) / 1e9)
    return statistics.median(h2d[1:]), statistics.median(d2h[1:])


def pagemem_moves(size: int, tensor_bytes: int, repeats: int) -> tuple[float, float, dict]:
    page = 4 << 20
    cfg = StoreConfig(page_bytes=page, gpu_bytes=size + 2 * page, cpu_bytes=size + 2 * page)
    with PageStore(cfg) as store:
        assert store.cuda, "the gpu tier is not CUDA memory"
        ts = [store.allocate((tensor_bytes,), torch.uint8, tier="cpu") for _ in range(size // tensor_bytes)]
        src = torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8)
        for t in ts:
            t.copy_(src)
        h2d, d2h = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            store.move(ts, "gpu").wait()
            h2d.append(size / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            store.move(ts, "cpu").wait()
            d2h.append(size / (time.perf_counter() - t0) / 1e9)
        assert torch.equal(ts[0].to_torch(), src)
        backend = {k: v.backend for k, v in store.stats().tiers.items()}
    return statistics.median(h2d[1:]), statistics.median(d2h[1:]), backend


# per-lane transfer rate (GT/s) and line-code efficiency of each PCIe generation
PCIE = {1: (2.5, 8 / 10), 2: (5.0, 8 / 10), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130), 5: (32.0, 128 / 130),
        6: (64.0, 242 / 256)}


def link_bandwidth(device: int = 0) -> dict:
    """The PCIe link's theoretical bandwidth per direction (GB/s) from NVML: the generation and
    width the link runs at under load (``Max``: NVML's current values drop while the GPU idles),
    and the current ones for the record. Fields NVML cannot read (a VM, say) are None."""
    out: dict = {"gen": None, "width": None, "gbps": None, "current_gen": None, "current_width": None}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(device)
            for key, fn in (("gen", "nvmlDeviceGetMaxPcieLinkGeneration"), ("width", "nvmlDeviceGetMaxPcieLinkWidth"),
                            ("current_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                            ("current_width", "nvmlDeviceGetCurrPcieLinkWidth")):
                try:
                    out[key] = int(getattr(pynvml, fn)(h))
                except pynvml.NVMLError as e:
                    out[f"{key}_error"] = str(e)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no NVML library, no driver: the anchor still stands
        out["error"] = f"{type(e).__name__}: {e}"
    if out["gen"] in PCIE and out["width"]:
        rate, code = PCIE[out["gen"]]
        out["gbps"] = rate * out["width"] * code / 8
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: no GPU here")
    size = parse_size(args.size)
    rows, out = [], []
    a_h2d, a_d2h = anchor(size, args.repeats)
    link = link_bandwidth(torch.cuda.current_device())
    limit = link["gbps"]
    for tensor_mib in (4, 64):
        h2d, d2h, backend = pagemem_moves(size, tensor_mib << 20, args.repeats)
        for label, ours, base in (("CPU->GPU", h2d, a_h2d), ("GPU->CPU", d2h, a_d2h)):
            rows.append([label, f"{tensor_mib} MiB tensors", f"{base:.2f}", f"{ours:.2f}", f"{ours / base:.2f}",
                         f"{limit:.1f}" if limit else "n/a", f"{ours / limit:.0%}" if limit else "n/a"])
            out.append({"direction": label, "tensor_mib": tensor_mib, "anchor_gbps": base, "pagemem_gbps": ours,
                        "ratio": ours / base, "link_gbps": limit})
    print(table(["direction", "tensors", "pinned copy_ GB/s", "pagemem GB/s", "ratio", "link GB/s",
                 "pagemem of link"], rows,
                f"GPU<->CPU moves, {args.size}, 4 MiB pages, median of {args.repeats}; link: PCIe gen "
                f"{link['gen']} x{link['width']} per direction, theoretical (NVML)"))
    goal = all(r["ratio"] >= 0.9 for r in out)
    print(f"\ngoal (>= 0.9 of a pinned copy_): {'met' if goal else 'NOT met'}")
    print("wrote", write_json("bench_gpu_moves", {"size": size, "results": out, "backend": backend, "link": link,
                                                  "goal_met": goal}))


if __name__ == "__main__":
    main()
