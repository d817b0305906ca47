"""The unified scheduler: from a trace to a task queue that never runs out of memory.

>>> from pagemem.sched import plan, validate, simulate, HardwareProfile, InfeasiblePlan
>>> p = plan(trace, budgets={"gpu": "8GiB", "cpu": "64GiB", "nvme": "1TiB"}, world_size=8,
...          optimizer_tier="cpu", home_tier="cpu")   # home_tier="nvme": parameters rest on nvme
>>> r = validate(p, trace, p.budgets)     # r.peak, r.violations
>>> p.tasks[i], p.deps[i]                 # a task, and the tasks it waits for
>>> effects(p.tasks[i], p.setting)        # what it takes, reads, writes, gives back (tasks.EFFECTS)
"""

from pagemem.sched.deps import Deps, dependencies
from pagemem.sched.errors import InfeasiblePlan
from pagemem.sched.hardware import HardwareProfile
from pagemem.sched.layout import LayerLayout, Layout
from pagemem.sched.plan import Budgets, Plan
from pagemem.sched.planner import least_cpu_bytes, least_gpu_bytes, plan
from pagemem.sched.simulate import SimEvent, SimResult, SimulationDeadlock, SimulationError, simulate
from pagemem.sched.holdings import Setting, TaskEffects, effects
from pagemem.sched.tasks import EFFECTS, OPERATIONS, Effect, Target, Task
from pagemem.sched.validate import ValidationReport, Violation, validate

__all__ = [
    "plan", "least_gpu_bytes", "least_cpu_bytes", "validate", "Plan", "Budgets", "Task", "Target", "OPERATIONS", "Layout", "LayerLayout",
    "EFFECTS", "Effect", "Setting", "TaskEffects", "effects", "Deps", "dependencies",
    "InfeasiblePlan", "ValidationReport", "Violation",
    "simulate", "SimResult", "SimEvent", "SimulationDeadlock", "SimulationError", "HardwareProfile",
]
