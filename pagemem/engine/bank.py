"""The model's states in pages, one group per paging unit, and the parameters' residency on the gpu.

A paging unit (``Layer``) is a run of consecutive modules owning parameters (a tied parameter
belongs to the first module that owns it), merged up to a size cap. Per unit:
- ``compute``: the parameters in the compute dtype, home on ``cpu``; a replica on ``gpu`` while
  the unit is resident;
- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, home on the optimizer tier;
- ``grad``: fp32 gradient sums on ``cpu`` (the first gradient of a step overwrites them).
The optimizer states of consecutive layers are chained with ``after=`` (they share boundary
pages: 99.9% utilization), since they move together at the update; each layer's compute group
starts on fresh pages, so that evicting a layer never drags a resident neighbour's page (this
costs the partly filled last page of each layer; ``stats()`` reports what it comes to).

[Note: parameters are views over page memory]
While a layer is resident, each of its ``nn.Parameter`` objects has ``.data`` set to a view of its
gpu replica (``PagedTensor.view``, which pins the pages for as long as that view or anything
derived from it lives, autograd's saved tensors included). Evicting a layer points ``.data`` at
a placeholder with the same shape and dtype (Hugging Face code reads ``.shape``) and drops the
replica; if a derived tensor still pins it, the replica stays (a *zombie*) until it dies and is
dropped later, so no tensor ever aliases a slot that was given to another layer. The Parameter
objects themselves never change, so optimizer and autograd references stay valid.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from pagemem.errors import InvalidRequest, OutOfMemory
from pagemem.store import Lease, PagedTensor, PageStore


@dataclass
class Layer:
    """A paging unit: consecutive modules whose parameters move to and from the gpu together."""

    index: int
    name: str
    params: list[int]
    """Indices into ``ParamBank.params``."""
    compute: list[PagedTensor]
    master: list[PagedTensor]
    exp_avg: list[PagedTensor]
    exp_avg_sq: list[PagedTensor]
    grad: list[PagedTensor] = field(default_factory=list)
    """fp32 gradient sums on cpu (valid for the parameters that got a gradient this step)."""
    leases: list[Lease] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    """Where the parameters' data starts while resident (for ``ParamBank.param_at``)."""
    resident: bool = False
    zombie: bool = False


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Replace every parameter on the ``meta`` device by a Parameter of the same shape, dtype
    and ``requires_grad`` on ``device`` (one element of memory), in every module that holds it
    (tied ones stay tied). Its values come later, from a checkpoint."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                shell = torch.zeros((), dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(shell.expand(p.shape) if p.dim() else shell,
                                          requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]


def owning_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, list[int]]]]:
    """The model's distinct parameters, and the layers (module name, parameter indices) owning
    them, in module order."""
    params: list[tuple[str, nn.Parameter]] = []
    index: dict[int, int] = {}
    layers = []
    for mname, module in model.named_modules():
        own = []
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in index:
                continue
            index[id(p)] = len(params)
            own.append(len(params))
            params.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            layers.append((mname, own))
    return params, layers


