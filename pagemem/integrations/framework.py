"""What the framework integrations share: a framework's knobs turned into an engine, once.

[Note: a framework's knobs drive the engine]
A framework user sets clipping, accumulation, precision and the optimizer the framework's way
(``TrainingArguments.max_grad_norm``, ``Trainer(gradient_clip_val=...)``, ``configure_optimizers``);
the ``EngineConfig`` they give says only where the states live. So each knob keeps one name: the
framework's. ``engine_config`` takes the framework's accumulation and compute dtype into the
config and refuses a config that sets either differently (or clips by itself: the framework
clips through ``engine.clip_grad_norm_``). The accumulation goes into ``accumulation_steps`` so
that the engine knows which backward ends a step (averaging over ranks); the framework's own
``optimizer.step()`` at the boundary updates, and nothing counts twice.

[Note: updates during backward under a framework]
``overlap_update`` (updates during the last backward of a step) stays the engine's default only
where the framework neither clips (the update would land before the clipping) nor accumulates:
an epoch whose batches do not divide by the accumulation ends with a shorter step, and the engine
takes the backwards a step had as the next step's count (``phase.per_step``), so the next step's
first backward would update. Elsewhere it is off, and asking for it is refused.

The optimizer the framework built (a ``torch.optim.AdamW`` with its parameter groups, before any
step) is read, never stepped: :func:`make_engine` gives the engine the same groups and
hyperparameters, and schedulers built over it are pointed at ``engine.optimizer``
(:func:`rebind_schedulers`), whose groups they then drive. Any other optimizer, AMSGrad or
``maximize`` is refused at start (``ConfigError`` naming the framework's field).

Checkpoints: the engine's ``save``/``load`` carry weights, Adam moments, counters, RNG and the
groups' hyperparameters; a framework's ``optimizer.pt`` (every moment in host memory) is never
written. The Hugging Face Trainer makes its scheduler after the optimizer, so after
``Engine.load``: the scheduler sets its first learning rate in the groups, as torch's does over a
fresh optimizer; the Trainer then loads the scheduler's state, and :func:`restore_groups` puts
back the saved hyperparameters, as ``optimizer.load_state_dict`` would have. Lightning's
schedulers are made (by ``configure_optimizers``) before the engine, so the groups
``Engine.load`` restores stand.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterable

import torch
from torch import nn

from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.engine.updates.adam import AdamW
from pagemem.engine.updates.groups import GROUP_KEYS
from pagemem.errors import ConfigError

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclasses.dataclass(frozen=True)
class FrameworkKnobs:
    """What a framework's own settings ask of the engine; ``names`` say where each is set, for
    error messages (``{"accumulation": "TrainingArguments.gradient_accumulation_steps", ...}``)."""

    accumulation_steps: int
    compute_dtype: torch.dtype | None
    clips: bool
    names: dict[str, str]

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(f"{self.names['accumulation']}: must be an integer >= 1, got {self.accumulation_steps!r}")


def engine_config(config: Any, knobs: FrameworkKnobs, field: str) -> EngineConfig:
    """``config`` (the user's, named ``field``) with the framework's accumulation and compute
    dtype; ``ConfigError`` where the two disagree ([Note: a framework's knobs drive the engine])."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"{field}: must be a pagemem.EngineConfig, got {type(config).__name__}")
    if config.max_grad_norm is not None:
        raise ConfigError(f"{field}.max_grad_norm: the framework clips ({knobs.names['clip']}); must be None, "
                          f"got {config.max_grad_norm!r}")
    if config.accumulation_steps not in (1, knobs.accumulation_steps):
        raise ConfigError(f"{field}.accumulation_steps: the framework accumulates ({knobs.names['accumulation']}="
                          f"{knobs.accumulation_steps}); must be 1 or {knobs.accumulation_steps}, "
                          f"got {config.accumulation_steps}")
    dtype = config.compute_dtype
    if knobs.compute_dtype is not None:
        if dtype not in (None, knobs.compute_dtype):
            raise ConfigError(f"{field}.compute_dtype: {knobs.names['precision']} asks for {knobs.compute_dtype}; "
                              f"must be None or {knobs.compute_dtype}, got {dtype}")
        dtype = knobs.compute_dtype
    if config.lock_free and knobs.clips:
        raise ConfigError(f"{field}.lock_free: the lock-free updater cannot clip by the global norm; set "
                          f"{knobs.names['clip']} to turn clipping off, or lock_free=False")
    overlap = config.overlap_update
    if knobs.clips or knobs.accumulation_steps > 1:  # [Note: updates during backward under a framework]
        if overlap:
            why = (f"cannot be clipped afterwards ({knobs.names['clip']} is set)" if knobs.clips else
                   f"need every step to take {knobs.names['accumulation']} backwards, and an epoch's last may take "
                   "fewer")
            raise ConfigError(f"{field}.overlap_update: updates during backward {why}; must be None or False, "
                              "got True")
        overlap = False
    if dtype == torch.float16:
        raise ConfigError(f"{knobs.names['precision']}: float16 is not offered through the framework "
                          "integrations yet (its loss scaling needs the engine's backward); use bfloat16 or float32")
    return dataclasses.replace(config, accumulation_steps=knobs.accumulation_steps, compute_dtype=dtype,
                               overlap_update=overlap)


def adamw_groups(optimizer: Any, field: str) -> tuple[AdamW, list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine's default hyperparameters, its parameter groups and each group's other keys
    (``initial_lr``, set by a scheduler) from a ``torch.optim.AdamW`` before its first step."""
    if type(optimizer) is not torch.optim.AdamW:
        raise ConfigError(f"{field}: the engine updates with AdamW over its pages; the optimizer must be a "
                          f"torch.optim.AdamW, got {type(optimizer).__module__}.{type(optimizer).__name__}")
    if optimizer.state:
        raise ConfigError(f"{field}: the optimizer has stepped already; hand over a fresh torch.optim.AdamW")
    groups, extras = [], []
    for g, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key, False):
                raise ConfigError(f"{field}.param_groups[{g}].{key}: the engine does not offer it; must be False")
        groups.append({"params": list(group["params"]), **{k: group[k] for k in HYPER_KEYS}})
        extras.append({k: v for k, v in group.items() if k != "params" and k not in GROUP_KEYS})
    first = optimizer.param_groups[0]
    return AdamW(**{k: first[k] for k in HYPER_KEYS}), groups, extras


def make_engine(model: nn.Module, optimizer: Any, config: EngineConfig, field: str,
                resume: str | None = None) -> Engine:
    """An engine over ``model`` with ``optimizer``'s groups and hyperparameters (see the Note),
    or, with ``resume``, the one saved there (``Engine.load``; the groups must hold the same
    parameters)."""
    hyper, groups, extras = adamw_groups(optimizer, field)
    config = dataclasses.replace(config, optimizer=hyper)
    if resume is not None:
        engine = Engine.load(resume, model, config, param_groups=groups)
    else:
        engine = Engine(model, config, param_groups=groups)
    for group, extra in zip(engine.optimizer.param_groups, extras):
        for key, value in extra.items():
            group.setdefault(key, value)
    track_steps(engine.optimizer)
    return engine


def track_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as a torch lr scheduler does when made over it, so a scheduler
    pointed at it later knows when it stepped (and does not warn that it never did)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


def rebind_schedulers(schedulers: Iterable[Any], old: Any, new: torch.optim.Optimizer) -> None:
    """Point every scheduler made over ``old`` at ``new`` (the engine's optimizer, whose groups
    were made from ``old``'s: same learning rates, ``initial_lr`` kept)."""
    for scheduler in schedulers:
        if scheduler is not None and getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's hyperparameters (every key but ``params``), as a checkpoint restored them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Put back the hyperparameters :func:`group_settings` took (after a scheduler made since
    overwrote the learning rates), as ``optimizer.load_state_dict`` restores them."""
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


def engine_checkpoint(path: str | os.PathLike, field: str) -> str:
    """``path`` if it holds an engine checkpoint (``latest`` and what it names), else
    ``ConfigError`` naming ``field``."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "latest")):
        raise ConfigError(f"{field}: {path!r} holds no pagemem checkpoint (no 'latest' file); resume from a "
                          "checkpoint this integration saved")
    return path


def latest_step(path: str) -> int:
    """The global step of the checkpoint ``path/latest`` names (``step-NNNNNNNN``)."""
    with open(os.path.join(path, "latest"), "rb") as f:
        name = f.read(256).decode("ascii", "replace").strip()
    digits = name[5:13]
    if not name.startswith("step-") or not digits.isdigit():
        raise ConfigError(f"{path}/latest: names {name!r}, not a pagemem checkpoint 'step-NNNNNNNN'")
    return int(digits)


class EngineModule(nn.Module):
    """What a framework calls as its model: forward goes through the engine (``engine(...)``);
    ``train()``, ``eval()``, ``parameters()`` and ``zero_grad()`` reach the wrapped model, a
    registered child."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a module: kept out of children and state dicts

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)
