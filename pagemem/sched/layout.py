"""Per-rank sizes of every layer's model states, in pages: derived from a trace, or given by
whoever owns the pages (an engine computes them once from its store's layout and hands them to
``plan(layout=)``, so planner, validator and executor count the same pages)."""

from __future__ import annotations

from dataclasses import dataclass

from pagemem.tracer import Trace


def _pages(nbytes: int, page_bytes: int) -> int:
    return -(-nbytes // page_bytes)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One layer's model states on one rank."""

    index: int
    name: str
    param_bytes: int
    """Bytes of the layer's parameters across all ranks (what ``compute`` uses, gathered)."""
    shard_elements: int
    """Parameter elements this rank owns and updates."""
    shard_bytes: int
    param_pages: int
    """Pages of this rank's parameter shard; its gradient shard has as many."""
    optim_bytes: int
    """Bytes of this rank's optimizer states (fp32 master weights, Adam moments) for the layer."""
    optim_pages: int
    cached_pages: int | None = None
    """Gpu pages the layer's optimizer states take where an executor keeps a cached layer's
    states (None: ``optim_pages``; an engine that keeps gradient sums beside them, or each kind
    on pages of its own, says more)."""

    stream_pages: int | None = None
    """The most cpu pages the layer's update holds at once where it is streamed (its states or
    gradients rest on nvme: [Note: a streamed update] in ``tasks.py``); None: the whole layer's
    gradient and optimizer pages (a trace alone cannot say more; an engine that brings its
    parameters through the cpu one at a time says what its largest one takes)."""

    elements: int | None = None
    """Parameter elements of the whole layer, every rank's (None: ``shard_elements``): the fp32
    gradient sums an ``all_reduce`` averages where only the states are sharded."""
    gather_elements: int | None = None
    """Where only the states are sharded: the elements each rank contributes to the all-gather of
    the updated weights after the layer's update (its share, padded to the largest rank's; None:
    ``shard_elements``); where units are gathered (``units``): to the reduce-scatter of the
    layer's fp32 gradient sums, as many."""
    unit_gather_bytes: int | None = None
    """Where units are gathered (``units``): the bytes each rank contributes to the layer's
    all-gather when it is fetched (its share of the compute copy, padded to the largest rank's;
    None: ``param_bytes / W``, rounded up)."""

    @property
    def pages_when_cached(self) -> int:
        return self.optim_pages if self.cached_pages is None else self.cached_pages

    @property
    def update_pages(self) -> int:
        """Cpu pages a streamed update of the layer holds at once: ``stream_pages``, by default
        the whole layer's gradient and optimizer pages."""
        return self.param_pages + self.optim_pages if self.stream_pages is None else self.stream_pages


SHARDINGS: tuple[str, ...] = ("params", "states", "units")
"""What the ranks shard (``Layout.sharding``): ``params``, every model state (ZeRO-3: compute
copies, gradients, optimizer states; the task table's ``W>1`` rows), ``states``, the optimizer
states only (ZeRO-1: every rank holds the whole compute copy and gradient sums, averages the
sums with an ``all_reduce``, updates its share and all-gathers it; the ``R>1`` rows), or
``units``, ZeRO-3 as an engine with ``shard_parameters`` runs it (the ``U`` rows): no compute
copy at rest, a layer's whole copy all-gathered from every rank's share when it moves to the gpu,
its gradient sums reduce-scattered into shares, no all-gather after the update."""


@dataclass(frozen=True)
class Layout:
    """Per-rank pages of every layer of a trace, for ``world_size`` ranks and ``page_bytes`` pages."""

    page_bytes: int
    world_size: int
    layers: tuple[LayerLayout, ...]
    sharding: str = "params"
    """What the ranks shard (``SHARDINGS``); with one rank, nothing."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding: one of {', '.join(SHARDINGS)}, got {self.sharding!r}")

    @property
    def shards_params(self) -> bool:
        """Several ranks, each holding a shard of every layer's parameters (ZeRO-3)."""
        return self.world_size > 1 and self.sharding == "params"

    @property
    def gathers_units(self) -> bool:
        """Several ranks, no compute copy at rest: each layer gathered when it moves (``units``)."""
        return self.world_size > 1 and self.sharding == "units"

    @property
    def shards_states(self) -> bool:
        """Several ranks, each holding the whole parameters and a share of the optimizer states."""
        return self.world_size > 1 and self.sharding == "states"

    @classmethod
    def from_trace(cls, trace: Trace, world_size: int, page_bytes: int, sharding: str = "params") -> "Layout":
        optim: dict[int, int] = {}
        for rec in trace.tensors:
            if rec.kind == "optimizer_state" and rec.layer is not None:
                optim[rec.layer] = optim.get(rec.layer, 0) + rec.nbytes
        layers = []
        whole_params = sharding in ("states", "units")
        for layer in trace.layers:
            elements = sum(_numel(trace.tensors[i].shape) for i in layer.tensor_ids)
            shard = layer.nbytes if whole_params else -(-layer.nbytes // world_size)
            pages = _pages(shard, page_bytes)  # units: the whole gathered copy's, on the gpu
            if sharding == "units" and world_size > 1:
                shard = 0  # no compute copy of the layer's own at rest: nothing to refresh after the update
            ob = -(-optim.get(layer.index, 0) // world_size)
            layers.append(LayerLayout(layer.index, layer.name, layer.nbytes, -(-elements // world_size),
                                      shard, pages, ob, _pages(ob, page_bytes),
                                      elements=elements if whole_params else None))
        return cls(page_bytes, world_size, tuple(layers), sharding)

    def gathered_pages(self, layer: int) -> int:
        """Gpu pages a layer's parameters take while it computes: W pages per shard page (one
        where the parameters are not sharded)."""
        return (self.world_size if self.shards_params else 1) * self.layers[layer].param_pages

    def grad_buffer_pages(self, layer: int) -> int:
        """Gpu pages of the layer's gradients as the backward pass produces them (the full
        gradient buffer when the parameters are sharded, the grad pages themselves otherwise)."""
        return (self.world_size if self.shards_params else 1) * self.layers[layer].param_pages

    @property
    def param_pages(self) -> int:
        return sum(l.param_pages for l in self.layers)

    @property
    def optim_pages(self) -> int:
        return sum(l.optim_pages for l in self.layers)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
