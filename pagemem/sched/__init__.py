"""The unified scheduler: from a trace to a task queue that never runs out of memory.

>>> from pagemem.sched import plan, validate, simulate, HardwareProfile, InfeasiblePlan
>>> p = plan(trace, budgets={"gpu": "8GiB", "cpu": "64GiB", "nvme": "1TiB"}, world_size=8,
...          optimizer_tier="cpu")
>>> r = validate(p, trace, p.budgets)     # r.peak, r.violations
"""

from pagemem.sched.errors import InfeasiblePlan
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.layout import LayerLayout, Layout
from pagemem.sched.plan import Budgets, Plan
from pagemem.sched.planner import plan
from pagemem.sched.simulate import SimEvent, SimResult, SimulationDeadlock, SimulationError, simulate
from pagemem.sched.tasks import OPERATIONS, Target, Task
from pagemem.sched.validate import ValidationReport, Violation, validate

__all__ = [
    "plan", "validate", "Plan", "Budgets", "Task", "Target", "OPERATIONS", "Layout", "LayerLayout",
    "InfeasiblePlan", "ValidationReport", "Violation",
    "simulate", "SimResult", "SimEvent", "SimulationDeadlock", "SimulationError", "HardwareProfile",
]
