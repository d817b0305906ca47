"""``pagemem io-tune PATH``: sweep page size, queue depth and I/O engine on directory PATH with
real reads and writes through pagemem's nvme tier, print MB/s per setting, and write the best as
a ``[store]`` config (``--out``) that ``pagemem train --config`` takes; ``--json`` keeps every
measurement. The sweep and the rule that picks are in :mod:`pagemem.commands.io_sweep`: highest
``min(read, write)``, and within 5% of it the smallest page, then depth. With CUDA it also sweeps
pinned host <-> GPU copies over transfer sizes and takes the page size where their bandwidth
levels off (ANGEL-PTM 4.1), drawn in ``--plot``; without CUDA that part is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from pagemem.checks import check_int
from pagemem.commands import io_sweep
from pagemem.commands.io_sweep import (
    ENGINES,
    TOLERANCE,
    CopySweep,
    Measurement,
    Skipped,
    size_text,
)
from pagemem.commands.train_config import to_toml
from pagemem.config import StoreConfig
from pagemem.errors import ConfigError
from pagemem.machine import disk_free, unwritable
from pagemem.units import format_bytes, parse_size

FULL = {"page_bytes": "256KiB,1MiB,4MiB,16MiB", "io_depth": "1,4,8,32", "total_bytes": "128MiB", "repeats": 3,
        "copy_sizes": io_sweep.COPY_SIZES}
QUICK = {"page_bytes": "256KiB,1MiB", "io_depth": "1,8", "total_bytes": "8MiB", "repeats": 1,
         "copy_sizes": io_sweep.COPY_SIZES[2:7]}
RULE = (f"highest min(read, write); among settings within {TOLERANCE:.0%} of it, the smallest page_bytes, "
        "then the smallest io_depth, then the io_engine listed first")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="directory on the drive to tune (the nvme_path to be)")
    parser.add_argument("--page_bytes", help=f"page sizes to sweep, comma-separated (default {FULL['page_bytes']})")
    parser.add_argument("--io_depth", help=f"queue depths to sweep, comma-separated (default {FULL['io_depth']})")
    parser.add_argument("--io_engine", default=",".join(ENGINES),
                        help="I/O engines to sweep, comma-separated (default aio,threads; one that cannot run "
                             "here is skipped, saying why)")
    parser.add_argument("--total_bytes", help=f"bytes written and read per setting and pass (default "
                        f"{FULL['total_bytes']}; at least the largest page)")
    parser.add_argument("--repeats", type=int, help=f"timed passes per setting, the median kept (default {FULL['repeats']})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short sweep: pages {QUICK['page_bytes']}, depths {QUICK['io_depth']}, "
                             f"{QUICK['total_bytes']}, one pass (explicit flags still win)")
    parser.add_argument("--out", default="io-tune.toml", help="the [store] config to write (default io-tune.toml)")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    parser.add_argument("--plot", default="io-tune-pcie.png",
                        help="with CUDA: the host <-> GPU bandwidth plot (default io-tune-pcie.png)")


def run(args: argparse.Namespace) -> int:
    s = _settings(args)
    path = args.path
    disk = _disk(path)
    print(f"pagemem io-tune: {os.path.abspath(path)} ({disk.get('filesystem') or '?'} on {disk.get('device') or '?'}, "
          f"{format_bytes(disk['free_bytes'])} free); {size_text(s['total_bytes'])} written and read per setting, "
          f"median of {s['repeats']} pass(es), checksums on")
    copies, copies_skipped = _copies(args, s)
    pages = list(s["page_bytes"])
    if copies is not None and copies.page_bytes() not in pages and copies.page_bytes() <= s["total_bytes"]:
        pages.append(copies.page_bytes())
        pages.sort()
    print(f"  {'io_engine':<9}  {'page_bytes':>10}  {'io_depth':>8}  {'read MB/s':>10}  {'write MB/s':>10}  "
          f"{'min MB/s':>9}")
    measured, skipped = io_sweep.sweep_disk(path, pages, s["io_depth"], s["io_engine"], s["total_bytes"],
                                            s["repeats"], log=_print_row)
    if not measured:
        raise ConfigError(f"io_engine: nothing could be measured on {path!r}: "
                          + "; ".join(f"{k.io_engine}: {k.reason}" for k in skipped))
    page = copies.page_bytes() if copies is not None else None
    at_page = [m for m in measured if m.page_bytes == page]
    best = io_sweep.pick_best(at_page or measured, engines=s["io_engine"])
    store = {"page_bytes": size_text(page or best.page_bytes), "io_engine": best.io_engine,
             "io_depth": best.io_depth, "direct_io": best.direct_io}
    StoreConfig(**store)  # the config written must be one pagemem takes
    if page is None:
        how = "the best disk setting"
    else:
        how = (f"page_bytes from the host <-> GPU plateau ({size_text(page)}); io_engine and io_depth the best "
               + ("at that page size" if at_page else "of every page size (that page size was not measured)"))
    print(f"best ({RULE}): {best.io_engine}, page_bytes {size_text(best.page_bytes)}, io_depth {best.io_depth}: "
          f"read {best.read_bytes_per_s / 1e6:.1f} MB/s, write {best.write_bytes_per_s / 1e6:.1f} MB/s")
    if page:
        print(f"config: {how}")
    _write(args.out, _toml(path, disk, store, best, how, len(measured)), "out")
    print(f"wrote {args.out}: [store] " + ", ".join(f"{k} = {v!r}" for k, v in store.items()))
    if args.json:
        report = {"nvme_path": os.path.abspath(path), "disk": disk, "total_bytes": s["total_bytes"],
                  "repeats": s["repeats"], "checksums": True, "rule": RULE, "tolerance": TOLERANCE,
                  "measurements": [_measurement(m) for m in measured], "skipped": [asdict(k) for k in skipped],
                  "best": _measurement(best), "store": store, "config": os.path.abspath(args.out),
                  "copies": _copies_json(copies, args.plot), "copies_skipped": copies_skipped}
        _write(args.json, json.dumps(report, indent=2), "json")
        print(f"wrote {args.json}")
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep's settings from the flags (``--quick`` changes the defaults), checked before
    anything is measured: each error names its flag."""
    base = QUICK if args.quick else FULL
    pages = [_page_bytes(v) for v in _items(args.page_bytes or base["page_bytes"], "page_bytes")]
    depths = []
    for v in _items(args.io_depth or base["io_depth"], "io_depth"):
        depths.append(check_int("io_depth", int(v) if v.isdigit() else v, 1, 1024))
    engines = _items(args.io_engine, "io_engine")
    for e in engines:
        if e not in ENGINES:
            raise ConfigError(f"io_engine: must be among {', '.join(map(repr, ENGINES))} ('auto' picks one of "
                              f"these; sweep them by name), got {e!r}")
    total = parse_size(args.total_bytes or base["total_bytes"], "total_bytes")
    if total <= 0 or total % 4096:
        raise ConfigError(f"total_bytes: must be a positive multiple of 4096 bytes, got {total}")
    if total < max(pages):
        raise ConfigError(f"total_bytes: must be at least the largest page_bytes swept ({size_text(max(pages))}), "
                          f"got {size_text(total)}")
    repeats = check_int("repeats", base["repeats"] if args.repeats is None else args.repeats, 1, 1000)
    why = unwritable(args.path)
    if why is not None:
        raise ConfigError(f"nvme_path (PATH): page files cannot be made in {args.path!r}: {why}")
    for name in ("out", "json", "plot"):
        target = getattr(args, name)
        if target and not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            raise ConfigError(f"{name}: the directory of {target!r} does not exist")
    return {"page_bytes": sorted(set(pages)), "io_depth": sorted(set(depths)), "io_engine": engines,
            "total_bytes": total, "repeats": repeats, "copy_sizes": base["copy_sizes"]}


