"""``pagemem train``'s configuration: one TOML file (``--config``) and dotted overrides.

Sections and the classes they fill (one name per knob: the field's name is the TOML key and,
after its section, the flag): ``[train]`` :class:`TrainSettings`; ``[model]``
:class:`ModelSettings` (the project's GPT shape, or ``hf``); ``[data]``
:class:`pagemem.commands.train_data.DataSettings` (the synthetic task's fields, or your data); ``[engine]`` :class:`pagemem.EngineConfig` without
its ``store`` and ``optimizer``, which are the sections ``[store]`` (:class:`pagemem.StoreConfig`)
and ``[optimizer]`` (:class:`pagemem.AdamW`). ``--store.gpu_bytes 2GiB`` sets
``EngineConfig.store.gpu_bytes``. ``gpu_bytes``, ``cpu_bytes`` and ``nvme_bytes`` also take
``"auto"`` (:mod:`pagemem.commands.auto_sizes`); ``nvme_path`` defaults to ``nvme/`` in the run
directory when optimizer states (or, with ``home_tier = "nvme"``, compute copies and gradient
sums) go there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping

import tomllib

from pagemem.checks import check_bool, check_choice, check_int
from pagemem.commands.train_data import DataSettings
from pagemem.commands.train_schedule import SCHEDULES
from pagemem.config import StoreConfig
from pagemem.engine.updates.adam import AdamW
from pagemem.engine.config import EngineConfig
from pagemem.errors import ConfigError
from pagemem.models.gpt import GPTConfig
from pagemem.plain import field_names, from_plain, to_plain, with_overrides

AUTO = "auto"
AUTO_SIZES = ("gpu_bytes", "cpu_bytes", "nvme_bytes")
EXPORTS = ("none", "safetensors", "hf")


@dataclass(frozen=True)
class TrainSettings:
    """The ``[train]`` section: the loop and its run directory."""

    steps: int = 150
    """Iterations (optimizer steps) in the run, counted from its start (a resumed run goes on to it)."""
    log_every: int = 10
    """A log line every this many steps."""
    save_every: int = 50
    """A checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    keep: int = 2
    """Checkpoints kept in the run directory (the newest)."""
    runs: str = "runs"
    """The directory run directories are made in (``runs/<name>/``)."""
    name: str | None = None
    """The run directory's name; None: the start time."""
    progress: bool = True
    """A progress bar (tqdm) on stderr."""
    schedule: str = "constant"
    """The learning rate after warm-up: ``constant``, or ``linear`` / ``cosine`` down to
    ``min_lr_ratio`` times ``optimizer.lr`` at the last step ([Note: the learning-rate schedule])."""
    warmup_steps: int = 0
    """Steps whose learning rate climbs linearly to ``optimizer.lr`` first."""
    min_lr_ratio: float = 0.1
    """Where ``linear`` and ``cosine`` end, as a fraction of ``optimizer.lr``."""
    eval_every: int = 0
    """Evaluate on the validation data every this many steps and at the end (0: never)."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    max_loss: float | None = None
    """Stop the run as for a loss that is not finite when a micro-batch's loss exceeds this (a
    diverging run; the initial loss is about ln(vocabulary)); None: only NaN, infinities and divergence stop it."""
    divergence_nats: float | None = 1.0
    """Stop the run as for a loss that is not finite when the loss's moving average rises this many
    nats above its best so far ([Note: detecting divergence]); None: never."""
    divergence_span: int = 20
    """The span in steps of that moving average (its weight is 2 / (span + 1))."""
    divergence_after: int = 20
    """Steps before divergence may stop the run (the average settles meanwhile)."""
    export: str = "none"
    """At the end, write the weights: ``safetensors`` (``export/``, sharded as Hugging Face's) or
    ``hf`` (that and ``config.json``, and the tokenizer: a ``from_pretrained`` directory; needs
    ``model.hf``); ``none``. ``pagemem export RUN_DIR`` does it afterwards."""

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 1, 1 << 40)
        check_int("log_every", self.log_every, 1, 1 << 40)
        check_int("save_every", self.save_every, 0, 1 << 40)
        check_int("keep", self.keep, 1, 1 << 20)
        check_bool("progress", self.progress)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_int("warmup_steps", self.warmup_steps, 0, 1 << 40)
        r = self.min_lr_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ConfigError(f"min_lr_ratio: must be a fraction in [0, 1], got {r!r}")
        check_int("eval_every", self.eval_every, 0, 1 << 40)
        check_int("eval_batches", self.eval_batches, 1, 1 << 20)
        check_choice("export", self.export, EXPORTS)
        m = self.max_loss
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0 or m == float("inf")):
            raise ConfigError(f"max_loss: must be a positive finite number or None, got {m!r}")
        d = self.divergence_nats
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 100):
            raise ConfigError(f"divergence_nats: must be a number of nats in (0, 100], or None to never stop on "
                              f"divergence, got {d!r}")
        check_int("divergence_span", self.divergence_span, 1, 100_000)
        check_int("divergence_after", self.divergence_after, 0, 1 << 40)
        if not isinstance(self.runs, str) or not self.runs or not self.runs.isprintable():
            raise ConfigError(f"runs: must be a directory path of printable characters, got {self.runs!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name or "/" in self.name
                                      or self.name in (".", "..") or not self.name.isprintable()):
            raise ConfigError(f"name: must be a directory name of printable characters without '/', got {self.name!r}")


@dataclass(frozen=True)
class ModelSettings(GPTConfig):
    """The ``[model]`` section: the project's GPT (its shape), or a Hugging Face causal LM."""

    hf: str | None = None
    """A model type (``"gpt2"``, ``"llama"``: its default config, freshly initialised) or a local
    directory holding a ``config.json``; its weights, when present, are the starting values:
    safetensors (``model.safetensors``, or shards and ``model.safetensors.index.json``) are read
    into the engine one module at a time, the model built on ``meta``
    (``pagemem.commands.models``); needs ``transformers``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hf is not None and (not isinstance(self.hf, str) or not self.hf):
            raise ConfigError(f"hf: must be a model type or a directory, got {self.hf!r}")


SECTIONS = ("train", "model", "data", "engine", "store", "optimizer")
ENGINE_OWN = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("store", "optimizer"))
SECTION_CLASSES: dict[str, type] = {"train": TrainSettings, "model": ModelSettings, "data": DataSettings,
                                    "engine": EngineConfig, "store": StoreConfig, "optimizer": AdamW}
"""The class each section fills (``engine``: its own fields, less ``store`` and ``optimizer``)."""

DEFAULT_TOML = """\
# pagemem train's embedded default: the project's GPT at a small size on a synthetic task,
# a gpu budget below the model's states, optimizer states on nvme, synchronous updates (the
# lock-free updater, engine.lock_free = true, is faster but rules out float16 and clipping, and
# its staleness costs loss where a task approaches zero: issue 33's measurements).
[train]
steps = 150
log_every = 10
save_every = 50

[model]
layers = 4
hidden = 256
heads = 4
vocab = 256
seq = 64

[data]
vocab = 256
seq = 64
batch = 8
branches = 4

[engine]
optimizer_tier = "nvme"
lock_free = false

[store]
page_bytes = "256KiB"
gpu_bytes = "auto"
cpu_bytes = "auto"
nvme_bytes = "auto"
copy_threads = 0

[optimizer]
lr = 1e-3
"""


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``pagemem train`` runs with, validated; ``auto`` sizes still to resolve are
    named in ``auto`` (their fields hold a placeholder until :meth:`with_sizes`)."""

    train: TrainSettings
    model: ModelSettings
    data: DataSettings
    engine: EngineConfig
    auto: tuple[str, ...] = ()
    """Store fields the file left to pagemem: sizes still to resolve, and ``nvme_path`` (which
    stays the run directory's own)."""

    def with_sizes(self, **sizes: int) -> "TrainConfig":
        """The config with ``auto`` store sizes given (``gpu_bytes=...``)."""
        store = dataclasses.replace(self.engine.store, **sizes)
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, store=store),
                                   auto=tuple(a for a in self.auto if a not in sizes))

    def to_plain(self) -> dict[str, Any]:
        """The file layout (sections as in ``DEFAULT_TOML``), every value resolved."""
        engine = to_plain(self.engine)
        out = {"train": to_plain(self.train), "model": to_plain(self.model), "data": to_plain(self.data),
               "store": engine.pop("store"), "optimizer": engine.pop("optimizer"), "engine": engine}
        for name in self.auto:
            out["store"][name] = None if name == "nvme_path" else AUTO
        return out


