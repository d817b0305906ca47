"""Telling a diverging run (a finite loss that climbs) from ordinary noise and loss spikes.

[Note: detecting divergence] Each step's loss (the mean over its micro-batches, with several
ranks the mean over the ranks) moves an exponential moving average: ``ema += a * (loss - ema)``
with ``a = 2 / (train.divergence_span + 1)`` (the average's span in steps; it starts at the
first loss). Its lowest value so far is the best. From step ``train.divergence_after`` on, a
step whose average would end more than ``train.divergence_nats`` above the best stops the run
as a NaN loss does ([Note: stopping on a loss that is not finite] in ``train_loop.py``): checked
before the step's backward, so nothing of it reaches the weights. The average of a span of 20
moves by about a tenth of a step's deviation, so noise (steps scattered by 0.3 nats give it a
spread of about 0.07) and a single spike (one step 5 nats above moves it 0.48) do not stop a run with
the default 1 nat, while a loss that stays 1.5 nats above its best stops it within about 12 steps.
The state is a pure function of the losses in ``metrics.jsonl``: a resumed run replays them and
goes on as an uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass
class DivergenceWatch:
    """The smoothed loss and its best (see the Note); ``nats`` None: never stops a run."""

    nats: float | None
    span: int
    after: int
    ema: float | None = None
    best: float = math.inf
    best_step: int = 0
    steps: int = 0

    @property
    def alpha(self) -> float:
        return 2.0 / (self.span + 1)

    def observe(self, loss: float) -> None:
        """Step ``steps + 1``'s loss, taken into the average (a loss that is not finite: skipped)."""
        self.steps += 1
        if not math.isfinite(loss):
            return
        self.ema = self._moved(loss)
        if self.ema < self.best:
            self.best, self.best_step = self.ema, self.steps

    def replay(self, losses: Iterable[float | None]) -> None:
        """The losses of the steps already trained (a resumed run's ``metrics.jsonl``)."""
        for loss in losses:
            self.observe(math.nan if loss is None else loss)

    def diverged(self, loss: float) -> str | None:
        """Why step ``steps + 1`` with ``loss`` diverges, in words, or None (it does not)."""
        step = self.steps + 1
        if self.nats is None or step <= self.after or not math.isfinite(loss) or self.ema is None:
            return None
        ema = self._moved(loss)
        if ema - self.best <= self.nats:
            return None
        return (f"the loss is diverging at step {step}: {loss:.4f}, its average over about {self.span} steps "
                f"{ema:.4f} is {ema - self.best:.2f} nats above its best, {self.best:.4f} at step {self.best_step} "
                f"(train.divergence_nats {self.nats:g})")

    def _moved(self, loss: float) -> float:
        return loss if self.ema is None else self.ema + self.alpha * (loss - self.ema)