def _items(text: str, name: str) -> list[str]:
    items = list(dict.fromkeys(v.strip() for v in text.split(",")))
    if not items or any(not v for v in items):
        raise ConfigError(f"{name}: expected a comma-separated list, got {text!r}")
    return items


def _page_bytes(text: str) -> int:
    return StoreConfig(page_bytes=parse_size(text, "page_bytes")).page_bytes  # type: ignore[return-value]


def _disk(path: str) -> dict[str, Any]:
    from pagemem.commands.measure import disk_info

    return {**disk_info(path), "free_bytes": disk_free(path)[0]}


def _copies(args: argparse.Namespace, s: dict[str, Any]) -> tuple[CopySweep | None, str | None]:
    """The host <-> GPU sweep and its plot with CUDA; else None and why it was skipped."""
    if not io_sweep.cuda_available():
        why = "no CUDA (torch.cuda.is_available() is False): the page size comes from the disk sweep alone"
        print(f"host <-> GPU copies: skipped: {why}")
        return None, why
    sweep = io_sweep.sweep_copies(s["copy_sizes"], s["repeats"])
    page = sweep.page_bytes()
    print(f"host <-> GPU copies (pinned, {torch.cuda.get_device_name(0)}):")
    print(f"  {'bytes':>10}  {'h2d GB/s':>9}  {'d2h GB/s':>9}")
    for size, a, b in zip(sweep.sizes, sweep.h2d, sweep.d2h):
        mark = "  <- plateau: page_bytes" if size == page else ""
        print(f"  {size_text(size):>10}  {a / 1e9:>9.2f}  {b / 1e9:>9.2f}{mark}")
    link = _link_bytes_per_s()
    io_sweep.plot_copies(sweep, page, link, args.plot, f"{torch.cuda.get_device_name(0)}: pinned copies")
    print(f"wrote {args.plot}")
    return sweep, None


