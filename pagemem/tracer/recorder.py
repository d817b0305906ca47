"""Logical time and access bookkeeping, shared by the live tracer and the synthetic builder.

The recorder knows nothing about torch modules or hooks: callers tell it that an op began, that
a module's forward or backward window opened or closed, that an activation was saved, used or
released. It keeps, per parameter, gradient and activation, the sorted list of op ids that
touched it, and per op its timing and the non-model bytes live during it.

Access rules (the same for traced and synthetic traces):

- while a module's forward runs (``forward_pre`` .. ``forward_post``) every op touches the
  parameters the module owns directly; while its backward runs (``backward_pre`` ..
  ``backward_post``) every op touches those parameters and their gradients;
- saving a parameter for backward touches it; unpacking it in backward touches it and its
  gradient; ``grad_ready`` touches the gradient; ``step`` touches what the optimizer updates;
- an activation is touched where it is saved and where it is unpacked.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence


def _touch(acc: list[int], op: int) -> None:
    if not acc or acc[-1] != op:
        acc.append(op)


@dataclass(slots=True)
class ActivationLog:
    """An activation as the recorder sees it: metadata plus its access list."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    accesses: list[int] = field(default_factory=list)


class Recorder:
    """Op log plus per-tensor access lists. ``timed`` records ``time.perf_counter`` at each op
    and, with ``cuda_device`` set, a CUDA event per op boundary."""

    def __init__(self, n_params: int, grad_params: Sequence[bool], *, timed: bool = False,
                 cuda_device: object | None = None) -> None:
        self.op_event: list[str] = []
        self.op_module: list[str] = []
        self.op_phase: list[str] = []
        self.op_non_model: list[int] = []
        self.op_start: list[float] = []
        self.op_end: list[float | None] = []
        self.cuda_start: list[object] = []
        self.cuda_end: list[object | None] = []
        self.param_acc: list[list[int]] = [[] for _ in range(n_params)]
        self.grad_acc: list[list[int] | None] = [[] if g else None for g in grad_params]
        self.acts: list[ActivationLog] = []
        self._live: dict[Hashable, list[int]] = {}  # key -> [activation index, refcount]
        self.live_bytes = 0
        self._peak = 0
        self._released: list[Hashable] = []
        self._fwd: list[tuple[int, tuple[int, ...], bool]] = []  # (module key, params, in backward)
        self._bwd: dict[int, tuple[int, ...]] = {}  # open backward windows: key -> params
        self._act_op = -1
        self._act_k = 0
        self._timed = timed
        self._cuda = cuda_device
        self.probe: Callable[[], int] | None = None
        """If set, called at each op boundary; returns the non-model bytes of the op just ended
        (the CUDA allocator path). Otherwise the saved-tensor bytes tracked here are used."""
        self.lock = threading.RLock()

    # ---- ops -------------------------------------------------------------------------------
    @property
    def n_ops(self) -> int:
        return len(self.op_event)

    def begin_op(self, event: str, module: str, phase: str) -> int:
        """Start a new op, close the previous one, and touch everything in an open window."""
        now = time.perf_counter() if self._timed else 0.0
        op = len(self.op_event)
        boundary = self._close_previous(now) if op else None
        self._drain()
        self._peak = self.live_bytes
        self.op_event.append(event)
        self.op_module.append(module)
        self.op_phase.append(phase)
        self.op_non_model.append(0)
        self.op_start.append(now)
        self.op_end.append(None)
        if self._cuda is not None:  # one event marks both the end of the last op and this start
            self.cuda_start.append(boundary if boundary is not None else _cuda_event(self._cuda))
            self.cuda_end.append(None)
        for _, params, _ in self._fwd:
            pa = self.param_acc
            for i in params:
                _touch(pa[i], op)
        for params in self._bwd.values():
            self._touch_params(params, op, grads=True)
        return op

    def end_op(self) -> None:
        """Mark the current op as finished now (work after it belongs to no op)."""
        if self.op_event and self.op_end[-1] is None:
            self._close_previous(time.perf_counter() if self._timed else 0.0)

    def _close_previous(self, now: float) -> object | None:
        """End the last op at ``now``; returns the CUDA event recorded for it (if any)."""
        last = len(self.op_event) - 1
        if self.op_end[last] is not None:
            return None
        self.op_end[last] = now
        event = None
        if self._cuda is not None:
            event = self.cuda_end[last] = _cuda_event(self._cuda)
        self.op_non_model[last] = self.probe() if self.probe is not None else self._peak
        return event

    # ---- module windows --------------------------------------------------------------------
    def forward_enter(self, key: int, params: tuple[int, ...], in_backward: bool) -> None:
        """A module owning ``params`` started its forward (touches them at the current op)."""
        self._fwd.append((key, params, in_backward))
        op = len(self.op_event) - 1
        for i in params:
            _touch(self.param_acc[i], op)

    def forward_exit(self, key: int) -> None:
        """The module's forward finished; windows opened above it (and never closed) go too."""
        stack = self._fwd
        for pos in range(len(stack) - 1, -1, -1):
            if stack[pos][0] == key:
                del stack[pos:]
                return

    def drop_recompute_windows(self) -> None:
        """Close forward windows opened during backward (a recomputation that stopped early)."""
        if self._fwd and self._fwd[-1][2]:
            self._fwd[:] = [w for w in self._fwd if not w[2]]

    def backward_enter(self, key: int, params: tuple[int, ...]) -> None:
        self._bwd[key] = params
        self._touch_params(params, len(self.op_event) - 1, grads=True)

    def backward_exit(self, key: int) -> None:
        self._bwd.pop(key, None)

    def close_windows(self) -> None:
        self._fwd.clear()
        self._bwd.clear()

    # ---- parameters and gradients ----------------------------------------------------------
    def touch_params(self, params: Sequence[int], grads: bool = False) -> None:
        if self.op_event:
            self._touch_params(params, len(self.op_event) - 1, grads)

    def _touch_params(self, params: Sequence[int], op: int, grads: bool) -> None:
        pa = self.param_acc
        for i in params:
            _touch(pa[i], op)
        if grads:
            ga = self.grad_acc
            for i in params:
                g = ga[i]
                if g is not None:
                    _touch(g, op)

    def touch_grad(self, i: int) -> None:
        g = self.grad_acc[i]
        if g is not None and self.op_event:
            _touch(g, len(self.op_event) - 1)

    # ---- activations -----------------------------------------------------------------------
    def save_activation(self, key: Hashable, module: str, dtype: str, shape: tuple[int, ...],
                        nbytes: int, name: str | None = None) -> None:
        """An activation (keyed by its storage) was saved for backward at the current op.
        Its name defaults to ``<module>@<op>.<k>``."""
        if self._released:
            self._drain()
        op = len(self.op_event) - 1
        entry = self._live.get(key)
        if entry is not None:
            entry[1] += 1
            _touch(self.acts[entry[0]].accesses, op)
            return
        if name is None:
            if self._act_op != op:
                self._act_op, self._act_k = op, 0
            name = f"{module or '<model>'}@{op}.{self._act_k}"
            self._act_k += 1
        self._live[key] = [len(self.acts), 1]
        self.acts.append(ActivationLog(name, dtype, shape, nbytes, [op]))
        self.live_bytes += nbytes
        if self.live_bytes > self._peak:
            self._peak = self.live_bytes

    def use_activation(self, key: Hashable) -> None:
        entry = self._live.get(key)
        if entry is not None and self.op_event:
            _touch(self.acts[entry[0]].accesses, len(self.op_event) - 1)

    def is_live(self, key: Hashable) -> bool:
        """Whether an activation with this key is currently saved."""
        return key in self._live

    def release_activation(self, key: Hashable) -> None:
        """One saved reference went away. Safe to call from ``__del__`` (deferred)."""
        self._released.append(key)

    def transient(self, nbytes: int) -> None:
        """Bytes live at the current op on top of the saved activations (e.g. a module output)."""
        if self.live_bytes + nbytes > self._peak:
            self._peak = self.live_bytes + nbytes

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` as live from the current op on, without a tensor record (negative:
        stop counting them). For memory a synthetic trace models but no record describes, e.g.
        the activations a checkpointed block recomputes, which the checkpoint (not autograd's
        saved-tensor hooks) keeps."""
        self.live_bytes += nbytes
        if self.live_bytes > self._peak:
            self._peak = self.live_bytes

    def _drain(self) -> None:
        released = self._released
        while released:
            key = released.pop()
            entry = self._live.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._live[key]
                self.live_bytes -= self.acts[entry[0]].nbytes

    # ---- results ---------------------------------------------------------------------------
    def finish(self) -> None:
        """Close the last op and every open window."""
        self.end_op()
        self.close_windows()

    def cpu_durations(self) -> list[float]:
        return [(e if e is not None else s) - s for s, e in zip(self.op_start, self.op_end)]

    def gpu_durations(self) -> list[float] | None:
        """Seconds between each op's CUDA events (synchronizes the device)."""
        if self._cuda is None:
            return None
        import torch

        torch.cuda.synchronize(self._cuda)
        return [s.elapsed_time(e) / 1e3 if e is not None else 0.0  # type: ignore[attr-defined]
                for s, e in zip(self.cuda_start, self.cuda_end)]


def _cuda_event(device: object) -> object:
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))  # type: ignore[arg-type]
    return ev
