"""``pagemem profile``: measure this machine's bandwidths and rates into a hardware profile JSON
(see :mod:`pagemem.commands.measure`), or print a built-in profile. It lives above the layers: the
executor's host time per window is measured by the engine (:mod:`pagemem.engine.paging.measure`)."""

from __future__ import annotations

import argparse
import os
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="write the measured profile to this file (JSON)")
    parser.add_argument("--name", default="measured", help="the profile's name (default: measured)")
    parser.add_argument("--nvme_path", default=None,
                        help="directory on the drive to measure (default: a temporary directory)")
    parser.add_argument("--nvme_bytes", default="1GiB",
                        help="the measuring store's nvme tier: bytes moved per pass (default 1GiB)")
    parser.add_argument("--copy_bytes", default="256MiB", help="bytes per copy measurement (default 256MiB)")
    parser.add_argument("--adam_elements", type=int, default=16_000_000,
                        help="elements of the Adam measurement (default 16M)")
    parser.add_argument("--network_bytes", default="64MiB", help="bytes per rank per collective (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is kept")
    parser.add_argument("--show", metavar="NAME", help="print a built-in profile (a100-server, dev-vm) and exit")


def run(args: argparse.Namespace) -> int:
    from pagemem.commands.measure import measure
    from pagemem.engine.paging.measure import window_host_seconds
    from pagemem.errors import PageMemError, one_line
    from pagemem.sched.hardware import HardwareProfile

    try:
        if args.show:
            print(HardwareProfile.builtin(args.show).summary())
            return 0
        if args.nvme_path is not None and not os.path.isdir(args.nvme_path):  # before minutes of measuring
            print(f"pagemem profile: nvme_path: {args.nvme_path!r} is not an existing directory", file=sys.stderr)
            return 2
        if not args.out:
            print("pagemem profile: --out FILE is required to measure (or --show NAME)", file=sys.stderr)
            return 2
        profile = measure(args.nvme_path, name=args.name, nvme_bytes=args.nvme_bytes, copy_bytes=args.copy_bytes,
                          adam_elements=args.adam_elements, network_bytes=args.network_bytes,
                          repeats=args.repeats, log=lambda msg: print(f"  {msg}", flush=True),
                          window_host=lambda: window_host_seconds(repeats=args.repeats))
    except PageMemError as e:
        print(f"pagemem profile: {one_line(str(e))}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(profile.summary())
    print(f"wrote {args.out}")
    return 0
