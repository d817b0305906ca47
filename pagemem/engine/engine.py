"""Engine: trains an unmodified PyTorch model whose states live in the page store.

>>> engine = pagemem.Engine(model, pagemem.EngineConfig(store=store_cfg, optimizer=pagemem.AdamW(lr=3e-4)))
>>> out = engine(**batch)          # calls the wrapped model
>>> engine.backward(out.loss)
>>> engine.step()

The weights, checkpoints and counters it gives back are ``results.py``'s (a mixin, as
``backward.py`` is). Who does what: ``bank.py`` keeps the model states in pages; ``pager.py`` decides per iteration
how parameters reach the gpu (the first iteration with given input shapes runs under the tracer
with demand paging, the scheduler plans it, later ones follow the plan through ``executor.py``,
an iteration that leaves its plan finishes on demand and is re-planned); ``residency.py`` moves
units and points the parameters at their pages; ``update.py`` turns gradients into updates. All
of them hear the ops of one ``pagemem.tracer.OpClock``, the same the trace was numbered with.
Autograd's saved parameters are kept as references and fetched again when backward needs them.
An engine belongs to the process that made it: in a forked child every call raises
``WrongProcess`` ([Note: an engine belongs to its process], ``pagemem/process.py``).
"""

from __future__ import annotations

import threading
import time
import zlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from pagemem.engine.updates.adam import PagedOptimizer
from pagemem.engine.backward import BackwardMixin
from pagemem.engine.call_checks import CallChecks
from pagemem.engine.results import ResultsMixin
from pagemem.engine.units.bank import ParamBank
from pagemem.engine.units.budget_checks import check_units_fit, unit_cap
from pagemem.engine.units.homes import choose_home_tier
from pagemem.engine.checkpoints.ckpt_state import engine_dtype
from pagemem.engine.units.safetensors_values import FromSafetensors
from pagemem.engine.units.values import (FromCheckpoint, FromModule, FromStateDict, ModuleInit, ValueSource,
                                         source_of)
from pagemem.engine.config import EngineConfig, check_no_amsgrad
from pagemem.engine.updates.groups import checked_groups
from pagemem.engine.gradients.grad_ledger import GradLedger
from pagemem.engine.gradients.gradients import Gradients, LockFreeDestination, SyncDestination
from pagemem.engine.units.guard import Guard
from pagemem.engine.calls import CallLock, engine_call
from pagemem.engine.interrupts import install as hold_interrupts, shield
from pagemem.engine.interrupts import uninstall as release_interrupts
from pagemem.engine.updates.lockfree import LockFreeUpdater
from pagemem.engine.units.model_checks import check_no_meta_buffers, check_parameters
from pagemem.engine.updates.optimizer_states import OptimizerStates
from pagemem.engine.paging.pager import Pager
from pagemem.engine.ranks import Collectives, RankGroup
from pagemem.engine.ranks.gather import MasterGather
from pagemem.engine.ranks.join import join_ranks
from pagemem.engine.ranks.replicas import agree_on_module_values, agree_on_values, sync_buffers
from pagemem.engine.ranks.grad_scatter import GradScatter
from pagemem.engine.ranks.unit_gather import UnitGather
from pagemem.engine.phase import EnginePhase, PhaseMachine
from pagemem.engine.units.readback import give_weights_back, hook_state_dicts
from pagemem.engine.updates.update import Updater
from pagemem.errors import ConfigError, FirstError, InvalidRequest, RankFailed
from pagemem.process import current_pid, is_owner
from pagemem.store import PageStore
from pagemem.tracer.clock import OpClock


