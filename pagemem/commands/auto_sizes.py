"""Store sizes given as ``"auto"``: what a model needs, so a new user does not have to know.

- ``gpu_bytes``: with CUDA, the device's free memory less a margin (a tenth, at least 1 GiB);
  on the host stand-in, the least budget the scheduler accepts for one traced iteration plus a
  quarter of the parameters' compute bytes, so pages really move. The engine lays the model out
  in its own units, which can need more than the plain model's trace says, so ``pagemem train``
  then tries the budget for two iterations and, refused with the least that works
  (``OutOfMemory.least_bytes``), takes that plus the same share (:func:`grown`).
- ``cpu_bytes``: the parameters' home copies and gradient sums (with ``home_tier="nvme"``: room
  for those of the two largest tensors, which pass through), the optimizer states with
  ``optimizer_tier="cpu"`` (with ``"nvme"``, room for those of the two largest tensors), a
  quarter more, one page per tensor and kind for rounding, and 64 MiB.
- ``nvme_bytes``: what lives on nvme (optimizer states with ``optimizer_tier="nvme"``, compute
  copies and gradient sums with ``home_tier="nvme"``) on the same terms.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pagemem.engine.units.records import compute_dtype_of
from pagemem.engine.config import EngineConfig
from pagemem.sched import least_gpu_bytes
from pagemem.tracer import trace

MARGIN = 64 << 20


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def gpu_bytes(model: nn.Module, iteration: Callable[[], None], config: EngineConfig) -> int:
    """The ``auto`` gpu budget (see the module docs); ``iteration()``: one forward and backward
    of ``model``, traced on the host to size the activations (its gradients are cleared)."""
    page = int(config.store.page_bytes)
    if config.store.gpu_backend != "host" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(config.store.cuda_device)
        return max(page, (free - max(1 << 30, free // 10)) // page * page)
    tr = trace(model, iteration).with_non_model_peak_reserved()
    model.zero_grad(set_to_none=True)
    return grown(least_gpu_bytes(tr, page_bytes=page), model, config)


def grown(least: int, model: nn.Module, config: EngineConfig) -> int:
    """``least`` plus the share of the parameters' compute bytes the host stand-in adds."""
    page = int(config.store.page_bytes)
    compute = sum(p.numel() * compute_dtype_of(config.compute_dtype, p.dtype).itemsize for p in model.parameters())
    return _round_up(least + compute // 4 + 4 * page, page)


def host_bytes(model: nn.Module, config: EngineConfig) -> dict[str, int]:
    """The ``auto`` cpu and nvme budgets (see the module docs)."""
    page = int(config.store.page_bytes)
    numel = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    states = 12 * numel  # fp32 master weights and two moments
    largest = max((p.numel() for p in model.parameters()), default=0)
    compute = sum(p.numel() * compute_dtype_of(config.compute_dtype, p.dtype).itemsize for p in model.parameters())
    homes_on_nvme = config.home_tier == "nvme"
    # with states on nvme, the cpu holds those of the unit being updated and of the next one
    held = states if config.optimizer_tier == "cpu" else 2 * 12 * largest
    cpu = held + (2 * 4 * largest if homes_on_nvme else compute + 4 * numel)
    out = {"cpu_bytes": _round_up(cpu * 5 // 4 + 4 * tensors * page + MARGIN, page)}
    disk = (states if config.optimizer_tier == "nvme" else 0) + (compute + 4 * numel if homes_on_nvme else 0)
    if disk:
        out["nvme_bytes"] = _round_up(disk * 5 // 4 + 4 * tensors * page + MARGIN, page)
    return out
