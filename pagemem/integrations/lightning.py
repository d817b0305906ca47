"""Lightning's ``Trainer(strategy="pagemem")``: a LightningModule trained through a pagemem engine.

>>> import pagemem.integrations.lightning                   # registers "pagemem"
>>> trainer = lightning.pytorch.Trainer(strategy="pagemem", ...)            # budgets sized from the model
>>> trainer = lightning.pytorch.Trainer(strategy=PagememStrategy(engine_config), ...)

As Lightning's ``DeepSpeedStrategy`` does: the engine wraps the LightningModule, and
``training_step``, ``validation_step`` (and test, predict) run as the engine's forward
(``Engine.__call__``), integer arguments such as ``batch_idx`` bound outside it so that every
step follows one plan; the optimizer ``configure_optimizers`` returns (a ``torch.optim.AdamW``,
never stepped) gives the engine its groups, and its schedulers drive ``engine.optimizer``
([Note: a framework's knobs drive the engine], ``framework.py``). ``PagememPrecision`` runs the
backward through ``engine.backward``, clips by norm with ``engine.clip_grad_norm_``
(``gradient_clip_val``) and steps ``engine.optimizer``; ``accumulate_grad_batches`` is told to the
engine. Precision ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"`` (both bf16 ones compute in
bfloat16 over fp32 master weights, as DeepSpeed's bf16 does). A checkpoint is a directory: the
engine's checkpoint and ``lightning-NNNNNNNN.pt``, Lightning's loops, callbacks and schedulers
for the engine's step NNNNNNNN (written before the engine's, which commits it), without the
state dict or optimizer states; ``ckpt_path`` (``"last"`` too) resumes it with ``Engine.load``.
The engine closes when ``fit`` ends (teardown), leaving the module its trained weights.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from pagemem.config import StoreConfig
from pagemem.engine.config import EngineConfig
from pagemem.engine.engine import Engine
from pagemem.errors import ConfigError, InvalidRequest
from pagemem.integrations.framework import (FrameworkKnobs, engine_checkpoint, engine_config, latest_step,
                                            make_engine, rebind_schedulers)

PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}
CLIENT = "lightning-{:08d}.pt"
"""Lightning's part of a checkpoint directory, for the engine checkpoint of that global step."""


def default_config(model: nn.Module) -> EngineConfig:
    """The config of ``strategy="pagemem"``: with CUDA, the gpu budget is nine tenths of the
    device's free memory; on the host stand-in, twice the parameters' bytes and 256 MiB; the
    cpu budget holds a compute copy, master weights, both moments and gradient sums (20 bytes a
    parameter) and 256 MiB. Give ``PagememStrategy(config)`` for other budgets (nvme, say)."""
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    slack = 256 << 20
    gpu = int(torch.cuda.mem_get_info()[0] * 0.9) if torch.cuda.is_available() else 2 * nbytes + slack
    return EngineConfig(store=StoreConfig(gpu_bytes=gpu, cpu_bytes=5 * nbytes + slack))


def device_of(config: EngineConfig | None) -> torch.device:
    """Where the engine will compute: its ``gpu`` tier's device."""
    if torch.cuda.is_available() and (config is None or config.store.gpu_backend != "host"):
        return torch.device("cuda", 0 if config is None else config.store.cuda_device)
    return torch.device("cpu")


class PagememPrecision(Precision):
    """Backward through ``engine.backward``, clipping by norm through ``engine.clip_grad_norm_``,
    the step through ``engine.optimizer`` (the strategy's engine); the compute dtype is the
    engine's (``precision``: one of ``PRECISIONS``)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"precision: with strategy='pagemem' must be one of {list(PRECISIONS)}, got "
                              f"{precision!r} (float16 needs the engine's loss scaling, not offered here yet)")
        self.precision = precision  # type: ignore[assignment]
        self.engine: Engine | None = None
        """The strategy's engine, from its ``setup`` to its ``teardown``."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision]

    def convert_input(self, data: Any) -> Any:
        dtype = self.compute_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        self._engine().backward(tensor)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ConfigError("training_step: returned None (skipping the backward), which strategy='pagemem' does "
                              "not offer; return the loss")
        return optimizer.step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._engine().clip_grad_norm_(float(clip_val))

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ConfigError("PagememPrecision: is the precision of strategy='pagemem' only (no engine is set up)")
        return self.engine


