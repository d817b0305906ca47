"""``pagemem bench``: run the benchmark suite and print each headline figure beside its anchor.

The suite is ``SUITE`` in ``benchmarks/run_all.py`` (the scripts of a source checkout: an
installed wheel has no ``benchmarks/``, and the command says so). Each benchmark runs in a
process of its own, its output going to ``<results>/<name>.log``; its results JSON is then read
by its function in ``bench_headlines.HEADLINES``, and one table shows every headline figure with
the anchor measured in the same run and their ratio. One combined JSON (``--out``) holds the
rows and the machine they ran on. ``--quick`` runs write to ``benchmarks/results/quick``: they
check that the benchmarks run and never replace the recorded figures. ``--from_results`` builds
the table from the JSON files already in the results directory without running anything (those
run only when named, too, where they have results). A benchmark that fails (a non-zero exit, no
results written, results without their figure, ``--timeout`` passed) is a failed row and makes
the exit status 1; one that needs what this machine lacks (fio, CUDA) is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pagemem
from pagemem.commands.bench_headlines import HEADLINES, Headline, NoFigure
from pagemem.errors import ConfigError

OK, FAILED, SKIPPED, MISSING = "ok", "failed", "skipped", "no results"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="run these benchmarks only (bench_engine or engine; also those not run by default)")
    parser.add_argument("--quick", action="store_true",
                        help="each benchmark's smallest settings: a check that it runs, not a measurement")
    parser.add_argument("--from_results", action="store_true",
                        help="build the table from the JSON files already in the results directory; run nothing")
    parser.add_argument("--results_dir", metavar="DIR", help="where benchmarks write and this reads results "
                        "(default: benchmarks/results, with --quick benchmarks/results/quick)")
    parser.add_argument("--out", metavar="FILE", help="the combined JSON (default: RESULTS/bench.json)")
    parser.add_argument("--benchmarks_dir", metavar="DIR", help="the benchmarks directory (default: the checkout's)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="longest run of one benchmark")


@dataclass
class Outcome:
    """One benchmark's part of the table."""

    name: str
    status: str
    rows: list[Headline] = field(default_factory=list)
    reason: str = ""
    seconds: float | None = None
    args: list[str] = field(default_factory=list)
    result_file: str | None = None
    log: str | None = None
    machine: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason, "seconds": self.seconds,
                "args": self.args, "result_file": self.result_file, "log": self.log, "result_machine": self.machine,
                "rows": [r.to_dict() for r in self.rows]}


def run(args: argparse.Namespace) -> int:
    bench_dir = benchmarks_dir(args.benchmarks_dir)
    suite = load_suite(bench_dir)
    chosen = select(suite.SUITE, args.only)
    # quick runs are checks, not measurements: they never replace the recorded figures
    results = os.path.abspath(args.results_dir or os.path.join(bench_dir, "results", *(["quick"] if args.quick else [])))
    out = args.out or os.path.join(results, "bench.json")
    if args.from_results and not os.path.isdir(results):
        raise ConfigError(f"--from_results: no results directory {results} (run pagemem bench first)")
    if args.from_results and args.only is None:  # and those run only when named, where they have results
        chosen = [b for b in suite.SUITE if b.default or os.path.exists(os.path.join(results, b.result_name + ".json"))]
    outcomes = []
    for i, bench in enumerate(chosen, 1):
        if args.from_results:
            outcome = from_file(bench, results, named=args.only is not None)
        else:
            print(f"[{i}/{len(chosen)}] {bench.name} ...", end=" ", file=sys.stderr, flush=True)
            outcome = run_one(suite, bench, bench_dir, results, args.quick, args.timeout)
            took = f" ({outcome.seconds:.0f} s)" if outcome.seconds is not None else ""
            print(f"{outcome.status}{took}" + (f": {outcome.reason}" if outcome.reason else ""), file=sys.stderr)
        outcomes.append(outcome)
    print(render(outcomes))
    failed = [o.name for o in outcomes if o.status == FAILED]
    write_combined(out, outcomes, quick=args.quick, from_results=args.from_results, results=results)
    print(f"\n{len(outcomes)} benchmarks: " + ", ".join(
        f"{sum(o.status == s for o in outcomes)} {s}" for s in (OK, FAILED, SKIPPED, MISSING)
        if any(o.status == s for o in outcomes)) + f"; wrote {out}")
    return 1 if failed else 0


def benchmarks_dir(given: str | None) -> str:
    """The benchmarks directory: ``given``, or ``benchmarks/`` beside the ``pagemem`` package
    (the checkout an editable install points at)."""
    path = os.path.abspath(given or os.path.join(os.path.dirname(os.path.dirname(pagemem.__file__)), "benchmarks"))
    if not os.path.isfile(os.path.join(path, "run_all.py")):
        raise ConfigError(f"no benchmarks directory at {path} (no run_all.py): the benchmarks ship with the source "
                          "checkout, not the installed package; run from a clone of the repository, or pass "
                          "--benchmarks_dir DIR")
    return path


