"""``pagemem bench``: the suite's headline table, from recorded results and from runs; failures
as rows, never tracebacks.

``tests/data/bench_results/`` holds what the benchmarks wrote in a ``pagemem bench --quick``
run on the development VM (``bench_gpu_moves.json``, which needs CUDA, is synthetic: made-up
figures in the layout the script writes; ``bench_offload_cpu.json`` records a failed pagemem
run, psutil being missing there)."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import pagemem
from pagemem.commands.bench import benchmarks_dir, load_suite
from pagemem.commands.bench_headlines import HEADLINES, NoFigure
from tests.conftest import exit_status

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = os.path.join(REPO, "tests", "data", "bench_results")
SUITE = load_suite(os.path.join(REPO, "benchmarks")).SUITE


def bench(*argv: str) -> int:
    return exit_status("bench", *argv)


def recorded(tmp_path, failed_offload: bool = False) -> str:
    """A copy of the recorded results (the failed bench_offload run only when asked for)."""
    shutil.copytree(RECORDED, tmp_path / "results")
    if not failed_offload:
        os.remove(tmp_path / "results" / "bench_offload_cpu.json")
    return str(tmp_path / "results")


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_every_benchmark_in_run_all_has_a_headline_function():
    names = [b.name for b in SUITE]
    assert len(names) == len(set(names))
    missing = [n for n in names if n not in HEADLINES]
    assert not missing, f"benchmarks in run_all.SUITE without a function in bench_headlines.HEADLINES: {missing}"
    scripts = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "benchmarks", "bench_*.py")))
    assert sorted(names) == scripts, "every benchmarks/bench_*.py is in run_all.SUITE"


@pytest.mark.parametrize("b", [b for b in SUITE if b.name != "bench_offload"], ids=lambda b: b.name)
def test_each_headline_function_reads_what_its_benchmark_wrote(b):
    rows = HEADLINES[b.name](load(os.path.join(RECORDED, b.result_name + ".json")))
    assert rows
    for r in rows:
        assert math.isfinite(r.figure) and r.anchor is not None and math.isfinite(r.anchor) and r.anchor > 0, r
        assert r.ratio == pytest.approx(r.figure / r.anchor) and r.unit and r.anchor_name


def tracked_results() -> list:
    """Suite entries whose results are committed in benchmarks/results (the record BENCHMARKS.md cites)."""
    try:
        out = subprocess.run(["git", "-C", REPO, "ls-files", "benchmarks/results"], capture_output=True, text=True,
                             timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    return [b for b in SUITE if f"benchmarks/results/{b.result_name}.json" in out]


@pytest.mark.parametrize("b", tracked_results(), ids=lambda b: b.name)
def test_each_headline_function_reads_the_committed_results(b):
    rows = HEADLINES[b.name](load(os.path.join(REPO, "benchmarks", "results", b.result_name + ".json")))
    assert rows and all(math.isfinite(r.figure) and r.ratio is not None and math.isfinite(r.ratio) for r in rows)


def test_offload_without_pagemem_figure_says_why_and_a_missing_anchor_is_a_note():
    d = load(os.path.join(RECORDED, "bench_offload_cpu.json"))
    with pytest.raises(NoFigure, match="psutil"):
        HEADLINES["bench_offload"](d)
    d["results"]["pagemem"] = {"ok": True, "tokens_per_s": 300.0}
    rows = HEADLINES["bench_offload"](d)
    by_anchor = {r.anchor_name: r for r in rows}
    assert by_anchor["DeepSpeed ZeRO-3 offload"].anchor is None and by_anchor["DeepSpeed ZeRO-3 offload"].ratio is None
    assert "deepspeed failed" in by_anchor["DeepSpeed ZeRO-3 offload"].note
    plain = d["results"]["plain"]["tokens_per_s"]
    assert by_anchor["plain PyTorch"].ratio == pytest.approx(300.0 / plain)


def test_from_results_builds_the_table_and_the_combined_json(tmp_path, capsys):
    results = recorded(tmp_path)
    out = tmp_path / "combined.json"
    assert bench("--from_results", "--results_dir", results, "--out", str(out)) == 0
    text = capsys.readouterr().out
    combined = load(out)
    # the default suite, and those run only when named where they have results (bench_lockfree, bench_homes, bench_ranks,
    # bench_paper_scale, bench_integrations)
    shown = [b.name for b in SUITE if b.default or b.name in ("bench_lockfree", "bench_homes", "bench_paper_scale", "bench_ranks",
                                                              "bench_integrations")]
    assert [e["name"] for e in combined["benchmarks"]] == shown
    assert all(e["status"] == "ok" and e["rows"] for e in combined["benchmarks"])
    assert combined["from_results"] is True and combined["failed"] == []
    m = combined["machine"]
    assert m["cpus"] == os.cpu_count() and m["cpu"] and m["memory_bytes"] > 0 and m["torch"] and m["date"]
    assert m["cuda"] == "none" or m["cuda"]
    entries = {e["name"]: e for e in combined["benchmarks"]}
    # figures are the recorded ones, beside the anchor of the same run, in the stated unit
    s = load(os.path.join(results, "bench_planner.json"))["seconds"]
    (row,) = entries["bench_planner"]["rows"]
    assert (row["figure"], row["anchor"], row["unit"]) == (1e3 * s["plan_segment"], 1e3 * s["plan_scan"], "ms")
    assert row["ratio"] == pytest.approx(s["plan_segment"] / s["plan_scan"])
    engine = load(os.path.join(results, "bench_engine.json"))
    its = [(r["figure"], r["anchor"]) for r in entries["bench_engine"]["rows"] if r["unit"] == "it/s"]
    assert its == [(r["engine_it_per_s"], r["plain_it_per_s"]) for r in engine["rows"]]
    moves = entries["bench_gpu_moves"]["rows"]
    assert [(r["figure"], r["anchor"]) for r in moves][0] == (20.1, 24.8)
    assert entries["bench_tracer"]["result_machine"] is None  # bench_tracer writes no machine facts
    assert entries["bench_engine"]["result_machine"]["cpus"] == 2
    # the table: one line per figure, the benchmark named on its first, with the ratio
    lines = text.splitlines()
    assert lines[0].split() == ["benchmark", "figure", "value", "anchor", "(same", "run)", "value", "unit",
                                "figure/anchor"]
    planner_line = next(ln for ln in lines if ln.startswith("bench_planner"))
    assert planner_line.split()[-2:] == ["ms", f"{row['ratio']:.4g}"]
    assert f"{1e3 * s['plan_scan']:.0f}" in planner_line
    for name in shown:
        assert sum(ln.startswith(name + " ") for ln in lines) == 1, name
    body = lines[2:lines.index("")]
    assert len(body) == sum(len(e["rows"]) for e in combined["benchmarks"])
    assert f"wrote {out}" in text


def test_unreadable_or_incomplete_results_are_failed_rows(tmp_path, capsys):
    results = recorded(tmp_path, failed_offload=True)
    planner = load(os.path.join(results, "bench_planner.json"))
    del planner["seconds"]
    with open(os.path.join(results, "bench_planner.json"), "w") as f:
        json.dump(planner, f)
    with open(os.path.join(results, "bench_simulate.json"), "w") as f:
        f.write('{"results": ')
    os.remove(os.path.join(results, "bench_tracer.json"))
    out = tmp_path / "c.json"
    code = bench("--from_results", "--results_dir", results, "--out", str(out),
                 "--only", "planner,simulate,bench_offload,tracer,bench_nvme.py")
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.out + captured.err
    status = {e["name"]: (e["status"], e["reason"]) for e in load(out)["benchmarks"]}
    assert status["bench_nvme"][0] == "ok"
    assert status["bench_planner"][0] == "failed" and "KeyError" in status["bench_planner"][1]
    assert status["bench_simulate"][0] == "failed" and "cannot read" in status["bench_simulate"][1]
    assert status["bench_offload"][0] == "failed" and "psutil" in status["bench_offload"][1]
    assert status["bench_tracer"][0] == "failed" and "no " in status["bench_tracer"][1]  # named, so missing fails
    assert sorted(load(out)["failed"]) == ["bench_offload", "bench_planner", "bench_simulate", "bench_tracer"]
    assert any(ln.startswith("bench_planner") and "FAILED: " in ln for ln in captured.out.splitlines())


def test_a_failed_run_recorded_is_a_failed_row_without_only(tmp_path, capsys):
    results = recorded(tmp_path, failed_offload=True)
    assert bench("--from_results", "--results_dir", results, "--out", str(tmp_path / "c.json")) == 1
    assert load(tmp_path / "c.json")["failed"] == ["bench_offload"]


def test_a_missing_default_result_is_reported_not_failed(tmp_path, capsys):
    results = recorded(tmp_path)
    os.remove(os.path.join(results, "bench_gpu_moves.json"))
    assert bench("--from_results", "--results_dir", results, "--out", str(tmp_path / "c.json")) == 0
    assert any(ln.startswith("bench_gpu_moves") and "NO RESULTS" in ln for ln in capsys.readouterr().out.splitlines())


FAKE_RUN_ALL = '''
from typing import NamedTuple


class Bench(NamedTuple):
    name: str
    quick: tuple = ()
    needs: object = None
    default: bool = True
    result: str = ""

    @property
    def result_name(self):
        return self.result or self.name


SUITE = [SUITE_HERE]


def unavailable(bench):
    return "no CUDA device" if bench.needs == "cuda" else None
'''

FAKE_SCRIPTS = {
    # writes the recorded planner results, with the arguments it was given
    "bench_planner": '''
        import json, os, sys
        d = json.load(open(os.environ["RECORDED"]))
        d["argv"] = sys.argv[1:]
        json.dump(d, open(os.path.join(os.environ["PAGEMEM_BENCH_RESULTS"], "bench_planner.json"), "w"))
        ''',
    "bench_tracer": '''
        print("some output")
        raise RuntimeError("the tracer broke")
        ''',
    "bench_cpu_adam": '''
        print("ran, but wrote nothing")
        ''',
    "bench_store_ops": '''
        import time
        time.sleep(60)
        ''',
}


def fake_checkout(tmp_path, monkeypatch, suite: str) -> Path:
    """A checkout whose benchmarks are ``FAKE_SCRIPTS`` and whose ``SUITE`` is ``suite``."""
    fake = tmp_path / "repo" / "benchmarks"
    fake.mkdir(parents=True)
    (fake / "run_all.py").write_text(FAKE_RUN_ALL.replace("SUITE_HERE", suite))
    for name, source in FAKE_SCRIPTS.items():
        (fake / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("RECORDED", os.path.join(RECORDED, "bench_planner.json"))
    return fake


def test_runs_report_failures_as_rows_and_exit_1(tmp_path, capsys, monkeypatch):
    fake = fake_checkout(tmp_path, monkeypatch, 'Bench("bench_planner", ("--tiny",)), Bench("bench_tracer"), '
                         'Bench("bench_cpu_adam"), Bench("bench_store_ops"), Bench("bench_gpu_moves", needs="cuda")')
    results = tmp_path / "res"
    # an old results file that the failing run does not rewrite must not count as its results
    results.mkdir()
    shutil.copy(os.path.join(RECORDED, "bench_cpu_adam.json"), results / "bench_cpu_adam.json")
    code = bench("--benchmarks_dir", str(fake), "--results_dir", str(results), "--quick", "--timeout", "4")
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.out + captured.err
    combined = load(results / "bench.json")
    status = {e["name"]: e for e in combined["benchmarks"]}
    assert status["bench_planner"]["status"] == "ok" and status["bench_planner"]["args"] == ["--tiny"]
    assert load(results / "bench_planner.json")["argv"] == ["--tiny"]  # --quick passed its arguments
    assert status["bench_tracer"]["status"] == "failed"
    assert "exit status 1" in status["bench_tracer"]["reason"] and "the tracer broke" in status["bench_tracer"]["reason"]
    assert "Traceback" in open(status["bench_tracer"]["log"]).read()  # the child's traceback is in its log
    assert status["bench_cpu_adam"]["status"] == "failed" and "wrote no" in status["bench_cpu_adam"]["reason"]
    assert status["bench_store_ops"]["status"] == "failed" and "timed out" in status["bench_store_ops"]["reason"]
    assert status["bench_gpu_moves"]["status"] == "skipped"
    assert combined["failed"] == ["bench_tracer", "bench_cpu_adam", "bench_store_ops"]
    lines = captured.out.splitlines()
    for name, word in (("bench_tracer", "FAILED"), ("bench_cpu_adam", "FAILED"), ("bench_store_ops", "FAILED"),
                       ("bench_gpu_moves", "SKIPPED")):
        assert any(ln.startswith(name) and word in ln for ln in lines), name


def test_quick_runs_default_to_their_own_results_directory(tmp_path, monkeypatch):
    # a checkout whose results hold recorded figures: --quick leaves them alone
    fake = fake_checkout(tmp_path, monkeypatch, 'Bench("bench_planner", ("--tiny",))')
    (fake / "results").mkdir()
    recorded = fake / "results" / "bench_planner.json"
    recorded.write_text("recorded")
    assert bench("--benchmarks_dir", str(fake), "--quick") == 0
    assert recorded.read_text() == "recorded"
    assert load(fake / "results" / "quick" / "bench_planner.json")["argv"] == ["--tiny"]
    assert (fake / "results" / "quick" / "bench.json").exists() and not (fake / "results" / "bench.json").exists()


def test_a_real_benchmark_runs_quick_into_the_given_results(tmp_path, capsys):
    results = tmp_path / "res"
    assert bench("--only", "planner", "--quick", "--results_dir", str(results)) == 0
    (entry,) = load(results / "bench.json")["benchmarks"]
    assert entry["status"] == "ok" and entry["args"] == ["--repeats", "1"]
    assert entry["rows"][0]["figure"] == 1e3 * load(results / "bench_planner.json")["seconds"]["plan_segment"]
    assert "bench_planner" in capsys.readouterr().out


def test_without_a_benchmarks_directory_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    # an installed wheel: the package sits in site-packages, with no benchmarks/ beside it
    monkeypatch.setattr(pagemem, "__file__", str(tmp_path / "site-packages" / "pagemem" / "__init__.py"))
    with pytest.raises(pagemem.ConfigError, match="no benchmarks directory"):
        benchmarks_dir(None)
    assert bench("--from_results") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no benchmarks directory" in err and "Traceback" not in err


def test_an_unknown_name_in_only_is_refused(capsys):
    assert bench("--only", "engine,nope", "--from_results") == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "bench_engine" in err
