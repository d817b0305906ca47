"""A Hugging Face ``Trainer`` that trains its model through a pagemem engine.

>>> from pagemem.integrations.hf import PagememTrainer
>>> trainer = PagememTrainer(model, args, train_dataset=ds, pagemem_config=engine_config)
>>> trainer.train()                                  # or train(resume_from_checkpoint=True)

What it changes in ``transformers.Trainer`` (5.x), as its DeepSpeed path does: the optimizer
``TrainingArguments`` builds (``optim="adamw_torch_fused"`` or ``"adamw_torch"``, with the
Trainer's decay / no-decay groups) is turned into an engine when training starts, and
``trainer.optimizer`` is ``engine.optimizer`` (the scheduler drives its groups); the model the
Trainer calls forwards through the engine (``EngineModule``) and is never moved to a device
(its parameters live in pages); clipping is ``engine.clip_grad_norm_``; accumulation stays the
Trainer's (``gradient_accumulation_steps``, told to the engine); ``bf16=True`` makes bfloat16 the
engine's compute dtype over fp32 master weights. Each ``save_steps`` checkpoint holds the
Trainer's files (model weights, scheduler, RNG, trainer state) and ``pagemem/``, the engine's
checkpoint, in place of ``optimizer.pt``; ``resume_from_checkpoint`` loads it with
``Engine.load``. Refused at start (``ConfigError``, a ``ValueError``): DeepSpeed or FSDP also
configured, an optimizer other than torch's AdamW, fp16, more than one process.

``trainer.engine`` is the engine once training or evaluation started; it stays open after
``train()`` (evaluation and ``save_model`` go through it): ``trainer.engine.close()`` gives the
model its trained weights as plain parameters.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer_utils import get_last_checkpoint

from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.errors import ConfigError, InvalidRequest
from pagemem.integrations.framework import (EngineModule, FrameworkKnobs, engine_checkpoint, engine_config,
                                            group_settings, make_engine, rebind_schedulers, restore_groups)

CHECKPOINT_DIR = "pagemem"
"""The engine's checkpoint inside each of the Trainer's ``checkpoint-N`` directories."""
OPTIMS = ("adamw_torch", "adamw_torch_fused")
SCHEDULER_NAME = "scheduler.pt"


def knobs_of(args: transformers.TrainingArguments) -> FrameworkKnobs:
    """What ``args`` asks of the engine; ``ConfigError`` for what the engine cannot honour."""
    if args.deepspeed:
        raise ConfigError(f"TrainingArguments.deepspeed: pagemem trains the model in place of DeepSpeed; must be "
                          f"None, got {args.deepspeed!r}")
    if args.fsdp:
        raise ConfigError(f"TrainingArguments.fsdp: pagemem trains the model in place of FSDP; must be empty, "
                          f"got {args.fsdp!r}")
    if args.world_size > 1:
        raise ConfigError(f"TrainingArguments: {args.world_size} processes; PagememTrainer trains in one process "
                          "(the engine's data parallelism is not wired to the Trainer yet)")
    if str(getattr(args.optim, "value", args.optim)) not in OPTIMS:
        raise ConfigError(f"TrainingArguments.optim: the engine updates with AdamW over its pages; must be one of "
                          f"{list(OPTIMS)}, got {getattr(args.optim, 'value', args.optim)!r}")
    if args.fp16:
        raise ConfigError("TrainingArguments.fp16: not offered with pagemem yet (its loss scaling needs the "
                          "engine's backward); use bf16=True or neither")
    return FrameworkKnobs(accumulation_steps=args.gradient_accumulation_steps,
                          compute_dtype=torch.bfloat16 if args.bf16 else None, clips=args.max_grad_norm > 0,
                          names={"accumulation": "TrainingArguments.gradient_accumulation_steps",
                                 "clip": "TrainingArguments.max_grad_norm", "precision": "TrainingArguments.bf16"})


class PagememTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through :class:`pagemem.Engine` (see the module docs);
    ``pagemem_config``: the engine's config (tiers and where states live). Everything else as
    the Trainer takes it."""

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *more: Any, pagemem_config: EngineConfig, **kwargs: Any) -> None:
        if not isinstance(pagemem_config, EngineConfig):
            raise ConfigError(f"pagemem_config: must be a pagemem.EngineConfig, got {type(pagemem_config).__name__}")
        if kwargs.get("model_init") is not None:
            raise ConfigError("model_init: PagememTrainer trains the model it is given; pass model= instead")
        if args is not None:
            knobs_of(args)  # refused before the Trainer sets anything up
        self.engine: Engine | None = None
        """The engine, once training or evaluation started."""
        self._module: EngineModule | None = None
        self._resume: str | None = None
        self._saved_groups: list[dict[str, Any]] | None = None
        super().__init__(model, args, *more, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # configured through accelerate rather than args
            raise ConfigError("accelerate: a DeepSpeed or FSDP plugin is configured (ACCELERATE_USE_DEEPSPEED / "
                              "ACCELERATE_USE_FSDP or an accelerate config); pagemem trains the model in their place")
        self.pagemem_config = engine_config(pagemem_config, knobs_of(self.args), "pagemem_config")
        """The engine's config, with the Trainer's accumulation and compute dtype."""
        # [Note: the Trainer's backward is the engine's] accelerate's backward (its loss scaled by
        # its accumulation, as there) goes through engine.backward, as its DeepSpeed path goes
        # through DeepSpeed's: the engine then knows the last backward of a step from
        # accumulation_steps, where a backward by habit would guess from the previous step (one
        # backward after an epoch's partial accumulation, wrong with updates during backward)
        accelerator = self.accelerator
        accelerator.backward = lambda loss, **_: self.engine.backward(loss / accelerator.gradient_accumulation_steps)

    # ------------------------------------------------------------------ the engine in the Trainer's places

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The engine places the model: its parameters live in pages."""

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The engine, made from the optimizer the Trainer builds (or the one it was given), or
        loaded from the checkpoint being resumed; ``self.optimizer`` is its optimizer."""
        if self.engine is not None and self._resume is None:
            return self.optimizer
        if self.engine is not None:  # made by an evaluation before this resumed run: start again from the checkpoint
            self.engine.close()
            self.engine = self._module = None
            self.optimizer = None
        built = super().create_optimizer(model)
        self.engine = make_engine(self.model, built, self.pagemem_config, "TrainingArguments.optim", self._resume)
        self._saved_groups = group_settings(self.engine.optimizer) if self._resume is not None else None
        self._resume = None
        rebind_schedulers([self.lr_scheduler], built, self.engine.optimizer)
        # accelerate's wrapper, without its device placement (a round trip of every Adam moment through host memory)
        self.optimizer = self.accelerator.prepare_optimizer(self.engine.optimizer, device_placement=False)
        self.optimizer._is_accelerate_prepared = True
        return self.optimizer

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The model the Trainer calls: forward through the engine (made here if evaluation
        comes first)."""
        if self.engine is None:
            self.create_optimizer()
        if self._module is None:
            self._module = EngineModule(self.engine)
        return self._module

    def train(self, resume_from_checkpoint: str | bool | None = None, *more: Any, **kwargs: Any) -> Any:
        """As the Trainer's; a checkpoint to resume must hold the engine's part (``pagemem/``),
        checked before anything starts."""
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        if isinstance(path, (str, os.PathLike)):
            engine_checkpoint(os.path.join(path, CHECKPOINT_DIR), "resume_from_checkpoint")
        return super().train(resume_from_checkpoint, *more, **kwargs)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if resume_from_checkpoint is not None:
            self._resume = engine_checkpoint(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR),
                                             "resume_from_checkpoint")
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The norm clipping returned, else the engine's; None (not logged) where updates ran
        during backward (``overlap_update``, without clipping): those gradients are gone."""
        if grad_norm is not None:
            return grad_norm
        try:
            return self.engine.get_global_grad_norm()
        except InvalidRequest:
            return None

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint in ``output_dir/pagemem`` in place of ``optimizer.pt``; the
        scheduler's state as the Trainer writes it."""
        self.engine.save(os.path.join(output_dir, CHECKPOINT_DIR), keep=1)
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine was loaded with the checkpoint (``create_optimizer``): its groups' saved
        hyperparameters come back after the scheduler made since, then the scheduler's state."""
        if checkpoint is None:
            return
        if self._saved_groups is not None:
            restore_groups(self.engine.optimizer, self._saved_groups)
            self._saved_groups = None
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            with warnings.catch_warnings(record=True):
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