def load_suite(bench_dir: str) -> ModuleType:
    """``run_all.py`` of ``bench_dir`` as a module (its ``SUITE`` and ``unavailable``)."""
    name = "_pagemem_bench_run_all"
    spec = importlib.util.spec_from_file_location(name, os.path.join(bench_dir, "run_all.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"{bench_dir}/run_all.py does not load: {type(exc).__name__}: {exc}") from None
    finally:
        sys.modules.pop(name, None)
    if not hasattr(module, "SUITE") or not hasattr(module, "unavailable"):
        raise ConfigError(f"{bench_dir}/run_all.py has no SUITE and unavailable()")
    return module


def select(suite: list[Any], only: str | None) -> list[Any]:
    """The benchmarks ``--only`` names (``engine`` or ``bench_engine.py`` for ``bench_engine``), in
    the suite's order; without it, those run by default."""
    if only is None:
        return [b for b in suite if b.default]
    known = {b.name: b for b in suite}
    wanted = set()
    for raw in only.split(","):
        name = raw.strip().removesuffix(".py")
        if not name:
            continue
        name = name if name.startswith("bench_") else "bench_" + name
        if name not in known:
            raise ConfigError(f"--only: no benchmark {raw.strip()!r}; the suite has {', '.join(known)}")
        wanted.add(name)
    if not wanted:
        raise ConfigError("--only: name at least one benchmark")
    return [b for b in suite if b.name in wanted]


def run_one(suite: ModuleType, bench: Any, bench_dir: str, results: str, quick: bool,
            timeout: float | None) -> Outcome:
    """Run ``bench`` in a process of its own (output to its log) and read its headline."""
    args = list(bench.quick) if quick else []
    why = suite.unavailable(bench)
    if why:
        return Outcome(bench.name, SKIPPED, reason=why, args=args)
    os.makedirs(results, exist_ok=True)
    result_file = os.path.join(results, bench.result_name + ".json")
    log = os.path.join(results, bench.name + ".log")
    before = _mtime(result_file)
    env = {**os.environ, "PAGEMEM_BENCH_RESULTS": results, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(bench_dir, bench.name + ".py"), *args]
    outcome = Outcome(bench.name, FAILED, args=args, result_file=result_file, log=log)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # a session of its own: a timeout or Ctrl-C ends its children too (fio, workers)
        proc = subprocess.Popen(cmd, cwd=os.path.dirname(bench_dir), stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            outcome.seconds = time.perf_counter() - t0
            outcome.reason = f"timed out after {timeout:g} s (log: {log})"
            return outcome
        except BaseException:
            _end(proc)
            raise
    outcome.seconds = time.perf_counter() - t0
    if code != 0:
        outcome.reason = f"exit status {code}: {_last_line(log)} (log: {log})"
        return outcome
    if _mtime(result_file) in (None, before):
        outcome.reason = f"wrote no {os.path.basename(result_file)} (log: {log})"
        return outcome
    return _read(outcome, result_file)


def from_file(bench: Any, results: str, named: bool) -> Outcome:
    """``bench``'s headline from its results file; a missing file is a failure only when named."""
    result_file = os.path.join(results, bench.result_name + ".json")
    if not os.path.exists(result_file):
        return Outcome(bench.name, FAILED if named else MISSING, reason=f"no {result_file}")
    return _read(Outcome(bench.name, FAILED, result_file=result_file), result_file)


def _read(outcome: Outcome, result_file: str) -> Outcome:
    extract = HEADLINES.get(outcome.name)
    if extract is None:
        outcome.reason = f"no headline function for {outcome.name} in pagemem/commands/bench_headlines.py"
        return outcome
    try:
        with open(result_file) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        outcome.reason = f"cannot read {result_file}: {exc}"
        return outcome
    machine = data.get("machine") if isinstance(data, dict) else None
    outcome.machine = machine if isinstance(machine, dict) else None  # bench_tracer's is a string
    try:
        rows = extract(data)
    except NoFigure as exc:
        outcome.reason = f"no headline figure in {os.path.basename(result_file)}: {exc}"
        return outcome
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as exc:
        outcome.reason = (f"{os.path.basename(result_file)} is not laid out as expected "
                          f"({type(exc).__name__}: {exc})")
        return outcome
    if not rows:
        outcome.reason = f"no headline figure in {os.path.basename(result_file)}"
        return outcome
    outcome.status, outcome.rows = OK, rows
    return outcome


def render(outcomes: list[Outcome]) -> str:
    """One table: a line per headline figure; a failed or skipped benchmark is one line."""
    headers = ["benchmark", "figure", "value", "anchor (same run)", "value", "unit", "figure/anchor"]
    cells = {id(o): [[o.name if j == 0 else "", r.what, _num(r.figure),
                      r.anchor_name + (f" ({r.note})" if r.note else ""), _num(r.anchor), r.unit,
                      "-" if r.ratio is None else f"{r.ratio:.4g}"] for j, r in enumerate(o.rows)]
             for o in outcomes}
    every = [c for rows in cells.values() for c in rows]
    widths = [max([len(h)] + [len(c[i]) for c in every] + ([len(o.name) for o in outcomes] if i == 0 else []))
              for i, h in enumerate(headers)]
    left = {0, 1, 3, 5}

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines = [line(headers), line(["-" * w for w in widths])]
    for o in outcomes:
        if o.status == OK:
            lines += [line(c) for c in cells[id(o)]]
        else:
            lines.append(f"{o.name.ljust(widths[0])}  {o.status.upper()}: {o.reason}")
    return "\n".join(lines)


def write_combined(path: str, outcomes: list[Outcome], *, quick: bool, from_results: bool, results: str) -> None:
    payload = {"benchmark": "bench", "machine": machine(), "quick": quick, "from_results": from_results,
               "results_dir": results, "failed": [o.name for o in outcomes if o.status == FAILED],
               "benchmarks": [o.to_dict() for o in outcomes]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def machine() -> dict[str, Any]:
    """This machine: CPU model and count, memory, torch, the CUDA device (or ``"none"``), the date."""
    from pagemem.commands.measure import machine_facts

    facts = machine_facts()
    facts["cuda"] = facts["cuda"] or "none"
    return facts


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    a = abs(x)
    if a >= 1e4:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _last_line(log: str) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:200] if lines else "no output"


def _end(proc: subprocess.Popen) -> None:
    """End ``proc`` and its process group (the session it leads)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