def known_settings() -> list[str]:
    """Every dotted setting a file or flag may give."""
    return ([f"train.{n}" for n in field_names(TrainSettings)] + [f"model.{n}" for n in field_names(ModelSettings)]
            + [f"data.{n}" for n in field_names(DataSettings)] + [f"engine.{n}" for n in ENGINE_OWN]
            + [f"store.{n}" for n in field_names(StoreConfig)] + [f"optimizer.{n}" for n in field_names(AdamW)])


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's tables (errors name the file and line)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: {os.fspath(path)} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config: {os.fspath(path)} is a directory, not a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: {os.fspath(path)} is not valid TOML ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"config: cannot read {os.fspath(path)} ({exc.strerror})") from None


def layered(files: list[Mapping[str, Any]], overrides: Mapping[str, str], world_size: int = 1) -> dict[str, Any]:
    """The default, then each file's tables over it, then the dotted overrides. With several
    ranks (``world_size``) the default trains without the lock-free updater, which runs in one
    process only; a file or flag that asks for it is refused by the engine."""
    known = set(known_settings())
    out: dict[str, Any] = tomllib.loads(DEFAULT_TOML)
    if world_size > 1:
        out["engine"]["lock_free"] = False
    for data in files:
        for section, table in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{section}: unknown section; known: {', '.join(SECTIONS)}")
            if not isinstance(table, Mapping):
                raise ConfigError(f"{section}: must be a table ([{section}]), got a {type(table).__name__}")
            for key in table:
                if f"{section}.{key}" not in known and not isinstance(table[key], Mapping):
                    raise ConfigError(f"{section}.{key}: unknown key; known in [{section}]: "
                                      + ", ".join(k.split(".", 1)[1] for k in known if k.startswith(section + ".")))
            out.setdefault(section, {}).update(table)
    bad = [k for k in overrides if k not in known]
    if bad:
        raise ConfigError(f"{bad[0]}: unknown setting (see `pagemem train --help_config` for every setting)")
    return overridden(out, overrides)


