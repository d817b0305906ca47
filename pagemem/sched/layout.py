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

    @property
    def pages_when_cached(self) -> int:
        return self.optim_pages if self.cached_pages is None else self.cached_pages

    @property
    def update_pages(self) -> int:
        """Cpu pages a streamed update of the layer holds at once: ``stream_pages``, by default
        the whole layer's gradient and optimizer pages."""
        return self.param_pages + self.optim_pages if self.stream_pages is None else self.stream_pages


@dataclass(frozen=True)
class Layout:
    """Per-rank pages of every layer of a trace, for ``world_size`` ranks and ``page_bytes`` pages."""

    page_bytes: int
    world_size: int
    layers: tuple[LayerLayout, ...]

    @classmethod
    def from_trace(cls, trace: Trace, world_size: int, page_bytes: int) -> "Layout":
        optim: dict[int, int] = {}
        for rec in trace.tensors:
            if rec.kind == "optimizer_state" and rec.layer is not None:
                optim[rec.layer] = optim.get(rec.layer, 0) + rec.nbytes
        layers = []
        for layer in trace.layers:
            elements = sum(_numel(trace.tensors[i].shape) for i in layer.tensor_ids)
            shard = -(-layer.nbytes // world_size)
            ob = -(-optim.get(layer.index, 0) // world_size)
            layers.append(LayerLayout(layer.index, layer.name, layer.nbytes, -(-elements // world_size),
                                      shard, _pages(shard, page_bytes), ob, _pages(ob, page_bytes)))
        return cls(page_bytes, world_size, tuple(layers))

    def gathered_pages(self, layer: int) -> int:
        """Gpu pages a layer's parameters take while it computes: W pages per shard page."""
        return self.world_size * self.layers[layer].param_pages

    def grad_buffer_pages(self, layer: int) -> int:
        """Gpu pages of the layer's gradients as the backward pass produces them (the full
        gradient buffer when W > 1, the grad pages themselves when W = 1)."""
        return self.world_size * self.layers[layer].param_pages

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
