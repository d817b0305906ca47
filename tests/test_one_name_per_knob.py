"""One name per knob (DEVELOPERS.md, "Glossary: one name per knob"), checked where a machine can:
every flag of every ``pagemem`` command spells the field (or parameter) it sets, words joined by
underscores, or is one of a short list of command-only options; the old spellings are gone; the
scheduler and its profiles call the nvme tier ``nvme``, never ``ssd``."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import re
import tokenize

import pytest

import pagemem
from pagemem import cli
from pagemem.commands import COMMANDS
from pagemem.commands.io_sweep import sweep_disk
from pagemem.commands.measure import measure
from pagemem.commands.train_config import ModelSettings, TrainSettings
from pagemem.commands.train_data import DataSettings
from pagemem.config import StoreConfig
from pagemem.engine.updates.adam import AdamW
from pagemem.engine.config import EngineConfig
from pagemem.models.gpt import GPTConfig
from pagemem.models.tasks import BranchingTask
from pagemem.sched import tasks
from pagemem.sched.hardware import PROFILES_DIR, STREAMS, HardwareProfile
from pagemem.sched.planner import plan
from pagemem.sched.simulate import simulate
from pagemem.tracer.synthetic import TransformerShape

SCHED_DIR = os.path.dirname(os.path.abspath(tasks.__file__))

FIELD_CLASSES = (StoreConfig, EngineConfig, AdamW, GPTConfig, HardwareProfile, TrainSettings, BranchingTask,
                 DataSettings, TransformerShape)
"""Config dataclasses whose fields a flag may set (``TransformerShape``: the synthetic trace's
``batch``, ``seq``, ``dtype``, ``attention``)."""
FUNCTIONS = {plan: ("trace", "budgets"), simulate: ("plan", "trace", "profile"), measure: (),
             sweep_disk: ("path", "log"), pagemem.Engine.save_weights: ("self", "directory")}
"""Functions the commands call, whose parameters a flag may set (``--cache_optimizer``,
``--iterations``, ``--copy_bytes``, ``--total_bytes``, pagemem export's ``--max_shard_bytes``), less those named here: what the
function works on, not a knob."""
SECTIONS = {"train": TrainSettings, "model": ModelSettings, "data": DataSettings, "engine": EngineConfig,
            "store": StoreConfig, "optimizer": AdamW}
"""``pagemem train``'s dotted flags: ``--SECTION.FIELD``."""

COMMAND_ONLY = {
    "help": "argparse's own",
    "out": "the file a command writes (always a file)",
    "out_dir": "the directory pagemem trace and pagemem export write their files in",
    "json": "the file pagemem demo writes its results to",
    "plot": "the PNG pagemem plan draws memory to",
    "chrome": "the Chrome trace-event file pagemem simulate writes",
    "model": "a GPT preset's name",
    "trace": "a trace file to plan",
    "profile": "a built-in hardware profile's name or a profile file",
    "show": "a built-in hardware profile to print",
    "synthetic": "build the trace from the configuration instead of running the model",
    "device": "where pagemem trace runs the model",
    "config": "pagemem train's TOML files",
    "resume": "the run pagemem train continues",
    "help_config": "pagemem train lists its settings",
    "quick": "pagemem io-tune's short sweep, pagemem bench's smallest settings",
    "only": "the benchmarks pagemem bench runs",
    "from_results": "pagemem bench reads recorded results instead of running",
    "results_dir": "the directory benchmarks write results to and pagemem bench reads",
    "benchmarks_dir": "the directory of benchmark scripts",
    "timeout": "the longest one benchmark may run",
}
"""Options no config field holds: what to read and write, and what to run."""

RENAMED = {
    "plan": ["--gpu", "--cpu", "--nvme", "--optimizer-tier", "--page-bytes", "--world-size", "--checkpoint",
             "--no-cache"],
    "simulate": ["--gpu", "--cpu", "--nvme", "--optimizer-tier", "--page-bytes", "--world-size", "--checkpoint"],
    "trace": ["--checkpoint", "--untied", "--out"],
    "demo": ["--page-bytes", "--nvme-path", "--io-engine"],
    "profile": ["--nvme-path", "--nvme-bytes", "--copy-bytes", "--adam-elements", "--network-bytes"],
    "train": ["--help-config"],
}
"""Spellings used before one name per knob; none is kept as an alias."""


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _known() -> set[str]:
    names: set[str] = set()
    for cls in FIELD_CLASSES:
        names |= _fields(cls)
    for fn, inputs in FUNCTIONS.items():
        names |= set(inspect.signature(fn).parameters) - set(inputs)
    return names


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _flags(sub: argparse.ArgumentParser) -> list[str]:
    return [s for a in sub._actions for s in a.option_strings if s.startswith("--")]


def test_every_command_is_built_and_refuses_abbreviations():
    subs = _subparsers()
    assert set(subs) == {name for name, _, _ in COMMANDS}
    assert cli.build_parser().allow_abbrev is False
    assert all(sub.allow_abbrev is False for sub in subs.values())


@pytest.mark.parametrize("command", [name for name, _, _ in COMMANDS])
def test_every_flag_spells_a_field_or_is_a_command_only_option(command):
    known = _known()
    bad = []
    for flag in _flags(_subparsers()[command]):
        name = flag[2:]
        if "-" in name:
            bad.append(f"{flag}: words joined by '-' (fields join them with '_')")
        elif "." in name:
            section, field = name.split(".", 1)
            if section not in SECTIONS or field not in _fields(SECTIONS[section]):
                bad.append(f"{flag}: no field {field!r} in section {section!r}")
        elif name not in known and name not in COMMAND_ONLY:
            bad.append(f"{flag}: neither a field of {', '.join(c.__name__ for c in FIELD_CLASSES)} or a parameter "
                       f"of {', '.join(f.__name__ for f in FUNCTIONS)}, nor a command-only option")
    assert not bad, "\n".join(bad)


def test_the_command_only_options_are_each_used_and_no_field():
    """The allow-list stays short: each entry is a flag of some command, and none shadows a
    field (that flag would have to mean the field)."""
    used = {f[2:] for sub in _subparsers().values() for f in _flags(sub)}
    assert set(COMMAND_ONLY) <= used, set(COMMAND_ONLY) - used
    assert not set(COMMAND_ONLY) & _known()


def test_train_registers_every_dotted_setting():
    flags = set(_flags(_subparsers()["train"]))
    for section, cls in SECTIONS.items():
        for field in _fields(cls):
            if not (section == "engine" and field in ("store", "optimizer")):
                assert f"--{section}.{field}" in flags


@pytest.mark.parametrize("command,old", [(c, f) for c, flags in RENAMED.items() for f in flags])
def test_old_spellings_are_refused(command, old, capsys):
    flags = set(_flags(_subparsers()[command]))
    assert old not in flags
    argv = [command, old] + ([] if old in ("--checkpoint", "--untied", "--no-cache", "--help-config") else ["1"])
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_shared_spellings_parse_to_the_fields():
    args = cli.build_parser().parse_args(
        ["plan", "--gpu_bytes", "1GiB", "--cpu_bytes", "2GiB", "--nvme_bytes", "3GiB", "--optimizer_tier", "nvme",
         "--page_bytes", "64KiB", "--world_size", "2", "--checkpoint_activations", "--tie_embeddings", "false",
         "--cache_optimizer", "false", "--layers", "3"])
    assert (args.gpu_bytes, args.cpu_bytes, args.nvme_bytes) == ("1GiB", "2GiB", "3GiB")
    assert (args.optimizer_tier, args.page_bytes, args.world_size) == ("nvme", "64KiB", 2)
    assert (args.checkpoint_activations, args.tie_embeddings, args.cache_optimizer) == (True, False, False)
    assert args.layers == 3
    args = cli.build_parser().parse_args(["trace", "--out_dir", "d", "--checkpoint_activations", "false"])
    assert args.out_dir == "d" and args.checkpoint_activations is False
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["plan", "--cache_optimizer", "maybe"])


