"""``pagemem train``: train a model through the engine from one config, into a run directory.

With no arguments it trains the embedded default (``train_config.DEFAULT_TOML``): the project's
GPT at a small size on a synthetic task generated on the fly, a gpu budget below the model's
states, optimizer states on nvme under the run directory, synchronous updates. ``--config
FILE`` layers a TOML file over it and ``--SECTION.FIELD VALUE`` sets one field
(``--optimizer.lr 3e-4``, ``--store.gpu_bytes 2GiB``, ``--model.hf gpt2``); ``--help_config``
lists every setting. ``--resume auto`` continues the newest run under ``train.runs`` from its
last checkpoint with its saved config (``--resume RUN_DIR`` a given one).
Under torchrun it trains data parallel over the ranks, and a restarted attempt resumes
([Note: pagemem train under torchrun] in ``train_ranks.py``).

[Note: Ctrl-C in pagemem train] A Ctrl-C during a step (its ``accumulation_steps``
forwards and backwards, the update, its metrics line and timeline events) is held (the engine's
``shield``) until the step is whole, so the metrics hold every step a checkpoint holds. A second
Ctrl-C lands at once: a backward it interrupts is discarded (the engine's step transaction),
gradients no update took are discarded, an update it interrupts is finished (``step()`` again,
the same bits as an uninterrupted one). Then the engine saves a checkpoint of the last whole
step, the run directory gets its plots, timelines and summary, and the command exits 130. A second Ctrl-C during that save stops at once; ``latest`` still names
the previous checkpoint, so the run stays resumable. SIGTERM takes the same path and exits 143
([Note: SIGTERM as Ctrl-C] in ``train_signals.py``); the loop is ``train_loop.py``. The batches are a pure function of the
step, and a checkpoint holds the whole training state, so a resumed run ends with the weights
an uninterrupted one would, bit for bit, where training is deterministic (synchronous updates,
or ``max_staleness=0``: lock-free staleness depends on thread timing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable

from pagemem.commands import auto_sizes
from pagemem.commands.models import build
from pagemem.commands.run_dir import RunDir
from pagemem.commands.train_config import (
    AUTO_SIZES,
    SECTION_CLASSES,
    TrainConfig,
    TrainSettings,
    field_docs,
    known_settings,
    layered,
    overridden,
    read_toml,
    resolve,
    to_toml,
)
from pagemem.commands.train_data import Batches
from pagemem.commands.train_estimate import host_estimate
from pagemem.commands.train_loop import Loop
from pagemem.commands.train_ranks import Launch, agreed, launch_from_env, on_device, process_group, restart_target
from pagemem.commands.train_signals import sigterm_as_interrupt
from pagemem.engine import Engine
from pagemem.errors import ConfigError, OutOfMemory, PageMemError
from pagemem.plain import from_plain

SET = "set:"
CHECKPOINT_BYTES_PER_PARAMETER = 16
"""A checkpoint's bytes per trainable parameter, about: fp32 master weights, two Adam moments and
the compute copy (its dtype's bytes; fp32 at most) (the free-space check at start)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="a TOML config layered over the embedded default (several: in order)")
    parser.add_argument("--resume", metavar="auto|RUN_DIR",
                        help="continue the newest run under train.runs (auto) or RUN_DIR from its last checkpoint; "
                             "settings given with it are saved with the run")
    parser.add_argument("--help_config", action="store_true",
                        help="list every setting with its default and what it does, and exit")
    for name in known_settings():
        parser.add_argument(f"--{name}", dest=SET + name, metavar="VALUE", default=None, help=argparse.SUPPRESS)
    parser.epilog = ("Every config field is a flag: --SECTION.FIELD VALUE (see --help_config). --model.hf takes a "
                     "model type (fresh weights) or a directory with config.json; safetensors weights there "
                     "(model.safetensors, or shards with model.safetensors.index.json) are the starting values, "
                     "read into the engine a module at a time. --data.path trains on your data: a text file or "
                     "directory (with --data.tokenizer, or model.hf's tokenizer), a token file (.bin), or a saved "
                     "dataset. SIGTERM, like Ctrl-C, saves a checkpoint and exits (143).")


def run(args: argparse.Namespace) -> int:
    overrides = {k[len(SET):]: v for k, v in vars(args).items() if k.startswith(SET) and v is not None}
    files = [read_toml(path) for path in args.config]
    if args.help_config:
        return _help_config(layered(files, {}))
    launch = launch_from_env()  # [Note: pagemem train under torchrun]
    with sigterm_as_interrupt(), process_group(launch, layered(files, overrides, launch.world_size)):
        return _run(args, files, overrides, launch)


def _start(args: argparse.Namespace, files: list[dict[str, Any]], overrides: dict[str, str],
           launch: Launch, made: list[str]) -> tuple[str, dict[str, Any], bool]:
    """Rank 0's choice: the run directory, the config it runs with, and whether it resumes
    (``--resume``, or a torchrun restart: ``restart_target``). A resume runs with the run's
    saved config and the settings given with it (saved too, once it has started)."""
    resume = args.resume
    if not resume:
        train = from_plain(TrainSettings, layered(files, overrides, launch.world_size)["train"], "train")
        resume = restart_target(launch, train.runs, train.name)
    if resume:
        if args.resume and args.config:
            raise ConfigError("config: --resume runs with the run's saved config; give changes as --SECTION.FIELD "
                              "flags, not --config")
        layered(files, overrides, launch.world_size)  # the flags' names checked
        runs = from_plain(TrainSettings, layered(files, overrides, launch.world_size)["train"], "train").runs
        rd = RunDir.newest(runs) if resume == "auto" else RunDir.named(resume)
        return rd.path, overridden(rd.read_config(), overrides), True
    plain = layered(files, overrides, launch.world_size)
    return _new_run_dir(from_plain(TrainSettings, plain["train"], "train"), made), plain, False


def _run(args: argparse.Namespace, files: list[dict[str, Any]], overrides: dict[str, str], launch: Launch) -> int:
    started = time.time()
    made: list[str] = []  # the run directory this process made (a SIGTERM may land as soon as it exists)
    rd: RunDir | None = None
    engine: Engine | None = None
    try:
        path, plain, resume = agreed(launch, lambda: _start(args, files, overrides, launch, made))
        rd, plain = RunDir(path), on_device(launch, plain)
        if launch.lead:
            rd.lock()  # a second writer is refused, naming this process
            for name in rd.remove_stale_page_files():
                print(f"pagemem train: removed {name}, a page file a killed run left", file=sys.stderr)
        engine, cfg, loss_of, batches, device = _open(rd, plain, resume, launch)
        if launch.lead:
            rd.write_config(cfg.to_plain(), to_toml(cfg.to_plain()))
            rd.add_history(engine.global_step, cfg.to_plain(), overrides)
            if cfg.model.hf is not None and os.path.isdir(cfg.model.hf) and cfg.data.synthetic and not resume:
                print(f"pagemem train: note: {cfg.model.hf}'s weights train on the synthetic task's random tokens; "
                      "give --data.path to fine-tune them on your data", file=sys.stderr)
            if not (cfg.engine.store.gpu_backend != "host" and _cuda()):
                print(host_estimate(engine.module, cfg), file=sys.stderr)
            if resume and not args.resume:
                print(f"pagemem train: torchrun restart {launch.restart}: resuming {rd.path} from its last "
                      f"checkpoint (step {engine.global_step})", file=sys.stderr)
    except BaseException:  # Ctrl-C and SIGTERM too
        if engine is not None:
            engine.close()  # its page files go
        if rd is not None:
            rd.unlock()
        for path in made:  # nothing of this run exists yet: leave nothing behind
            _remove_tree(path)
        raise
    created = bool(made)
    try:
        if resume and engine.global_step >= cfg.train.steps:
            engine.close()
            if launch.lead:
                print(f"pagemem train: {rd.path} has finished its {cfg.train.steps} steps (give --train.steps N "
                      "to go on)")
            return 0
        try:
            return Loop(cfg, rd, engine, loss_of, batches, device, launch, started).run()
        except BaseException:
            if created and not rd.metrics():  # not one step: nothing to resume or to read
                engine.close()
                _remove_tree(rd.path)
            raise
    finally:
        rd.unlock()


def _open(rd: RunDir, plain: dict[str, Any], resume: bool, launch: Launch) -> tuple[Engine, TrainConfig, Any,
                                                                                       Batches, Any]:
    """The run's engine (new, or resumed from its newest intact checkpoint), its resolved config,
    loss, batches and device."""
    on_disk = "nvme" in (plain.get("engine", {}).get("optimizer_tier"), plain.get("engine", {}).get("home_tier"))
    if on_disk and plain.get("store", {}).get("nvme_path") is None:
        os.makedirs(os.path.join(rd.path, "nvme"), exist_ok=True)  # where resolve() puts the page files
    cfg = resolve(plain, rd.path)
    _check_host_memory(cfg)
    built = build(cfg.model, cfg.data.seed)
    model, loss_of = built.model, built.loss_of
    if cfg.model.hf is not None and (cfg.data.synthetic and cfg.data.vocab > built.vocab or cfg.data.seq > built.longest):
        raise ConfigError(f"data: vocab {cfg.data.vocab} and seq {cfg.data.seq} must be at most the model's "
                          f"({built.vocab} and {built.longest})")
    model_dir = cfg.model.hf if cfg.model.hf is not None and os.path.isdir(cfg.model.hf) else None
    batches = Batches(cfg.data, launch.rank, launch.world_size, model_dir, built.vocab)
    import torch

    on_cuda = cfg.engine.store.gpu_backend != "host" and _cuda()
    device = torch.device("cuda", cfg.engine.store.cuda_device) if on_cuda else torch.device("cpu")

    def batch(i: int) -> torch.Tensor:  # where the model computes: the gpu tier's device
        return batches.train(i).to(device, non_blocking=True)

    probe = "gpu_bytes" in cfg.auto and (cfg.engine.store.gpu_backend == "host" or not _cuda())
    # a model on meta (its values in files) is sized through a stand-in of the same shapes
    sizing = build(cfg.model, cfg.data.seed, weights=False).model if probe and built.values else model
    cfg = _sized(cfg, sizing, lambda: loss_of(sizing, batch(0)).backward())
    if probe and not resume:
        cfg = _tried(cfg, loss_of, batch)
        model = build(cfg.model, cfg.data.seed).model  # the tries trained a copy: start afresh
    if launch.lead:
        os.makedirs(rd.path, exist_ok=True)
        _check_free_space(rd, model, cfg)
    if resume:
        engine = _load_newest_intact(rd, model, cfg, launch)
        if launch.lead:
            rd.keep_metrics_until(engine.global_step)
    else:
        try:
            engine = Engine(model, cfg.engine, values=built.values)
        except ConfigError as exc:  # the store's and engine's checks name their own fields: give the section
            raise ConfigError(dotted(str(exc))) from None
    return engine, cfg, loss_of, batches, device


def dotted(message: str) -> str:
    """``message`` with a bare field name it starts with (``gpu_bytes: ...``) given its section
    (``store.gpu_bytes: ...``)."""
    name = message.split(":", 1)[0]
    for section in ("store", "engine", "optimizer"):
        if f"{section}.{name}" in known_settings():
            return f"{section}.{message}"
    return message


def _load_newest_intact(rd: RunDir, model: Any, cfg: TrainConfig, launch: Launch) -> Engine:
    """The engine from ``latest``; where that is damaged, from the newest checkpoint that is
    not, with a warning (a refused load leaves ``model`` as it was)."""
    try:
        engine = Engine.load(rd.checkpoints, model, cfg.engine)
    except PageMemError as first:
        if launch.data_parallel:
            raise
        older = sorted((n for n in os.listdir(rd.checkpoints) if n.startswith("step-")
                        and os.path.isdir(os.path.join(rd.checkpoints, n))), reverse=True)
        for name in older:
            try:
                engine = Engine.load(os.path.join(rd.checkpoints, name), model, cfg.engine)
            except PageMemError:
                continue
            print(f"pagemem train: warning: the checkpoint latest names is damaged ({first}); resuming from {name}, "
                  "the newest intact one", file=sys.stderr)
            break
        else:
            raise
    return engine


def _check_host_memory(cfg: TrainConfig) -> None:
    """Refuse a model whose weights host memory cannot hold while it is built (before building
    it: an allocation that large fails with a traceback, or wakes the OOM killer). A
    ``model.hf`` directory with safetensors weights is built on ``meta``: never refused here."""
    from pagemem.commands.models import has_safetensors, shapes_only
    from pagemem.machine import host_memory_available

    if cfg.model.hf is not None and os.path.isdir(cfg.model.hf) and has_safetensors(cfg.model.hf):
        return
    shape = shapes_only(cfg.model, cfg.data.seed)
    need = sum(p.numel() * p.element_size() for p in shape.parameters())
    have = host_memory_available()
    if have is not None and need > have:
        from pagemem.units import format_bytes

        raise ConfigError(f"model: its weights take {format_bytes(need)} of host memory while it is built, and "
                          f"{format_bytes(have)} is available; give a smaller model, or a model.hf directory with "
                          "safetensors weights (read into the engine a module at a time)")


def _check_free_space(rd: RunDir, model: Any, cfg: TrainConfig) -> None:
    """Refuse a run whose disk cannot hold ``train.keep`` checkpoints (and the one being written)."""
    params = sum(p.numel() for p in model.parameters())
    each = params * CHECKPOINT_BYTES_PER_PARAMETER
    have = len([n for n in os.listdir(rd.checkpoints) if n.startswith("step-")]) if os.path.isdir(rd.checkpoints) else 0
    need = max(0, cfg.train.keep + 1 - have) * each
    free = shutil.disk_usage(rd.path).free
    if free < need:
        from pagemem.units import format_bytes

        raise ConfigError(f"train.keep: {cfg.train.keep} checkpoints (and one being written) need about "
                          f"{format_bytes(need)} more, and the disk of {rd.path} has {format_bytes(free)} free; "
                          "free space, lower train.keep, or give train.runs on another disk")


def _new_run_dir(train: TrainSettings, made: list[str] | None = None) -> str:
    """Make the run's directory, atomically: a given name that exists is refused; the default
    (the start time) takes a suffix, so runs started in the same second get one each."""
    if os.path.exists(train.runs) and not os.path.isdir(train.runs):
        raise ConfigError(f"train.runs: {train.runs} is a file, not a directory; give a directory for the runs")
    os.makedirs(train.runs, exist_ok=True)
    base = os.path.join(train.runs, train.name or time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        held = {signal.SIGINT, signal.SIGTERM}
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)  # made and recorded, or neither
        try:
            os.mkdir(path)
            if made is not None:
                made.append(path)
            return path
        except FileExistsError:
            if train.name:
                raise ConfigError(f"train.name: {path} exists; give another name, or --resume {path}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    raise ConfigError(f"train.runs: no free run directory name under {train.runs}")


def _sized(cfg: TrainConfig, model: Any, iteration: Any) -> TrainConfig:
    """``cfg`` with its ``auto`` sizes resolved (``auto_sizes``)."""
    if not cfg.auto:
        return cfg
    sizes: dict[str, int] = {}
    if "gpu_bytes" in cfg.auto:
        sizes["gpu_bytes"] = auto_sizes.gpu_bytes(model, iteration, cfg.engine)
    sizes.update({k: v for k, v in auto_sizes.host_bytes(model, cfg.engine).items() if k in cfg.auto})
    return cfg.with_sizes(**sizes)


def _tried(cfg: TrainConfig, loss_of: Any, batch: Callable[[int], Any], attempts: int = 4) -> TrainConfig:
    """``cfg`` whose ``auto`` gpu budget held two iterations (traced, then planned) of a fresh
    copy of the model, grown to the least the engine names where it did not (``auto_sizes``);
    with several ranks, on all of them together (the shapes, and so the sizes, are alike)."""
    for _ in range(attempts):
        model = build(cfg.model, cfg.data.seed, weights=False).model  # the budget depends on shapes only
        try:
            with Engine(model, cfg.engine) as engine:
                for step in range(2):
                    engine.backward(loss_of(engine, batch(step)))
                    engine.step()
            return cfg
        except OutOfMemory as exc:
            if exc.least_bytes is None or exc.least_bytes <= cfg.engine.store.gpu_bytes:
                raise
            cfg = cfg.with_sizes(gpu_bytes=auto_sizes.grown(exc.least_bytes, model, cfg.engine))
    raise ConfigError(f"store.gpu_bytes: \"auto\" found no budget that holds this model after {attempts} tries; "
                      "give one")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _help_config(plain: dict[str, Any]) -> int:
    """Every setting, its default (the embedded default's, else the field's) and its description
    (the field's docstring, first sentence)."""
    print("Settings (TOML key in [SECTION], or --SECTION.FIELD VALUE), with the default and what each does:")
    docs = {section: field_docs(cls) for section, cls in SECTION_CLASSES.items()}
    for name in known_settings():
        section, key = name.split(".", 1)
        value = plain.get(section, {}).get(key, _field_default(SECTION_CLASSES[section], key))
        shown = "None" if value is None else repr(value)
        print(f"  --{name:<34} {shown}")
        doc = docs[section].get(key.split(".")[0])
        if doc:
            print(f"      {doc}")
    print(f"Sizes {', '.join(AUTO_SIZES)} also take \"auto\". Text fields take the text as given; none: unset.")
    return 0


def _field_default(cls: type, dotted: str) -> Any:
    import dataclasses
    import typing

    first, _, rest = dotted.partition(".")
    f = next(f for f in dataclasses.fields(cls) if f.name == first)
    if rest:
        inner = next(o for o in typing.get_args(typing.get_type_hints(cls)[first]) or (typing.get_type_hints(cls)[first],)
                     if dataclasses.is_dataclass(o))
        return _field_default(inner, rest)
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    from pagemem.plain import to_plain

    return to_plain(value)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