def precision_of(plugin: Precision) -> PagememPrecision:
    """Lightning's precision plugin for ``Trainer(precision=...)`` as the engine's; any other
    (DeepSpeed's, FSDP's, fp16, double, quantized) is refused."""
    if isinstance(plugin, PagememPrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision) and name in PRECISIONS:
        return PagememPrecision(name)
    raise ConfigError(f"precision: strategy='pagemem' computes in {list(PRECISIONS)} through its own precision "
                      f"plugin; got {type(plugin).__name__}({name!r})")


class PagememStrategy(SingleDeviceStrategy):
    """A LightningModule trained through :class:`pagemem.Engine` in one process (see the module
    docs); ``config``: the engine's (None: :func:`default_config` of the module)."""

    strategy_name = "pagemem"

    def __init__(self, config: EngineConfig | None = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Precision | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise ConfigError(f"config: must be a pagemem.EngineConfig or None, got {type(config).__name__}")
        self.engine: Engine | None = None
        """The engine, from ``setup`` to ``teardown``."""
        self.config = config
        self._resume: str | None = None
        self._whole: tuple[int, str] | None = None
        """The last checkpoint written or resumed: its global step and path."""
        # no default precision plugin here: Lightning's from Trainer(precision=...) comes through the setter
        super().__init__(device=device_of(config), accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)

    @property  # type: ignore[override]
    def precision_plugin(self) -> PagememPrecision:
        return self._precision_plugin if self._precision_plugin is not None else PagememPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else precision_of(plugin)

    # ------------------------------------------------------------------ the engine

    def model_to_device(self) -> None:
        """The engine places the module: its parameters live in pages."""

    def setup(self, trainer: pl.Trainer) -> None:
        """The engine over the LightningModule, made from ``configure_optimizers``' AdamW (or
        loaded from the checkpoint being resumed)."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        devices = len(getattr(trainer._accelerator_connector, "_parallel_devices", None) or [self.root_device])
        if devices > 1 or trainer.num_nodes > 1:
            raise ConfigError(f"Trainer.devices, Trainer.num_nodes: strategy='pagemem' trains in one process on one "
                              f"device (the engine's data parallelism is not wired to Lightning yet); got "
                              f"{devices} devices on {trainer.num_nodes} nodes")
        refuse_sharded(module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        config = self.config if self.config is not None else default_config(module)
        knobs = FrameworkKnobs(accumulation_steps=trainer.accumulate_grad_batches if fitting else 1,
                               compute_dtype=self.precision_plugin.compute_dtype,
                               clips=bool(trainer.gradient_clip_val),
                               names={"accumulation": "Trainer.accumulate_grad_batches",
                                      "clip": "Trainer.gradient_clip_val", "precision": "Trainer.precision"})
        config = engine_config(config, knobs, "PagememStrategy.config")
        if not fitting:
            self.engine = self.precision_plugin.engine = Engine(module, config)
            return
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ConfigError(f"configure_optimizers: strategy='pagemem' trains with one optimizer, got "
                              f"{len(optimizers)}")
        self.engine = self.precision_plugin.engine = make_engine(module, optimizers[0], config,
                                                                 "configure_optimizers", self._resume)
        rebind_schedulers([c.scheduler for c in schedulers], optimizers[0], self.engine.optimizer)
        self.optimizers, self.lr_scheduler_configs = [self.engine.optimizer], schedulers
        self.setup_precision_plugin()

    def teardown(self) -> None:
        """The engine closes: the module keeps its trained weights as plain parameters, without
        gradients (the engine's handles on ``p.grad`` would outlive it)."""
        engine, self.engine = self.engine, None
        self.precision_plugin.engine = None
        self.optimizers = []
        try:
            if engine is not None:
                engine.close()
        finally:
            if engine is not None:
                for p in engine.module.parameters():
                    p.grad = None
            super().teardown()

    def _through_engine(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``module.<method>(*args, **kwargs)`` as the engine's forward; integer arguments
        (``batch_idx``, ``dataloader_idx``) are bound outside it, so every step follows one plan."""
        module = self.lightning_module
        assert self.engine is not None and module is not None
        bound = {i: a for i, a in enumerate(args) if isinstance(a, int)}
        passed = [a for i, a in enumerate(args) if i not in bound]

        def forward(*given: Any, **named: Any) -> Any:
            module.__dict__.pop("forward", None)  # the step's own self(x) calls the module's forward
            rest = iter(given)
            full = [bound[i] if i in bound else next(rest) for i in range(len(args))]
            return getattr(module, method)(*full, **named)

        module.forward = forward  # for the engine's call of the module only (Lightning's forward redirection)
        try:
            return self.engine(*passed, **kwargs)
        finally:
            module.__dict__.pop("forward", None)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_engine("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_engine("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_engine("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_engine("predict_step", args, kwargs)

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds the weights."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds the optimizer states (never all in host memory)."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """``filepath`` becomes a directory: Lightning's part for this step first, then the
        engine's checkpoint, whose ``latest`` commits both; parts of older steps go after."""
        if storage_options is not None:
            raise ConfigError("storage_options: not used by strategy='pagemem' (the engine writes its checkpoint)")
        assert self.engine is not None
        path = os.fspath(filepath)
        if os.path.isfile(path):
            raise ConfigError(f"checkpoint path: {path!r} is a file; strategy='pagemem' saves a directory there")
        step = self.engine.global_step
        if self.engine.gradients_pending:  # a backward of the next step ran (ModelCheckpoint after a resume)
            if self._whole is not None and self._whole[0] == step:
                rank_zero_warn(f"pagemem: {path} is not written: a checkpoint in the middle of an accumulation would "
                               f"lose its gradients; {self._whole[1]} holds step {step} whole")
                return
            raise InvalidRequest(f"checkpoint {path}: asked for in the middle of an accumulation; strategy='pagemem' "
                                 "saves between optimizer steps (its gradients are not saved)")
        os.makedirs(path, exist_ok=True)
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        client["state_dict"], client["optimizer_states"] = {}, []
        target = os.path.join(path, CLIENT.format(step))
        tmp = f"{target}.tmp-{os.getpid()}"
        torch.save(client, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        self.engine.save(path, keep=1)
        self._whole = (step, path)
        for old in glob.glob(os.path.join(path, CLIENT.format(0).replace("00000000", "*"))):
            if os.path.basename(old) != CLIENT.format(step):
                os.remove(old)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's part of the checkpoint ``latest`` names; the engine loads the rest in
        ``setup``."""
        path = engine_checkpoint(checkpoint_path, "ckpt_path")
        client = os.path.join(path, CLIENT.format(latest_step(path)))
        if not os.path.isfile(client):
            raise ConfigError(f"ckpt_path: {path!r} has no {os.path.basename(client)} beside its engine checkpoint")
        self._resume = path
        self._whole = (latest_step(path), path)
        return torch.load(client, map_location="cpu", weights_only=False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``Engine.load`` gives the weights in ``setup``."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``Engine.load`` gave the states and the groups' hyperparameters in ``setup``
        (the schedulers, made before the engine, left them as saved; their states come next)."""
        self._resume = None

    def remove_checkpoint(self, filepath: Any) -> None:
        import shutil

        path = os.fspath(filepath)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="pagemem: paged training beyond GPU memory")


def refuse_sharded(module: nn.Module) -> None:
    """A module FSDP or DeepSpeed already shards cannot be paged as well: ``ConfigError``."""
    for name, sub in module.named_modules():
        kind = type(sub).__name__
        if kind in ("FullyShardedDataParallel", "DeepSpeedEngine") or kind.startswith("FSDP"):
            raise ConfigError(f"model: {name or 'the module'} is a {kind}; strategy='pagemem' pages an unsharded "
                              "module (drop FSDP/DeepSpeed)")
    for name, p in module.named_parameters():
        if type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            raise ConfigError(f"model: parameter {name!r} is a DTensor (sharded); strategy='pagemem' pages an "
                              "unsharded module")


if "pagemem" not in StrategyRegistry:
    PagememStrategy.register_strategies(StrategyRegistry)
