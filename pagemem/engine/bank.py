"""The model's states in pages, one group per layer, and the parameters' residency on the gpu.

Per layer (a module owning parameters directly; a tied parameter belongs to the first module
that owns it):
- ``compute``: the parameters in the compute dtype, home on ``cpu``; a replica on ``gpu`` while
  the layer is resident;
- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, home on the optimizer tier;
- ``grad``: fp32 gradient sums on ``cpu``, from the first ``backward()`` of a step to the update.
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
    index: int
    name: str
    params: list[int]
    """Indices into ``ParamBank.params``."""
    compute: list[PagedTensor]
    master: list[PagedTensor]
    exp_avg: list[PagedTensor]
    exp_avg_sq: list[PagedTensor]
    grad: list[PagedTensor] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    resident: bool = False
    zombie: bool = False


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


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """Shape and dtype of ``p``, one element of memory (never read by a correct schedule)."""
    one = torch.zeros((), dtype=p.dtype, device=p.device)
    return one.expand(p.shape) if p.dim() else one


class ParamBank:
    def __init__(self, model: nn.Module, store: PageStore, compute_dtype: torch.dtype, optimizer_tier: str) -> None:
        self.store = store
        self.compute_dtype = compute_dtype
        self.params, layer_specs = owning_layers(model)
        if not self.params:
            raise InvalidRequest("the model has no parameters to train")
        self.original_dtype = [p.dtype for _, p in self.params]
        self.layers: list[Layer] = []
        self.layer_of: list[int] = [0] * len(self.params)
        tails: dict[str, PagedTensor | None] = {k: None for k in ("compute", "master", "exp_avg", "exp_avg_sq")}
        with torch.no_grad():
            for li, (name, idx) in enumerate(layer_specs):
                ps = [self.params[i][1] for i in idx]
                for i in idx:
                    self.layer_of[i] = li
                groups = {}
                for kind, dtype, tier in (("compute", compute_dtype, "cpu"), ("master", torch.float32, optimizer_tier),
                                          ("exp_avg", torch.float32, optimizer_tier),
                                          ("exp_avg_sq", torch.float32, optimizer_tier)):
                    # compute pages move per layer: fresh pages, so evicting one layer never drags
                    # a resident neighbour's boundary page; states move together: chained
                    after = tails[kind] if kind != "compute" else None
                    groups[kind] = store.allocate_group([(p.shape, dtype) for p in ps], tier=tier, after=after)
                    tails[kind] = groups[kind][-1]
                for p, c, m, a, s in zip(ps, groups["compute"], groups["master"], groups["exp_avg"],
                                         groups["exp_avg_sq"]):
                    src = p.detach().to("cpu")
                    m.copy_(src.float())
                    c.copy_(src.to(compute_dtype))
                    a.copy_(torch.zeros(p.shape))
                    s.copy_(torch.zeros(p.shape))
                self.layers.append(Layer(li, name, idx, groups["compute"], groups["master"], groups["exp_avg"],
                                         groups["exp_avg_sq"]))
            for _, p in self.params:
                p.data = _placeholder(p.data.to(dtype=compute_dtype, device=self._gpu_device()))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.fetches = 0
        self.evictions = 0
        self.peak_gpu_pages = 0
        """Most gpu-tier pages in use at once (sampled after every fetch, when use peaks)."""

    def _gpu_device(self) -> torch.device:
        return self.store.tier("gpu").device

    # ------------------------------------------------------------------ residency

    def ensure(self, layer_indices) -> None:
        """Make every listed layer resident on the gpu (their parameters' ``.data`` views of it)."""
        for li in layer_indices:
            layer = self.layers[li]
            if layer.resident:
                self._lru.move_to_end(li)
                continue
            self._fetch(layer, keep=set(layer_indices))

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
            if t.is_viewable and "gpu" in t.tiers:
                p.data = t.view()
            else:  # scattered slots: a merged copy of the gpu pages (counted in stats().view_copies)
                lease = t.lease("gpu", write=False)
                layer.leases.append(lease)
                p.data = lease.tensor
        layer.resident, layer.zombie = True, False
        self.peak_gpu_pages = max(self.peak_gpu_pages, self.store.tier("gpu").used_pages)
        self._lru[layer.index] = None
        self._lru.move_to_end(layer.index)
        self.fetches += 1

    def _evict_one(self, keep: set[int]) -> bool:
        """Evict the least recently used resident layer not in ``keep``; retry zombies first.
        False when nothing could be given back."""
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
            p.data = _placeholder(p.data)
        for lease in layer.leases:
            lease.release()
        layer.leases.clear()
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

    def evict_all(self) -> None:
        for layer in self.layers:
            self.evict(layer)
        for layer in self.layers:
            if layer.zombie:
                self._drop(layer)

    def set_state(self, i: int, kind: str, value: torch.Tensor) -> None:
        """Overwrite parameter ``i``'s ``kind`` state (``master``, ``exp_avg``, ``exp_avg_sq``);
        setting ``master`` also refreshes the compute copy (every copy of it)."""
        layer = self.layers[self.layer_of[i]]
        k = layer.params.index(i)
        getattr(layer, kind)[k].copy_(value)
        if kind == "master":
            layer.compute[k].copy_(value.to(self.compute_dtype))

    # ------------------------------------------------------------------ gradients

    def accumulate_grad(self, i: int, grad: torch.Tensor) -> None:
        """Add parameter ``i``'s gradient into its fp32 gradient pages (zero at the first
        gradient of a step)."""
        layer = self.layers[self.layer_of[i]]
        if not layer.grad:
            layer.grad = self.store.allocate_group([(self.params[j][1].shape, torch.float32) for j in layer.params],
                                                   tier="cpu")
            for g in layer.grad:
                g.copy_(torch.zeros(g.shape))
        g = layer.grad[layer.params.index(i)]
        with g.lease("cpu") as x, torch.no_grad():
            x.add_(grad.to(device=x.device, dtype=x.dtype))

    def free_grads(self) -> None:
        for layer in self.layers:
            for g in layer.grad:
                g.free()
            layer.grad = []
