"""A roofline-style time estimate for operations that were not measured.

Synthetic traces (and a modelled optimizer step in a traced one) need per-op durations for the
scheduler's simulator. Each op is charged ``max(flops / flops_per_second, bytes /
bytes_per_second)``: matrix multiplies are compute-bound, normalisation, element-wise ops and the
optimizer step are memory-bound. The defaults describe an A100-class GPU at a realistic
utilisation: 100 TFLOP/s of fp16 tensor-core work (about a third of its 312 TFLOP/s peak) and
1.5 TB/s of HBM bandwidth. Pass your own :class:`CostModel` to model other hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagemem.checks import check_rate


@dataclass(frozen=True)
class CostModel:
    """Throughputs used to turn FLOPs and bytes moved into seconds."""

    flops_per_second: float = 100e12
    """Sustained matrix-multiply throughput (FLOP/s)."""
    bytes_per_second: float = 1.5e12
    """Sustained memory bandwidth (bytes/s)."""

    def __post_init__(self) -> None:
        for name in ("flops_per_second", "bytes_per_second"):
            check_rate(name, getattr(self, name))

    def seconds(self, flops: float = 0.0, nbytes: float = 0.0) -> float:
        """Estimated seconds of an op doing ``flops`` and moving ``nbytes``."""
        return max(flops / self.flops_per_second, nbytes / self.bytes_per_second)

    def adam_step_seconds(self, param_bytes: int, grad_bytes: int, state_bytes: int) -> float:
        """An Adam step reads the gradient, reads and writes the parameter and every state:
        about 28 bytes per fp32 element (memory-bound)."""
        return self.seconds(nbytes=2 * param_bytes + grad_bytes + 2 * state_bytes)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
