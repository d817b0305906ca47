"""CPU AdamW over 4 MiB optimizer pages: elements per second against torch and the memory bound.

One fp32 parameter of ``--elements`` (default 50M) with its gradient and moments, split into
pages of ``--page-elements`` (default 2**20 = 4 MiB). Rows, all measured in the same run with
rounds interleaved (so a noisy neighbour slows every row alike), median of ``--rounds``:
- **anchor**: ``torch.optim.AdamW(fused=True)`` stepping the whole tensor in one call;
- ``pagemem.engine.CpuAdam.step`` over the pages with 1, 2 and ``os.cpu_count()`` workers (one
  torch thread each; runs of pages per kernel call, about 4 per worker), with clipping by global
  norm (its extra norm pass and gradient multiply), and ``step_chunk`` with one task per page
  (how the engine overlaps pages with I/O: Python's cost per page shows here);
- the same page-by-page loop from the main thread with torch's default intra-op threads (the
  trap: an OpenMP fork/join per small call);
- the gradient-norm pass alone (``CpuAdam.sumsq`` over the pages, 4 bytes per element);
- DeepSpeed's ``DeepSpeedCPUAdam`` on the whole tensor, when it imports and builds (optional).
The physical limit: AdamW reads p, g, m, v and writes p, m, v, 28 bytes per fp32 element; over
this machine's memcpy bandwidth (a large ``copy_``, read + write bytes, measured in the same
interleaved rounds) that is the bound in elements/s ("of bound": each row's rate over the
bound's in the same round, median over rounds; "vs anchor" likewise). A ``copy_`` also reads the
lines it writes (write-allocate), which AdamW's in-place writes do not, so rows can exceed it;
"of in-place" is the fraction of an in-place stream's bandwidth (``mul_``: the same lines read
then written, AdamW's pattern for p, m and v), the tighter limit.
Goal: CpuAdam at >= 1.0x the anchor's elements/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

from common import table, write_json

import torch

from pagemem.engine import AdamW, Chunk, CpuAdam, fused_step
from pagemem.engine.updates.adam import wait_all

ADAM_BYTES = 28  # read p, g, m, v; write p, m, v (fp32)


def bandwidth_probes(nbytes: int) -> dict[str, tuple[int, Callable[[], None]]]:
    """Streams over ``nbytes`` buffers and the bytes each call moves (read + write, as counted
    for AdamW's 28): ``copy_`` into another buffer (whose lines the CPU also reads before writing
    them: write-allocate) and an in-place multiply (reads then writes the same lines, as AdamW
    does p, m and v)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return {"memcpy (copy_)": (2 * nbytes, lambda: dst.copy_(src)),
            "in-place stream (mul_)": (2 * nbytes, lambda: src.mul_(1.0))}


