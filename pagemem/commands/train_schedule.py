"""``pagemem train``'s learning rate: a pure function of the step, so a resumed run follows the
schedule an uninterrupted one would (nothing of it is saved but the step).

[Note: the learning-rate schedule] Step ``s`` (counted from 0: the update that makes
``global_step`` ``s + 1``) runs with ``lr * factor(s)``: during the ``warmup_steps`` first
steps ``factor`` climbs linearly to 1 (``(s + 1) / warmup_steps``); then ``constant`` keeps 1,
``linear`` falls in a line and ``cosine`` along a half cosine to ``min_lr_ratio`` at the last
step of ``train.steps``. Each group's learning rate is set before the update, through
``engine.optimizer.param_groups`` as a torch scheduler would.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, steps: int, schedule: str, warmup_steps: int, min_lr_ratio: float) -> float:
    """The multiple of the peak learning rate step ``step`` (0-based) of ``steps`` runs with."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = steps - warmup_steps
    done = min(1.0, (step - warmup_steps + 1) / span) if span > 0 else 1.0
    if schedule == "linear":
        shape = 1.0 - done
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * done))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape
