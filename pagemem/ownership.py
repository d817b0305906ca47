"""Which module owns which parameter: the order the engine splits a model into paging units and
gives a model built on ``meta`` its values (``pagemem.Engine(init=)``). A leaf: the engine and the
reference models both walk a model this way."""

from __future__ import annotations

from typing import Iterator

from torch import nn


def owning_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Each module that owns parameters, with them, in module order; a parameter shared by
    several modules (a tied embedding) belongs to the first."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            yield name, module, own
