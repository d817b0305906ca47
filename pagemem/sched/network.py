"""How long a collective takes on a profile's two-level network: the one place that says it.

>>> collective_seconds(hw, "all_gather", 4 << 20, 256)      # seconds, the faster algorithm's
>>> collective_time(hw, "all_reduce", 1 << 30, 768)          # CollectiveTime(seconds, "tree")

``S`` is the bytes each rank holds of the operation's smaller side: the shard it gives to an
``all_gather`` (it gets ``W * S`` back), the shard it keeps from a ``reduce_scatter`` (it gives
``W * S``), its whole buffer for an ``all_reduce``. ``W`` ranks fill servers of
``ranks_per_server`` in order: ``n = ceil(W / ranks_per_server)`` servers of ``g = min(W,
ranks_per_server)`` ranks (a last server with fewer ranks is counted as full).

[Note: collectives on a two-level network] A server's GPUs reach each other over NVLink, each
with ``nvlink_bytes_per_s`` of bus bandwidth (NCCL's "busbw": the rate at which a GPU's bytes
leave it in a ring); servers reach each other through their NICs, ``internode_bytes_per_s``
summed over one server's NICs, one direction. Each algorithm's time is a latency plus its bytes
over the slowest link they cross, with the links of one phase running at once:

- **ring** (NCCL's ring, one call): ranks in a ring that enters and leaves each server once per
  channel; NCCL spreads its channels over the NICs, so the rings that leave a server share all
  of them (assumed: as many channels as it takes to fill them). In
  ``all_gather`` and ``reduce_scatter`` every rank sends ``(W - 1) * S`` bytes to the next
  (``all_reduce``: ``2 (W - 1) / W * S``, a reduce-scatter then an all-gather of ``S / W``
  chunks) -- over NVLink inside a server, and the same bytes leave each server through its NICs
  in total, so a ring spanning servers runs at ``min(nvlink, internode)``, however many ranks share
  the server. ``W - 1`` steps (``all_reduce``: ``2 (W - 1)``), each waiting for its slowest hop:
  ``internode_latency_s`` each once the ring crosses servers.
- **tree** (two levels; for ``all_reduce`` this is the shape of NCCL's tree, intra-server then
  across servers): ``all_reduce`` reduce-scatters inside each server over NVLink (``(g - 1) / g *
  S`` per GPU), all-reduces its ``S / g`` piece across servers -- the ``g`` ranks of a server do
  so at once (one "rail" each), sharing its NICs, which move ``2 (n - 1) / n * S`` in total --
  and all-gathers inside the server again; ``2 * ceil(log2 n)`` steps cross servers (up a tree
  and down). ``all_gather`` gathers across servers first (each rail its ``S``: ``g (n - 1) S``
  through a server's NICs, ``n - 1`` steps), then inside them (``(g - 1) n S`` per GPU over
  NVLink); ``reduce_scatter`` runs the same phases backwards. The phases run one after another.

Each call also costs ``collective_latency_s`` (alpha: launch, synchronisation, steps inside a
server). The time is the faster algorithm's, as NCCL's tuner picks one per call from a model of
this kind: rings for large messages, the tree where many cross-server steps or NICs much slower
than NVLink make the ring slow. NCCL itself runs ``all_gather`` and ``reduce_scatter`` as rings
only; their two-level variant is what a runtime can run with a process group per level (ZeRO++'s
hierarchical partitioning, hybrid sharding), so a tree chosen for those is a choice the runtime
makes, not NCCL. Within one server (``n = 1``) both are the ring and never touch the NICs.

Not modelled: protocol choice (LL / LL128 / Simple) and its bandwidth factors, the pipelining
of one phase into the next, congestion from other traffic on the NICs, rails that do not line up
with the NICs, and a last server with fewer ranks. Sources: the ring and tree algorithms and the
bus-bandwidth convention as NCCL's documentation and nccl-tests' PERFORMANCE notes describe
them; the alpha-beta form of the cost as in Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH" (2005).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from pagemem.errors import ConfigError

if TYPE_CHECKING:
    from pagemem.sched.hardware import HardwareProfile

COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS: tuple[str, ...] = ("ring", "tree")


class CollectiveTime(NamedTuple):
    """Seconds of one collective and the algorithm that takes them (``"none"``: one rank)."""

    seconds: float
    algorithm: str


def servers(hw: "HardwareProfile", world_size: int) -> tuple[int, int]:
    """``(n, g)``: servers the ranks span, ranks on each (see the module docs)."""
    g = hw.sharing(world_size)
    return -(-world_size // hw.ranks_per_server), g


def ring_seconds(hw: "HardwareProfile", collective: str, nbytes: float, world_size: int) -> float:
    """One ``collective`` of ``nbytes`` per rank over ``world_size`` ranks as a ring."""
    W = world_size
    n, _ = servers(hw, W)
    passes = 2 if collective == "all_reduce" else 1
    sent = (W - 1) * nbytes / W if collective == "all_reduce" else (W - 1) * nbytes
    link = hw.nvlink_bytes_per_s if n == 1 else min(hw.nvlink_bytes_per_s, hw.internode_bytes_per_s)
    steps = passes * (W - 1) if n > 1 else 0
    return hw.collective_latency_s + steps * hw.internode_latency_s + passes * sent / link


def tree_seconds(hw: "HardwareProfile", collective: str, nbytes: float, world_size: int) -> float:
    """One ``collective`` of ``nbytes`` per rank over ``world_size`` ranks in two levels (the
    ring itself where the ranks share one server)."""
    n, g = servers(hw, world_size)
    if n == 1:
        return ring_seconds(hw, collective, nbytes, world_size)
    if collective == "all_reduce":
        inside = 2 * (g - 1) / g * nbytes / hw.nvlink_bytes_per_s
        across = 2 * (n - 1) / n * nbytes / hw.internode_bytes_per_s
        steps = 2 * math.ceil(math.log2(n))
    else:
        inside = (g - 1) * n * nbytes / hw.nvlink_bytes_per_s
        across = g * (n - 1) * nbytes / hw.internode_bytes_per_s
        steps = n - 1
    return hw.collective_latency_s + steps * hw.internode_latency_s + inside + across


def collective_time(hw: "HardwareProfile", collective: str, nbytes: float, world_size: int) -> CollectiveTime:
    """The faster of ring and tree for one ``collective`` (``COLLECTIVES``) of ``nbytes`` per
    rank over ``world_size`` ranks; a tie goes to the ring. One rank, or no bytes: nothing."""
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective: must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ConfigError(f"nbytes: must be a finite number >= 0, got {nbytes!r}")
    hw.sharing(world_size)  # validates world_size
    if world_size == 1 or nbytes == 0:
        return CollectiveTime(0.0, "none")
    ring = ring_seconds(hw, collective, nbytes, world_size)
    tree = tree_seconds(hw, collective, nbytes, world_size)
    return CollectiveTime(tree, "tree") if tree < ring else CollectiveTime(ring, "ring")


def collective_seconds(hw: "HardwareProfile", collective: str, nbytes: float, world_size: int) -> float:
    """Seconds of :func:`collective_time`."""
    return collective_time(hw, collective, nbytes, world_size).seconds


def bus_bytes(collective: str, nbytes: int, world_size: int) -> int:
    """Bytes a rank sends in a ring (NCCL's bus-bandwidth convention): ``(W - 1) * S`` for
    ``all_gather`` and ``reduce_scatter``, ``2 (W - 1) / W * S`` for ``all_reduce``; what
    ``Plan.bytes_moved`` reports as ``network``."""
    W = world_size
    return 2 * (W - 1) * nbytes // W if collective == "all_reduce" else (W - 1) * nbytes
