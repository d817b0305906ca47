"""``bench_offload.py --largest``: the search for the most layers a system trains, against a
stand-in probe (a device call has minutes for it, so it must never probe a size twice and must
find the largest size in ``[1, --max-layers]`` whatever ``--start-layers`` is)."""

from __future__ import annotations

import os
import sys
import types

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import bench_offload  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 600), start=st.integers(1, 64), most=st.integers(1, 512))
def test_the_search_finds_the_largest_that_trains_up_to_the_cap_probing_each_size_once(limit, start, most):
    calls: list[int] = []

    def probe(args, spec, system, n):
        calls.append(n)
        return n <= limit

    saved = bench_offload.probe, bench_offload.machine_limit_params, bench_offload.gpt_config, bench_offload.table
    bench_offload.probe = probe
    bench_offload.machine_limit_params = lambda spec: 0
    bench_offload.gpt_config = lambda spec: types.SimpleNamespace(param_count=lambda: spec["shape"]["layers"])
    bench_offload.table = lambda *a, **k: ""
    try:
        args = types.SimpleNamespace(systems=["x"], start_layers=start, max_layers=most, hidden=64)
        found = bench_offload.largest(args, {"shape": {}, "offload": "cpu"})["largest"]["x"]["layers"]
    finally:
        bench_offload.probe, bench_offload.machine_limit_params, bench_offload.gpt_config, bench_offload.table = saved
    assert found == min(limit, most)
    assert len(calls) == len(set(calls)) and max(calls) <= most
