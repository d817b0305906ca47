"""``pagemem train``'s loop: the steps, their metrics, evaluation, and how a run ends (finished,
interrupted by Ctrl-C or SIGTERM, or stopped by a loss that is not finite).

[Note: stopping on a loss that is not finite] Each micro-batch's loss is checked before its
backward (against ``train.max_loss`` too, where given, and for divergence: [Note: detecting
divergence] in ``train_divergence.py``), and the gradient norm before the update (not with loss
scaling: float16's overflows skip their update, and the scale falls): one that is NaN or infinite stops the run
before anything of it reaches the weights (with several ranks, the step's exchanged losses are
checked too, after the update: the run stops without saving). Nothing is saved then: the
checkpoints are the last good ones, ``latest`` names the newest, the metrics end at the last
whole step, the summary says why, and the command exits 1.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from typing import Any

from pagemem.commands.run_dir import RunDir
from pagemem.commands.train_config import TrainConfig
from pagemem.commands.train_board import Board
from pagemem.commands.train_data import Batches
from pagemem.commands.train_divergence import DivergenceWatch
from pagemem.commands.train_ranks import Launch, RankTotals, StepExchange, die_if_asked
from pagemem.commands.train_report import log_line, summary_table
from pagemem.commands.train_schedule import lr_factor
from pagemem.engine import Engine
from pagemem.engine.interrupts import shield

DIVERGED = 1
"""The exit status of a run stopped by a loss or gradient norm that is not finite, or diverging."""


class Diverged(Exception):
    """A loss or gradient norm that is not finite, or a diverging loss (see the Note)."""


class Loop:
    """The training loop, its metrics and its ending (see [Note: Ctrl-C in pagemem train])."""

    def __init__(self, cfg: TrainConfig, rd: RunDir, engine: Engine, loss_of: Any, batches: Batches, device: Any,
                 launch: Launch, started: float) -> None:
        self.cfg, self.rd, self.engine, self.loss_of, self.launch = cfg, rd, engine, loss_of, launch
        self.batches, self.device = batches, device
        self.tokens = cfg.data.batch * cfg.data.seq * cfg.engine.accumulation_steps
        """Tokens one rank trains on in a step."""
        self.saved_at = engine.global_step if rd.has_checkpoint() else -1
        self.peak_used: dict[str, int] = {}
        self.exchange = StepExchange(launch, engine.ranks.device)
        self.ranks = RankTotals(launch.world_size, self.tokens)
        self.started = started
        """``time.time()`` when this process started the run (start-up included in wall time)."""
        before = rd.metrics()
        self.wall_before = before[-1].get("wall_seconds") or 0.0 if before else 0.0
        """Wall seconds of the sessions before this one (a resumed run's)."""
        self.start_step = engine.global_step
        self.stopped: str | None = None
        t = cfg.train
        self.watch = DivergenceWatch(t.divergence_nats, t.divergence_span, t.divergence_after)
        """[Note: detecting divergence]: the steps trained so far replayed, as a resumed run's."""
        self.watch.replay(m.get("loss") for m in before if m["step"] <= self.start_step)
        self.watch.steps = self.start_step
        self.board = Board(None)
        """[Note: TensorBoard live]: rank 0's, opened when the loop starts."""
        self.spans_since = time.perf_counter()
        """The end of the last move span in the measured timeline (``time.perf_counter``)."""

    def run(self) -> int:
        from tqdm import tqdm

        t = self.cfg.train
        lead = self.launch.lead  # [Note: pagemem train under torchrun]: rank 0 writes and prints
        bar = tqdm(total=t.steps, initial=self.start_step, disable=None if t.progress and lead else True, unit="step",
                   file=sys.stderr, dynamic_ncols=True, leave=False)
        interrupted: KeyboardInterrupt | None = None
        try:
            try:
                if lead:
                    self.board = Board(self.rd.file("tensorboard"), self.rd.metrics())
                self._steps(self.start_step, bar)
            except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (train_signals.Preempted)
                interrupted = exc
                self._whole()
            except Diverged as exc:
                self.stopped = str(exc)
            bar.close()
            if self.stopped is None:
                self._save()
                if interrupted is None:
                    self._evaluate_at_end()
                    self._export()
            summary = self._finish(interrupted is not None) if lead else None
        finally:
            bar.close()
            self.board.close()
            self.engine.close()
        status = getattr(interrupted, "exit_status", 130) if interrupted is not None else 0
        if self.stopped is not None:
            status = DIVERGED
        if summary is None:
            return status
        print(summary_table(summary))
        if self.stopped is not None:
            kept = self.rd.latest_step()
            print(f"pagemem train: stopped: {self.stopped}; nothing of it was saved"
                  + (f"; the last good checkpoint is step {kept} (--resume {self.rd.path})" if kept else "")
                  + "; " + self._advice(), file=sys.stderr)
        elif interrupted is not None:
            what = "preempted (SIGTERM)" if status == 143 else "interrupted"
            print(f"pagemem train: {what} after step {summary['steps_done']}; continue with "
                  f"`pagemem train --resume {self.rd.path}` (or --resume auto)", file=sys.stderr)
        return status

    def _advice(self) -> str:
        """What to change after a stop on the loss, as flags this run can take."""
        advice = "lower optimizer.lr, add train.warmup_steps" + (
            "" if self.cfg.engine.lock_free else ", or set engine.max_grad_norm")
        if self.stopped is not None and "diverging" in self.stopped:
            advice += " (or raise train.divergence_nats, or give it none, where the rise is expected)"
        return advice

    def _steps(self, start: int, bar: Any) -> None:
        """The steps; lock-free on the host stand-in, with the compute and the updater on their
        own cores ([Note: a core partition] in ``engine/updates/partition.py``)."""
        import torch

        from pagemem.engine.updates.partition import host_partition

        store = self.cfg.engine.store
        partition = host_partition(self.cfg.engine.lock_free, store.gpu_backend == "host" or not torch.cuda.is_available())
        with partition.applied() if partition is not None else contextlib.nullcontext():
            self._steps_on(start, bar, partition)

    def _steps_on(self, start: int, bar: Any, partition: Any) -> None:
        engine, t = self.engine, self.cfg.train
        before = engine.stats()
        self.spans_since = time.perf_counter()
        acc = self.cfg.engine.accumulation_steps
        base_lrs = [self.cfg.engine.optimizer.lr for _ in engine.optimizer.param_groups]
        scaled = self.cfg.engine.effective_loss_scale is not None  # an overflow skips its update: no divergence
        for step in range(start, t.steps):
            if partition is not None and step == start + 3:  # the engine's threads started since
                partition.apply()
            die_if_asked(self.launch, step + 1)  # a test hook (tests/test_cmd_train_ranks.py)
            t0 = time.perf_counter()
            losses, phases = [], []
            with shield():  # a Ctrl-C from here on lands when the step and its record are whole
                # a step is accumulation_steps backwards, each over its own batch
                for micro in range(acc):
                    a = time.perf_counter()
                    loss = self.loss_of(engine, self.batches.train(step * acc + micro).to(self.device,
                                                                                          non_blocking=True))
                    value = float(loss.detach())
                    b = time.perf_counter()
                    if not self.launch.data_parallel and (not math.isfinite(value) or (
                            t.max_loss is not None and value > t.max_loss)):
                        self._drop_gradients()
                        above = f", above train.max_loss {t.max_loss}" if math.isfinite(value) else ""
                        raise Diverged(f"the loss is {value}{above} at step {step + 1}")
                    why = None if self.launch.data_parallel else self.watch.diverged((sum(losses) + value) /
                                                                                     (len(losses) + 1))
                    if why is not None:
                        self._drop_gradients()
                        raise Diverged(why)
                    engine.backward(loss)
                    losses.append(value)
                    phases += [("forward", a, b), ("backward", b, time.perf_counter())]
                t1 = time.perf_counter()
                grad_norm = engine.get_global_grad_norm()
                if not math.isfinite(grad_norm) and not self.launch.data_parallel and not scaled:
                    self._drop_gradients()
                    raise Diverged(f"the gradient norm is {grad_norm} at step {step + 1}")
                factor = lr_factor(step, t.steps, t.schedule, t.warmup_steps, t.min_lr_ratio)
                for group, base in zip(engine.optimizer.param_groups, base_lrs):
                    group["lr"] = base * factor  # [Note: the learning-rate schedule]
                t2 = time.perf_counter()
                engine.step()
                t3 = time.perf_counter()
                stats = engine.stats()
                sent = stats["ranks"]["sent_bytes"] - before["ranks"]["sent_bytes"]
                rows = self.exchange(sum(losses) / acc, t3 - t0, sent)  # every rank's, in rank order
                if not all(math.isfinite(r[0]) and (t.max_loss is None or r[0] <= t.max_loss) for r in rows):
                    raise Diverged(f"a rank's loss is not finite or above train.max_loss at step {step + 1}")
                why = self.watch.diverged(sum(r[0] for r in rows) / len(rows)) if self.launch.data_parallel else None
                if why is not None:  # every rank sees the same losses: all stop, after the update, unsaved
                    raise Diverged(why)
                self.watch.observe(sum(r[0] for r in rows) / len(rows))
                m = self._metrics(step + 1, rows, grad_norm, t3 - t0, stats, before, base_lrs[0] * factor)
                before = stats
                phases += [("grad norm", t1, t2), ("update", t2, t3)]
                if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                    m.update(self._evaluate())
                    phases.append(("evaluate", t3, time.perf_counter()))
                logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps
                if logged and self.launch.data_parallel:
                    m["ranks"] = self.ranks.interval()
                if self.launch.lead:
                    self.rd.append_metrics(m)
                    self.board.add(m)
                    for name, a, b in phases:
                        self.rd.phase(name, a, b - a, step + 1)
                    self._record_moves()
                    self.rd.counters(t3, m["tier_used_bytes"])
                    self.rd.counters(t3, m["moved_bytes_per_s"], "moved bytes per second")
                bar.update(1)
                if logged and self.launch.lead:
                    bar.write(log_line(m), file=sys.stdout)
            if t.save_every and (step + 1) % t.save_every == 0:
                self._save(periodic=True)

    def _record_moves(self) -> None:
        """The store's move spans that ended since the last call, into the measured timeline."""
        spans = self.engine.store.move_spans(self.spans_since)
        if spans:
            self.spans_since = spans[-1].end
            self.rd.moves(spans)

    def _drop_gradients(self) -> None:
        """A loss or norm not finite: the step's gradients go, none reaches the weights."""
        if self.engine.gradients_pending and not self.cfg.engine.lock_free:
            self.engine.zero_grad()

    def _whole(self) -> None:
        """After a Ctrl-C: the engine at a whole step (see the Note). Only a second Ctrl-C gets
        inside a step; then an interrupted update is finished, and gradients no update took are
        discarded (handed on, with lock-free, whose sums share them: that step counts)."""
        engine = self.engine
        if engine.update_unfinished:
            engine.step()  # the same bits as an uninterrupted update
        elif engine.gradients_pending:
            if self.cfg.engine.lock_free:
                engine.step()
            else:
                engine.zero_grad()

    def _evaluate(self) -> dict[str, Any]:
        """The mean loss over ``train.eval_batches`` validation batches (every rank's), and its
        perplexity; {} where the data holds none out."""
        import torch

        if not self.batches.has_validation:
            return {}
        losses = []
        with torch.no_grad():
            for k in range(self.cfg.train.eval_batches):
                x = self.batches.validation(k).to(self.device, non_blocking=True)
                losses.append(float(self.loss_of(self.engine, x)))
        rows = self.exchange(sum(losses) / len(losses), 0.0, 0)
        val = sum(r[0] for r in rows) / len(rows)
        return {"val_loss": val, "val_perplexity": math.exp(val) if val < 700 else math.inf}

    def _evaluate_at_end(self) -> None:
        """The last step's evaluation, onto its metrics line (evaluated once the run is whole)."""
        t = self.cfg.train
        if not t.eval_every or self.engine.global_step != t.steps or self.engine.global_step == self.start_step:
            return
        found = self._evaluate()
        if found and self.launch.lead:
            self.rd.update_last_metrics(found)
            self.board.add({"step": self.engine.global_step, **found})

    def _export(self) -> None:
        if self.cfg.train.export == "none":
            return
        from pagemem.commands.export import export_weights

        path = export_weights(self.engine, self.cfg, self.rd.file("export"))
        if self.launch.lead:
            print(f"pagemem train: exported the weights to {path}", file=sys.stderr)

    def _metrics(self, step: int, rows: list[tuple[float, float, int]], grad_norm: float, seconds: float,
                 stats: dict, before: dict, lr: float) -> dict[str, Any]:
        """The step's metrics line; ``rows``: every rank's (loss, seconds, bytes sent): the loss is
        their mean (the combined batch's), ``tokens_per_s`` the ranks' sum."""
        self.ranks.add(rows)
        loss = sum(r[0] for r in rows) / len(rows)
        used = {n: t["used_bytes"] for n, t in stats["tiers"].items()}
        for n, b in used.items():
            self.peak_used[n] = max(self.peak_used.get(n, 0), b)
        moved = {k: (v - before["moved_bytes"].get(k, 0)) / seconds for k, v in stats["moved_bytes"].items()}
        staleness = stats["staleness"]
        now = time.time()
        return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "seconds": seconds,
                "tokens_per_s": sum(self.tokens / r[1] for r in rows), "gpu_peak_bytes": stats["gpu_peak_bytes"],
                "gpu_budget_bytes": stats["gpu_budget_bytes"], "tier_used_bytes": used, "moved_bytes_per_s": moved,
                "gpu_idle": stats["gpu_idle"], "staleness_mean": staleness["mean"] if staleness else None,
                "time": now, "wall_seconds": self.wall_before + now - self.started,
                "val_loss": None, "val_perplexity": None}

    def _save(self, periodic: bool = False) -> None:
        """A checkpoint of the step; a periodic one that fails for want of disk (or another
        error of the disk) is reported and training goes on, ``latest`` naming the one before."""
        step = self.engine.global_step
        if step != self.saved_at:
            t0 = time.perf_counter()
            try:
                self.engine.save(self.rd.checkpoints, keep=self.cfg.train.keep)
            except OSError as exc:  # TierIOError too
                if not periodic or self.launch.data_parallel:
                    raise
                kept = self.rd.latest_step()
                print(f"pagemem train: the checkpoint of step {step} failed ({exc}); training goes on, and the "
                      + (f"last checkpoint is step {kept}" if kept else "run has no checkpoint yet")
                      + f": free space under {self.rd.checkpoints}", file=sys.stderr)
            finally:  # a Ctrl-C held during the save lands once it is whole: it is saved
                if self.rd.latest_step() == step:
                    self.saved_at = step
                    if self.launch.lead:
                        self.rd.phase("checkpoint", t0, time.perf_counter() - t0, step)

    def _finish(self, interrupted: bool) -> dict[str, Any]:
        from pagemem.sched import HardwareProfile, simulate

        engine, rd = self.engine, self.rd
        stats = engine.stats()
        plan, trace = engine.pager.last_plan, engine.pager.last_trace
        on_host = self.cfg.engine.store.gpu_backend == "host" or not _cuda()
        planned, profile = None, "dev-vm" if on_host else "a100-server"
        if plan is not None and trace is not None:
            planned = simulate(plan, trace, HardwareProfile.builtin(profile))
        self._record_moves()  # the last checkpoint's, where the store moved pages for it
        rd.write_timelines(trace, planned)
        metrics = rd.metrics()
        budgets = {"gpu": stats["gpu_budget_bytes"], **{n: t["capacity_bytes"] for n, t in stats["tiers"].items()
                                                        if n != "gpu"}}
        if metrics:
            rd.write_plots(metrics, self.cfg.data.floor, budgets)
        rd.write_csv(metrics)
        steady = [m["tokens_per_s"] for m in metrics[3:]] or [m["tokens_per_s"] for m in metrics]
        finite = [m for m in metrics if m["loss"] is not None]
        head, tail = finite[:10], finite[-10:]
        evals = [m for m in metrics if m.get("val_loss") is not None]
        summary = {
            "run_dir": rd.path, "steps_done": engine.global_step, "steps": self.cfg.train.steps,
            "interrupted": interrupted, "stopped": self.stopped,
            "session_steps": engine.global_step - self.start_step,
            "wall_seconds": self.wall_before + time.time() - self.started,
            "tokens_per_s": statistics.median(steady) if steady else None,
            "first_loss": statistics.mean(m["loss"] for m in head) if head else None,
            "last_loss": statistics.mean(m["loss"] for m in tail) if tail else None,
            "loss_floor": self.cfg.data.floor,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_perplexity": evals[-1]["val_perplexity"] if evals else None,
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
