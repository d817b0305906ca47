"""``pagemem io-tune``: a quick sweep through the real nvme tier, the config it writes as
``pagemem train`` reads it, engines and depths that cannot run, the host <-> GPU path with
synthetic copies, the two picking rules on synthetic numbers, and bad input."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemem.commands import io_sweep, measure
from pagemem.commands.io_sweep import CopySweep, Measurement, pick_best, plateau
from pagemem.commands.train_config import layered, read_toml, resolve
from pagemem.tiers.io.base import EngineUnavailable
from tests.conftest import aio_available, exit_status

KiB, MiB = 1 << 10, 1 << 20


def io_tune(*argv: str) -> int:
    return exit_status("io-tune", *argv)


def run_json(tmp_path, *argv: str) -> dict:
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    assert io_tune(str(disk), "--out", str(tmp_path / "t.toml"), "--json", str(tmp_path / "t.json"), *argv) == 0
    assert os.listdir(disk) == []  # page files removed
    return json.loads((tmp_path / "t.json").read_text())


def store_of(tmp_path, toml) -> object:
    """The ``[store]`` pagemem train would run with, from the written file."""
    (tmp_path / "run" / "nvme").mkdir(parents=True, exist_ok=True)
    return resolve(layered([read_toml(toml)], {}), str(tmp_path / "run")).engine.store


def measurements(report: dict) -> list[Measurement]:
    return [Measurement(**{k: v for k, v in m.items() if k != "min_bytes_per_s"}) for m in report["measurements"]]


def test_a_quick_sweep_measures_every_setting_and_writes_a_config_train_takes(tmp_path, capsys):
    report = run_json(tmp_path, "--quick")
    text = capsys.readouterr().out
    engines = ["aio", "threads"] if aio_available() else ["threads"]
    got = {(m["io_engine"], m["page_bytes"], m["io_depth"]) for m in report["measurements"]}
    assert got == {(e, p, d) for e in engines for p in (256 * KiB, MiB) for d in (1, 8)}
    for m in report["measurements"]:
        assert set(m) == {"page_bytes", "io_depth", "io_engine", "read_bytes_per_s", "write_bytes_per_s",
                          "direct_io", "min_bytes_per_s"}
        assert m["read_bytes_per_s"] > 0 and m["write_bytes_per_s"] > 0
        assert m["min_bytes_per_s"] == min(m["read_bytes_per_s"], m["write_bytes_per_s"])
        assert f"{m['read_bytes_per_s'] / 1e6:.1f}" in text and f"{m['write_bytes_per_s'] / 1e6:.1f}" in text
    best = pick_best(measurements(report))
    assert report["best"] == {**asdict(best), "min_bytes_per_s": best.score}
    store = store_of(tmp_path, tmp_path / "t.toml")
    assert (store.page_bytes, store.io_depth, store.io_engine, store.direct_io) == \
        (best.page_bytes, best.io_depth, best.io_engine, best.direct_io)
    assert report["total_bytes"] == 8 * MiB and report["repeats"] == 1 and report["checksums"] is True
    if not torch.cuda.is_available():
        assert report["copies"] is None and "no CUDA" in report["copies_skipped"]
        assert "host <-> GPU copies: skipped: no CUDA" in text


def test_an_engine_that_cannot_run_is_skipped_saying_why(tmp_path, capsys, monkeypatch):
    def no_libaio():
        raise EngineUnavailable("cannot load libaio: libaio.so.1: cannot open shared object file")

    monkeypatch.setattr("pagemem.tiers.io.aio._load_libaio", no_libaio)
    report = run_json(tmp_path, "--page_bytes", "256KiB", "--io_depth", "1,4", "--total_bytes", "1MiB",
                      "--repeats", "1")
    assert "skipped aio: cannot load libaio" in capsys.readouterr().out
    assert report["skipped"] == [{"io_engine": "aio", "page_bytes": None, "io_depth": None,
                                  "reason": "cannot load libaio: libaio.so.1: cannot open shared object file"}]
    assert {m["io_engine"] for m in report["measurements"]} == {"threads"} and len(report["measurements"]) == 2
    assert store_of(tmp_path, tmp_path / "t.toml").io_engine == "threads"


def test_without_o_direct_aio_is_skipped_and_the_config_says_buffered(tmp_path, capsys, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *rest, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    report = run_json(tmp_path, "--page_bytes", "256KiB", "--io_depth", "2", "--total_bytes", "1MiB", "--repeats", "1")
    text = capsys.readouterr().out
    assert "skipped aio:" in text and "O_DIRECT" in text and "(buffered)" in text
    assert [m["direct_io"] for m in report["measurements"]] == [False]
    store = store_of(tmp_path, tmp_path / "t.toml")
    assert store.direct_io is False and store.io_engine == "threads"


def test_a_depth_beyond_the_pages_in_total_bytes_is_skipped(tmp_path, capsys):
    report = run_json(tmp_path, "--page_bytes", "1MiB", "--io_depth", "1,2,4", "--total_bytes", "2MiB",
                      "--io_engine", "threads", "--repeats", "1")
    assert sorted(m["io_depth"] for m in report["measurements"]) == [1, 2]
    (skip,) = report["skipped"]
    assert skip["io_depth"] == 4 and "only 2 pages" in skip["reason"] and "4MiB" in skip["reason"]
    assert "skipped threads, page_bytes 1MiB, io_depth 4" in capsys.readouterr().out


def synthetic_copies(size: int, repeats: int, count: int = 1) -> tuple[float, float]:
    """A link that levels off: host->GPU at 25 GB/s past ~1 MiB, GPU->host slower to rise."""
    return 25e9 * size / (size + 64 * KiB), 24e9 * size / (size + 128 * KiB)


def test_with_cuda_the_page_size_is_the_copy_plateau_and_it_is_plotted(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(io_sweep, "cuda_available", lambda: True)
    monkeypatch.setattr(measure, "cuda_copy", synthetic_copies)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Synthetic GPU")
    monkeypatch.setattr("pagemem.commands.io_tune._link_bytes_per_s", lambda: 31.5e9)
    plot = tmp_path / "pcie.png"
    report = run_json(tmp_path, "--quick", "--io_engine", "threads", "--plot", str(plot))
    text = capsys.readouterr().out
    sizes = [256 * KiB << i for i in range(5)]  # the quick sweep: 256 KiB .. 4 MiB
    rates = [min(synthetic_copies(s, 1)) for s in sizes]
    expected = plateau(sizes, rates)
    assert expected == 2 * MiB  # d2h, the slower direction, levels off there
    copies = report["copies"]
    assert copies["sizes"] == sizes and copies["page_bytes"] == expected and report["copies_skipped"] is None
    assert "<- plateau: page_bytes" in text and "2MiB" in text
    at_page = [m for m in measurements(report) if m.page_bytes == expected]
    assert at_page, "the plateau's page size is measured on disk too"
    best = pick_best(at_page)
    store = store_of(tmp_path, tmp_path / "t.toml")
    assert (store.page_bytes, store.io_depth, store.io_engine) == (expected, best.io_depth, best.io_engine)
    from PIL import Image

    img = Image.open(plot).convert("L")
    assert img.size[0] > 400 and len(set(img.tobytes())) > 10  # decodes, and is not blank


def test_a_plateau_page_larger_than_total_bytes_still_sets_the_page_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(io_sweep, "cuda_available", lambda: True)
    monkeypatch.setattr(measure, "cuda_copy", synthetic_copies)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Synthetic GPU")
    monkeypatch.setattr("pagemem.commands.io_tune._link_bytes_per_s", lambda: None)
    report = run_json(tmp_path, "--quick", "--io_engine", "threads", "--total_bytes", "1MiB", "--plot",
                      str(tmp_path / "pcie.png"))
    assert report["copies"]["page_bytes"] == 2 * MiB
    assert {m["page_bytes"] for m in report["measurements"]} == {256 * KiB, MiB}  # 2 MiB does not fit in 1 MiB
    best = pick_best(measurements(report))
    store = store_of(tmp_path, tmp_path / "t.toml")
    assert (store.page_bytes, store.io_depth, store.io_engine) == (2 * MiB, best.io_depth, best.io_engine)
    assert "that page size was not measured" in capsys.readouterr().out


@pytest.mark.parametrize("argv,field", [
    (["{tmp}/nope"], "nvme_path"),
    (["{tmp}/file"], "nvme_path"),
    (["/proc"], "nvme_path"),
    (["{tmp}", "--page_bytes", "-4096"], "page_bytes"),
    (["{tmp}", "--page_bytes", "1000"], "page_bytes"),
    (["{tmp}", "--page_bytes", "256KiB,,1MiB"], "page_bytes"),
    (["{tmp}", "--total_bytes", "-5"], "total_bytes"),
    (["{tmp}", "--quick", "--total_bytes", "1048577"], "total_bytes"),  # 1 MiB + 1
    (["{tmp}", "--total_bytes", "1MiB"], "total_bytes"),  # below the 16 MiB page
    (["{tmp}", "--io_engine", "fast"], "io_engine"),
    (["{tmp}", "--io_engine", "auto"], "io_engine"),
    (["{tmp}", "--io_depth", "0"], "io_depth"),
    (["{tmp}", "--io_depth", "four"], "io_depth"),
    (["{tmp}", "--repeats", "0"], "repeats"),
    (["{tmp}", "--out", "{tmp}/no/t.toml"], "out"),
])
def test_bad_input_is_one_line_naming_the_field_and_exit_2(tmp_path, capsys, monkeypatch, argv, field):
    monkeypatch.chdir(tmp_path)  # where --out would go by default
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert io_tune(*argv, "--json", str(tmp_path / "t.json")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagemem io-tune: ConfigError: {field}"), err
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing written, nothing measured


@pytest.mark.parametrize("argv", [[], ["{tmp}", "--repeats", "x"], ["{tmp}", "--page-bytes", "4MiB"]])
def test_usage_errors_exit_2(tmp_path, capsys, argv):
    assert io_tune(*[a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


# ----------------------------------------------------------------------- the rules, on synthetic numbers

def m(page: int, depth: int, engine: str, read: float, write: float) -> Measurement:
    return Measurement(page, depth, engine, read, write, True)


def test_pick_best_takes_the_highest_of_the_lower_direction():
    fast_reads = m(4 * MiB, 8, "aio", 9000, 1000)  # the best read, a poor write
    balanced = m(16 * MiB, 32, "threads", 2000, 2100)
    assert pick_best([fast_reads, balanced]) == balanced


def test_pick_best_among_near_equals_takes_the_smallest_page_then_depth_then_engine():
    big = m(16 * MiB, 8, "aio", 2000, 2000)
    small_within_5pct = m(MiB, 32, "threads", 1910, 1950)
    small_too_slow = m(256 * KiB, 1, "aio", 1890, 3000)  # 5.5% below: not near
    assert pick_best([big, small_within_5pct, small_too_slow]) == small_within_5pct
    shallow = m(MiB, 4, "threads", 1905, 1905)
    assert pick_best([big, small_within_5pct, shallow]) == shallow
    aio = m(MiB, 4, "aio", 1905, 1905)
    assert pick_best([big, shallow, aio]) == aio
    assert pick_best([big, shallow, aio], engines=("threads", "aio")) == shallow
    with pytest.raises(ValueError):
        pick_best([])


rates_st = st.floats(min_value=1.0, max_value=1e12, allow_nan=False)
settings_st = st.lists(st.tuples(st.sampled_from([64 * KiB, 256 * KiB, MiB, 4 * MiB]), st.sampled_from([1, 4, 8, 32]),
                                 st.sampled_from(["aio", "threads"]), rates_st, rates_st),
                       min_size=1, max_size=12, unique_by=lambda t: t[:3])


@settings(max_examples=200, deadline=None)
@given(settings_st, st.randoms())
def test_pick_best_is_near_the_top_smallest_of_those_and_ignores_order(rows, rnd):
    ms = [m(*r) for r in rows]
    best = pick_best(ms)
    top = max(x.score for x in ms)
    assert best.score >= 0.95 * top
    key = (best.page_bytes, best.io_depth, ["aio", "threads"].index(best.io_engine))
    assert all((x.page_bytes, x.io_depth, ["aio", "threads"].index(x.io_engine)) >= key
               for x in ms if x.score >= 0.95 * top)
    rnd.shuffle(ms)
    assert pick_best(ms) == best


def test_plateau_is_the_smallest_size_within_5_percent_of_the_best():
    sizes = [64 * KiB << i for i in range(11)]  # 64 KiB .. 64 MiB
    saturating = [25e9 * s / (s + MiB) for s in sizes]  # 98.5% of 25 GB/s at 64 MiB
    assert plateau(sizes, saturating) == 16 * MiB  # 94.1% at 8 MiB, 96.9% at 16 MiB: 0.95 * 98.5% = 93.6%
    assert plateau(sizes, saturating, tolerance=0.01) == 64 * MiB
    assert plateau([1, 2, 3, 4], [95.0, 10.0, 100.0, 99.0]) == 1  # exactly 5% below counts
    assert plateau([1, 2, 3, 4], [94.9, 10.0, 100.0, 99.0]) == 3
    assert plateau([4, 1, 3, 2], [99.0, 10.0, 100.0, 50.0]) == 3  # order of the input does not matter
    flat = CopySweep((1, 2, 4), (10.0, 10.0, 10.0), (2.0, 5.0, 9.8))  # d2h is the slower direction
    assert flat.page_bytes() == 4
    with pytest.raises(ValueError):
        plateau([1, 2], [1.0])
    with pytest.raises(ValueError):
        plateau([], [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1 << 30), rates_st), min_size=1, max_size=15, unique_by=lambda t: t[0]),
       st.integers(-20, 20))
def test_plateau_reaches_the_plateau_and_nothing_smaller_does(points, shift):
    sizes, rates = [p[0] for p in points], [p[1] for p in points]
    size = plateau(sizes, rates)
    top = max(rates)
    assert rates[sizes.index(size)] >= 0.95 * top
    assert all(r < 0.95 * top for s, r in points if s < size)
    assert plateau(sizes, [r * 2.0 ** shift for r in rates]) == size  # units do not matter
