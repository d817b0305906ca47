"""The CUDA code path (events for gpu_time, allocator for non-model memory), run on any machine.

The real path is ``test_tracer_gpt.py::test_cuda_times_and_allocator_memory`` (needs a GPU). Here
``torch.cuda``'s event and memory-statistics functions are replaced by deterministic stand-ins so
the wiring (which number lands in which field) is checked where no GPU exists.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tracer_helpers import gpt_step, make_gpt
from pagemem.tracer import api, trace


class FakeEvent:
    clock = itertools.count()

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: int | None = None

    def record(self, stream=None) -> None:
        self.t = next(FakeEvent.clock)

    def elapsed_time(self, end: "FakeEvent") -> float:
        return float(end.t - self.t) * 2.0  # 2 ms per tick


class FakeAllocator:
    def __init__(self) -> None:
        self.calls = 0
        self.resets = 0

    def max_memory_allocated(self, device=None) -> int:
        self.calls += 1
        return 10_000_000 + 1000 * self.calls

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    alloc = FakeAllocator()
    monkeypatch.setattr(api, "_cuda_device_of", lambda devices: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", alloc.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", alloc.reset_peak_memory_stats)
    return alloc


def test_gpu_times_and_allocator_memory_land_in_the_records(fake_cuda):
    model = make_gpt()
    tr = trace(model, gpt_step(model), torch.optim.AdamW(model.parameters()))
    assert tr.meta["non_model_memory"] == "cuda_allocator"
    # every op spans one event tick (2 ms) and its duration is the GPU time, not the host time
    assert all(o.gpu_time == 2e-3 and o.duration == o.gpu_time for o in tr.ops)
    assert all(o.cpu_time is not None for o in tr.ops)
    # non-model bytes come from the allocator's peak since the previous op (model states are on
    # the CPU here, so nothing is subtracted), one probe and one reset per op
    values = [o.non_model_bytes for o in tr.ops]
    assert values == sorted(values) and values[0] > 10_000_000
    assert fake_cuda.calls == len(tr.ops) and fake_cuda.resets == len(tr.ops) + 1
    acts = tr.of_kind("activation")
    assert all(a.gpu_time == 2e-3 for a in acts)
