"""What the simulator needs to know about a machine: one frozen, validated ``HardwareProfile``.

One name per knob, one unit per name (bytes/s, elements/s, FLOP/s):

- per GPU (each rank has its own): ``h2d_bytes_per_s`` and ``d2h_bytes_per_s`` (PCIe, one
  direction each, both directions at once), ``nvlink_bytes_per_s`` (*bus* bandwidth among the
  ranks of one server, NCCL's "busbw"), ``gpu_adam_elements_per_s`` (Adam on layers whose
  optimizer states are cached on the GPU), ``flops_per_s`` and ``hbm_bytes_per_s`` (to build
  synthetic traces with, :meth:`HardwareProfile.cost_model`), ``compute_scale`` (multiplies a
  trace's op durations: 1 for a trace timed on, or synthesised for, this hardware);
- per server, shared by the ranks on it: ``nvme_read_bytes_per_s``, ``nvme_write_bytes_per_s``
  (the ``nvme`` tier: the server's SSDs), ``cpu_adam_elements_per_s``,
  ``host_memory_bytes_per_s`` (bytes read + written per second by a host ``copy_``: the compute
  copy refreshed after a CPU update) and ``nvme_host_bytes_per_s`` (disk bytes per second of
  CPU time: the host's share of disk I/O). ``ranks_per_server`` ranks share a server; with
  ``world_size`` W a rank gets ``total / min(W, ranks_per_server)`` (:meth:`HardwareProfile.rate`);
  ``internode_bytes_per_s``: one server's NICs together, one direction;
- collectives (``all_gather``, ``reduce_scatter``, ``all_reduce``) over W ranks on
  ``ceil(W / ranks_per_server)`` servers: :mod:`pagemem.sched.network` (ring or two-level tree,
  whichever is faster), with ``collective_latency_s`` per call and ``internode_latency_s`` per
  step that crosses servers (:meth:`HardwareProfile.seconds`);
- ``window_host_seconds``: host time the engine's executor spends on each window of a layer the
  plan moves (staging its pages, binding its parameters as views, releasing them), on the thread
  that runs the model: charged on the ``compute`` stream at the window's release. Measured by
  ``pagemem profile`` without CUDA (the host stand-in, where that thread *is* the compute); on a
  GPU the host queues its work ahead of the device, where this is hidden unless the host falls
  behind (not modelled: GPU profiles keep 0);
- ``shared_processor``: streams (of ``STREAMS``) that are one processor, so at most one of them
  runs at a time. Empty on a real GPU, where compute, each copy direction and the CPU's Adam are
  separate engines. Without CUDA the ``gpu`` tier is a host stand-in: its compute, the memcpys
  that stand for PCIe, the CPU side of disk I/O and CPU Adam all run on the same cores and memory
  bus (``pagemem profile`` then sets ``("compute", "h2d", "d2h", "io", "cpu")``), so their work
  adds up instead of overlapping.

Profiles ship as JSON in ``pagemem/sched/profiles/`` (``HardwareProfile.builtin(name)``):
``a100-server`` (the paper's server, from :meth:`HardwareProfile.a100_server`) and
``dev-vm`` (measured on the development VM by ``pagemem profile``, see
:mod:`pagemem.commands.measure`). ``facts`` holds where the numbers come from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from pagemem.checks import check_int, check_rate
from pagemem.errors import ConfigError
from pagemem.plain import from_plain, to_plain
from pagemem.sched.network import COLLECTIVES, collective_seconds
from pagemem.tracer import CostModel

FORMAT = "pagemem-hardware-profile"
VERSION = 4
LEGACY_NAMES: dict[str, str] = {
    "ssd_read_bytes_per_s": "nvme_read_bytes_per_s",
    "ssd_write_bytes_per_s": "nvme_write_bytes_per_s",
    "ssd_host_bytes_per_s": "nvme_host_bytes_per_s",
}
"""Version 2's keys for the nvme tier (it called the tier ``ssd``) and their names since version
3; ``from_dict`` reads a version-2 profile through this table (and its ``shared_processor``
stream ``"ssd"`` as ``"nvme"``)."""
DEFAULT_COLLECTIVE_LATENCY_S = 10e-6
"""Alpha, per collective call: launching NCCL's kernel and synchronising its ranks, about what
small-message all-reduces take inside one server (a few to a few tens of microseconds in
nccl-tests' tables). Assumed, not measured here."""
DEFAULT_INTERNODE_LATENCY_S = 5e-6
"""Per step of a collective that crosses servers: one message from NIC to NIC through a switch,
with NCCL's proxy thread on each side (a few microseconds on RoCE or InfiniBand). Assumed."""
PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")

_RATES = ("h2d_bytes_per_s", "d2h_bytes_per_s", "nvlink_bytes_per_s", "internode_bytes_per_s", "nvme_read_bytes_per_s",
          "nvme_write_bytes_per_s", "cpu_adam_elements_per_s", "gpu_adam_elements_per_s",
          "flops_per_s", "hbm_bytes_per_s", "host_memory_bytes_per_s", "nvme_host_bytes_per_s", "compute_scale")
_LATENCIES = ("collective_latency_s", "internode_latency_s")

STREAMS: tuple[str, ...] = ("compute", "h2d", "d2h", "network", "nvme", "io", "cpu")
"""The simulator's streams (see :mod:`pagemem.sched.simulate`)."""
HOST_STAND_IN_SHARED: tuple[str, ...] = ("compute", "h2d", "d2h", "io", "cpu")
"""``shared_processor`` of a machine without CUDA (see the module docs)."""

ADAM_BYTES_PER_ELEMENT = 26
"""Bytes a mixed-precision Adam step moves per element: read the fp16/bf16 gradient (2), read
and write the fp32 master weight and both moments (24). Writing the fp16/bf16 parameter from the
new master weights is a pass of its own (the table's ``("memory", "refresh")``)."""


@dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths and rates of one machine type (see the module docs for units and sharing)."""

    name: str
    h2d_bytes_per_s: float
    """Host-to-device copy bandwidth per GPU."""
    d2h_bytes_per_s: float
    """Device-to-host copy bandwidth per GPU."""
    nvlink_bytes_per_s: float
    """Collective bus bandwidth per GPU among the ranks of one server (NVLink)."""
    internode_bytes_per_s: float
    """Bandwidth of one server's NICs together, one direction: what its ranks' collectives across
    servers share (:mod:`pagemem.sched.network`)."""
    nvme_read_bytes_per_s: float
    """Read bandwidth of one server's nvme tier, its SSDs (shared by its ranks)."""
    nvme_write_bytes_per_s: float
    """Write bandwidth of one server's nvme tier, its SSDs (shared by its ranks)."""
    cpu_adam_elements_per_s: float
    """Adam elements per second of one server's CPUs (shared by its ranks)."""
    gpu_adam_elements_per_s: float
    """Adam elements per second on one GPU (layers cached on the GPU)."""
    flops_per_s: float
    """Sustained matrix-multiply rate of one GPU, for synthetic traces."""
    hbm_bytes_per_s: float
    """Sustained device-memory bandwidth of one GPU (bytes read + written): synthetic traces, and
    the compute-copy refresh after an update on the GPU."""
    host_memory_bytes_per_s: float
    """Sustained host-memory bandwidth of one server (bytes read + written by a ``copy_``; shared
    by its ranks): the compute-copy refresh after a CPU update."""
    nvme_host_bytes_per_s: float
    """Disk bytes per second of the host's CPU time (XXH3 checksums, I/O submission and
    completion; shared by a server's ranks): the CPU share of a disk transfer, charged on the
    ``io`` stream while the transfer runs on ``nvme``."""
    ranks_per_server: int = 8
    compute_scale: float = 1.0
    """Multiplies every op duration of a trace (1: the trace was timed on this hardware)."""
    window_host_seconds: float = 0.0
    """Executor host time per window of a moved layer, on the compute stream (see the module docs;
    0: none charged)."""
    collective_latency_s: float = DEFAULT_COLLECTIVE_LATENCY_S
    """Alpha: seconds every collective call costs besides its bytes and steps across servers."""
    internode_latency_s: float = DEFAULT_INTERNODE_LATENCY_S
    """Seconds of each step of a collective that crosses servers."""
    shared_processor: tuple[str, ...] = ()
    """Streams that run one task at a time between them (see the module docs)."""
    facts: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Where the numbers come from: source, assumptions, measurement date, machine."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"name: must be a non-empty string, got {self.name!r}")
        for name in _RATES:
            object.__setattr__(self, name, check_rate(name, getattr(self, name)))
        check_int("ranks_per_server", self.ranks_per_server, 1)
        for name in ("window_host_seconds", *_LATENCIES):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ConfigError(f"{name}: must be a finite number >= 0, got {w!r}")
            object.__setattr__(self, name, float(w))
        shared = self.shared_processor
        if (isinstance(shared, str) or not isinstance(shared, (tuple, list))
                or any(s not in STREAMS for s in shared) or len(set(shared)) != len(shared)):
            raise ConfigError(f"shared_processor: must be distinct stream names from {list(STREAMS)}, got {shared!r}")
        object.__setattr__(self, "shared_processor", tuple(shared))
        if not isinstance(self.facts, Mapping):
            raise ConfigError(f"facts: must be a mapping, got {type(self.facts).__name__}")

    # ------------------------------------------------------------------ per rank

    def sharing(self, world_size: int) -> int:
        """How many ranks share one server's SSD and CPUs: ``min(world_size, ranks_per_server)``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size: must be an integer >= 1, got {world_size!r}")
        return min(world_size, self.ranks_per_server)

    def nvme_read_per_rank(self, world_size: int) -> float:
        return self.nvme_read_bytes_per_s / self.sharing(world_size)

    def nvme_write_per_rank(self, world_size: int) -> float:
        return self.nvme_write_bytes_per_s / self.sharing(world_size)

    def cpu_adam_per_rank(self, world_size: int) -> float:
        return self.cpu_adam_elements_per_s / self.sharing(world_size)

    def host_memory_per_rank(self, world_size: int) -> float:
        return self.host_memory_bytes_per_s / self.sharing(world_size)

    def seconds(self, resource: str, amount: float, tier: str | None, world_size: int) -> float:
        """Seconds one rank spends on ``amount`` of ``resource`` (``pagemem.sched.tasks.RESOURCES``)
        for a task on ``tier``: a collective (``network.COLLECTIVES``; ``amount`` is its bytes per
        rank) as :func:`pagemem.sched.network.collective_seconds` says, anything else at
        :meth:`rate`."""
        if resource in COLLECTIVES:
            return collective_seconds(self, resource, amount, world_size)
        return amount / self.rate(resource, tier, world_size) if amount else 0.0

    def collective_seconds(self, collective: str, nbytes: float, world_size: int) -> float:
        """Seconds of one ``collective`` of ``nbytes`` per rank over ``world_size`` ranks
        (:mod:`pagemem.sched.network`)."""
        return collective_seconds(self, collective, nbytes, world_size)

    def rate(self, resource: str, tier: str | None, world_size: int) -> float:
        """Units per second one rank gets of ``resource`` (``pagemem.sched.tasks.RESOURCES``, less
        the collectives: see :meth:`seconds`) for a task on ``tier``: ``adam`` and ``memory`` on
        the gpu for a gpu task, else the server's CPUs and memory."""
        on_gpu = tier == "gpu"
        rates = {"h2d": self.h2d_bytes_per_s, "d2h": self.d2h_bytes_per_s}
        if resource in rates:
            return rates[resource]
        if resource == "nvme_read":
            return self.nvme_read_per_rank(world_size)
        if resource == "nvme_write":
            return self.nvme_write_per_rank(world_size)
        if resource == "adam":
            return self.gpu_adam_elements_per_s if on_gpu else self.cpu_adam_per_rank(world_size)
        if resource == "memory":
            return self.hbm_bytes_per_s if on_gpu else self.host_memory_per_rank(world_size)
        if resource == "nvme_host":
            return self.nvme_host_bytes_per_s / self.sharing(world_size)
        if resource == "window":  # windows per second of the executor's host time
            return 1.0 / self.window_host_seconds if self.window_host_seconds else math.inf
        raise ConfigError(f"resource: must be one of h2d, d2h, nvme_read, nvme_write, adam, memory, nvme_host, "
                          f"window (collectives: HardwareProfile.seconds); got {resource!r}")

    def cost_model(self) -> CostModel:
        """The roofline model that gives a synthetic trace this GPU's op durations."""
        return CostModel(flops_per_second=self.flops_per_s, bytes_per_second=self.hbm_bytes_per_s)

    def replace(self, **changes: Any) -> "HardwareProfile":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        g = 1e9
        return "\n".join([
            f"hardware profile {self.name!r}, ranks per server: {self.ranks_per_server}",
            f"  per GPU: h2d {self.h2d_bytes_per_s / g:.2f} GB/s, d2h {self.d2h_bytes_per_s / g:.2f} GB/s, "
            f"NVLink {self.nvlink_bytes_per_s / g:.2f} GB/s, Adam {self.gpu_adam_elements_per_s / g:.2f} G el/s, "
            f"{self.flops_per_s / 1e12:.3g} TFLOP/s, memory {self.hbm_bytes_per_s / g:.1f} GB/s, "
            f"compute scale {self.compute_scale:g}",
            f"  per server: nvme read {self.nvme_read_bytes_per_s / g:.2f} GB/s, write "
            f"{self.nvme_write_bytes_per_s / g:.2f} GB/s, CPU Adam {self.cpu_adam_elements_per_s / g:.2f} G el/s, "
            f"memory {self.host_memory_bytes_per_s / g:.1f} GB/s, disk I/O on the CPU {self.nvme_host_bytes_per_s / g:.2f} GB/s, "
            f"NICs {self.internode_bytes_per_s / g:.2f} GB/s",
            f"  collectives: {self.collective_latency_s * 1e6:.3g} us per call, "
            f"{self.internode_latency_s * 1e6:.3g} us per step across servers",
            f"  executor host time per moved window: {self.window_host_seconds * 1e3:.3g} ms",
            *([f"  one processor, one task at a time: {', '.join(self.shared_processor)}"]
              if self.shared_processor else []),
        ])

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready values: every field by its name (``pagemem.plain``)."""
        return {"format": FORMAT, "version": VERSION, **to_plain(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ConfigError(f"not a pagemem hardware profile (format {data.get('format') if isinstance(data, Mapping) else None!r})")
        if data.get("version") == 1:
            raise ConfigError("hardware profile version 1 has no host_memory_bytes_per_s (bytes read + written per "
                              "second by a host copy_): measure the machine again with `pagemem profile`, or add "
                              "that field and set version 2")
        if data.get("version") == 2:
            data = _from_version_2(data)
        if data.get("version") == 3:
            data = _from_version_3(data)
        if data.get("version") != VERSION:
            raise ConfigError(f"hardware profile version {data.get('version')!r} is not supported "
                              f"(this pagemem reads 2 to {VERSION})")
        missing = [n for n in ("name", *_RATES) if n not in data and n != "compute_scale"]
        if missing:
            raise ConfigError(f"hardware profile: missing field(s) {missing}")
        return from_plain(cls, {k: v for k, v in data.items() if k not in ("format", "version")}, "hardware profile")

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HardwareProfile":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @staticmethod
    def builtin_names() -> list[str]:
        """Names :meth:`builtin` accepts: ``a100-server`` and every JSON file in ``profiles/``."""
        files = [f[:-5] for f in os.listdir(PROFILES_DIR) if f.endswith(".json")] if os.path.isdir(PROFILES_DIR) else []
        return sorted(set(files) | {"a100-server"})

    @classmethod
    def builtin(cls, name: str) -> "HardwareProfile":
        """A shipped profile by name (``"a100-server"``, ``"dev-vm"``)."""
        if name == "a100-server":
            return cls.a100_server()
        path = os.path.join(PROFILES_DIR, f"{name}.json") if isinstance(name, str) else ""
        if not path or os.sep in name or not os.path.isfile(path):
            raise ConfigError(f"profile: no built-in profile {name!r}; built-in: {cls.builtin_names()}")
        return cls.load(path)

    # ------------------------------------------------------------------ the paper's server

    @classmethod
    def a100_server(cls) -> "HardwareProfile":
        """The A100 server of ANGEL-PTM §5-6: 8 A100-40GB on NVLink-3, PCIe 32 GB/s, 16 x 12.5 GB/s
        RoCE NICs, SSD 3.5 GB/s, 2 x 48-core EPYC 7K62 with 32 x 32 GB DDR4-2933.

        The paper gives the bandwidths; everything else is an assumption, stated in ``facts``:

        - PCIe: 32 GB/s per GPU in each direction at once (PCIe 4.0 x16). On a DGX-style board
          two GPUs share one switch uplink, which would halve it when both copy.
        - Network: inside a server NVLink-3, 12 links x 25 GB/s per direction = 300 GB/s of bus
          bandwidth per A100 (the nominal figure, as for PCIe and the NICs; the paper's "600 GB/s"
          of §4.3 is the same links counted both ways). Across servers the 16 x 12.5 GB/s RoCE
          NICs of §6.1, 200 GB/s per server (the "GPU-GPU communication 200 GB/s" of §4.2).
          Latencies: the module defaults (10 us per call, 5 us per step across servers).
        - SSD: 3.5 GB/s read and write per server (the paper's one "peak" figure for both).
        - GPU compute: 60% of the A100's 312 TFLOP/s dense bf16 peak (187 TFLOP/s), a typical
          sustained rate for large GEMMs; HBM at 85% of 1555 GB/s.
        - GPU Adam: memory-bound at 26 bytes per element at that HBM rate.
        - CPU Adam: memory-bound at 26 bytes per element. Table 3 lists 4 x EPYC 7K62, but EPYC
          Rome runs at most two sockets; 32 DIMMs fill 2 sockets x 8 channels x 2 DIMMs, so 16
          channels of DDR4-2933 (375 GB/s peak). A fused CPU Adam is assumed to sustain 60% of
          that: 225 GB/s / 26 B = 8.7 G elements/s for the server; a host copy sustains the same
          225 GB/s (read + written).
        """
        hbm = 0.85 * 1555e9
        dram = 16 * 2933e6 * 8  # channels x transfers/s x 8 bytes
        return cls(
            name="a100-server",
            h2d_bytes_per_s=32e9,
            d2h_bytes_per_s=32e9,
            nvlink_bytes_per_s=12 * 25e9,
            internode_bytes_per_s=16 * 12.5e9,
            nvme_read_bytes_per_s=3.5e9,
            nvme_write_bytes_per_s=3.5e9,
            cpu_adam_elements_per_s=0.6 * dram / ADAM_BYTES_PER_ELEMENT,
            gpu_adam_elements_per_s=hbm / ADAM_BYTES_PER_ELEMENT,
            flops_per_s=0.6 * 312e12,
            hbm_bytes_per_s=hbm,
            host_memory_bytes_per_s=0.6 * dram,
            nvme_host_bytes_per_s=40e9,
            ranks_per_server=8,
            collective_latency_s=DEFAULT_COLLECTIVE_LATENCY_S,
            internode_latency_s=DEFAULT_INTERNODE_LATENCY_S,
            facts={
                "source": "ANGEL-PTM (VLDB 2023) §4.2-4.3, §5, §6.1 and Table 3; NVIDIA's A100 datasheet "
                          "(NVLink-3); assumptions below",
                "given": {
                    "h2d_bytes_per_s": "PCIe 32 GB/s (§4.3, §6.1)",
                    "d2h_bytes_per_s": "PCIe 32 GB/s (§4.3, §6.1)",
                    "nvlink_bytes_per_s": "GPUs in a server on NVLink-3 (§6.1): 12 links x 25 GB/s per direction "
                                          "per A100 (NVIDIA's datasheet: 600 GB/s both ways, the '600 GB/s' of §4.3)",
                    "internode_bytes_per_s": "servers on RoCE, 16 NICs, 200 GB/s in total (16 x 12.5 GB/s, §6.1); the "
                                             "'GPU-GPU communication 200 GB/s' of §4.2",
                    "nvme_read_bytes_per_s": "SSD peak 3.5 GB/s (§4.3, §6.1)",
                    "nvme_write_bytes_per_s": "SSD peak 3.5 GB/s (§4.3, §6.1)",
                },
                "assumed": {
                    "h2d/d2h": "per GPU, both directions at once (PCIe 4.0 x16); a shared switch uplink would halve it",
                    "nvlink_bytes_per_s": "nominal: nccl-tests measure less (about 230-240 GB/s all-reduce busbw on "
                                          "8 A100s); §4.3's '600 GB/s GPU memory access' matches NVLink-3's two-way "
                                          "figure, not HBM (1555 GB/s)",
                    "internode_bytes_per_s": "nominal line rate, one direction, shared by the server's 8 ranks; a ring "
                                             "leaves each server once per channel, so a ring across servers runs at "
                                             "min(NVLink, NICs) (pagemem.sched.network)",
                    "collective_latency_s": "10 us per NCCL call (launch and synchronisation): assumed",
                    "internode_latency_s": "5 us per step across servers (NIC, switch, NCCL's proxy): assumed",
                    "nvme": "one array per server, 3.5 GB/s both ways, shared by its 8 ranks",
                    "flops_per_s": "60% of the A100's 312 TFLOP/s dense bf16 peak",
                    "hbm_bytes_per_s": "85% of the A100-40GB's 1555 GB/s",
                    "gpu_adam_elements_per_s": "memory-bound: hbm_bytes_per_s / 26 bytes per element",
                    "host_memory_bytes_per_s": "60% of 16 channels x DDR4-2933 (375 GB/s)",
                    "nvme_host_bytes_per_s": "XXH3 at about 20 GB/s per core, two of the 96 cores busy with disk I/O: "
                                            "not a limit next to the 3.5 GB/s SSD",
                    "window_host_seconds": "0: the host queues the executor's work ahead of the GPU",
                    "cpu_adam_elements_per_s": "memory-bound: 60% of 16 channels x DDR4-2933 (375 GB/s) / 26 bytes "
                                               "per element; Table 3's '4 x EPYC 7K62' read as 2 sockets (Rome is "
                                               "at most 2P; 32 DIMMs = 2 sockets x 8 channels x 2)",
                },
            },
        )


def _from_version_2(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-2 profile as version 3: its ``ssd_*`` keys renamed (:data:`LEGACY_NAMES`), its
    stream ``"ssd"`` called ``"nvme"``; ``facts`` are kept as written."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        new = LEGACY_NAMES.get(key, key)
        if new in out or (new != key and new in data):
            raise ConfigError(f"hardware profile version 2: both {key!r} and {new!r} given")
        out[new] = value
    shared = out.get("shared_processor")
    if isinstance(shared, (list, tuple)):
        out["shared_processor"] = ["nvme" if s == "ssd" else s for s in shared]
    out["version"] = 3
    return out


def _from_version_3(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-3 profile as version 4, its network unchanged: version 3's one
    ``network_bytes_per_s`` (bus bandwidth per GPU: a collective over W ranks on S bytes took
    ``(W - 1) * S / network_bytes_per_s``, whatever servers they spanned) becomes both
    ``nvlink_bytes_per_s`` and ``internode_bytes_per_s``, with no latencies; the ring then takes
    exactly that time and the tree never less (:mod:`pagemem.sched.network`)."""
    out = dict(data)
    new = [k for k in ("nvlink_bytes_per_s", "internode_bytes_per_s", *_LATENCIES) if k in out]
    if new:
        raise ConfigError(f"hardware profile version 3: {new[0]!r} is a version-4 field (set version 4)")
    if "network_bytes_per_s" not in out:
        raise ConfigError("hardware profile: missing field(s) ['network_bytes_per_s'] (version 3)")
    bus = check_rate("network_bytes_per_s", out.pop("network_bytes_per_s"))
    out.update(nvlink_bytes_per_s=bus, internode_bytes_per_s=bus, collective_latency_s=0.0, internode_latency_s=0.0)
    out["version"] = VERSION
    return out
