"""``pagemem train``: train a model through the engine from one config, into a run directory.

With no arguments it trains the embedded default (``train_config.DEFAULT_TOML``): the project's
GPT at a small size on a synthetic task generated on the fly, a gpu budget below the model's
states, optimizer states on nvme under the run directory, the lock-free updater. ``--config
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
the previous checkpoint, so the run stays resumable. The batches are a pure function of the
step, and a checkpoint holds the whole training state, so a resumed run ends with the weights
an uninterrupted one would, bit for bit, where training is deterministic (synchronous updates,
or ``max_staleness=0``: lock-free staleness depends on thread timing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable

from pagemem.commands import auto_sizes
from pagemem.commands.models import build
from pagemem.commands.run_dir import RunDir
from pagemem.commands.train_report import log_line, summary_table
from pagemem.commands.train_ranks import (
    Launch,
    RankTotals,
    StepExchange,
    agreed,
    die_if_asked,
    launch_from_env,
    on_device,
    process_group,
    restart_target,
)
from pagemem.commands.train_config import (
    AUTO_SIZES,
    TrainConfig,
    TrainSettings,
    known_settings,
    layered,
    read_toml,
    resolve,
    to_toml,
)
from pagemem.engine import Engine
from pagemem.engine.interrupts import shield
from pagemem.errors import ConfigError, OutOfMemory
from pagemem.plain import from_plain, with_overrides

SET = "set:"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="a TOML config layered over the embedded default (several: in order)")
    parser.add_argument("--resume", metavar="auto|RUN_DIR",
                        help="continue the newest run under train.runs (auto) or RUN_DIR from its last checkpoint")
    parser.add_argument("--help_config", action="store_true", help="list every setting with its default, and exit")
    for name in known_settings():
        parser.add_argument(f"--{name}", dest=SET + name, metavar="VALUE", default=None, help=argparse.SUPPRESS)
    parser.epilog = ("Every config field is a flag: --SECTION.FIELD VALUE (see --help_config). --model.hf takes a "
                     "model type (fresh weights) or a directory with config.json; safetensors weights there "
                     "(model.safetensors, or shards with model.safetensors.index.json) are the starting values, "
                     "read into the engine a module at a time.")


def run(args: argparse.Namespace) -> int:
    overrides = {k[len(SET):]: v for k, v in vars(args).items() if k.startswith(SET) and v is not None}
    files = [read_toml(path) for path in args.config]
    if args.help_config:
        return _help_config(layered(files, {}))
    launch = launch_from_env()  # [Note: pagemem train under torchrun]
    with process_group(launch, layered(files, overrides, launch.world_size)):
        return _run(args, files, overrides, launch)


def _start(args: argparse.Namespace, files: list[dict[str, Any]], overrides: dict[str, str],
           launch: Launch) -> tuple[str, dict[str, Any], bool]:
    """Rank 0's choice: the run directory, the config it runs with, and whether it resumes
    (``--resume``, or a torchrun restart: ``restart_target``)."""
    resume = args.resume
    if not resume:
        train = from_plain(TrainSettings, layered(files, overrides, launch.world_size)["train"], "train")
        resume = restart_target(launch, train.runs, train.name)
    if resume:
        runs = from_plain(TrainSettings, layered(files, overrides, launch.world_size)["train"], "train").runs
        rd = RunDir.newest(runs) if resume == "auto" else RunDir.named(resume)
        return rd.path, with_overrides(rd.read_config(), overrides), True
    plain = layered(files, overrides, launch.world_size)
    return _new_run_dir(from_plain(TrainSettings, plain["train"], "train")), plain, False


def _run(args: argparse.Namespace, files: list[dict[str, Any]], overrides: dict[str, str], launch: Launch) -> int:
    path, plain, resume = agreed(launch, lambda: _start(args, files, overrides, launch))
    rd, plain = RunDir(path), on_device(launch, plain)
    created = launch.lead and not resume
    try:
        on_disk = "nvme" in (plain.get("engine", {}).get("optimizer_tier"), plain.get("engine", {}).get("home_tier"))
        if on_disk and plain.get("store", {}).get("nvme_path") is None:
            os.makedirs(os.path.join(rd.path, "nvme"), exist_ok=True)  # where resolve() puts the page files
        cfg = resolve(plain, rd.path)
        built = build(cfg.model, cfg.data.seed)
        model, loss_of = built.model, built.loss_of
        if cfg.model.hf is not None and (cfg.data.vocab > built.vocab or cfg.data.seq > built.longest):
            raise ConfigError(f"data: vocab {cfg.data.vocab} and seq {cfg.data.seq} must be at most the model's "
                              f"({built.vocab} and {built.longest})")
        table = cfg.data.table()
        rows = functools.partial(cfg.data.batch_at, table=table, rank=launch.rank, world_size=launch.world_size)
        import torch

        on_cuda = cfg.engine.store.gpu_backend != "host" and _cuda()
        device = torch.device("cuda", cfg.engine.store.cuda_device) if on_cuda else torch.device("cpu")

        def batch(i: int) -> torch.Tensor:  # where the model computes: the gpu tier's device
            return rows(i).to(device, non_blocking=True)

        probe = "gpu_bytes" in cfg.auto and (cfg.engine.store.gpu_backend == "host" or not _cuda())
        # a model on meta (its values in files) is sized through a stand-in of the same shapes
        sizing = build(cfg.model, cfg.data.seed, weights=False).model if probe and built.values else model
        cfg = _sized(cfg, sizing, lambda: loss_of(sizing, batch(0)).backward())
        if probe and not resume:
            cfg = _tried(cfg, loss_of, batch)
            model = build(cfg.model, cfg.data.seed).model  # the tries trained a copy: start afresh
        if launch.lead:
            os.makedirs(rd.path, exist_ok=True)
        if resume:
            engine = Engine.load(rd.checkpoints, model, cfg.engine)
            if launch.lead:
                rd.keep_metrics_until(engine.global_step)
                if not args.resume:
                    print(f"pagemem train: torchrun restart {launch.restart}: resuming {rd.path} from its last "
                          f"checkpoint (step {engine.global_step})", file=sys.stderr)
        else:
            engine = Engine(model, cfg.engine, values=built.values)
            if launch.lead:
                rd.write_config(cfg.to_plain(), to_toml(cfg.to_plain()))
    except BaseException:
        if created:  # nothing of this run exists yet: leave nothing behind
            _remove_tree(rd.path)
        raise
    if resume and engine.global_step >= cfg.train.steps:
        engine.close()
        if launch.lead:
            print(f"pagemem train: {rd.path} has finished its {cfg.train.steps} steps (give --train.steps N to go on)")
        return 0
    try:
        return _Loop(cfg, rd, engine, loss_of, batch, launch).run()
    except Exception:
        if created and not rd.metrics():  # not one step: nothing to resume or to read
            _remove_tree(rd.path)
        raise


def _new_run_dir(train: TrainSettings) -> str:
    """Make the run's directory, atomically: a given name that exists is refused; the default
    (the start time) takes a suffix, so runs started in the same second get one each."""
    os.makedirs(train.runs, exist_ok=True)
    base = os.path.join(train.runs, train.name or time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            if train.name:
                raise ConfigError(f"train.name: {path} exists; give another name, or --resume {path}") from None
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


class _Loop:
    """The training loop, its metrics and its ending (see [Note: Ctrl-C in pagemem train])."""

    def __init__(self, cfg: TrainConfig, rd: RunDir, engine: Engine, loss_of: Any, batch: Callable[[int], Any],
                 launch: Launch) -> None:
        self.cfg, self.rd, self.engine, self.loss_of, self.batch, self.launch = cfg, rd, engine, loss_of, batch, launch
        self.tokens = cfg.data.batch * cfg.data.seq * cfg.engine.accumulation_steps
        """Tokens one rank trains on in a step."""
        self.saved_at = engine.global_step if rd.has_checkpoint() else -1
        self.peak_used: dict[str, int] = {}
        self.exchange = StepExchange(launch, engine.ranks.device)
        self.ranks = RankTotals(launch.world_size, self.tokens)

    def run(self) -> int:
        from tqdm import tqdm

        t = self.cfg.train
        start = self.engine.global_step
        lead = self.launch.lead  # [Note: pagemem train under torchrun]: rank 0 writes and prints
        bar = tqdm(total=t.steps, initial=start, disable=None if t.progress and lead else True, unit="step",
                   file=sys.stderr, dynamic_ncols=True, leave=False)
        interrupted = False
        try:
            try:
                self._steps(start, bar)
            except KeyboardInterrupt:
                interrupted = True
                self._whole()
            bar.close()
            self._save()
            summary = self._finish(interrupted) if lead else None
        finally:
            bar.close()
            self.engine.close()
        if summary is None:
            return 130 if interrupted else 0
        print(summary_table(summary))
        if interrupted:
            print(f"pagemem train: interrupted after step {summary['steps_done']}; continue with "
                  f"`pagemem train --resume {self.rd.path}` (or --resume auto)", file=sys.stderr)
            return 130
        return 0

    def _steps(self, start: int, bar: Any) -> None:
        """The steps; lock-free on the host stand-in, with the compute and the updater on their
        own cores ([Note: a core partition] in ``engine/updates/partition.py``)."""
        from pagemem.engine.updates.partition import host_partition

        store = self.cfg.engine.store
        partition = host_partition(self.cfg.engine.lock_free, store.gpu_backend == "host" or not _cuda())
        with partition.applied() if partition is not None else contextlib.nullcontext():
            self._steps_on(start, bar, partition)

    def _steps_on(self, start: int, bar: Any, partition: Any) -> None:
        engine, t = self.engine, self.cfg.train
        before = engine.stats()
        acc = self.cfg.engine.accumulation_steps
        for step in range(start, t.steps):
            if partition is not None and step == start + 3:  # the engine's threads started since
                partition.apply()
            die_if_asked(self.launch, step + 1)  # a test hook (tests/test_cmd_train_ranks.py)
            t0 = time.perf_counter()
            losses = []
            with shield():  # a Ctrl-C from here on lands when the step and its record are whole
                # a step is accumulation_steps backwards, each over its own batch
                for micro in range(acc):
                    loss = self.loss_of(engine, self.batch(step * acc + micro))
                    engine.backward(loss)
                    losses.append(float(loss.detach()))
                t1 = time.perf_counter()
                # the lock-free updater takes the gradients away: their norm is not kept
                grad_norm = None if self.cfg.engine.lock_free else engine.get_global_grad_norm()
                t2 = time.perf_counter()
                engine.step()
                t3 = time.perf_counter()
                stats = engine.stats()
                sent = stats["ranks"]["sent_bytes"] - before["ranks"]["sent_bytes"]
                rows = self.exchange(sum(losses) / acc, t3 - t0, sent)  # every rank's, in rank order
                m = self._metrics(step + 1, rows, grad_norm, t3 - t0, stats, before)
                before = stats
                logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps
                if logged and self.launch.data_parallel:
                    m["ranks"] = self.ranks.interval()
                if self.launch.lead:
                    self.rd.append_metrics(m)
                    for name, a, b in (("forward and backward", t0, t1), ("grad norm", t1, t2), ("step", t2, t3)):
                        self.rd.phase(name, a, b - a, step + 1)
                    self.rd.counters(t3, m["tier_used_bytes"])
                bar.update(1)
                if logged and self.launch.lead:
                    bar.write(log_line(m), file=sys.stdout)
            if t.save_every and (step + 1) % t.save_every == 0:
                self._save()

    def _whole(self) -> None:
        """After a Ctrl-C: the engine at a whole step (see the Note). Only a second Ctrl-C gets
        inside a step; then an interrupted update is finished, and gradients no step took are
        discarded (handed on, with lock-free, whose sums share them: that step counts)."""
        engine = self.engine
        if engine.update_unfinished:
            engine.step()  # the same bits as an uninterrupted update
        elif engine.gradients_pending:
            if self.cfg.engine.lock_free:
                engine.step()
            else:
                engine.zero_grad()

    def _metrics(self, step: int, rows: list[tuple[float, float, int]], grad_norm: float | None, seconds: float,
                 stats: dict, before: dict) -> dict[str, Any]:
        """The step's metrics line; ``rows``: every rank's (loss, seconds, bytes sent): the loss is
        their mean (the combined batch's), ``tokens_per_s`` the ranks' sum."""
        self.ranks.add(rows)
        loss = sum(r[0] for r in rows) / len(rows)
        used = {n: t["used_bytes"] for n, t in stats["tiers"].items()}
        for n, b in used.items():
            self.peak_used[n] = max(self.peak_used.get(n, 0), b)
        moved = {k: (v - before["moved_bytes"].get(k, 0)) / seconds for k, v in stats["moved_bytes"].items()}
        staleness = stats["staleness"]
        return {"step": step, "loss": loss, "grad_norm": grad_norm, "seconds": seconds,
                "tokens_per_s": sum(self.tokens / r[1] for r in rows), "gpu_peak_bytes": stats["gpu_peak_bytes"],
                "gpu_budget_bytes": stats["gpu_budget_bytes"], "tier_used_bytes": used, "moved_bytes_per_s": moved,
                "gpu_idle": stats["gpu_idle"], "staleness_mean": staleness["mean"] if staleness else None}

    def _save(self) -> None:
        step = self.engine.global_step
        if step != self.saved_at:
            try:
                self.engine.save(self.rd.checkpoints, keep=self.cfg.train.keep)
            finally:  # a Ctrl-C held during the save lands once it is whole: it is saved
                if self.rd.latest_step() == step:
                    self.saved_at = step

    def _finish(self, interrupted: bool) -> dict[str, Any]:
        from pagemem.sched import HardwareProfile, simulate

        engine, rd = self.engine, self.rd
        stats = engine.stats()
        plan, trace = engine.pager.last_plan, engine.pager.last_trace
        planned, profile = None, "dev-vm" if self.cfg.engine.store.gpu_backend == "host" or not _cuda() else "a100-server"
        if plan is not None and trace is not None:
            planned = simulate(plan, trace, HardwareProfile.builtin(profile))
        rd.write_timelines(trace, planned)
        metrics = rd.metrics()
        if metrics:
            rd.write_plots(metrics, self.cfg.data.floor)
        steady = [m["tokens_per_s"] for m in metrics[3:]] or [m["tokens_per_s"] for m in metrics]
        head, tail = metrics[:10], metrics[-10:]
        budgets = {"gpu": stats["gpu_budget_bytes"], **{n: t["capacity_bytes"] for n, t in stats["tiers"].items()
                                                        if n != "gpu"}}
        summary = {
            "run_dir": rd.path, "steps_done": engine.global_step, "steps": self.cfg.train.steps,
            "interrupted": interrupted,
            "tokens_per_s": statistics.median(steady) if steady else None,
            "first_loss": statistics.mean(m["loss"] for m in head) if head else None,
            "last_loss": statistics.mean(m["loss"] for m in tail) if tail else None,
            "loss_floor": self.cfg.data.floor,
            "peak_bytes": {"gpu": stats["gpu_peak_bytes"], **{n: b for n, b in self.peak_used.items() if n != "gpu"}},
            "budget_bytes": budgets,
            "moved_bytes": stats["moved_bytes"], "gpu_idle": stats["gpu_idle"], "replans": stats["replans"],
            "staleness": stats["staleness"], "planned_iteration_s": planned.iteration_time if planned else None,
            "profile": profile,
            "homes": {"compute and gradient sums": stats["home_tier"], "optimizer states": stats["optimizer_tier"]},
            "world_size": self.launch.world_size, "ranks": self.ranks.overall(),
        }
        rd.write_summary(summary)
        return summary


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _help_config(plain: dict[str, Any]) -> int:
    print("Settings (TOML key in [SECTION], or --SECTION.FIELD VALUE), with the embedded default:")
    for name in known_settings():
        section, key = name.split(".", 1)
        value = plain.get(section, {}).get(key, "(the field's default)")
        print(f"  --{name:<36} {value!r}")
    print(f"Sizes {', '.join(AUTO_SIZES)} also take \"auto\".")
    return 0


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
