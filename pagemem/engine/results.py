"""What the engine gives back: the trained weights as a state dict, checkpoints (save, load, and
the narrow handle they see, ``checkpoints.checkpoint.Checkpointed``), its counters as JSON-ready
values, and ``stats()``. A mixin of ``Engine``, as ``backward.py`` is: these methods share its state."""

from __future__ import annotations

import dataclasses

import functools

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from pagemem.checks import check_int
from pagemem.engine.checkpoints import checkpoint, safetensors_save
from pagemem.engine.ranks.checkpoints import by_rank_zero, save_over_ranks
from pagemem.engine.config import EngineConfig
from pagemem.engine.calls import CallLock, engine_call
from pagemem.errors import ConfigError, InvalidRequest, PageMemError
from pagemem.units import parse_size

if TYPE_CHECKING:
    from pagemem.engine.gradients.gradients import Gradients
    from pagemem.engine.paging.pager import Pager
    from pagemem.engine.units.guard import Guard
    from pagemem.engine.phase import PhaseMachine
    from pagemem.engine.units.bank import ParamBank
    from pagemem.engine.updates.adam import PagedOptimizer
    from pagemem.engine.updates.lockfree import LockFreeUpdater
    from pagemem.engine.updates.update import Updater
    from pagemem.engine.ranks import Collectives, RankGroup
    from pagemem.store import PageStore


_E = TypeVar("_E", bound="ResultsMixin")


