"""Parameter groups, as ``torch.optim`` takes them, and the usual decay / no-decay split.

>>> engine = pagemem.Engine(model, config, param_groups=pagemem.decay_groups(model, weight_decay=0.1))
>>> engine.optimizer.param_groups[1]["weight_decay"]      # biases, norms, 1-d parameters
0.0

Each group may set ``lr``, ``betas``, ``eps`` and ``weight_decay`` (the rest come from
``EngineConfig.optimizer``); lr schedulers drive every group, as they do a torch optimizer's.
A parameter that requires a gradient must be in a group; a frozen one may be left out (it is
then never updated, even if unfrozen later, as with a torch optimizer that does not hold it).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from pagemem.engine.updates.adam import AdamW
from pagemem.engine.config import check_no_amsgrad
from pagemem.errors import ConfigError

GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay",
              "fused", "foreach", "capturable", "differentiable")


def checked_groups(model: nn.Module, groups: Iterable[dict[str, Any]], defaults: AdamW | None = None
                   ) -> list[dict[str, Any]]:
    """``groups`` as a list of dicts whose ``params`` are lists of ``model``'s parameters, each in
    at most one group, every trainable one in some group, their hyperparameters valid over
    ``defaults``; ``ConfigError`` names what is wrong."""
    if isinstance(groups, dict) or not isinstance(groups, Iterable):
        raise ConfigError(f"param_groups: must be a list of dicts with 'params', got {type(groups).__name__}")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    out, seen = [], {}
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(f"param_groups[{g}]: must be a dict with 'params', got {group!r:.80}")
        unknown = sorted(set(group) - set(GROUP_KEYS))
        if unknown:
            raise ConfigError(f"param_groups[{g}]: unknown keys {unknown}; allowed: {list(GROUP_KEYS)}")
        params = group["params"]
        params = [params] if isinstance(params, nn.Parameter) else list(params)
        for p in params:
            if id(p) not in names:
                raise ConfigError(f"param_groups[{g}]['params']: holds a tensor that is not a parameter of this model")
            if id(p) in seen:
                raise ConfigError(f"param_groups[{g}]['params']: {names[id(p)]!r} is also in "
                                  f"param_groups[{seen[id(p)]}]; a parameter belongs to one group")
            seen[id(p)] = g
        try:
            check_no_amsgrad(AdamW.from_group({**(defaults or AdamW()).group(), **group}))
        except ConfigError as exc:
            raise ConfigError(f"param_groups[{g}]: {exc}") from None
        out.append({**group, "params": params})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ConfigError(f"param_groups: {len(missing)} trainable parameters are in no group ({missing[:3]}"
                          f"{'...' if len(missing) > 3 else ''}); add them, or set requires_grad=False")
    return out


def is_no_decay(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    """The usual rule: no weight decay for biases, normalization weights and other parameters
    of fewer than two dimensions (gains, layer scale)."""
    return param.dim() < 2 or name.endswith("bias") or "norm" in type(owner).__name__.lower()


def decay_groups(model: nn.Module, weight_decay: float = 0.1, **group: Any) -> list[dict[str, Any]]:
    """Two parameter groups of ``model``'s trainable parameters: weight decay ``weight_decay``
    for the others, 0.0 for those :func:`is_no_decay` names; ``group`` (``lr``, ...) goes into
    both."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (no_decay if is_no_decay(pname, p, module) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, **group},
            {"params": no_decay, "weight_decay": 0.0, **group}]