def overridden(plain: Mapping[str, Any], overrides: Mapping[str, str]) -> dict[str, Any]:
    """``plain`` with the dotted command-line ``overrides`` set: a text field (``train.name``,
    ``data.path``) takes the text as it is (``none`` or ``null``: unset, where it may be), any
    other a TOML value where the text is one (``3e-4``, ``true``, ``[0.9, 0.95]``) else the text."""
    texts = text_settings()
    out = with_overrides(plain, {k: v for k, v in overrides.items() if k not in texts})
    for dotted, text in overrides.items():
        if dotted in texts:
            section, key = dotted.split(".", 1)
            out.setdefault(section, {})[key] = None if texts[dotted] and text.lower() in ("none", "null") else text
    return out


def text_settings() -> dict[str, bool]:
    """The dotted settings whose field holds text only, each with whether it may be None."""
    out = {}
    for section, cls in SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            options = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) in (
                typing.Union, types.UnionType) else (hints[f.name],)
            if f.init and options and all(o in (str, type(None)) for o in options) and str in options:
                out[f"{section}.{f.name}"] = type(None) in options
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string after it in the class body), first sentence, for
    ``--help_config``; a subclass's over its bases'."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        described = " ".join((klass.__doc__ or "").split())
        for f in dataclasses.fields(klass):  # a class that describes its fields in its docstring
            found = re.search(rf"``{f.name}``: (.+?)(?:(?<=[a-z0-9)\]`])\.(?: |$)|; ``)", described)
            if found:
                text = found.group(1).replace("``", "")
                docs[f.name] = text[0].upper() + text[1:] + "."
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                text = " ".join(b.value.value.split()).replace("``", "")
                docs[a.target.id] = re.split(r"(?<=[a-z0-9)\]])\. (?=[A-Z(])", text)[0].rstrip(".") + "."
    return docs


def resolve(plain: Mapping[str, Any], run_dir: str) -> TrainConfig:
    """Validate the layered tables into a :class:`TrainConfig` (``run_dir``: where ``nvme_path``
    defaults to, when optimizer states go to nvme)."""
    train = from_plain(TrainSettings, plain.get("train", {}), "train")
    model = from_plain(ModelSettings, plain.get("model", {}), "model")
    data = from_plain(DataSettings, plain.get("data", {}), "data")
    if train.export == "hf" and model.hf is None:
        raise ConfigError('train.export: "hf" needs model.hf (a Hugging Face model); the project\'s GPT exports '
                          '"safetensors"')
    if model.hf is None:
        if data.synthetic and data.vocab > model.vocab:
            raise ConfigError(f"data.vocab: must be at most model.vocab ({model.vocab}), got {data.vocab}")
        if data.seq > model.seq:
            raise ConfigError(f"data.seq: must be at most model.seq ({model.seq}), got {data.seq}")
    store = dict(plain.get("store", {}))
    auto = tuple(k for k in AUTO_SIZES if store.get(k) == AUTO)
    for k in auto:
        store[k] = store.get("page_bytes", StoreConfig.page_bytes)  # a placeholder, until resolved
    engine_own = dict(plain.get("engine", {}))
    tier = engine_own.get("optimizer_tier", EngineConfig.optimizer_tier)
    if engine_own.get("home_tier") == "nvme":
        tier = "nvme"  # compute copies and gradient sums there: the page files need a directory too
    if tier == "nvme" and store.get("nvme_path") is None:
        store["nvme_path"] = os.path.join(run_dir, "nvme")
        auto += ("nvme_path",)  # written back as None: the run directory's own, wherever it is
    if tier != "nvme" and "nvme_bytes" in auto:
        store["nvme_bytes"] = 0
        auto = tuple(a for a in auto if a != "nvme_bytes")
    store_cfg = from_plain(StoreConfig, store, "store")
    optimizer = from_plain(AdamW, plain.get("optimizer", {}), "optimizer")
    try:
        engine = from_plain(EngineConfig, {**engine_own, "store": store_cfg, "optimizer": optimizer}, "engine")
    except ConfigError as exc:
        if "lock_free" in str(exc) and "float16" in str(exc):  # what to change, as pagemem train's flags
            raise ConfigError(f"{exc}; give --engine.lock_free false (float16 with loss scaling) or "
                              "--engine.compute_dtype bfloat16") from None
        raise
    return TrainConfig(train, model, data, engine, auto)


def to_toml(plain: Mapping[str, Any]) -> str:
    """The file layout as TOML text (the resolved config a run directory keeps)."""
    lines: list[str] = []
    for section in SECTIONS:
        table = plain.get(section)
        if not table:
            continue
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:  # TOML has no null: a missing key is its default, None
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # a basic string: JSON's escapes are TOML's (DEL escaped too)
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} as TOML")
