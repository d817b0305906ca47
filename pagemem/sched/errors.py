"""The scheduler's errors."""

from __future__ import annotations

from pagemem.errors import PageMemError
from pagemem.units import format_bytes


class InfeasiblePlan(PageMemError):
    """No plan fits the budgets. ``min_gpu_bytes`` is the smallest GPU budget with which the
    planner finds one (other budgets unchanged); ``tier`` and ``min_bytes`` name the budget that
    was too small and what it needs; ``op_id`` is the op where the need peaks."""

    def __init__(self, tier: str, min_bytes: int, budget: int, min_gpu_bytes: int, op_id: int,
                 detail: str = "") -> None:
        self.tier = tier
        self.min_bytes = min_bytes
        self.budget = budget
        self.min_gpu_bytes = min_gpu_bytes
        self.op_id = op_id
        msg = (f"no plan fits: the {tier} tier needs at least {format_bytes(min_bytes)} ({min_bytes} bytes) "
               f"at op {op_id}, the budget is {format_bytes(budget)}")
        if detail:
            msg += f" ({detail})"
        if tier == "gpu":
            msg += f"; the smallest GPU budget that works is {min_gpu_bytes} bytes"
        super().__init__(msg)
