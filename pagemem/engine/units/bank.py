"""The model's states in pages, one group per paging unit.

A paging unit (``Unit``, ``unit.py``: [Note: the unit owns its state]) is a run of consecutive
modules owning parameters (a tied parameter belongs to the first module that owns it), merged up
to a size cap (``paging_units``); the warm-up trace is recorded over these units, so the
scheduler's plans speak of exactly them. Per unit:
- ``compute``: the parameters in their compute dtype ([Note: compute dtypes]), home on ``cpu``; a replica on ``gpu`` while
  the unit is resident (its only copy, on ``gpu``, while the plan keeps it there for good:
  ``Residency.settle``);
- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, home on the optimizer tier;
- ``grad``: fp32 gradient sums beside the optimizer states: on ``gpu`` when they are there (the
  update reads them in place, as plain PyTorch does), else on ``cpu`` (the first gradient of a
  step overwrites them).
In fp32 with the optimizer states on the gpu, the compute copy *is* the master (see
``ParamBank.compute_is_master``). The optimizer states of consecutive layers are chained with
``after=`` (they share boundary pages: 99.9% utilization), since they move together at the
update; each layer's compute group starts on fresh pages, so that evicting a layer never drags
a resident neighbour's page (this costs the partly filled last page of each layer; ``stats()``
reports what it comes to).

Which units are on the gpu, and the parameters' ``.data`` meanwhile, is ``residency.py``'s job.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

import torch
from torch import nn

from pagemem.errors import InvalidRequest
from pagemem.store import PagedTensor, PageStore
from pagemem.store.layout import pack
from pagemem.engine.gradients.grad_copies import GradCopies
from pagemem.engine.units.records import (ParamRecord, compute_dtype_of, compute_is_master, grad_tier_beside,
                                    owning_layers, paging_units, placeholder)
from pagemem.engine.units.state_moves import StatesMoved
from pagemem.engine.units.unit import Unit
from pagemem.engine.units.values import FromModule, ValueSource, check_source, materialize_meta
from pagemem.engine.units.shards import StateShards, check_gatherable, master_shardable, shard_states
from pagemem.engine.units.state_shares import MOMENTS, ShardedStates


def _accumulate(dst: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    with torch.no_grad():
        if first:
            dst.copy_(grad)
        else:
            dst.add_(grad.to(device=dst.device, dtype=dst.dtype))


class UnitGatherer(Protocol):
    """What fills a gathered unit's compute copy (``ranks/unit_gather.py``'s ``UnitGather``)."""

    def __call__(self, layer: Unit) -> None: ...

    def start(self, layer: Unit) -> Any: ...


class ParamBank(StatesMoved, ShardedStates):
    def __init__(self, model: nn.Module, store: PageStore, compute_dtype: torch.dtype | None, optimizer_tier: str,
                 unit_bytes: int | None = None, source: ValueSource | None = None,
                 states_apart: bool = False, home_tier: str = "cpu", ranks: tuple[int, int] = (0, 1),
                 gathered: bool = False) -> None:
        """``source`` gives the first values (default: the module's own; see [Note: first values]
        in ``values.py``), one module at a time. ``states_apart``: each unit's optimizer states on
        pages of their own (the lock-free updater moves one unit's states at a time);
        ``compute_dtype``: ``EngineConfig.compute_dtype`` ([Note: compute dtypes]). ``home_tier``:
        where compute copies and gradient sums live at rest, ``"cpu"`` or ``"nvme"`` ([Note: homes
        on nvme] in ``homes.py``; resolved from ``EngineConfig.home_tier`` by ``choose_home_tier``).
        ``ranks``: ``(rank, world_size)`` over which the Adam moments are sharded ([Note: sharded
        moments] in ``units/shards.py``; ``(0, 1)``: not sharded). ``gathered``: no compute copy at
        rest, each rank's share of it being its share of the master ([Note: gathered units] in
        ``ranks/unit_gather.py``)."""
        self.store = store
        self.states_apart = states_apart
        self.copies = GradCopies()
        self.compute_dtype = compute_dtype
        """The compute dtype asked for (None: each parameter's own; see ``compute_dtype_of``)."""
        self.optimizer_tier = optimizer_tier
        if home_tier not in ("cpu", "nvme"):
            raise InvalidRequest(f"home_tier: must be 'cpu' or 'nvme' (resolved), got {home_tier!r}")
        self.home_tier = home_tier
        """Where compute copies and gradient sums (beside states off the gpu) live at rest."""
        self._lasting: dict[tuple[str, int], torch.Tensor | None] = {}
        source = source if source is not None else FromModule()
        check_source(source, model)
        if any(p.is_meta for p in model.parameters()):
            materialize_meta(model, self._gpu_device())
        params, module_specs = owning_layers(model)
        self.params: tuple[tuple[str, nn.Parameter], ...] = tuple(params)
        """(name, Parameter) of each parameter, in index order: a read-only view of the records."""
        if not self.params:
            raise InvalidRequest("the model has no parameters to train")
        dtypes = [compute_dtype_of(compute_dtype, p.dtype) for _, p in self.params]
        self.compute_is_master = compute_is_master(dtypes, optimizer_tier)
        """[Note: the compute copy is the master] fp32 compute with the optimizer states on the
        gpu: a compute copy would hold the master's bits on the same tier, so the parameters are
        views of the master pages instead. No compute pages, no refresh after the update, and
        the gpu holds 16 bytes per parameter (weights, gradient sums, two moments), as plain
        PyTorch does. Those pages never move: units have nothing to page (``param_nbytes`` 0,
        ``compute_pages`` 0), so a plan only schedules compute around them."""
        trainable = [p.requires_grad for _, p in self.params]
        self.gathered = gathered and ranks[1] > 1
        """Compute copies exist only while their unit is resident, gathered from every rank's
        share of the master ([Note: gathered units] in ``ranks/unit_gather.py``)."""
        if self.gathered:
            check_gatherable(self.compute_is_master)
        """[Note: frozen parameters] A parameter that does not require a gradient when the bank is
        made keeps only its compute copy: no fp32 master, no moments, no gradient sums (a LoRA
        model pays optimizer memory for its adapters only). Unfrozen later, it gets them then
        (``make_trainable``), its master weights cast from the compute copy."""
        nbytes = [p.numel() * dtypes[i].itemsize for i, (_, p) in enumerate(self.params)]
        layer_specs = paging_units(module_specs, nbytes, unit_bytes if unit_bytes is not None else store.page_bytes)
        self.units: tuple[tuple[str, list[int]], ...] = tuple((n, list(idx)) for n, idx in layer_specs)
        """(name, parameter indices) of every paging unit, in unit order."""
        param_nbytes = [0] * len(self.params)
        for _name, idx in layer_specs:
            layout = pack([nbytes[i] for i in idx], store.page_bytes)  # as allocate_group lays them out
            ends = layout.starts[1:] + (layout.end,)
            for i, start, end in zip(idx, layout.starts, ends):
                param_nbytes[i] = 0 if self.compute_is_master else end - start
        self.shards: StateShards | None = None if ranks[1] == 1 else shard_states(
            [idx for _, idx in layer_specs], [p.numel() for _, p in self.params], [True] * len(self.params),
            store.page_bytes, *ranks)
        """Which elements of each parameter's moments this rank holds (None: all of them)."""
        self._every_share: list[StateShards] | None = None
        self.whole_master: Callable[[int], torch.Tensor] | None = None
        self.gather_unit: UnitGatherer | None = None
        """A gathered bank's filler of a unit's compute copy (``ranks/unit_gather.py``), set by
        the engine."""
        self.grad_sink: Callable[[int, torch.Tensor], None] | None = None
        """A gathered bank's taker of each gradient autograd hands off (its unit's local buffer,
        reduce-scattered into the shares: [Note: sharded gradient sums] in
        ``ranks/grad_scatter.py``), set by the engine."""
        self._stale_copies: list[list[PagedTensor]] = []
        """Gathered compute copies replaced while still pinned (``drop_compute`` frees them later)."""
        """A gathered bank's reader of one parameter's whole fp32 master (a collective every rank
        makes: ``ranks/unit_gather.py``), set by the engine."""
        self._master_sharded: tuple[bool, ...] = tuple(
            self.shards is not None and ok
            for ok in master_shardable(dtypes, [p.dtype for _, p in self.params], self.compute_is_master, self.gathered))
        """Per parameter: whether this rank holds only its share of the master weights ([Note:
        sharded master weights] in ``units/shards.py``)."""
        self.layers: list[Unit] = []
        """Every paging unit, in unit order ([Note: the unit owns its state])."""
        layer_of, position = [0] * len(self.params), [0] * len(self.params)
        groups: dict[str, list[list[PagedTensor]]] = {}
        # [Note: layout] each kind is allocated for every layer before the next kind, so a kind's
        # pages are adjacent in its tier and every state tensor can be viewed in place. Compute
        # groups start on fresh pages (a unit is paged alone, so evicting it never drags a
        # resident neighbour's page); states and gradients are chained (they move together),
        # except states apart for the lock-free updater (it moves one unit's states at a time)
        for kind, dtype, tier in (("compute", None, home_tier), ("master", torch.float32, optimizer_tier),
                                  ("exp_avg", torch.float32, optimizer_tier),
                                  ("exp_avg_sq", torch.float32, optimizer_tier),
                                  ("grad", torch.float32, grad_tier_beside(optimizer_tier, home_tier))):
            tail = None
            groups[kind] = []
            if kind == "compute" and (self.compute_is_master or self.gathered):
                continue  # the master's groups, once they exist (see the Note), or none at rest
            # a frozen parameter has a master only where it is the compute copy, or as the share of its
            # compute copy a gathered bank keeps ([Note: gathered units])
            every = kind == "compute" or (kind == "master" and (self.compute_is_master or self.gathered))
            chained = kind == "grad" or (kind != "compute" and not states_apart)
            for _name, idx in layer_specs:
                members = [i for i in idx
                           if (every or trainable[i]) and (not self.is_sharded(i, kind) or self.owned_numel(i))]
                group = store.allocate_group([(self.state_shape(i, kind), dtype or dtypes[i]) for i in members],
                                             tier=tier, after=tail if chained else None) if members else []
                tail = group[-1] if group else tail
                at = dict(zip(members, group))
                groups[kind].append([at.get(i) for i in idx])
        if self.compute_is_master:
            groups["compute"] = groups["master"]
        elif self.gathered:
            groups["compute"] = [[] for _ in layer_specs]  # made on the gpu while the unit is resident
        self._gathered_pages = tuple(pack([nbytes[i] for i in idx], store.page_bytes).pages for _, idx in layer_specs)
        """Pages each unit's whole compute copy takes (what a gathered unit allocates on the gpu)."""
        for li, (name, idx) in enumerate(layer_specs):
            for k, i in enumerate(idx):
                layer_of[i], position[i] = li, k
            self.layers.append(Unit(li, name, list(idx), groups["compute"][li], groups["master"][li],
                                    groups["exp_avg"][li], groups["exp_avg_sq"][li], groups["grad"][li],
                                    state_tier=optimizer_tier))
        self.records = [ParamRecord(i, n, p, layer_of[i], position[i], p.dtype, trainable[i],
                                    compute_dtype=dtypes[i], nbytes=param_nbytes[i])
                        for i, (n, p) in enumerate(self.params)]
        """One record per parameter ([Note: parameter records])."""
        self.layer_of: tuple[int, ...] = tuple(r.unit for r in self.records)
        """Each parameter's unit: a read-only view of the records, for the hot paths."""
        self.position: tuple[int, ...] = tuple(r.position for r in self.records)
        """Where parameter ``i`` sits in its unit's lists (see ``where``): a read-only view."""
        self.param_nbytes: tuple[int, ...] = tuple(r.nbytes for r in self.records)
        """Each parameter's ``ParamRecord.nbytes``: a read-only view."""
        with torch.no_grad():  # [Note: first values]: one module at a time, from the source
            for mname, idx in module_specs:
                given = source.values(mname, model.get_submodule(mname), [self.params[i] for i in idx])
                for i, value in zip(idx, given):
                    self.fill(i, value)
                    self.params[i][1].data = placeholder(self.params[i][1].shape, dtypes[i], self._gpu_device())

    def fill(self, i: int, value: torch.Tensor) -> None:
        """Parameter ``i``'s first value: into its master and compute copies, with zero moments."""
        layer, k = self.where(i)
        if layer.master[k] is not None:
            layer.master[k].copy_(self._mine(i, "master", value.float()).reshape(layer.master[k].shape))
        if not self.compute_is_master and not self.gathered:
            layer.compute[k].copy_(value.to(self.compute_dtype_of(i)))
        for t in (layer.exp_avg[k], layer.exp_avg_sq[k]):
            if t is not None:
                t.copy_(torch.zeros(t.shape))

    def make_trainable(self, i: int) -> None:
        """Give a frozen parameter what training needs (see [Note: frozen parameters]): fp32
        master weights cast from its compute copy, zero moments, gradient sums, each beside its
        unit's (on pages of their own). Nothing changes if the pages cannot be had."""
        if self.records[i].trainable:
            return
        layer, k = self.where(i)
        tier = layer.state_tier
        kinds = [("exp_avg", tier), ("exp_avg_sq", tier), ("grad", grad_tier_beside(tier, self.home_tier))]
        if not self.compute_is_master and layer.master[k] is None:  # a gathered bank's frozen one has its share
            kinds.insert(0, ("master", tier))
        kinds = [(kind, t) for kind, t in kinds if not self.is_sharded(i, kind) or self.owned_numel(i)]
        made: dict[str, PagedTensor] = {}
        try:
            for kind, t in kinds:
                made[kind] = self.store.allocate_group([(self.state_shape(i, kind), torch.float32)], tier=t)[0]
        except BaseException:
            for t in made.values():
                t.free()
            raise
        value = layer.compute[k].to_torch().float() if "master" in made else None
        for kind, t in made.items():
            t.copy_(self._mine(i, kind, value).reshape(t.shape) if kind == "master" else torch.zeros(t.shape))
            getattr(layer, kind)[k] = t
        self._lasting = {key: v for key, v in self._lasting.items() if key[1] != i}
        self.records[i].trainable = True

    def state_bytes(self) -> dict[str, int]:
        """Bytes the optimizer states (fp32 master weights where they are not the compute copy,
        two moments) and the gradient sums take, over all units."""
        out = {"optimizer_state": 0, "grad": 0}
        for layer in self.layers:
            masters = [] if self.compute_is_master else layer.master
            out["optimizer_state"] += sum(t.nbytes for t in (*masters, *layer.exp_avg, *layer.exp_avg_sq)
                                          if t is not None)
            out["grad"] += sum(t.nbytes for t in layer.grad if t is not None)
        return out

    def _gpu_device(self) -> torch.device:
        return self.store.tier("gpu").device

    @property
    def state_tiers(self) -> tuple[str, ...]:
        """Each unit's ``state_tier``: a read-only view."""
        return tuple(u.state_tier for u in self.layers)

    def where(self, i: int) -> tuple[Unit, int]:
        """Parameter ``i``'s unit and its position in the unit's lists."""
        return self.layers[self.layer_of[i]], self.position[i]

    def is_trainable(self, i: int) -> bool:
        return self.records[i].trainable

    def original_dtype_of(self, i: int) -> torch.dtype:
        return self.records[i].original_dtype

    def group_of(self, i: int) -> int:
        """Parameter ``i``'s group in the optimizer's ``param_groups`` (0 for one in none: it is
        never handed a gradient, so never updated)."""
        g = self.records[i].group
        return g if g is not None else 0

    def group_count(self) -> int:
        """How many groups the parameters are in (at least one)."""
        return max((r.group for r in self.records if r.group is not None), default=0) + 1

    def compute_dtype_of(self, i: int) -> torch.dtype:
        """The dtype parameter ``i`` computes in ([Note: compute dtypes])."""
        return self.records[i].compute_dtype

    def count_step(self, i: int) -> int:
        """Parameter ``i`` was updated once more; returns its update count."""
        self.records[i].steps += 1
        return self.records[i].steps

    def set_step_count(self, i: int, steps: int) -> None:
        """Parameter ``i``'s update count, as a checkpoint or an optimizer state dict says."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise InvalidRequest(f"parameter {self.params[i][0]!r}: step must be a count >= 0, got {steps!r}")
        self.records[i].steps = steps

    def host_value(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``i``'s current value on the host: its fp32 master weights cast to ``dtype``.
        Where this rank holds a share of the master only ([Note: sharded master weights]) the
        compute copy gives it, which is the master cast for ``dtype`` the parameter's own
        (``master_whole_here`` says when a caller must gather the fp32 master instead)."""
        layer, k = self.where(i)
        if self.gathered:
            if self.whole_master is None:
                raise InvalidRequest(f"parameter {self.params[i][0]!r}: its value is spread over the ranks "
                                     "(shard_parameters=True) and no gather is set up")
            return self.whole_master(i).to(dtype).reshape(self.params[i][1].shape)
        t = layer.master[k] if layer.master[k] is not None and not self.master_sharded(i) else layer.compute[k]
        return t.to_torch().cpu().to(dtype).reshape(self.params[i][1].shape)

    def unviewed_value(self, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Parameter ``i``'s value from a copy its bound ``.data`` does not view, to compare a
        write through ``.data`` with ([Note: writes to parameters]): its master weights, or for a
        frozen one (no master) the home copy of its compute copy, which a gpu replica leaves
        alone; None where no such copy can be read (a frozen parameter homed on nvme: the caller
        takes the bound values as written)."""
        layer, k = self.where(i)
        if layer.master[k] is not None or self.compute_is_master:
            return self.host_value(i, dtype)
        if self.home_tier != "cpu":
            return None
        try:
            lease = layer.compute[k].lease("cpu", write=False)
        except InvalidRequest:
            return None
        try:
            return lease.tensor.to(dtype, copy=True).reshape(self.params[i][1].shape)
        finally:
            lease.release()

    def host_state(self, i: int, kind: str) -> torch.Tensor:
        """Parameter ``i``'s ``kind`` state (``exp_avg``, ``exp_avg_sq``, ``master``) on the host;
        with sharded moments (and master weights: ``master_sharded``), this rank's elements of it
        only, flat (``owned`` says which)."""
        layer, k = self.where(i)
        t = getattr(layer, kind)[k]
        if t is None:
            if (kind in MOMENTS or kind == "grad" and self.gathered) and self.is_trainable(i) or (
                    kind == "master" and self.master_sharded(i)):
                return torch.zeros(0)
            raise InvalidRequest(f"parameter {self.params[i][0]!r} has no {kind} (it is frozen)")
        return t.to_torch().cpu().reshape(self.state_shape(i, kind))

    def compute_pages(self, li: int) -> int:
        """Pages unit ``li``'s compute copy moves to and from the gpu (none where it is the master)."""
        if self.gathered:
            return self._gathered_pages[li]
        return 0 if self.compute_is_master else self.store.page_count(self.layers[li].compute)

    def set_state(self, i: int, kind: str, value: torch.Tensor) -> None:
        """Overwrite parameter ``i``'s ``kind`` state (``master``, ``exp_avg``, ``exp_avg_sq``)
        or its ``compute`` copy (the master weights too, where it has them); setting ``master``
        also refreshes the compute copy (every copy of it). A state the parameter has no pages for
        (it is frozen) is skipped."""
        layer, k = self.where(i)
        if kind == "compute":
            if layer.master[k] is not None:
                layer.master[k].copy_(self._mine(i, "master", value.float()).reshape(layer.master[k].shape))
            if not self.compute_is_master:
                self.write_compute(i, value)
            return
        t = getattr(layer, kind)[k]
        if t is not None:
            t.copy_(self._mine(i, kind, value).reshape(t.shape))  # this rank's elements of a sharded state
        if kind == "master" and (t is not None or self.master_sharded(i) and self.is_trainable(i)):
            self.refresh_compute(i, value)
        elif kind == "master" and not self.is_trainable(i) and not self.gathered:
            self.set_state(i, "compute", value)  # a master saved for a frozen one by a gathered bank

    def write_compute(self, i: int, value: torch.Tensor) -> None:
        """Every copy of parameter ``i``'s compute copy takes ``value``; its master weights are
        left as they are."""
        if self.compute_is_master:
            return
        layer, k = self.where(i)
        if self.gathered and not layer.compute:
            return  # at rest this rank's share of it is its share of the master
        layer.compute[k].copy_(value.to(self.compute_dtype_of(i)))

    def write_parameter(self, i: int, value: torch.Tensor) -> None:
        """Parameter ``i`` was written (in place, by user code): its master weights (or, frozen,
        its compute copy) take ``value``, and every copy of its compute copy too."""
        value = value.detach().clone()  # it may be a view of the very pages written next
        layer, k = self.where(i)
        if layer.master[k] is not None:
            self.set_state(i, "master", value.float())
        else:
            self.set_state(i, "compute", value)

    def refresh_compute(self, i: int, master: torch.Tensor, start: int = 0) -> None:
        """Write parameter ``i``'s master weights, cast, into every copy of its compute parameter
        (none to write where the compute copy is the master); ``master`` may be a piece of them,
        its elements from ``start`` on."""
        if self.compute_is_master:
            return
        layer, k = self.where(i)
        shape = self.params[i][1].shape
        if self.gathered:  # nothing at rest; a resident unit takes whole values (a write), never an update's
            if not layer.compute:
                return
            assert start == 0 and master.numel() == shape.numel(), f"unit {layer.name!r} resident during its update"
        if start == 0 and master.numel() == shape.numel():
            layer.compute[k].copy_(master.reshape(shape).to(self.compute_dtype_of(i)))
        else:
            self.store.write(layer.compute[k], master.to(self.compute_dtype_of(i)), start)

    def write_master_ranges(self, ranges: list[tuple[int, torch.Tensor, int]]) -> None:
        """Each ``(i, value, start)``: parameter ``i``'s master weights from flat element ``start``
        on take ``value`` (another rank's update of its share: [Note: sharded moments]), and
        every copy of its compute copy, cast; all in one store operation. A master this rank
        holds a share of only (``master_sharded``) keeps its own elements: the compute copy
        alone takes another rank's."""
        items: list[tuple] = []
        for i, value, start in ranges:
            layer, k = self.where(i)
            if not self.master_sharded(i):
                items.append((layer.master[k], value, start))
            if not self.compute_is_master and not self.gathered:
                items.append((layer.compute[k], value.to(self.compute_dtype_of(i)), start))
        if items:
            self.store.write_many(items)

    def refresh_unit(self, values: Mapping[int, torch.Tensor], flat: torch.Tensor | None = None) -> None:
        """Write new values into the compute copies of one unit's parameters, cast to their
        compute dtype, in one store operation. ``flat``: the values' elements in one tensor, in
        the order of ``values`` (they are views of it): one packed write, a copy per run of
        adjacent pages instead of one per page and parameter ([Note: a packed write])."""
        if self.compute_is_master or self.gathered or not values:
            return
        dtypes = {self.compute_dtype_of(i) for i in values}
        if flat is not None and len(dtypes) == 1:
            tensors = [layer.compute[k] for layer, k in map(self.where, values)]
            self.store.write_packed(tensors, flat.to(dtypes.pop()))
            return
        items = []
        for i, value in values.items():
            layer, k = self.where(i)
            items.append((layer.compute[k], value.reshape(self.params[i][1].shape).to(self.compute_dtype_of(i))))
        self.store.write_many(items)

    # ------------------------------------------------------------------ gradients

    def accumulate_grad(self, i: int, grad: torch.Tensor, first: bool) -> None:
        """Add parameter ``i``'s gradient into its fp32 gradient pages (``first``: the first
        gradient of this step, which replaces what the pages held)."""
        if self.grad_sink is not None:
            self.grad_sink(i, grad)
            return
        x = self.lasting_view("grad", i)
        if x is None:
            self.copies.landed([i])
            layer, k = self.where(i)
            if self.grad_tier_of(layer.index) == "nvme":  # [Note: homes on nvme]: written through
                value = grad.detach().to("cpu", torch.float32)
                if not first:
                    flat = value.reshape(-1)
                    with self.grad_pieces(i) as pieces:
                        for start, x in pieces:
                            x.add_(flat[start:start + x.numel()])
                    return
                layer.grad[k].copy_(value.reshape(layer.grad[k].shape))
                return
            with layer.grad[k].lease(self.grad_tier_of(layer.index)) as x:
                _accumulate(x, grad, first)
        else:  # [Note: gradient copies]: off the compute stream where it crosses to the host
            self.copies.put(i, x.view(grad.shape), grad, first)

    def set_grad(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient sum becomes ``grad`` (assigned to ``p.grad`` by hand): this
        rank's elements of it where the sums are sharded ([Note: sharded gradient sums])."""
        if not self.is_sharded(i, "grad"):
            self.accumulate_grad(i, grad, first=True)
            return
        if self.owned_numel(i):
            value = self._mine(i, "grad", grad.detach().to("cpu", torch.float32))
            with self.grad_pieces(i) as pieces, torch.no_grad():
                for start, view in pieces:
                    view.copy_(value[start:start + view.numel()])

    def grads_landed(self, params: Iterable[int] | None = None) -> None:
        """Wait until the gradients handed to ``accumulate_grad`` for ``params`` (None: all) are
        in their pages: call before reading gradient sums (see [Note: gradient copies])."""
        self.copies.landed(params)

    def drop_lasting_views(self, tier: str) -> None:
        """Forget the lasting views of pages on ``tier`` (they pin them: before the store resizes
        the tier); they are made again at their next use."""
        self.copies.landed()
        self._lasting = {key: v for key, v in self._lasting.items()
                         if self.tier_of(key[0], self.layer_of[key[1]]) != tier}

    def tier_of(self, kind: str, li: int) -> str:
        """Where unit ``li``'s ``grad`` or optimizer-state (``master``, ``exp_avg``,
        ``exp_avg_sq``) pages live."""
        return self.grad_tier_of(li) if kind == "grad" else self.layers[li].state_tier

    def grad_tier_of(self, li: int) -> str:
        """Where unit ``li``'s fp32 gradient sums live (``grad_tier_beside`` its states)."""
        return grad_tier_beside(self.layers[li].state_tier, self.home_tier)

    def lend_tier_of(self, li: int) -> str:
        """The memory tier unit ``li``'s states and gradient sums are lent from for its update:
        the gpu for states kept there, else the cpu (where states and sums on nvme are brought)."""
        return "gpu" if self.layers[li].state_tier == "gpu" else "cpu"

    @contextmanager
    def grad_pieces(self, i: int, write: bool = True) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Parameter ``i``'s fp32 gradient sum as flat ``(first element, view)`` pieces: views of
        its page memory, or, for sums on nvme with no cpu copy, one host copy read from disk and
        written back when the block ends (``write``). Where this rank holds a share of the sums
        only ([Note: sharded gradient sums]), the share's: numbered from its first element, none
        for an empty share."""
        if self.is_sharded(i, "grad") and not self.owned_numel(i):
            yield []
            return
        x = self.lasting_view("grad", i)
        if x is not None:
            yield [(0, x)]
            return
        layer, k = self.where(i)
        t = layer.grad[k]
        tier = self.lend_tier_of(layer.index)
        lease = None
        try:
            lease = self.store.lease_many([t], tier, split=True, write=write)[0]
        except InvalidRequest:
            if self.grad_tier_of(layer.index) != "nvme":
                raise
        if lease is not None:  # in memory (sums on nvme: while a step brought them to the cpu)
            with lease:
                yield list(lease.pieces)
            return
        value = t.to_torch().reshape(-1)
        yield [(0, value)]
        if write:
            t.copy_(value.view(t.shape))

    def lasting_view(self, kind: str, i: int) -> torch.Tensor | None:
        """A flat view of parameter ``i``'s ``grad`` or optimizer state (``master``, ``exp_avg``,
        ``exp_avg_sq``) that the bank keeps for its lifetime, or None where the pages are not
        adjacent or may move (optimizer states on nvme): use a lease then.

        [Note: lasting views] Gradient pages never leave their tier, nor optimizer states a memory
        tier, so a view of them (which pins the pages) can be made once instead of a lease per
        gradient and per update: a lease costs more Python than a 4 MiB page costs to copy."""
        key = (kind, i)
        if key not in self._lasting:
            layer, k = self.where(i)
            tier = self.tier_of(kind, layer.index)
            view = None
            if tier != "nvme":
                try:
                    view = getattr(layer, kind)[k].view(tier).reshape(-1)
                except InvalidRequest:
                    pass
            self._lasting[key] = view
        return self._lasting[key]
