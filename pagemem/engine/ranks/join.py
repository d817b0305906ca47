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
        shape = repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()])
        arithmetic = repr((config.optimizer, config.compute_dtype, config.max_grad_norm, config.accumulation_steps,
                           config.effective_loss_scale, config.optimizer_tier))
        digests = [zlib.crc32(shape.encode()), zlib.crc32(arithmetic.encode())]
        if not coll.same_everywhere(digests, "checking every rank's model and config"):
            raise ConfigError("process_group: the ranks made their engines over different models (parameter names, "
                              "shapes, dtypes or requires_grad) or with a different optimizer, compute_dtype, "
                              "max_grad_norm, accumulation_steps, loss_scale or optimizer_tier; every rank must "
                              "make the same engine")
    except BaseException:
        coll.close()
        raise
    return coll
