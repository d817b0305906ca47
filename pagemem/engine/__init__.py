"""The engine: trains an unmodified model whose states live in the page store.

The facade is ``engine.py`` (``Engine``: forward, backward in ``backward.py``, step, save, load),
with its configuration (``config.py``), its phase (``phase.py``) and the Ctrl-C shield
(``interrupts.py``). Behind it, five rooms: ``units/`` (the model's states and where they are),
``paging/`` (how units reach the gpu each iteration), ``gradients/`` (autograd to the sums),
``updates/`` (the sums to new weights) and ``checkpoints/``. ARCHITECTURE.md follows one
parameter through them.
"""

import importlib as _importlib
import sys as _sys

from pagemem.engine.updates.adam import (AdamW, Chunk, CpuAdam, PagedOptimizer, StepResult, clip_coefficient,
                                         fused_step, sumsq, total_sumsq)
from pagemem.engine.updates.adam_threads import WorkerDied
from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.engine.updates.groups import decay_groups

__all__ = [
    "AdamW",
    "Chunk",
    "CpuAdam",
    "Engine",
    "EngineConfig",
    "decay_groups",
    "PagedOptimizer",
    "StepResult",
    "WorkerDied",
    "clip_coefficient",
    "fused_step",
    "sumsq",
    "total_sumsq",
]

_ROOMS = {
    "units": ("unit", "records", "bank", "values", "model_checks", "budget_checks", "residency", "scopes", "guard",
              "readback"),
    "paging": ("pager", "executor", "arena", "peaks", "saved", "measure"),
    "gradients": ("grads", "handoff", "grad_copies", "grad_ledger"),
    "updates": ("update", "adam", "adam_threads", "state_pieces", "loss_scale", "lockfree", "groups",
                "optimizer_states"),
    "checkpoints": ("checkpoint", "manifest", "ckpt_io", "ckpt_state"),
}
# [Note: module paths before the rooms] Code written against the flat layout imports
# ``pagemem.engine.update``, ``pagemem.engine.residency`` and the like (and tests patch their
# globals): each such path names the very module object now in its room, so both spellings, and
# a patch through either, reach one module. (``pagemem.engine.gradients`` is the room now; it
# keeps the old module's names.)
for _room, _names in _ROOMS.items():
    for _name in _names:
        _module = _importlib.import_module(f"pagemem.engine.{_room}.{_name}")
        _sys.modules.setdefault(f"pagemem.engine.{_name}", _module)
        globals().setdefault(_name, _module)
