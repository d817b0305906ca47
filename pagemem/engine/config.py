"""EngineConfig: everything the engine is told, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagemem.checks import as_set, check_bool, check_choice, check_int, check_rate
from pagemem.config import StoreConfig
from pagemem.engine.updates.adam import AdamW
from pagemem.errors import ConfigError
from pagemem.plain import from_plain, to_plain

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXECUTORS = ("plan", "demand")
HOME_TIERS = ("auto", "cpu", "nvme")
STALENESS_CORRECTIONS = ("predict", "none")
DEFAULT_MAX_STALENESS = 1
"""``max_staleness="default"`` with ``lock_free``: one iteration ([Note: the lock-free default] in ``staleness.py``)."""


def check_no_amsgrad(hp: AdamW) -> AdamW:
    """The engine keeps no ``max_exp_avg_sq`` pages: AMSGrad is refused, never half-run."""
    if hp.amsgrad:
        raise ConfigError("optimizer.amsgrad: the engine keeps no max_exp_avg_sq pages; must be False")
    return hp


@dataclass(frozen=True)
class EngineConfig:
    """How the engine trains a model.

    ``store``: the tier budgets. ``optimizer``: AdamW's hyperparameters (``engine.optimizer``'s
    ``param_groups`` start from them; lr schedulers change those). ``optimizer_tier``: where the
    fp32 master weights and Adam moments live. ``compute_dtype``: the dtype forward and backward
    run in: None (default) keeps each parameter's and buffer's own dtype, as plain PyTorch
    computes; a dtype casts every floating parameter and buffer to it, as ``model.to(dtype)``
    would ([Note: compute dtypes] in ``records.py``). ``max_grad_norm``: clip by global norm (None: no clipping). ``accumulation_steps``:
    ``step()`` updates after this many ``backward()`` calls, their gradients summed.
    ``loss_scale``: ``"dynamic"`` (as ``torch.amp.GradScaler``), a number (static), or None;
    ``"default"`` is ``"dynamic"`` for float16 and None otherwise, resolved when used
    (``effective_loss_scale``), so ``dataclasses.replace(cfg, compute_dtype=...)`` follows it.
    Ranks are the process group's, never the config's ([Note: data parallel over the process
    group] in ``ranks/average.py``); ``collective_timeout_s``: how long a collective may wait for
    the other ranks before ``RankFailed`` names the ranks that did not come (the first
    iteration's collective waits for every rank's tracing and planning);
    ``shard_optimizer_states``: with several ranks, each holds and updates only its share of the
    Adam moments, and of the fp32 master weights where the parameter computes in its own dtype,
    and the ranks gather the updated weights (ZeRO stage 1: [Note: sharded moments] and [Note:
    sharded master weights] in ``units/shards.py``); False keeps a replica on every rank.
    ``shard_parameters``: with several ranks, each also keeps only its share of the compute copy
    at rest: a unit's whole copy exists on the gpu only while the unit is resident, gathered from
    every rank's share when it is fetched (ZeRO stage 3: [Note: gathered units] in
    ``ranks/unit_gather.py``), and its share of the gradient sums, each unit's gradients
    reduce-scattered once its backward is done ([Note: sharded gradient sums] in
    ``ranks/grad_scatter.py``); every read of a parameter outside forward and backward, and of a
    gradient whole, is then a collective every rank makes. ``adam_threads``: CPU Adam
    workers (default: the usable cores). ``overlap_update``: update a parameter during backward
    as soon as its gradient is final, where that changes nothing (see ``Engine``); None (default)
    means on when the gpu tier is CUDA, for units whose states are off the gpu (backward runs
    on the GPU while the CPU updates; a unit with states on the gpu is updated in ``step()``:
    [Note: which updates may overlap backward]), and off on the host stand-in (CPU Adam would
    compete with backward for the same cores). True also steps states on the gpu in the
    gradient hook, from autograd's gradient.
    ``executor``: ``"plan"`` (default: the first iteration with given input shapes runs under the
    tracer with demand paging, the scheduler plans it, later ones follow the plan) or
    ``"demand"`` (never trace: demand paging with a one-unit-ahead guess, every iteration).
    ``lock_free``: ``step()`` hands the gradients to an updating thread that updates behind the
    compute (ANGEL-PTM's lock-free updater; [Note: the lock-free updater] in ``lockfree.py``);
    ``max_staleness``: with it, the most iterations a unit's parameters may lag before an
    iteration waits (0: synchronous, bit for bit; None: never waits; ``"default"``: 1 with
    ``lock_free``, resolved when used as ``effective_max_staleness``); ``synchronous_steps``: with
    it, the first steps wait for every update, as ``max_staleness=0`` (DeepSpeed's delayed
    parameter update; default 20; [Note: the lock-free default] in ``updates/staleness.py``);
    ``staleness_correction``: ``"predict"`` (default) buffers a lagging unit's parameters
    extrapolated by its last update per iteration it lags, ``"none"`` buffers the update as
    applied ([Note: predicting past the staleness] in ``lockfree.py``).
    """

    store: StoreConfig
    optimizer: AdamW = field(default_factory=AdamW)
    optimizer_tier: str = "cpu"
    home_tier: str = "auto"
    compute_dtype: torch.dtype | None = None
    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    loss_scale: str | float | None = "default"
    collective_timeout_s: float = 600.0
    shard_optimizer_states: bool = True
    shard_parameters: bool = False
    adam_threads: int | None = None
    overlap_update: bool | None = None
    executor: str = "plan"
    lock_free: bool = False
    max_staleness: int | str | None = "default"
    synchronous_steps: int = 20
    staleness_correction: str = "predict"

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError(f"store: must be a pagemem.StoreConfig, got {type(self.store).__name__}")
        if not isinstance(self.optimizer, AdamW):
            raise ConfigError(f"optimizer: must be a pagemem.AdamW, got {type(self.optimizer).__name__}")
        check_no_amsgrad(self.optimizer)
        check_choice("optimizer_tier", self.optimizer_tier, ("gpu", "cpu", "nvme"))
        check_choice("home_tier", self.home_tier, HOME_TIERS)
        if self.home_tier == "nvme" and not self.store.nvme_bytes:
            raise ConfigError(f"home_tier: 'nvme' needs nvme bytes in store ({as_set(self.store, 'nvme_bytes')}); "
                              "give nvme_bytes and nvme_path, or use 'cpu' or 'auto'")
        if self.compute_dtype is not None:
            check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        if self.max_grad_norm is not None:
            object.__setattr__(self, "max_grad_norm", check_rate("max_grad_norm", self.max_grad_norm))
        check_int("accumulation_steps", self.accumulation_steps, 1, 1 << 20)
        if self.loss_scale not in (None, "default", "dynamic"):  # "default" is kept as given (see the docstring)
            object.__setattr__(self, "loss_scale", check_rate("loss_scale", self.loss_scale))
        object.__setattr__(self, "collective_timeout_s", check_rate("collective_timeout_s", self.collective_timeout_s))
        if self.collective_timeout_s < 1.0:
            raise ConfigError(f"collective_timeout_s: must be at least 1 second (the first collective waits for every "
                              f"rank's tracing and planning), got {self.collective_timeout_s!r}")
        check_bool("shard_optimizer_states", self.shard_optimizer_states)
        check_bool("shard_parameters", self.shard_parameters)
        if self.shard_parameters and not self.shard_optimizer_states:
            raise ConfigError("shard_parameters: needs shard_optimizer_states=True (each rank's share of the compute "
                              "copy is its share of the master weights, cast)")
        if self.adam_threads is not None:
            check_int("adam_threads", self.adam_threads, 1, 1024)
        if self.overlap_update is not None:
            check_bool("overlap_update", self.overlap_update)
        check_choice("executor", self.executor, EXECUTORS)
        self._check_lock_free()
        tier_bytes = {"gpu": self.store.gpu_bytes, "cpu": self.store.cpu_bytes, "nvme": self.store.nvme_bytes}
        if not tier_bytes[self.optimizer_tier]:
            raise ConfigError(f"optimizer_tier: {as_set(self, 'optimizer_tier')} has no bytes in store "
                              f"({as_set(self.store, self.optimizer_tier + '_bytes')}); must be a tier with bytes")
        if not self.store.cpu_bytes:
            raise ConfigError(f"store.cpu_bytes: the engine keeps parameters' home copies on cpu, or passes them "
                              f"through it from nvme; must be > 0, got "
                              f"{as_set(self.store, 'cpu_bytes')}")

    def _check_lock_free(self) -> None:
        """What the lock-free updater cannot do ([Note: the lock-free updater], ``lockfree.py``)."""
        check_bool("lock_free", self.lock_free)
        check_choice("staleness_correction", self.staleness_correction, STALENESS_CORRECTIONS)
        check_int("synchronous_steps", self.synchronous_steps, 0, 1 << 40)
        if self.max_staleness not in (None, "default"):
            if type(self.max_staleness) is not int or not 0 <= self.max_staleness <= 1 << 20:
                raise ConfigError(f"max_staleness: must be an integer in [0, {1 << 20}], None (never waits) or "
                                  f"'default' ({DEFAULT_MAX_STALENESS} with lock_free), got {self.max_staleness!r}")
            if not self.lock_free:
                raise ConfigError("max_staleness: bounds the lock-free updater; set lock_free=True or leave it "
                                  "'default'")
        if not self.lock_free:
            return
        refused = {"optimizer_tier": (self.optimizer_tier == "gpu", "must be 'cpu' or 'nvme' (states on the gpu "
                                      "are updated in the gradient hook)"),
                   "max_grad_norm": (self.max_grad_norm is not None, "must be None: clipping by the global norm "
                                     "needs every unit's gradient before any update"),
                   "loss_scale": (self.effective_loss_scale is not None, "must be None: an overflow anywhere "
                                  "would have to skip every unit's update"),
                   "overlap_update": (self.overlap_update is True, "must not be True: the updating thread "
                                      "updates behind backward")}
        for name, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"{name}: with lock_free=True it {why}; got {as_set(self, name)}"
                                  + (f" with {as_set(self, 'compute_dtype')}" if name == "loss_scale" else ""))

    @property
    def effective_max_staleness(self) -> int | None:
        """``max_staleness`` with ``"default"`` resolved: ``DEFAULT_MAX_STALENESS`` with
        ``lock_free``, else None (no updating thread to bound)."""
        if self.max_staleness == "default":
            return DEFAULT_MAX_STALENESS if self.lock_free else None
        return self.max_staleness  # type: ignore[return-value]

    @property
    def effective_loss_scale(self) -> str | float | None:
        """``loss_scale`` with ``"default"`` resolved: ``"dynamic"`` for float16, else None."""
        if self.loss_scale == "default":
            return "dynamic" if self.compute_dtype == torch.float16 else None
        return self.loss_scale

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (for checkpoints; ``pagemem.plain``)."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        """The inverse of :meth:`to_dict`, validated like any construction (missing keys take
        their defaults, so older checkpoints load; ``rank`` and ``world_size``, which configs
        before data parallelism held, are dropped when they say one process)."""
        if isinstance(d, dict) and ("rank" in d or "world_size" in d):
            if (d.get("rank", 0), d.get("world_size", 1)) != (0, 1):
                raise ConfigError("rank, world_size: no longer configured: the process group gives them "
                                  f"(Engine(process_group=...)); got rank={d.get('rank')!r}, "
                                  f"world_size={d.get('world_size')!r}")
            d = {k: v for k, v in d.items() if k not in ("rank", "world_size")}
        return from_plain(cls, d)
