"""An engine joins its ranks: what cannot run data parallel is refused, the collectives start,
and the ranks check they made the same engine."""

from __future__ import annotations

import zlib

from torch import nn

from pagemem.engine.config import EngineConfig
from pagemem.engine.ranks.collectives import Collectives
from pagemem.engine.ranks.group import RankGroup
from pagemem.errors import ConfigError


def join_ranks(ranks: RankGroup, model: nn.Module, config: EngineConfig) -> Collectives | None:
    """The engine's collectives over ``ranks`` (None for one process), after one collective that
    checks every rank made its engine over the same parameters and with the same training
    arithmetic (else every rank raises ``ConfigError``, none hangs)."""
    if not ranks.data_parallel:
        return None
    if config.lock_free:
        raise ConfigError("lock_free: must be False with several ranks (the updating thread would update from a "
                          "rank's own gradients before they are averaged); data-parallel lock-free updates are not "
                          "built yet")
    if config.overlap_update is True:
        raise ConfigError("overlap_update: must not be True with several ranks (gradients are averaged at the "
                          "end of backward, before any update); leave it None")
    coll = Collectives(ranks, config.collective_timeout_s)
    try:
        fields = {"parameters (names, shapes, dtypes, requires_grad)":
                  [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
                  "optimizer": config.optimizer, "compute_dtype": config.compute_dtype,
                  "max_grad_norm": config.max_grad_norm, "accumulation_steps": config.accumulation_steps,
                  "loss_scale": config.effective_loss_scale, "optimizer_tier": config.optimizer_tier,
                  "shard_optimizer_states": config.shard_optimizer_states,
                  "shard_parameters": config.shard_parameters,
                  "page_bytes": config.store.page_bytes,
                  "gpu_bytes (the plans every rank follows)": config.store.gpu_bytes}
        mine = [zlib.crc32(repr(v).encode()) for v in fields.values()]
        top, low = coll.begin("checking every rank's engine", mine)
        differ = [name for name, a, b in zip(fields, top, low) if a != b]
        if differ:
            raise ConfigError(f"process_group: the ranks made their engines with different {', '.join(differ)}; "
                              "every rank must make the same engine (same model, same config)")
    except BaseException:
        coll.close()
        raise
    return coll
