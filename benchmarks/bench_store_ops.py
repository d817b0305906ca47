"""Python cost per page of the store's calls: move, copy (keeping the source), release, view.

For calls over 1, 16 and 256 adjacent 4 MiB pages between the ``gpu`` and ``cpu`` tiers it
measures
- the issue cost: time spent in the call itself (what the caller's thread pays), per page;
- the overhead: the call plus waiting for it, minus the time a bare ``copy_`` of the same bytes
  between the same memories takes (measured in the same run, the anchor), per page;
and reports them beside the time one page's copy takes (on a GPU, a 4 MiB page crosses PCIe 4 in
about 160 us; here the anchor is this machine's host memcpy, or the pinned H2D copy with CUDA).
Goal: under 5 us of Python per page for a 256-page call.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import table, write_json

import torch

from pagemem import PageStore, StoreConfig

MiB = 1 << 20
PAGE = 4 * MiB


def _median(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(pages: int, rounds: int) -> list[dict]:
    cfg = StoreConfig(page_bytes=PAGE, gpu_bytes=pages * PAGE, cpu_bytes=pages * PAGE, staging_pages=2)
    rows = []
    with PageStore(cfg) as store:
        t = store.allocate((pages * PAGE,), torch.uint8, tier="cpu")
        t.copy_(torch.ones(pages * PAGE, dtype=torch.uint8))
        gpu, cpu = store.tier("gpu"), store.tier("cpu")
        src, dst = cpu.span(0, pages), gpu.span(0, pages)

        def bare_copy():
            dst.copy_(src)
            if store.cuda:
                torch.cuda.synchronize()

        anchor = _median(bare_copy, rounds)
        page_copy = _median(lambda: (dst[:PAGE].copy_(src[:PAGE]),
                                     torch.cuda.synchronize() if store.cuda else None), rounds)

        def timed(call, undo) -> tuple[float, float]:
            issue, total = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                h = call()
                t1 = time.perf_counter()
                h.wait()
                t2 = time.perf_counter()
                issue.append(t1 - t0)
                total.append(t2 - t0)
                undo()
            return statistics.median(issue), statistics.median(total)

        cases = {
            "move cpu->gpu": (lambda: t.move("gpu"), lambda: t.move("cpu").wait()),
            "copy cpu->gpu (keep source)": (lambda: t.copy("gpu"), lambda: t.release("gpu").wait()),
        }
        for name, (call, undo) in cases.items():
            issue, total = timed(call, undo)
            rows.append({"call": name, "pages": pages, "issue_us_per_page": issue / pages * 1e6,
                         "overhead_us_per_page": max(0.0, total - anchor) / pages * 1e6,
                         "total_s": total, "anchor_bare_copy_s": anchor, "page_copy_us": page_copy * 1e6})
        t.copy("gpu").wait()
        rel = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            t.release("gpu").wait()
            rel.append(time.perf_counter() - t0)
            t.copy("gpu").wait()
        rows.append({"call": "release gpu replica", "pages": pages, "issue_us_per_page": statistics.median(rel) / pages * 1e6,
                     "overhead_us_per_page": statistics.median(rel) / pages * 1e6, "total_s": statistics.median(rel),
                     "anchor_bare_copy_s": anchor, "page_copy_us": page_copy * 1e6})

        def view_once():
            v = t.view()
            del v
        v = _median(view_once, rounds)
        rows.append({"call": "view (pin, alias, unpin)", "pages": pages, "issue_us_per_page": v / pages * 1e6,
                     "overhead_us_per_page": v / pages * 1e6, "total_s": v, "anchor_bare_copy_s": anchor,
                     "page_copy_us": page_copy * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for pages in (1, 16, 256):
        rows += measure(pages, args.rounds)
    print(table(["call", "pages", "issue us/page", "overhead us/page", "total ms", "bare copy ms", "1-page copy us"],
                [[r["call"], r["pages"], f"{r['issue_us_per_page']:.2f}", f"{r['overhead_us_per_page']:.2f}",
                  f"{r['total_s'] * 1e3:.2f}", f"{r['anchor_bare_copy_s'] * 1e3:.2f}", f"{r['page_copy_us']:.0f}"]
                 for r in rows],
                f"Python cost per page of store calls, 4 MiB pages, gpu tier = "
                f"{'CUDA' if torch.cuda.is_available() else 'host stand-in'} (median of {args.rounds})"))
    big = [r for r in rows if r["pages"] == 256 and r["call"] != "release gpu replica"]
    goal = all(r["issue_us_per_page"] < 5 and r["overhead_us_per_page"] < 5 for r in big)
    print(f"\ngoal (< 5 us per page for 256-page calls, issue and overhead): {'met' if goal else 'NOT met'}")
    print("wrote", write_json("bench_store_ops", {"rows": rows, "goal_met": goal}))


if __name__ == "__main__":
    main()