def deepspeed_step(param: torch.nn.Parameter, hp: AdamW) -> tuple[Callable[[], None] | None, str]:
    """A DeepSpeedCPUAdam step on ``param``, or None and why not."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([param], lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                               adamw_mode=True, fp32_optimizer_states=True)
        print(f"DeepSpeed {deepspeed.__version__}: building/loading cpu_adam (about 70 s the first time)...",
              flush=True)
        opt.step()
    except Exception as e:  # not installed, or its JIT build failed
        return None, f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return opt.step, f"deepspeed {deepspeed.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=50_000_000)
    parser.add_argument("--page-elements", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    n, page = args.elements, args.page_elements
    hp = AdamW()
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    chunks = [Chunk(p[a:a + page], g[a:a + page], m[a:a + page], v[a:a + page]) for a in range(0, n, page)]

    param = torch.nn.Parameter(p)  # shares p's storage: every row steps the same memory
    param.grad = g
    anchor = torch.optim.AdamW([param], **hp.group(), fused=True)
    steps = {"n": 0}

    def next_step() -> int:
        steps["n"] += 1
        return steps["n"]

    def paged_default_threads() -> None:
        s = next_step()
        for c in chunks:
            fused_step(c.param, c.grad, c.exp_avg, c.exp_avg_sq, s, hp)

    cpus = os.cpu_count() or 1
    pools = {t: CpuAdam(t) for t in sorted({1, 2, cpus})}
    rows: list[tuple[str, int | str, int, Callable[[], None]]] = [
        ("torch fused AdamW, one tensor (anchor)", torch.get_num_threads(), ADAM_BYTES, anchor.step),
        ("per page, torch default threads (trap)", torch.get_num_threads(), ADAM_BYTES, paged_default_threads),
    ]
    for t, pool in pools.items():
        rows.append((f"CpuAdam.step, {t} worker{'s' if t > 1 else ''}", t, ADAM_BYTES,
                     lambda pool=pool: pool.step(chunks, next_step(), hp)))
    best = pools[max(pools)]

    def one_task_per_page() -> None:
        s = next_step()
        wait_all([best.step_chunk(c.param, c.grad, c.exp_avg, c.exp_avg_sq, s, hp) for c in chunks])

    rows.append(("CpuAdam.step_chunk, one task per page", best.threads, ADAM_BYTES, one_task_per_page))
    rows.append(("CpuAdam.step + clip by global norm", best.threads, ADAM_BYTES,
                 lambda: best.step(chunks, next_step(), hp, max_grad_norm=1.0)))
    rows.append(("grad-norm pass alone (sumsq per page)", best.threads, 4,
                 lambda: wait_all([best.sumsq(c.grad) for c in chunks])))
    ds_note = "skipped (--no-deepspeed)"
    if not args.no_deepspeed:
        ds_param = torch.nn.Parameter(p)
        ds_param.grad = g
        ds, ds_note = deepspeed_step(ds_param, hp)
        if ds is None:
            print(ds_note)
        else:
            rows.append(("DeepSpeedCPUAdam, one tensor", torch.get_num_threads(), ADAM_BYTES, ds))

    probes = bandwidth_probes(256 << 20)
    work = [(name, fn) for name, *_, fn in rows] + [(name, fn) for name, (_, fn) in probes.items()]
    times: dict[str, list[float]] = {name: [] for name, _ in work}
    for _, fn in work:  # warm-up: first touch of the moments, thread start-up
        fn()
    for r in range(args.rounds):  # each round in a rotated order, so no row always follows another
        for name, fn in work[r % len(work):] + work[:r % len(work)]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for pool in pools.values():
        pool.close()

    def per_round(name: str, nbytes: int, ref: str) -> list[float]:
        """Rate of ``name`` over that of ``ref`` in each round: robust to a neighbour's load
        that changes between rounds."""
        ref_bytes = probes[ref][0] if ref in probes else n * ADAM_BYTES
        return sorted((n * nbytes / t) / (ref_bytes / t_ref) for t, t_ref in zip(times[name], times[ref]))

    med = statistics.median
    bws = {name: nbytes / med(times[name]) for name, (nbytes, _) in probes.items()}
    bw, bw_inplace = bws["memcpy (copy_)"], bws["in-place stream (mul_)"]
    bound = bw / ADAM_BYTES
    anchor = rows[0][0]
    out = []
    for name, threads, nbytes, _ in rows:
        s = med(times[name])
        vs = per_round(name, ADAM_BYTES, anchor)  # elements/s over the anchor's
        out.append({"row": name, "threads": threads, "seconds": s, "elements_per_s": n / s,
                    "vs_anchor": med(vs), "vs_anchor_quartiles": [vs[len(vs) // 4], vs[-1 - len(vs) // 4]],
                    "bytes_per_element": nbytes, "gb_per_s": n * nbytes / s / 1e9,
                    "fraction_of_bound": med(per_round(name, nbytes, "memcpy (copy_)")),
                    "fraction_of_inplace_bound": med(per_round(name, nbytes, "in-place stream (mul_)"))})
    print(table(["row", "threads", "ms", "Melem/s", "vs anchor", "(quartiles)", "B/elem", "GB/s", "of bound",
                 "of in-place"],
                [[r["row"], r["threads"], f"{r['seconds'] * 1e3:.1f}", f"{r['elements_per_s'] / 1e6:.0f}",
                  f"{r['vs_anchor']:.2f}x", "{:.2f}-{:.2f}".format(*r["vs_anchor_quartiles"]),
                  r["bytes_per_element"], f"{r['gb_per_s']:.1f}",
                  f"{r['fraction_of_bound']:.2f}", f"{r['fraction_of_inplace_bound']:.2f}"] for r in out],
                f"AdamW over {n / 1e6:.1f}M fp32 elements in pages of {page} ({page * 4 >> 20} MiB), "
                f"median of {args.rounds} interleaved rounds; ratios and fractions are per round"))
    print(f"\nbound (of bound): memcpy, copy_ of 256 MiB, {bw / 1e9:.1f} GB/s read + write "
          f"-> {bound / 1e6:.0f} Melem/s at {ADAM_BYTES} B/elem; a copy_ also reads its destination "
          f"(write-allocate), which AdamW's in-place writes do not")
    print(f"of in-place: in-place stream (mul_ of 256 MiB) {bw_inplace / 1e9:.1f} GB/s read + write "
          f"-> {bw_inplace / ADAM_BYTES / 1e6:.0f} Melem/s, the tighter limit for AdamW's access pattern")
    print(f"DeepSpeed: {ds_note}")
    cpu_rows = [r for r in out if r["row"].startswith("CpuAdam.step,")]
    goal = max(r["vs_anchor"] for r in cpu_rows) >= 1.0
    print(f"goal (CpuAdam >= 1.0x the anchor's elements/s): {'met' if goal else 'NOT met'}")
    print("wrote", write_json("bench_cpu_adam", {
        "elements": n, "page_elements": page, "rounds": args.rounds, "rows": out,
        "memcpy_bytes_per_s": bw, "inplace_bytes_per_s": bw_inplace, "bound_elements_per_s": bound,
        "inplace_bound_elements_per_s": bw_inplace / ADAM_BYTES,
        "deepspeed": ds_note, "goal_met": goal}))


if __name__ == "__main__":
    main()