# ---------------------------------------------------------------------------------------- nvme, not ssd

def _keys(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def test_the_scheduler_calls_the_nvme_tier_nvme():
    assert "nvme" in STREAMS and not any("ssd" in s for s in STREAMS)
    assert not any("ssd" in r for r in tasks.RESOURCES)
    assert not any("ssd" in f for f in _fields(HardwareProfile))
    for effect in tasks.EFFECTS.values():
        names = [effect.stream, effect.gpu_stream, *(r for r, _ in effect.cost),
                 *(effect.host or ()), *(effect.executor or ())]
        assert not any(n and "ssd" in n for n in names), effect
    for name in HardwareProfile.builtin_names():
        hw = HardwareProfile.builtin(name)
        assert not any("ssd" in k for k in _keys(hw.to_dict())), name
    for path in sorted(os.listdir(PROFILES_DIR)):
        with open(os.path.join(PROFILES_DIR, path)) as f:
            assert not any("ssd" in k for k in _keys(json.load(f))), path
        with open(os.path.join(PROFILES_DIR, path)) as f:
            assert not re.search(r"\bo_direct\b", f.read()), path


def _legacy_lines() -> set[int]:
    """Lines of ``hardware.py`` that read version-2 profiles: ``LEGACY_NAMES`` (with its
    docstring) and ``_from_version_2``."""
    with open(os.path.join(SCHED_DIR, "hardware.py"), encoding="utf-8") as f:
        body = ast.parse(f.read()).body
    lines: set[int] = set()
    for i, node in enumerate(body):
        legacy = (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "LEGACY_NAMES") or \
            (isinstance(node, ast.FunctionDef) and node.name == "_from_version_2")
        if legacy:
            last = body[i + 1] if isinstance(node, ast.AnnAssign) else node
            lines |= set(range(node.lineno, last.end_lineno + 1))
    assert lines
    return lines


def test_no_ssd_in_the_schedulers_names_or_strings():
    """Identifiers and string literals of ``pagemem/sched`` (docstrings too) say ``nvme``; ``SSD``
    in prose is the physical device. The one exception: what reads version-2 profiles."""
    legacy = _legacy_lines()
    found = []
    for name in sorted(os.listdir(SCHED_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(SCHED_DIR, name), encoding="utf-8") as f:
            source = f.read()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.NAME, tokenize.STRING) and "ssd" in tok.string:
                if not (name == "hardware.py" and tok.start[0] in legacy):
                    found.append(f"{name}:{tok.start[0]}: {tok.string[:60]}")
    assert not found, "\n".join(found)


def test_the_nvme_tier_describes_direct_io_by_the_store_configs_name(tmp_path):
    from pagemem import PageStore

    cfg = StoreConfig(page_bytes=4096, cpu_bytes=1 << 20, nvme_bytes=1 << 20, nvme_path=str(tmp_path))
    with PageStore(cfg) as store:
        info = store.tier("nvme").describe()
    assert "direct_io" in info and "o_direct" not in info
