"""How far the lock-free updater may fall behind at each step ([Note: the lock-free default]).

[Note: the lock-free default]
Stale gradients cost AdamW most while the weights move fast: in the first steps of a run, where
the loss falls steeply. Measured on the counting task of issue 33 (a 3-layer GPT and Hugging
Face GPT-2, lr 3e-3, 120 steps; ``benchmarks/lockfree_quality.py`` and BENCHMARKS.md):
plain PyTorch one step late from the start ends 3-15x synchronous training's tail loss, two
steps late 100x and more, and neither weight prediction nor a learning rate scaled by the
staleness brings one step within 0.02 nats on both models; the same lateness after 20
synchronous steps costs nothing measurable at one or two steps, while four steps late diverges
even then. So the default is both: the first ``synchronous_steps`` (20) steps wait for every
update (DeepSpeed's delayed parameter update starts the same way), and after them no unit lags
more than ``max_staleness`` (``"default"``: 1) iterations however slow the updating thread
is: the bound is what makes the quality independent of the machine's load, which the user does
not control. With the bound at 1 the updating thread still has a whole iteration to land each
update and may take two iterations' gradients in one fetch of a unit's states. Both are knobs:
``max_staleness=None, synchronous_steps=0`` is the paper's behaviour (never waits), for tasks
known to tolerate it. A longer warm-up suits a run whose loss falls steeply for longer (a
learning-rate warm-up shortens that phase).
"""

from __future__ import annotations


def staleness_bound(submitted: int, max_staleness: int | None, synchronous_steps: int) -> int | None:
    """The most iterations a unit may lag when ``submitted`` steps have been handed to the
    updating thread: 0 during the first ``synchronous_steps`` steps, then ``max_staleness``
    (None: no bound)."""
    return 0 if submitted < synchronous_steps else max_staleness