class ResultsMixin:
    module: nn.Module
    config: EngineConfig
    bank: "ParamBank"
    store: "PageStore"
    device: torch.device
    optimizer: "PagedOptimizer"
    updater: "Updater"
    lockfree: "LockFreeUpdater | None"
    pager: "Pager"
    calls: CallLock
    phase: "PhaseMachine"
    global_step: int
    gradients: "Gradients"
    guard: "Guard"
    failed_backwards: int
    _phase_seconds: dict[str, float]
    collectives: "Collectives | None"
    ranks: "RankGroup"

    if TYPE_CHECKING:  # Engine's
        def _usable(self, what: str) -> None: ...

        def _before_reading_weights(self, what: str = "state_dict") -> None: ...

        @property
        def group_of(self) -> list[int | None]: ...

    @engine_call("state_dict")
    def state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The trained weights as an ordinary state dict keyed like ``module.state_dict()``: fp32
        master weights on the host (wherever their pages are; a frozen parameter's compute copy
        in its original dtype), buffers as they are. With several ranks and a model that computes
        in bf16 or fp16 in its own dtype, the master weights are sharded and gathered here: every
        rank calls it ([Note: sharded master weights])."""
        self._usable("state_dict")
        self._before_reading_weights()
        index = {id(p): i for i, (_, p) in enumerate(self.bank.params)}
        bank = self.bank
        # [Note: sharded master weights]: a master no rank holds whole, and the compute copy
        # cannot give (it computes in another dtype), is gathered: then a collective
        apart = [i for i in range(len(bank.params)) if bank.is_trainable(i) and not bank.master_whole_here(i)]
        gathered = self.updater.gather_masters.whole_masters(apart) if apart else {}  # type: ignore[union-attr]
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=True).items():
            i = index.get(id(value))
            if i is None:
                out[key] = value.detach().clone()
            elif i in gathered:
                out[key] = gathered[i]
            else:
                # on the host, wherever the pages are; a frozen parameter's compute copy as it was given
                out[key] = bank.host_value(i, torch.float32 if bank.is_trainable(i) else bank.original_dtype_of(i))
        return out

    @engine_call("save")
    def save(self, directory: str, keep: int | None = None) -> str:
        """Write the whole training state as a new checkpoint under ``directory`` and point
        ``directory/latest`` at it once it is durable (see ``engine/checkpoints/checkpoint.py``). Call it
        between updates (not in the middle of gradient accumulation). Returns its path. ``keep``:
        then remove all but the newest ``keep`` checkpoints (never the one ``latest`` names).
        With several ranks every rank calls it at the same step, with the same ``directory`` on a
        filesystem every rank sees (rank 0 writes; [Note: checkpoints over ranks]); a rank that
        cannot save makes every rank raise, and none goes out of step."""
        self._usable("save")
        if keep is not None:
            check_int("keep", keep, 1)
        if self.collectives is None:
            self._ready_to_save()
            return checkpoint.save(self.checkpointed(), directory, keep)
        try:
            self._ready_to_save()
            refused = None
        except PageMemError as exc:  # told to the other ranks first: every rank refuses together
            refused = exc
        return save_over_ranks(self.checkpointed(), self.collectives, directory, keep, self.global_step, refused)

    def _ready_to_save(self) -> None:
        self.updater.refuse_if_unfinished("save")
        if self.lockfree is not None:
            if self.lockfree.has_fresh():
                raise InvalidRequest("save: call step() first (gradients of this iteration are not saved)")
            self.lockfree.quiesce()  # a checkpoint of a drained updater is a synchronous one
        if self.phase.micro:
            raise InvalidRequest("save: gradients of an unfinished accumulation are not saved; "
                                 "call save() after step() has updated")
        self.updater.flush()
        self.pager.residency.keep_writes()

    @engine_call("save_weights")
    def save_weights(self, directory: str | os.PathLike,
                     max_shard_bytes: int | str = safetensors_save.DEFAULT_MAX_SHARD_BYTES) -> list[str]:
        """Write the model's current weights into ``directory`` as safetensors files in Hugging
        Face's layout: ``model.safetensors``, or shards ``model-0000k-of-0000N.safetensors`` of at
        most ``max_shard_bytes`` each (``"2GiB"`` style or bytes; default 2 GiB) with
        ``model.safetensors.index.json``. Keys are those ``model.state_dict()`` has, tied weights
        once; parameters in the dtype they came with (from the fp32 master weights), persistent
        buffers as they are. Read one shard at a time (host memory holds at most one shard),
        written atomically: a failure leaves the files that were there. It does not write
        ``config.json``: for ``from_pretrained``, save the model's config there too
        (``model.config.save_pretrained(directory)``). ``Engine(model, config, values=directory)``
        reads them back. Returns the paths written, the index last (see
        ``engine/checkpoints/safetensors_save.py``). With several ranks every rank calls it and
        rank 0 writes."""
        self._usable("save_weights")
        self.updater.refuse_if_unfinished("save_weights")
        limit = parse_size(max_shard_bytes, "max_shard_bytes")
        if limit < 1:
            raise ConfigError(f"max_shard_bytes: must be at least 1 byte, got {max_shard_bytes!r}")
        self._before_reading_weights("save_weights")
        entries = safetensors_save.weight_entries(self.module, self.bank)
        if self.bank.gathered:  # each value a collective every rank makes ([Note: gathered units]); rank 0 writes
            entries = [dataclasses.replace(e, read=lambda v=e.read(): v) for e in entries]
        if self.collectives is not None:  # replicas: rank 0 writes ([Note: checkpoints over ranks])
            self.collectives.begin("saving weights")
            return by_rank_zero(self.collectives, "save_weights", os.fspath(directory),
                                lambda: safetensors_save.save_weights(entries, directory, limit))
        return safetensors_save.save_weights(entries, directory, limit)

    def checkpointed(self) -> checkpoint.Checkpointed:
        """What a checkpoint reads and writes of this engine (``checkpoint.Checkpointed``)."""
        return checkpoint.Checkpointed(self.module, self.config, self.bank, self.store, self.device,
                                       self.training_state, self.restore_training_state,
                                       lambda: self.updater.scaler.scale, rank=self.ranks.rank,
                                       same_on_every_rank=None if self.collectives is None else self._same_checkpoint)

    def _same_checkpoint(self, values: list[int]) -> bool:
        assert self.collectives is not None
        top, low = self.collectives.begin("loading a checkpoint", values)
        return top == low

    @classmethod
    def load(cls: type[_E], directory: str, model: nn.Module, config: EngineConfig | None = None, *,
             param_groups: Any = None, process_group: Any = None) -> _E:
        """An engine over ``model`` resumed from the checkpoint ``directory`` names (or its
        ``latest``): weights, buffers, optimizer states, counters, loss scale, optimizer groups
        (which parameters each holds, and their hyperparameters), RNG. ``config`` defaults to the
        one saved (its store paths must exist here); ``param_groups`` to the saved membership
        (given, it must hold the same parameters in the same groups). The model may be built on
        the ``meta`` device (``with torch.device("meta"): model = ...``): its values then come
        only from the checkpoint and host memory never holds a second copy. A scheduler made
        after this resets the learning rates, as torch's does when made after an optimizer state
        is loaded: load its state, then set each group's ``lr`` from ``get_last_lr()``. A damaged
        checkpoint raises a PageMemError naming the file, and a refused load leaves ``model`` as it
        was; compute dtype and loss scaling are ``config``'s (``engine/checkpoints/checkpoint.py``).
        ``process_group``: as ``Engine``'s; any number of ranks loads a checkpoint saved by any
        number ([Note: checkpoints over ranks])."""
        make = functools.partial(cls, process_group=process_group) if process_group is not None else cls
        return checkpoint.load(make, directory, model, config, param_groups)

    def training_state(self) -> dict[str, Any]:
        """Counters, loss scale and optimizer groups as JSON-ready values (for checkpoints)."""
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return {"global_step": self.global_step, **self.updater.state(), "param_groups": groups,
                "group_of": self.group_of}

    def restore_training_state(self, state: dict[str, Any]) -> None:
        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise InvalidRequest(f"the checkpoint has {len(state['param_groups'])} parameter groups, this engine "
                                 f"{len(self.optimizer.param_groups)}: pass the same param_groups")
        if "group_of" in state and list(state["group_of"]) != list(self.group_of):
            raise InvalidRequest("the checkpoint's parameter groups hold other parameters than this engine's: "
                                 "pass the same param_groups (or none, to take the saved ones)")
        self.updater.restore(state)
        self.global_step = state["global_step"]
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})

    @engine_call("stats")
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
            "grad_materialised": self.gradients.handles.materialised,
            "skipped_steps": self.updater.skipped_steps,
            "overlapped_updates": self.updater.overlapped_updates,
            "gpu_state_units": sum(t == "gpu" for t in self.bank.state_tiers),
            "unforeseen_reads": self.guard.reads,
            "parameter_writes": self.pager.residency.written,
            "units_final_in_backward": self.gradients.handoff.early,
            "failed_backwards": self.failed_backwards,
            **self.updater.undo.stats(),  # [Note: a failed backward is undone]: what keeping it costs
            "staleness": self.lockfree.stats() if self.lockfree is not None else None,
            **{f"{k}_bytes": v for k, v in self.bank.state_bytes().items()},
            "home_tier": self.bank.home_tier,  # [Note: homes on nvme]: where compute copies and gradient sums live
            "optimizer_tier": self.config.optimizer_tier,
            "loss_scale": self.updater.scaler.scale,
            "ranks": self._rank_stats(),
        }

    def _rank_stats(self) -> dict[str, Any]:
        """The collectives' counts ([Note: collectives]) and each rank's share of the moments
        ([Note: sharded moments]: elements per rank, in rank order; one process: all of them)."""
        gather = self.updater.gather_masters
        shares = ([s.owned_elements for s in gather.shares] if gather is not None else
                  [sum(p.numel() for _, p in self.bank.params)])
        counts = (self.collectives.stats() if self.collectives is not None else
                  {"rank": 0, "world_size": 1, "backend": self.ranks.backend, "collectives": 0, "sent_bytes": 0,
                   "header_bytes": 0, "collective_wait_seconds": 0.0})
        return {**counts, "moment_shares": shares, "sharded": gather is not None,
                "gathered_bytes": gather.gathered_bytes if gather is not None else 0,
                "gathered_units": self.unit_gather.gathers if self.bank.gathered else 0,
                "unit_gathers": list(self.unit_gather.unit_gathers) if self.bank.gathered else [],
                "unit_gather_bytes": self.unit_gather.received_bytes if self.bank.gathered else 0,
                **(self.grad_scatter.stats() if self.bank.gathered else
                   {"grad_scatters": 0, "grad_scatters_early": 0, "grad_scatter_bytes": 0, "grad_local_peak_bytes": 0})}