def _link_bytes_per_s() -> float | None:
    """The theoretical bandwidth of the CUDA device's PCIe link, where NVML names the same GPU."""
    from pagemem.commands.probes import nvml_gpus

    name = torch.cuda.get_device_name(0)
    return next((g.link_bytes_per_s for g in nvml_gpus()[0] if g.name == name), None)


def _print_row(item: Measurement | Skipped) -> None:
    if isinstance(item, Skipped):
        what = item.io_engine if item.page_bytes is None else \
            f"{item.io_engine}, page_bytes {size_text(item.page_bytes)}, io_depth {item.io_depth}"
        print(f"  skipped {what}: {item.reason}", flush=True)
        return
    m = item
    print(f"  {m.io_engine:<9}  {size_text(m.page_bytes):>10}  {m.io_depth:>8}  {m.read_bytes_per_s / 1e6:>10.1f}  "
          f"{m.write_bytes_per_s / 1e6:>10.1f}  {m.score / 1e6:>9.1f}" + ("" if m.direct_io else "  (buffered)"),
          flush=True)


def _measurement(m: Measurement) -> dict[str, Any]:
    return {**asdict(m), "min_bytes_per_s": m.score}


def _copies_json(sweep: CopySweep | None, plot: str) -> dict[str, Any] | None:
    if sweep is None:
        return None
    return {"sizes": list(sweep.sizes), "h2d_bytes_per_s": list(sweep.h2d), "d2h_bytes_per_s": list(sweep.d2h),
            "page_bytes": sweep.page_bytes(), "tolerance": TOLERANCE, "plot": os.path.abspath(plot)}


def _toml(path: str, disk: dict[str, Any], store: dict[str, Any], best: Measurement, how: str, n: int) -> str:
    head = [
        f"# pagemem io-tune, {time.strftime('%Y-%m-%d %H:%M')}: {n} settings measured on {json.dumps(os.path.abspath(path))}",
        f"# ({disk.get('filesystem') or '?'} on {disk.get('device') or '?'}), checksums on",
        f"# rule: {RULE}",
        f"# best: read {best.read_bytes_per_s / 1e6:.1f} MB/s, write {best.write_bytes_per_s / 1e6:.1f} MB/s; {how}",
        "# the directory measured; uncomment to keep page files there (default: the run directory):",
        f"# nvme_path = {json.dumps(os.path.abspath(path))}",
    ]
    return "\n".join(head) + "\n" + to_toml({"store": store})


def _write(target: str, text: str, name: str) -> None:
    try:
        with open(target, "w") as f:
            f.write(text)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot write {target!r} ({exc.strerror})") from None