def paging_units(modules: list[tuple[str, list[int]]], nbytes: list[int], cap: int) -> list[tuple[str, list[int]]]:
    """Consecutive modules merged into paging units of at most ``cap`` bytes (a module larger
    than ``cap`` is a unit of its own): a LayerNorm travels with its neighbours instead of taking a
    page of its own, and a block's small layers cost one fetch."""
    units: list[tuple[str, list[int]]] = []
    size = 0
    for name, idx in modules:
        b = sum(nbytes[i] for i in idx)
        if units and size + b <= cap:
            units[-1][1].extend(idx)
            size += b
            continue
        units.append((name, list(idx)))
        size = b
    return units


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with one element of memory (never read by a correct
    schedule: evicted parameters keep their shape and dtype for code that reads them)."""
    one = torch.zeros((), dtype=dtype, device=device)
    return one.expand(shape) if len(shape) else one


class ParamBank:
    def __init__(self, model: nn.Module, store: PageStore, compute_dtype: torch.dtype, optimizer_tier: str,
                 unit_bytes: int | None = None, values: bool = True) -> None:
        """``values``: copy the parameters' values into the pages; False for a model on ``meta``
        whose values will come from a checkpoint (the pages start as zeros)."""
        self.store = store
        self.compute_dtype = compute_dtype
        meta = any(p.is_meta for p in model.parameters())
        if meta and values:
            raise InvalidRequest("the model's parameters are on 'meta' (no values): load them with "
                                 "pagemem.Engine.load(checkpoint, model)")
        if meta:
            materialize_meta(model, self._gpu_device())
        self.params, module_specs = owning_layers(model)
        if not self.params:
            raise InvalidRequest("the model has no parameters to train")
        self.original_dtype = [p.dtype for _, p in self.params]
        nbytes = [p.numel() * compute_dtype.itemsize for _, p in self.params]
        cap = unit_bytes if unit_bytes is not None else store.page_bytes
        layer_specs = paging_units(module_specs, nbytes, cap)
        self.layers: list[Layer] = []
        self.layer_of: list[int] = [0] * len(self.params)
        self.position: list[int] = [0] * len(self.params)
        """Where parameter ``i`` sits in its unit's lists (see ``where``)."""
        groups: dict[str, list[list[PagedTensor]]] = {}
        # [Note: layout] each kind is allocated for every layer before the next kind, so a kind's
        # pages are adjacent in its tier and every state tensor can be viewed in place. Compute
        # groups start on fresh pages (a unit is paged alone, so evicting it never drags a
        # resident neighbour's page); states and gradients are chained (they move together)
        for kind, dtype, tier in (("compute", compute_dtype, "cpu"), ("master", torch.float32, optimizer_tier),
                                  ("exp_avg", torch.float32, optimizer_tier),
                                  ("exp_avg_sq", torch.float32, optimizer_tier), ("grad", torch.float32, "cpu")):
            tail = None
            groups[kind] = []
            for _name, idx in layer_specs:
                group = store.allocate_group([(self.params[i][1].shape, dtype) for i in idx], tier=tier,
                                             after=tail if kind != "compute" else None)
                tail = group[-1]
                groups[kind].append(group)
        with torch.no_grad():
            for li, (name, idx) in enumerate(layer_specs):
                for k, i in enumerate(idx):
                    self.layer_of[i], self.position[i] = li, k
                    p = self.params[i][1]
                    src = p.detach().to("cpu") if values else torch.zeros(p.shape)
                    groups["master"][li][k].copy_(src.float())
                    groups["compute"][li][k].copy_(src.to(compute_dtype))
                    zeros = torch.zeros(src.shape)
                    groups["exp_avg"][li][k].copy_(zeros)
                    groups["exp_avg_sq"][li][k].copy_(zeros)
                self.layers.append(Layer(li, name, list(idx), groups["compute"][li], groups["master"][li],
                                         groups["exp_avg"][li], groups["exp_avg_sq"][li], groups["grad"][li]))
            for _, p in self.params:
                p.data = _placeholder(p.shape, compute_dtype, self._gpu_device())
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._order: list[int] = []
        """Units in the order the previous iteration asked for them (what prefetching follows)."""
        self._seen: list[int] = []
        self._cursor = 0
        self._prefetched: dict[int, object] = {}
        """Units whose gpu copy was started ahead of use: unit -> MoveHandle."""
        self._by_ptr: dict[int, int] = {}
        self.prefetches = 0
        self.fetches = 0
        self.evictions = 0
        self.peak_gpu_pages = 0
        """Most gpu-tier pages in use at once (sampled after every fetch, when use peaks)."""

    def _gpu_device(self) -> torch.device:
        return self.store.tier("gpu").device

    def where(self, i: int) -> tuple[Layer, int]:
        """Parameter ``i``'s unit and its position in the unit's lists."""
        return self.layers[self.layer_of[i]], self.position[i]

    def param_at(self, ptr: int) -> int | None:
        """The resident parameter whose data starts at address ``ptr``, if any."""
        return self._by_ptr.get(ptr)

    # ------------------------------------------------------------------ residency

    def new_iteration(self) -> bool:
        """A forward begins: the units asked for since the last one become the order to prefetch
        in. True when that order differs from the one before (the access pattern changed: the
        prefetches of the iteration that just ended missed, and the new order is learned)."""
        changed = bool(self._order) and bool(self._seen) and self._seen != self._order
        if self._seen:
            self._order, self._seen = self._seen, []
        self._cursor = 0
        return changed

    def ensure(self, layer_indices) -> None:
        """Make every listed layer resident on the gpu (their parameters' ``.data`` views of it),
        then start copying the unit the previous iteration used next, if it fits without evicting."""
        for li in layer_indices:
            self._seen.append(li)
            layer = self.layers[li]
            if layer.resident:
                self._lru.move_to_end(li)
            else:
                self._fetch(layer, keep=set(layer_indices))
            self._prefetch_after(li)

    def _prefetch_after(self, li: int) -> None:
        """[Note: prefetch] follows the previous iteration's order of use: one unit ahead, and
        only into free pages (a prefetch never evicts), so demand fetches stay the only ones that
        make room. Its pages are dropped like any evictable unit's when room is needed."""
        order = self._order
        try:
            pos = order.index(li, self._cursor)
        except ValueError:
            return
        self._cursor = pos + 1
        if self._cursor >= len(order):
            return
        nxt = self.layers[order[self._cursor]]
        if nxt.resident or nxt.index in self._prefetched:
            return
        try:  # reserves up front: no room means OutOfMemory, nothing changed
            self._prefetched[nxt.index] = self.store.copy(nxt.compute, "gpu")
        except OutOfMemory:
            return
        self.prefetches += 1

    def _fetch(self, layer: Layer, keep: set[int]) -> None:
        while True:
            try:
                self.store.copy(layer.compute, "gpu").wait()
                break
            except OutOfMemory as exc:
                if not self._evict_one(keep):
                    raise OutOfMemory("gpu", exc.requested_pages, exc.free_pages, exc.page_bytes,
                                      f"layer {layer.name!r}: every other resident layer is in use") from None
        for i, t in zip(layer.params, layer.compute):
            p = self.params[i][1]
            try:
                p.data = t.view("gpu")
            except InvalidRequest:  # scattered slots: a merged copy of the gpu pages (stats().view_copies)
                lease = t.lease("gpu", write=False)
                layer.leases.append(lease)
                p.data = lease.tensor
            if p.numel():
                ptr = p.data.untyped_storage().data_ptr()
                self._by_ptr[ptr] = i
                layer.ptrs.append(ptr)
        layer.resident, layer.zombie = True, False
        self._prefetched.pop(layer.index, None)
        self.peak_gpu_pages = max(self.peak_gpu_pages, self.store.tier("gpu").used_pages)
        self._lru[layer.index] = None
        self._lru.move_to_end(layer.index)
        self.fetches += 1

    def _evict_one(self, keep: set[int]) -> bool:
        """Evict the least recently used resident layer not in ``keep``; drop prefetched copies
        and retry zombies first. False when nothing could be given back."""
        for li in list(self._prefetched):
            if li not in keep and self._drop_prefetched(li):
                return True
        for layer in self.layers:
            if layer.zombie and self._drop(layer):
                return True
        for li in list(self._lru):
            if li in keep:
                continue
            self.evict(self.layers[li])
            if not self.layers[li].zombie:
                return True
        return False

    def evict(self, layer: Layer) -> None:
        """Point the layer's parameters at placeholders and drop its gpu replica (see the Note)."""
        if not layer.resident:
            return
        for i in layer.params:
            p = self.params[i][1]
            p.data = _placeholder(p.shape, p.dtype, p.device)
        for lease in layer.leases:
            lease.release()
        layer.leases.clear()
        for ptr in layer.ptrs:
            self._by_ptr.pop(ptr, None)
        layer.ptrs.clear()
        layer.resident = False
        self._lru.pop(layer.index, None)
        self.evictions += 1
        layer.zombie = not self._drop(layer)

    def _drop(self, layer: Layer) -> bool:
        try:
            self.store.release(layer.compute, "gpu").wait()
        except InvalidRequest:  # still pinned by a tensor derived from an old view
            return False
        layer.zombie = False
        return True

    def _drop_prefetched(self, li: int) -> bool:
        """Wait for unit ``li``'s prefetch and drop what it brought; True if the pages went back."""
        try:
            self._prefetched.pop(li).wait()
        except Exception:  # a failed prefetch leaves whatever landed; dropped all the same
            pass
        return self._drop(self.layers[li])

    def evict_all(self) -> None:
        for li in list(self._prefetched):
            self._drop_prefetched(li)
        for layer in self.layers:
            self.evict(layer)
        for layer in self.layers:
            if layer.zombie:
                self._drop(layer)

    def set_state(self, i: int, kind: str, value: torch.Tensor) -> None:
        """Overwrite parameter ``i``'s ``kind`` state (``master``, ``exp_avg``, ``exp_avg_sq``);
        setting ``master`` also refreshes the compute copy (every copy of it)."""
        layer, k = self.where(i)
        getattr(layer, kind)[k].copy_(value)
        if kind == "master":
            layer.compute[k].copy_(value.to(self.compute_dtype))

    # ------------------------------------------------------------------ gradients

    def accumulate_grad(self, i: int, grad: torch.Tensor, first: bool) -> None:
        """Add parameter ``i``'s gradient into its fp32 gradient pages (``first``: the first
        gradient of this step, which replaces what the pages held)."""
        layer, k = self.where(i)
        g = layer.grad[k]
        with g.lease("cpu") as x, torch.no_grad():
            if first:
                x.copy_(grad)
            else:
                x.add_(grad.to(device=x.device, dtype=x.dtype))
