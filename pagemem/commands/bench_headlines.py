"""Each benchmark's headline figures beside their anchors, read out of its results JSON.

``HEADLINES`` maps a benchmark (its script's name, ``benchmarks/<name>.py``) to one function
that pulls :class:`Headline` rows out of the JSON the script writes: the figure pagemem reached
and the anchor measured in the same run (plain PyTorch, torch's fused AdamW, fio, the
simulator's prediction, ...), in one unit. This is the only place that knows the results'
layout; ``pagemem bench`` prints and combines what it returns. A function raises
:class:`NoFigure` when the results hold no figure (the run failed part-way), and a missing key
(``KeyError``) when the layout is not what it expects.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Headline:
    """One figure beside its anchor from the same run."""

    what: str
    figure: float
    anchor_name: str
    anchor: float | None
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """figure / anchor (None without an anchor)."""
        if self.anchor is None or self.anchor == 0 or not math.isfinite(self.anchor):
            return None
        return self.figure / self.anchor

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


class NoFigure(Exception):
    """The results hold no headline figure (the benchmark's own run failed)."""


Results = dict[str, Any]


def allocator(d: Results) -> list[Headline]:
    rows = [Headline(r["what"], r["per_second"], "torch.empty, same sizes", r["anchor_torch_empty_per_second"],
                     "allocs/s") for r in d["allocation"] if "anchor_torch_empty_per_second" in r]
    util = d["utilization"]
    for workload in dict.fromkeys(r["workload"] for r in util):
        of = {r["layout"]: r["utilization"] for r in util if r["workload"] == workload}
        ours = next(v for k, v in of.items() if k.startswith("pagemem: layer groups chained"))
        chunks = next(v for k, v in of.items() if k.startswith("PatrickStar chunks"))
        rows.append(Headline(f"utilization, {workload}", 100 * ours, "PatrickStar chunks", 100 * chunks, "%"))
    return rows


def store_ops(d: Results) -> list[Headline]:
    rows = []
    for r in d["rows"]:
        if r["pages"] == 256 and "real_s" in r:
            rows.append(Headline(f"{r['call']}, 256 pages", 1e3 * r["real_s"], "bare copy_, same bytes",
                                 1e3 * r["bare_copy_s"], "ms"))
        if r["pages"] == 256 and r["call"] == "move cpu->gpu":
            rows.append(Headline("Python cost of a 256-page move", r["python_us_per_page"], "one page's copy",
                                 r["one_page_copy_us"], "us/page"))
    return rows


def cpu_adam(d: Results) -> list[Headline]:
    anchor = next(r for r in d["rows"] if "(anchor)" in r["row"])
    ours = max((r for r in d["rows"] if r["row"].startswith("CpuAdam.step,")), key=lambda r: r["elements_per_s"])
    return [Headline(ours["row"], ours["elements_per_s"] / 1e6, "torch fused AdamW, one tensor",
                     anchor["elements_per_s"] / 1e6, "Melem/s"),
            Headline(ours["row"], ours["elements_per_s"] / 1e6, "memory bound (memcpy)",
                     d["bound_elements_per_s"] / 1e6, "Melem/s")]


def engine(d: Results) -> list[Headline]:
    rows = []
    for r in d["rows"]:
        rows.append(Headline(f"engine, {r['row']}", r["engine_it_per_s"], "plain PyTorch, fused AdamW",
                             r["plain_it_per_s"], "it/s"))
        predicted = r.get("predicted", {}).get("iteration_s")
        if predicted:
            rows.append(Headline(f"simulator's prediction, {r['row']}", 1e3 * predicted, "measured engine iteration",
                                 1e3 * r["median_engine_s"], "ms"))
    if not rows:
        raise NoFigure("no rows")
    return rows


def tracer(d: Results) -> list[Headline]:
    rows = [Headline(f"traced iteration, {r['label']}", 1e3 * r["median_traced_s"], "untraced iteration",
                     1e3 * r["median_untraced_s"], "ms") for r in d["rows"]]
    if not rows:
        raise NoFigure("no configurations ran")
    return rows


def planner(d: Results) -> list[Headline]:
    s = d["seconds"]
    return [Headline(f"plan() {d['model']}, {d['world_size']} ranks", 1e3 * s["plan_segment"],
                     "same planner, rescanning timeline", 1e3 * s["plan_scan"], "ms")]


def simulate(d: Results) -> list[Headline]:
    cpu, nvme = d["results"]["cpu"], d["results"]["nvme"]
    return [Headline("simulated iteration, states on SSD", nvme["iteration_s"], "states in CPU memory",
                     cpu["iteration_s"], "s"),
            Headline("simulated GPU idle, states on SSD", 100 * nvme["gpu_idle"], "states in CPU memory",
                     100 * cpu["gpu_idle"], "%")]


def paper_scale(d: Results) -> list[Headline]:
    rows = [Headline(f"simulated GPT3-175B, {w} GPUs, batch {r['batch_per_rank']}/rank", r["samples_per_s"],
                     "ANGEL-PTM Figure 7 (its text)", r["paper_samples_per_s"], "samples/s")
            for w, r in d["results"].items() if r.get("paper_samples_per_s")]
    if not rows:
        raise NoFigure("no world size the paper reports ran")
    return rows


def nvme(d: Results) -> list[Headline]:
    results = d["results"]
    deep = [r for r in results if r["depth"] >= 8] or results
    rows = [Headline(f"store aio {r['direction']}, depth {r['depth']}", r["aio_gbps"], "fio, same traffic",
                     r["fio_gbps"], "GB/s") for r in deep]
    if not rows:
        raise NoFigure("no depths ran")
    return rows


def gpu_moves(d: Results) -> list[Headline]:
    rows = [Headline(f"store move {r['direction']}, {r['tensor_mib']} MiB tensors", r["pagemem_gbps"],
                     "pinned copy_, same bytes", r["anchor_gbps"], "GB/s") for r in d["results"]]
    if not rows:
        raise NoFigure("no moves ran")
    return rows


def lockfree(d: Results) -> list[Headline]:
    rows = []
    for model, r in d.get("convergence", {}).items():
        rows.append(Headline(f"lock-free tail loss, {model}", r["tail_mean"]["predict"], "synchronous engine",
                             r["tail_mean"]["sync"], "loss"))
    t = d.get("throughput")
    if t:
        for key, what in (("ms_lock_free_nvme", "lock-free, states on capped nvme"),
                          ("ms_sync_nvme", "synchronous, states on capped nvme")):
            rows.append(Headline(what, t[key], "synchronous, states on cpu", t["ms_anchor_cpu_states"], "ms"))
    if not rows:
        raise NoFigure("neither part ran")
    return rows


def offload(d: Results) -> list[Headline]:
    results = d["results"]
    ours = results.get("pagemem")
    if not ours or not ours.get("ok"):
        raise NoFigure(f"pagemem's run failed: {_last_error(ours)}")
    rows = []
    for system, name in (("deepspeed", "DeepSpeed ZeRO-3 offload"), ("plain", "plain PyTorch")):
        other = results.get(system)
        if other is None:
            continue
        if other.get("ok"):
            rows.append(Headline("pagemem tokens/s", ours["tokens_per_s"], name, other["tokens_per_s"], "tok/s"))
        else:
            rows.append(Headline("pagemem tokens/s", ours["tokens_per_s"], name, None, "tok/s",
                                 note=f"{system} failed: {_last_error(other)}"))
    return rows


def homes(d: Results) -> list[Headline]:
    rows = []
    runs = [r for r in d["rows"] if "refused" not in r]
    on_cpu = {r["multiple"]: r for r in runs if r["home"] == "cpu"}
    mib = 1 << 20
    for r in runs:
        if r["home"] != "nvme":
            continue
        what = f"homes on nvme, state {r['multiple']}x cpu_bytes"
        rows.append(Headline(f"{what}: peak RSS growth", r["growth"] / mib, "gpu + cpu + 4 layers + 256 MiB",
                             r["bound_bytes"] / mib, "MiB"))
        if r.get("sim_seconds"):
            rows.append(Headline(f"{what}: iteration", r["iteration_seconds"], "the simulator's prediction",
                                 r["sim_seconds"], "s"))
        elif r["multiple"] in on_cpu:
            rows.append(Headline(f"{what}: iteration", r["iteration_seconds"], "homes on cpu, same model",
                                 on_cpu[r["multiple"]]["iteration_seconds"], "s"))
    if not rows:
        raise NoFigure("no row ran")
    return rows


def integrations(d: Results) -> list[Headline]:
    ms = d["ms_per_step"]
    rows = []
    for fw, what in (("trainer", "PagememTrainer"), ("lightning", "Lightning strategy='pagemem'")):
        rows.append(Headline(f"{what}, GPT-2, pages moving (ms/step)", ms[f"pagemem_{fw}"], "engine's own loop",
                             ms["engine_loop"], "ms", "" if d["bit_identical"][fw] else "weights differ from plain"))
        rows.append(Headline(f"{what}, GPT-2, pages moving (ms/step)", ms[f"pagemem_{fw}"],
                             f"plain {fw}, model fits", ms[f"plain_{fw}"], "ms"))
    return rows


def train_loop(d: Results) -> list[Headline]:
    rows = []
    for r in d["engine"]:
        mode = "lock-free" if r["lock_free"] else "synchronous"
        rows.append(Headline(f"pagemem train {mode}: grad norm per step", 1e3 * r["grad_norm_s"],
                             "the step (forward, backward, update)", 1e3 * r["step_s"], "ms"))
        rows.append(Headline(f"pagemem train {mode}: one evaluation batch", 1e3 * r["eval_batch_s"],
                             "the step (forward, backward, update)", 1e3 * r["step_s"], "ms"))
    b = d["batches"]
    rows.append(Headline("pagemem train: a token-file batch (memmap)", 1e3 * b["token_file_batch_s"],
                         "the synthetic task's batch", 1e3 * b["synthetic_batch_s"], "ms"))
    return rows


def _last_error(result: dict[str, Any] | None) -> str:
    """The last line of a failed run's error (bench_offload joins its last lines with " | ")."""
    if not result:
        return "not run"
    return str(result.get("error", "no error recorded")).split(" | ")[-1].strip()[-200:]


def ranks(d: Results) -> list[Headline]:
    rows = []
    for r in d["rows"]:
        w = r["world_size"]
        mode = {True: ", moments sharded", False: ", replicas"}.get(r.get("sharded"), "") if w > 1 else ""
        if r.get("sim_tokens_per_s"):
            rows.append(Headline(f"{w} gloo rank(s){mode}: tokens/s per rank", r["per_rank_tokens_per_s"],
                                 "the simulator's prediction", r["sim_tokens_per_s"], "tokens/s"))
        if w > 1:
            anchor = ("the ring all-reduce of the gradients" + (" and all-gather of the master shares"
                                                                if r.get("sharded") else ""))
            rows.append(Headline(f"{w} gloo ranks{mode}: bytes sent per rank per iteration",
                                 r["sent_bytes_per_iteration"] / (1 << 20), anchor,
                                 r["ring_bytes_per_iteration"] / (1 << 20), "MiB"))
    if not rows:
        raise NoFigure("no row ran")
    return rows


HEADLINES: dict[str, Callable[[Results], list[Headline]]] = {
    "bench_allocator": allocator,
    "bench_store_ops": store_ops,
    "bench_cpu_adam": cpu_adam,
    "bench_engine": engine,
    "bench_tracer": tracer,
    "bench_planner": planner,
    "bench_simulate": simulate,
    "bench_paper_scale": paper_scale,
    "bench_nvme": nvme,
    "bench_gpu_moves": gpu_moves,
    "bench_lockfree": lockfree,
    "bench_train_loop": train_loop,
    "bench_offload": offload,
    "bench_integrations": integrations,
    "bench_homes": homes,
    "bench_ranks": ranks,
}
"""benchmark -> its headline rows. A benchmark in ``benchmarks/run_all.py``'s ``SUITE`` needs a row here."""
