"""Engine: trains an unmodified PyTorch model whose states live in the page store.

>>> engine = pagemem.Engine(model, pagemem.EngineConfig(store=store_cfg, optimizer=pagemem.AdamW(lr=3e-4)))
>>> out = engine(**batch)          # calls the wrapped model
>>> engine.backward(out.loss)
>>> engine.step()

Who does what: ``bank.py`` keeps the model states in pages; ``pager.py`` decides per iteration
how parameters reach the gpu (the first iteration with given input shapes runs under the tracer
with demand paging, the scheduler plans it, later ones follow the plan through ``executor.py``,
an iteration that leaves its plan finishes on demand and is re-planned); ``residency.py`` moves
units and points the parameters at their pages; ``update.py`` turns gradients into updates. All
of them hear the ops of one ``pagemem.tracer.OpClock``, the same the trace was numbered with.
Autograd's saved parameters are kept as references and fetched again when backward needs them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import partial
from typing import Any

import torch
from torch import nn

from pagemem.engine.adam import PagedOptimizer
from pagemem.engine.bank import ModuleInit, ParamBank
from pagemem.engine.config import EngineConfig, check_no_amsgrad
from pagemem.engine.pager import Pager
from pagemem.engine.update import Updater
from pagemem.errors import ConfigError, InvalidRequest
from pagemem.store import PageStore
from pagemem.tracer.clock import OpClock


class Engine:
    def __init__(self, model: nn.Module, config: EngineConfig, *, init: ModuleInit | None = None,
                 _values: bool = True) -> None:
        """Take over ``model``'s parameters: from here on they live in the store's pages.

        A model too large for host memory is built on the ``meta`` device (``with
        torch.device("meta"): model = ...``) and given ``init``: ``init(name, module)`` sets the
        values of one module's own parameters in place, and is called on each module that owns
        parameters, one at a time, so host memory never holds the whole model (for example
        ``lambda name, m: m.reset_parameters()``, or ``pagemem.models.gpt.init_module(cfg)``).
        Or build it on ``meta`` and resume it with :meth:`load`."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config: must be a pagemem.EngineConfig, got {type(config).__name__}")
        self.module = model
        self.config = config
        self.store = PageStore(config.store)
        try:
            gpu_bytes = self.store.tier("gpu").capacity * self.store.page_bytes
            self.bank = ParamBank(model, self.store, config.compute_dtype, config.optimizer_tier,
                                  unit_bytes=max(self.store.page_bytes, gpu_bytes // 16),
                                  values=_values and init is None, init=init)
        except BaseException:
            self.store.close()
            raise
        self.device = self.store.tier("gpu").device
        """Where the model computes: the ``gpu`` tier's device (the host for the stand-in). Put
        the inputs there."""
        with torch.no_grad():  # buffers are small and used by compute: they live on the device
            for module in model.modules():
                for name, b in list(module._buffers.items()):
                    if b is not None and not b.is_meta and b.device != self.device:
                        module._buffers[name] = b.to(self.device)
        params = [p for _, p in self.bank.params]
        self.optimizer = PagedOptimizer(params, config.optimizer, step_fn=lambda _opt: self._update())
        self.updater = Updater(self.bank, self.store, config, lambda: check_no_amsgrad(self.optimizer.hyper(0)))
        self._micro = 0
        self.global_step = 0
        """Updates attempted so far (one per ``accumulation_steps`` backward calls)."""
        self._last_taken = False
        self._phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._grad_ready, i))
                       for i, p in enumerate(params) if p.requires_grad]
        self.clock = OpClock(model, self.bank.params)
        self.pager = Pager(model, self.bank, self.clock, config.optimizer_tier, config.executor)
        self.clock.install()

    # ------------------------------------------------------------------ the training loop

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model's forward."""
        t0 = time.perf_counter()
        self.pager.begin(args, kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pager.pack, self.pager.unpack):
                return self.module(*args, **kwargs)
        finally:
            self._phase_seconds["forward"] += time.perf_counter() - t0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; gradients of successive calls add up until ``step()`` updates."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidRequest("backward: loss must be a one-element tensor")
        t0 = time.perf_counter()
        scale = self.updater.scaler.scale
        self.updater.begin_backward(final=self._micro + 1 == self.config.accumulation_steps)
        with torch.autograd.graph.saved_tensors_hooks(self.pager.pack, self.pager.unpack):
            (loss * scale if scale is not None else loss).backward()
        self.pager.end_backward()
        self.updater.end_backward()
        self._micro += 1
        self._phase_seconds["backward"] += time.perf_counter() - t0

    def step(self) -> bool:
        """Update after every ``accumulation_steps``-th ``backward()``; True if it updated (False
        between accumulation boundaries, or when an fp16 overflow skipped the update)."""
        if self._micro < self.config.accumulation_steps:
            return False
        self.optimizer.step()
        return self._last_taken

    # ------------------------------------------------------------------ hooks

    def _grad_ready(self, i: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        self.updater.grad_ready(i, p.grad)
        p.grad = None

    # ------------------------------------------------------------------ the update

    def _update(self) -> None:
        if len(self.optimizer.param_groups) != 1:
            raise InvalidRequest("the engine's optimizer has one param group")
        t0 = time.perf_counter()
        try:
            self._last_taken = self.updater.step()
        finally:
            self._micro = 0
            self.global_step += 1
            self._phase_seconds["step"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ results

    def state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The trained weights as an ordinary state dict keyed like ``module.state_dict()``: fp32
        master weights on the host (wherever their pages are), buffers as they are."""
        index = {id(p): i for i, (_, p) in enumerate(self.bank.params)}
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=True).items():
            i = index.get(id(value))
            if i is None:
                out[key] = value.detach().clone()
            else:
                layer, k = self.bank.where(i)
                out[key] = layer.master[k].to_torch().cpu()  # on the host, wherever the pages are
        return out

    def save(self, directory: str) -> str:
        """Write the whole training state as a new checkpoint under ``directory`` and point
        ``directory/latest`` at it once it is durable (see ``engine/checkpoint.py``). Call it
        between updates (not in the middle of gradient accumulation). Returns its path."""
        if self._micro:
            raise InvalidRequest("save: gradients of an unfinished accumulation are not saved; "
                                 "call save() after step() has updated")
        from pagemem.engine import checkpoint

        self.updater.flush()
        return checkpoint.save(self, directory)

    @classmethod
    def load(cls, directory: str, model: nn.Module, config: EngineConfig | None = None) -> "Engine":
        """An engine over ``model`` resumed from the checkpoint ``directory`` names (or its
        ``latest``): weights, optimizer states, counters, loss scale, optimizer groups, RNG.
        ``config`` defaults to the one saved (its store paths must exist here). The model may be
        built on the ``meta`` device (``with torch.device("meta"): model = ...``): its values
        then come only from the checkpoint and host memory never holds a second copy."""
        from pagemem.engine import checkpoint

        ckpt = checkpoint.resolve(directory)
        manifest = checkpoint.read_manifest(ckpt)
        meta = any(p.is_meta for p in model.parameters())
        engine = cls(model, config or EngineConfig.from_dict(manifest["config"]), _values=not meta)
        try:
            checkpoint.load_into(engine, ckpt, manifest)
        except BaseException:
            engine.close()
            raise
        return engine

    def training_state(self) -> dict[str, Any]:
        """Counters, loss scale and optimizer groups as JSON-ready values (for checkpoints)."""
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return {"global_step": self.global_step, **self.updater.state(), "param_groups": groups}

    def restore_training_state(self, state: dict[str, Any]) -> None:
        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise InvalidRequest("the checkpoint's optimizer state does not fit this model")
        self.updater.restore(state)
        self.global_step = state["global_step"]
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})

    def stats(self) -> dict[str, Any]:
        """Per-tier use against budget, bytes moved per direction, time per phase, paging counts."""
        s = self.store.stats()
        paging = self.pager.stats()
        busy = self._phase_seconds["forward"] + self._phase_seconds["backward"]
        return {
            **paging,
            "gpu_budget_bytes": self.pager.residency.budget_bytes,
            "gpu_idle": paging["gpu_wait_seconds"] / busy if busy else 0.0,
            "tiers": {n: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                          "utilization": t.utilization} for n, t in s.tiers.items()},
            "moved_bytes": {k: m.bytes for k, m in s.moves.items()},
            "seconds": dict(self._phase_seconds),
            "view_copies": s.view_copies,
            "skipped_steps": self.updater.skipped_steps,
            "overlapped_updates": self.updater.overlapped_updates,
            "gpu_state_units": sum(t == "gpu" for t in self.bank.state_tiers),
            "loss_scale": self.updater.scaler.scale,
        }

    def close(self) -> None:
        """Remove the hooks, stop the workers and give the store's memory back. The module's
        parameters are left as placeholders; load ``state_dict()`` into a model to keep training."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.clock.remove(quiet=True)
        self.updater.close()
        self.pager.close()
        self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
