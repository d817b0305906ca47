"""Group parameters into layers: the units the scheduler moves together.

Without hints, every child of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` is a
layer (a transformer block), and outside such containers every module that owns parameters
directly is one (embeddings, final LayerNorm, an untied head). ``layer_types`` overrides this:
each module of one of those classes is a layer, and the remaining parameters go by their direct
owner. A parameter reachable from several candidates (tied weights) belongs to the candidate
whose module ran forward first.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def candidate_layers(model: nn.Module, param_index: dict[int, int],
                     layer_types: tuple[type, ...] = ()) -> list[tuple[str, list[int]]]:
    """Candidate layers in module-tree order: (module path, parameter indices). A tied parameter
    can appear in more than one candidate; :func:`assign_layers` settles it."""
    out: list[tuple[str, list[int]]] = []

    def subtree(module: nn.Module) -> list[int]:
        seen: list[int] = []
        for m in module.modules():
            for p in m.parameters(recurse=False):
                i = param_index.get(id(p))
                if i is not None and i not in seen:
                    seen.append(i)
        return seen

    def direct(module: nn.Module) -> list[int]:
        idx = [param_index.get(id(p)) for p in module.parameters(recurse=False)]
        return list(dict.fromkeys(i for i in idx if i is not None))

    def walk(module: nn.Module, path: str) -> None:
        if layer_types and isinstance(module, layer_types):
            params = subtree(module)
            if params:
                out.append((path, params))
            return
        own = direct(module)
        if own:
            out.append((path, own))
        containerish = not layer_types and isinstance(module, _CONTAINERS)
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if containerish:
                params = subtree(child)
                if params:
                    out.append((child_path, params))
            else:
                walk(child, child_path)

    walk(model, "")
    return out


def assign_layers(candidates: Sequence[tuple[str, Sequence[int]]], n_params: int,
                  module_start: dict[str, int]) -> list[tuple[str, list[int]]]:
    """Give every parameter exactly one layer. A parameter in several candidates goes to the one
    whose module started forward first (``module_start``: path -> first ``forward_pre`` op);
    candidates that end up empty are dropped. A parameter in no candidate gets its own layer."""
    inf = float("inf")
    best: dict[int, tuple[float, int]] = {}
    for rank, (path, params) in enumerate(candidates):
        key = (module_start.get(path, inf), rank)
        for i in params:
            if i not in best or key < best[i]:
                best[i] = key
    groups: list[tuple[str, list[int]]] = []
    for rank, (path, params) in enumerate(candidates):
        mine = [i for i in params if best[i][1] == rank]
        if mine:
            groups.append((path, mine))
    for i in range(n_params):
        if i not in best:
            groups.append((f"<param {i}>", [i]))
    return groups
