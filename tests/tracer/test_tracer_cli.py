"""The ``pagemem trace`` command."""

from __future__ import annotations

import argparse

import pytest

from pagemem.commands import trace as trace_cli
from pagemem.tracer import Trace


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    trace_cli.configure(parser)
    return trace_cli.run(parser.parse_args(argv))


def test_trace_command_writes_both_files(tmp_path, capsys):
    out = tmp_path / "o"
    assert _run(["--model", "tiny", "--layers", "3", "--batch", "2", "--seq", "16", "--out_dir", str(out)]) == 0
    tr = Trace.load(out / "trace.json")
    assert [lay.name for lay in tr.layers][2:5] == ["blocks.0", "blocks.1", "blocks.2"]
    assert tr.meta["optimizer"] == "traced AdamW"
    assert (out / "trace.chrome.json").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "activation" in printed and "trace.json" in printed


def test_synthetic_command(tmp_path):
    out = tmp_path / "s"
    assert _run(["--model", "gpt2", "--batch", "1", "--seq", "128", "--synthetic", "--dtype", "float16",
                 "--out_dir", str(out)]) == 0
    tr = Trace.load(out / "trace.json")
    assert tr.meta["source"] == "synthetic" and len(tr.layers) == 12 + 3


def test_synthetic_command_with_checkpointing(tmp_path):
    common = ["--model", "gpt2", "--layers", "4", "--batch", "1", "--seq", "128", "--synthetic", "--dtype", "bfloat16"]
    assert _run(common + ["--checkpoint_activations", "--out_dir", str(tmp_path / "ck")]) == 0
    assert _run(common + ["--out_dir", str(tmp_path / "plain")]) == 0
    ck, plain = Trace.load(tmp_path / "ck" / "trace.json"), Trace.load(tmp_path / "plain" / "trace.json")
    assert ck.meta["config"]["checkpoint_activations"] is True
    assert plain.meta["config"]["checkpoint_activations"] is False
    assert sum(o.phase == "backward" and o.event == "forward_pre" for o in ck.ops) == 4 * 9  # recomputed
    assert ck.peak_non_model_bytes < plain.peak_non_model_bytes


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert _run(["--model", "nope", "--out_dir", str(tmp_path)]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert _run(["--model", "tiny", "--seq", "100000", "--out_dir", str(tmp_path)]) == 2


def test_registered_in_the_pagemem_command():
    from pagemem import cli
    from pagemem.commands import COMMANDS

    assert ("trace", "pagemem.commands.trace") in [(n, m) for n, m, _ in COMMANDS]
    try:
        parser = cli.build_parser()
    except ModuleNotFoundError as e:  # another subcommand's module is not on this branch yet
        pytest.skip(str(e))
    args = parser.parse_args(["trace", "--model", "tiny", "--synthetic"])
    assert args._run is trace_cli.run


def test_trace_command_on_meta_writes_the_cpu_trace(tmp_path):
    """``--device meta`` allocates nothing for the model and writes what ``--device cpu`` writes."""
    from trace_canon import assert_same_trace

    common = ["--model", "tiny", "--layers", "2", "--batch", "2", "--seq", "16", "--dtype", "bfloat16"]
    assert _run(common + ["--device", "meta", "--out_dir", str(tmp_path / "meta")]) == 0
    assert _run(common + ["--out_dir", str(tmp_path / "cpu")]) == 0
    meta, cpu = Trace.load(tmp_path / "meta" / "trace.json"), Trace.load(tmp_path / "cpu" / "trace.json")
    assert meta.meta["device"] == "meta" and meta.meta["optimizer"] == "traced AdamW"
    assert_same_trace(cpu, meta)