class Engine(CallChecks, BackwardMixin, ResultsMixin):
    def __init__(self, model: nn.Module, config: EngineConfig, *, param_groups: Any = None,
                 init: ModuleInit | None = None, values: Any = None, process_group: Any = None,
                 _values: bool = True) -> None:
        """Take over ``model``'s parameters: from here on they live in the store's pages.

        ``param_groups``: as ``torch.optim`` takes them (see ``pagemem/engine/updates/groups.py`` and
        :func:`pagemem.decay_groups`); default one group of every parameter, with
        ``config.optimizer``'s hyperparameters. Parameters that do not require a gradient keep
        only their compute copy ([Note: frozen parameters]).

        A model too large for host memory is built on the ``meta`` device (``with
        torch.device("meta"): model = ...``) and given ``init``: ``init(name, module)`` sets the
        values of one module's own parameters in place, and is called on each module that owns
        parameters, one at a time, so host memory never holds the whole model (for example
        ``lambda name, m: m.reset_parameters()``, or ``pagemem.models.gpt.init_module(cfg)``).
        Or build it on ``meta`` and resume it with :meth:`load`. ``values``: where the first values
        come from instead of the module (buffers too), the model may be on ``meta`` then: a state
        dict (keys as ``model.state_dict()``), or the path (``str`` or ``os.PathLike``) of
        safetensors weights: a ``.safetensors`` file, or a directory in Hugging Face's layout
        (``model.safetensors``, or shards with ``model.safetensors.index.json``), read one module
        at a time; the files must hold exactly the keys ``model.state_dict()`` has (one alias of
        tied weights suffices), else ``ConfigError`` naming the file and keys, before anything is
        allocated (see [Note: first values] in ``values.py`` and [Note: values from safetensors]).
        :meth:`save_weights` writes them.

        ``process_group``: the ``torch.distributed`` group to be data parallel over (default: the
        default group, when one is initialised; else one process). Every rank makes its engine
        over the same model and config; budgets are per rank ([Note: data parallel over the
        process group] in ``ranks/average.py``)."""
        if init is not None and values is not None:
            raise ConfigError("init, values: give the first values one way, not both")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config: must be a pagemem.EngineConfig, got {type(config).__name__}")
        self.owner_pid = current_pid()
        """The process that made the engine, the only one that may call it ([Note: an engine
        belongs to its process], ``pagemem/process.py``)."""
        check_parameters(model)
        groups = checked_groups(model, param_groups, config.optimizer) if param_groups is not None else None
        if groups is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]
        self.module = model
        self.config = config
        self.calls = CallLock(self.owner_pid)
        """One public call at a time, from any thread ([Note: calls from several threads], ``calls.py``)."""
        shards = RankGroup.peek(process_group) if config.shard_optimizer_states else (0, 1)  # [Note: sharded moments]
        check_units_fit(model, config, shards)  # [Note: gpu budgets refused early], before anything is made
        self._home_tier = choose_home_tier(model, config, unit_cap(config.store), shards)  # [Note: homes on nvme]
        source = source_of(model, init, values, _values)  # a path's files are checked here, before the store
        self.collectives: Collectives | None = None
        """The collectives over the ranks (None: one process)."""
        try:
            self.store = PageStore(config.store)
            try:
                self.ranks = RankGroup.resolve(process_group, self.store.tier("gpu").device)
                """The process group's ranks this engine is data parallel over."""
                self.collectives = join_ranks(self.ranks, model, config)
                gathered = self.collectives is not None and config.shard_parameters
                if gathered and _values and isinstance(source, FromModule):  # no rank holds whole values after
                    agree_on_module_values(model, self.collectives)
                self._build(model, config, groups, source)
                if self.collectives is not None and _values:  # [Note: replicas agree as DDP makes them]; a
                    # model on meta resumed by Engine.load has no values yet: every rank loads one checkpoint
                    if not gathered:
                        agree_on_values(self.bank, self.collectives)
                    sync_buffers(model, self.collectives)
            except BaseException:
                self._undo_build(model, restore=init is None and values is None and _values)
                raise
        finally:
            if isinstance(source, FromSafetensors):
                source.close()
        hold_interrupts()

    @property
    def rank(self) -> int:
        """This process's rank in the engine's process group (0 for one process)."""
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        """The ranks the engine is data parallel over (1 for one process)."""
        return self.ranks.world_size

    def _build(self, model: nn.Module, config: EngineConfig, groups: list | None, source: ValueSource) -> None:
        self.bank = ParamBank(model, self.store, config.compute_dtype, config.optimizer_tier,
                              unit_bytes=unit_cap(config.store), source=source, states_apart=config.lock_free,
                              home_tier=self._home_tier,
                              ranks=((self.ranks.rank, self.ranks.world_size) if config.shard_optimizer_states
                                     else (0, 1)), gathered=config.shard_parameters)
        if isinstance(source, (FromStateDict, FromSafetensors)):
            source.set_buffers(model, self.store.tier("gpu").device)
        if not isinstance(source, FromCheckpoint):
            check_no_meta_buffers(model)
        self.device = self.store.tier("gpu").device
        """Where the model computes: the ``gpu`` tier's device (the host for the stand-in). Put
        the inputs there."""
        with torch.no_grad():  # buffers are small and used by compute: they live on the device, in
            # their own dtype unless a compute dtype was asked for ([Note: compute dtypes])
            for module in model.modules():
                for name, b in list(module._buffers.items()):
                    if b is None or b.is_meta:
                        continue
                    dtype = engine_dtype(b, config.compute_dtype)
                    if b.device != self.device or b.dtype != dtype:
                        module._buffers[name] = b.to(self.device, dtype)
        params = [p for _, p in self.bank.params]
        if groups is not None:  # by name: a model on meta got new Parameter objects (values.py)
            now = dict(model.named_parameters(remove_duplicate=False))
            groups = [{**g, "params": [now[n] for n in g["params"]]} for g in groups]
        self.optimizer = PagedOptimizer(groups if groups is not None else params, config.optimizer,
                                        step_fn=lambda _opt: self._update(), zero_grad_fn=self._zero_grad,
                                        before_zero_grad_fn=lambda: self._usable("zero_grad"),
                                        states=OptimizerStates(self.bank, lambda: self.optimizer.param_groups,
                                                               lambda: self.updater.flush(), self._states_call))
        index = {id(p): i for i, p in enumerate(params)}
        for g, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self.bank.records[index[id(p)]].group = g
        self.ledger = GradLedger([n for n, _ in self.bank.params], self.bank.layer_of)
        """Each parameter's gradient state ([Note: gradient states] in ``grad_ledger.py``)."""
        self.bank.copies.record_in(self.ledger)
        self.updater = Updater(self.bank, self.store, config, lambda g: check_no_amsgrad(self.optimizer.hyper(g)),
                               self.ledger, data_parallel=self.ranks.data_parallel)
        if self.collectives is not None:  # every rank loads the same optimizer state
            coll = self.collectives
            self.optimizer.states.same_on_every_rank = lambda digest: coll.same_everywhere(
                "loading the optimizer state", [digest], "optimizer.load_state_dict: the ranks loaded different "
                "optimizer states, or only some ranks loaded one; nothing was loaded: every rank loads the same one")
        if self.bank.shards is not None:  # [Note: sharded moments]
            assert self.collectives is not None
            self.updater.gather_masters = MasterGather(self.bank, self.collectives)
            self.optimizer.states.whole_moments = self.updater.gather_masters.whole_moments
            if self.bank.gathered:  # [Note: gathered units]
                self.unit_gather = UnitGather(self.bank, self.collectives, self.updater.gather_masters)
                self.bank.gather_unit = self.unit_gather
                self.bank.whole_master = self.unit_gather.whole_master
                self.grad_scatter = GradScatter(self.bank, self.collectives, self.ledger, self.updater.gather_masters,
                                                self.updater.keep_for_undo)
                self.bank.grad_sink = self.grad_scatter.accumulate  # [Note: sharded gradient sums]
                self.updater.sums.spread = self.grad_scatter
                self.unit_gather.ready = self.grad_scatter.ready_flags  # units sent as gathers agree on them
                self.unit_gather.agreed = self.grad_scatter.issue_agreed
        self.phase = PhaseMachine()
        """Where the engine stands between backward and the update, with the backwards since the
        last update ([Note: engine phases], ``phase.py``)."""
        self.global_step = 0
        """Updates attempted so far (one per ``accumulation_steps`` backward calls)."""
        self._phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.failed_backwards = 0
        self.backwards = 0
        """Backwards begun, failed ones too (ranks compare it when they average: ``ranks/average.py``)."""
        self.lockfree: LockFreeUpdater | None = None
        """The updating thread, with ``config.lock_free`` ([Note: the lock-free updater])."""
        if config.lock_free:
            self.lockfree = LockFreeUpdater(self.bank, self.store, self.updater.chunks, self.updater.take_sum,
                                            config.effective_max_staleness,
                                            predict=config.staleness_correction == "predict", ledger=self.ledger,
                                            undo=self.updater.undo, synchronous_steps=config.synchronous_steps)
        # where handed-off gradients go, for the engine's life: the updater's sums, or the lock-free buffers
        destination = LockFreeDestination(self.lockfree) if self.lockfree is not None else SyncDestination(self.updater)
        self.gradients = Gradients(self.bank, self.updater, self.ledger, destination)
        """Gradients between autograd and the update (``gradients.py``)."""
        for r in self.bank.records:
            r.requires_grad = r.trainable
        self._hooks = self.gradients.hooks(self._before_accumulate)
        self.clock = OpClock(model, self.bank.params, lock=self.calls)  # hooks serialised with calls (calls.py)
        units, unit_of = self.bank.layers, self.bank.layer_of
        self.guard = Guard(self.bank.params, lambda i: self.pager.fetch_unforeseen(i), self.clock.lock,
                           self._saved_tensor_hooks, lambda i: self.pager.residency.data_taken(i),
                           resident=lambda i: units[unit_of[i]].bound)
        if self.lockfree is not None:  # [Note: reads between steps]
            before_read = self.lockfree.before_read
            self.guard.before_read = lambda i: before_read(unit_of[i])
        self.pager = Pager(model, self.bank, self.clock, config.optimizer_tier, config.executor, self.guard,
                           self.updater.wait_for_updates, self.ranks.world_size)
        if self.bank.gathered:  # [Note: sharded gradient sums]: ranks agree on ready units at module ends
            self.clock.subscribe(self.grad_scatter.on_op)
        if self.bank.gathered:  # [Note: ranks page alike]
            coll = self.collectives
            assert coll is not None

            def agree(values: list[int]) -> bool:
                top, low = coll.begin("choosing how an iteration is paged", values)
                return top == low
            self.pager.agree = agree
        self.clock.install()
        self._state_dict_hooks = hook_state_dicts(model, self.bank, self.guard, self._before_reading_weights,
                                                  self.calls)

    @contextmanager
    def _states_call(self, what: str) -> Iterator[None]:
        """``optimizer.state_dict()`` / ``load_state_dict()``: one call ([Note: calls from several
        threads]), shielded, after a backward by habit that raised is undone."""
        with self.calls.call(what):
            self._before_reading_weights(what)
            yield

    @property
    def group_of(self) -> list[int | None]:
        """Each parameter's group in ``optimizer.param_groups`` (None: in none, never updated): a
        view of the records."""
        return [r.group for r in self.bank.records]

    def _before_reading_weights(self, what: str = "state_dict") -> None:
        """A state dict is read: a backward by habit that raised is undone first, updates
        submitted land, writes to parameters are kept. Refused inside a backward that may have
        updated parameters (``overlap_update``): they would be a mix."""
        self._find_failed_backward(what)
        coll = self.collectives
        if coll is not None and coll.failed is not None and self.updater.unfinished is not None:
            # [Note: sharded moments]: the update ran on this rank's share and the ranks' shares
            # never arrived: these weights hold two steps at once
            raise RankFailed(f"{what}: refused: a rank failed during the update ({coll.failed}); this rank updated "
                             "its share of the weights and never received the others', so its weights mix two steps: "
                             "restart from the last checkpoint", coll.failed.ranks)
        if self.phase.in_backward and self.updater.overlap:
            raise InvalidRequest(f"{what}: called during backward, which may have updated some parameters already "
                                 "(overlap_update); read them once backward has returned")
        self.updater.wait_for_updates(range(len(self.bank.records)))  # each parameter whole (calls.py)
        if self.lockfree is not None:
            self.lockfree.quiesce()
        self.pager.residency.keep_writes()

    def _undo_build(self, model: nn.Module, restore: bool) -> None:
        """Construction failed: hooks off, workers stopped, the store closed, and (``restore``:
        the values came from the module) the parameters given back their values and class."""
        for h in getattr(self, "_hooks", []) + getattr(self, "_state_dict_hooks", []):
            h.remove()
        if getattr(self, "clock", None) is not None:
            self.clock.remove(quiet=True)
        if getattr(self, "lockfree", None) is not None:
            self.lockfree.close()
        if getattr(self, "updater", None) is not None:
            self.updater.close()
        if self.collectives is not None:
            self.collectives.close()
        bank = getattr(self, "bank", None)
        try:
            if bank is not None and restore:
                for i, (_, p) in enumerate(bank.params):
                    with torch._C.DisableTorchFunctionSubclass():
                        p.data = bank.host_value(i, bank.original_dtype_of(i))
                    p.__class__ = nn.Parameter
        finally:
            self.store.close()

    def _follow_requires_grad(self) -> None:
        """``requires_grad`` changed since the last iteration: a parameter unfrozen gets what
        training needs, the hooks follow, and iterations are traced and planned anew (their
        ops differ)."""
        records = self.bank.records
        with torch._C.DisableTorchFunctionSubclass():  # a plain read of each flag
            now = [r.param.requires_grad for r in records]
        if all(want == r.requires_grad for want, r in zip(now, records)):
            return
        for want, r in zip(now, records):
            if want and not r.requires_grad and r.group is None:
                raise InvalidRequest(f"parameter {r.name!r} was unfrozen but is in no param group, so it would "
                                     "never be updated: put it in param_groups when making the engine")
        for want, r in zip(now, records):
            if want and not r.requires_grad:
                # [Note: states a plan keeps on the gpu]: the unit's states go home first, so the
                # new ones are made there too; the plans are forgotten below, the next places them
                self.bank.place_states(self.bank.layer_of[r.index], None)
                self.bank.make_trainable(r.index)
            r.requires_grad = want
        for h in self._hooks:
            h.remove()
        self._hooks = self.gradients.hooks(self._before_accumulate)
        self.clock.remove(quiet=True)
        self.clock.install()
        self.pager.forget_plans()

    # ------------------------------------------------------------------ the training loop

    @engine_call("forward", shielded=False)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model's forward."""
        self._usable("forward")
        self.calls.loop_thread = threading.current_thread()
        t0 = time.perf_counter()
        with shield():  # [Note: Ctrl-C inside the engine]
            if self.lockfree is not None and not self.phase.in_backward:
                self.lockfree.before_iteration(first_of_step=self.phase.micro == 0)
            if not self.phase.in_backward:
                self._follow_requires_grad()
            if (self.collectives is not None and torch.is_grad_enabled()
                    and self.phase.micro + 1 >= self.config.accumulation_steps):
                sync_buffers(self.module, self.collectives)  # [Note: replicas agree as DDP makes them]
            self.pager.begin(args, kwargs)
            self.guard.enter()
        try:
            with self._saved_tensor_hooks():
                return self.module(*args, **kwargs)
        finally:
            self.guard.exit()
            self._phase_seconds["forward"] += time.perf_counter() - t0

    def _saved_tensor_hooks(self) -> Any:
        """Autograd saves parameters as references the engine fetches again in backward."""
        return torch.autograd.graph.saved_tensors_hooks(self.pager.saved.pack, self.pager.saved.unpack)

    @engine_call("step")
    def step(self) -> bool:
        """Update after every ``accumulation_steps``-th ``backward()``; True if it updated (False
        between accumulation boundaries, or when an fp16 overflow skipped the update). The
        gradients are consumed: the next backward starts new sums (``engine.optimizer.step()``
        keeps them until ``zero_grad()``, as a torch optimizer does)."""
        self._usable("step")
        if self.lockfree is not None:  # a failed updating thread says so at every step(), with or without gradients
            self.lockfree.check()
        if self.phase.micro < self.config.accumulation_steps:
            return False
        if self.phase.in_backward:
            raise InvalidRequest("step(): called during backward")
        # through optimizer.step(), which an lr scheduler wraps and whose step hooks run; the
        # whole of it shielded, so that the phase never stays STEPPING ([Note: engine phases])
        try:
            self.phase.begin_step(consume=True)
            self.optimizer.step()
        finally:
            self.phase.leave_step(consume=True)
        return self.phase.taken

    @property
    def update_unfinished(self) -> bool:
        """An update failed or was interrupted part-way: ``step()`` finishes it ([Note: a step
        is a transaction] in ``update.py``); until then backward, zero_grad and save refuse."""
        return self.updater.unfinished is not None

    @property
    def gradients_pending(self) -> bool:
        """Gradients of a backward that no ``step()`` has taken yet (``save`` refuses them)."""
        return bool(self.phase.micro) or (self.lockfree is not None and self.lockfree.has_fresh())

    # ------------------------------------------------------------------ the update

    @engine_call("optimizer.step")
    def _update(self) -> None:
        """``engine.optimizer.step()``'s work, called by itself (the gradients kept) or inside
        ``step()`` (the phase is ``STEPPING`` then: they are consumed)."""
        self._usable("step")
        t0 = time.perf_counter()
        consume = self.phase.consuming
        try:
            if not consume and self.phase.in_backward:
                raise InvalidRequest("optimizer.step(): called during backward")
            if not consume:
                self.phase.begin_step(consume=False)
            try:
                self.gradients.take_back()
                self.pager.residency.keep_writes()  # [Note: writes to parameters]
                if self.bank.gathered:  # a resident copy would be stale after the update ([Note: gathered units])
                    self.pager.residency.release_all()
                # a failure leaves the counters: step() again finishes this update ([Note: a step is a transaction])
                if self.lockfree is not None:
                    hps = [check_no_amsgrad(self.optimizer.hyper(g)) for g in range(len(self.optimizer.param_groups))]
                    taken = self.lockfree.submit(hps)
                else:
                    if self.collectives is not None:
                        self._same_hyperparameters(self.collectives)
                    taken = self.updater.step(consume=consume)
                if not consume:  # a torch optimizer's step leaves p.grad until zero_grad()
                    self.gradients.show()
                self.phase.end_step(taken)
                self.global_step += 1
                if self.lockfree is not None:  # the step is counted: a Ctrl-C in this write loses nothing
                    self.lockfree.after_step()  # [Note: reads between steps]
            finally:
                if not consume:
                    self.phase.leave_step(consume=False)
        finally:
            self._phase_seconds["step"] += time.perf_counter() - t0

    def _same_hyperparameters(self, coll: Collectives) -> None:
        """With several ranks, before an update: every rank updates with the same groups'
        hyperparameters (an lr changed on one rank would update its share, or its replica, with
        another rate: every rank raises instead, nothing updated, the gradients kept)."""
        hps = [check_no_amsgrad(self.optimizer.hyper(g)) for g in range(len(self.optimizer.param_groups))]
        digest = zlib.crc32(repr(hps).encode())
        coll.same_everywhere("updating", [digest], "step: the ranks' optimizer param_groups differ (a learning rate "
                             "or other hyperparameter changed on some ranks only); nothing was updated and the "
                             "gradients are kept: set the same values on every rank and call step() again")

    # ------------------------------------------------------------------ results

    @engine_call("close")
    def close(self) -> None:
        """Remove the hooks, stop the workers and give the store's memory back. The module keeps
        its trained weights (the fp32 master weights, in each parameter's original dtype, in host
        memory) when host memory has room for them; otherwise it warns, and its parameters refuse
        every read (load a checkpoint instead); every ``p.grad`` is None (the gradient handles
        read pages given back here). Each step runs even if an earlier one raises (a
        failed nvme write-back), so the store's files and threads are always released; then the
        first error is raised ([Note: closing releases everything], errors.py). In a process
        forked from the owner it raises ``WrongProcess`` and releases nothing."""
        if self.phase.now is EnginePhase.CLOSED:
            return
        if self.phase.in_backward and torch._C._current_graph_task_id() != -1:  # from a hook of it
            raise InvalidRequest("close: called during backward; close the engine once backward has returned")
        self._refuse_beside_backward("close")
        unfound = self.phase.in_backward  # a backward that raised and was not found (by habit) goes with it
        self.phase.close()
        with FirstError() as step:
            if self.lockfree is not None:
                if unfound:
                    step(self.lockfree.end_backward)  # its units open no more: the updating thread may take them
                step(self.lockfree.close)  # what was submitted lands, then the thread stops
            for h in self._hooks + self._state_dict_hooks:
                step(h.remove)
            self._hooks, self._state_dict_hooks = [], []
            step(self.clock.remove, quiet=True)
            step(self.pager.close)  # every unit goes home (writes to parameters kept) before the weights come back
            step(self.gradients.drop_handles)  # p.grad read pages given back below
            step(self.bank.grads_landed)
            if self.guard.closed is None:
                step(self.updater.flush)
                step(give_weights_back, self.bank, self.guard)
            step(self.updater.close)
            if self.collectives is not None:
                step(self.collectives.close)
            step(self.store.close)
            step(release_interrupts)
            self.calls.closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None and not is_owner(self.owner_pid):
            return  # a forked child leaving by an exception: it goes on, nothing is closed
        self.close()
