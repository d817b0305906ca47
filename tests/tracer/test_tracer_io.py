"""Trace files (versioned JSON, Chrome trace events), fingerprints and comparison."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tracer_helpers import gpt_step
from pagemem.tracer import Trace, TraceError, synthetic_transformer, trace


def test_traced_trace_round_trips_exactly(tiny, tmp_path):
    tr = trace(tiny, gpt_step(tiny), torch.optim.AdamW(tiny.parameters()))
    tr.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert back == tr
    assert back.fingerprint == tr.fingerprint
    assert [o.duration for o in back.ops] == [o.duration for o in tr.ops]  # floats bit-exact
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["format"] == "pagemem-trace" and data["version"] == 1


def test_unknown_or_broken_files_get_clear_errors(tmp_path):
    tr = synthetic_transformer(layers=1, hidden=16, heads=2, seq=4, batch=1, vocab=32)
    good = tr.to_dict()
    cases = {
        "version": ({**good, "version": 2}, "version 2"),
        "format": ({**good, "format": "other"}, "not a pagemem trace"),
        "columns": ({**good, "ops": {"columns": ["op_id"], "rows": []}}, "columns"),
        "rows": ({**good, "layers": {"columns": good["layers"]["columns"], "rows": [[0]]}}, "rows"),
    }
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(TraceError, match=match):
            Trace.load(path)
    bad_access = json.loads(json.dumps(good))
    bad_access["tensors"]["rows"][0][6] = [5, 3]
    with pytest.raises(TraceError, match="accesses must increase"):
        Trace.from_dict(bad_access)
    bad_layer = json.loads(json.dumps(good))
    bad_layer["layers"]["rows"][0][2] = []
    with pytest.raises(TraceError, match="layer"):
        Trace.from_dict(bad_layer)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TraceError, match="not a JSON file"):
        Trace.load(tmp_path / "junk.json")


def test_chrome_export(tiny, tmp_path):
    tr = trace(tiny, gpt_step(tiny))
    tr.to_chrome(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["op_id"] for e in slices] == list(range(len(tr.ops)))
    assert all(b["ts"] >= a["ts"] for a, b in zip(slices, slices[1:]))
    assert all(e["dur"] == pytest.approx(op.duration * 1e6) for e, op in zip(slices, tr.ops))
    counters = [e for e in data["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == len(tr.ops)
    assert max(c["args"]["non_model"] for c in counters) == pytest.approx(tr.peak_non_model_bytes / 2**20)
    assert data["otherData"]["fingerprint"] == tr.fingerprint


class Dynamic(nn.Module):
    """Skips its middle block when ``skip`` is set: control flow that changes between iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = torch.tanh(block(x))
        return x.square().mean()


def test_changed_control_flow_changes_the_fingerprint():
    torch.manual_seed(0)
    model = Dynamic()
    x = torch.randn(4, 8)
    full = trace(model, lambda: model(x).backward())
    again = trace(model, lambda: model(x).backward())
    model.skip = True
    skipped = trace(model, lambda: model(x).backward())
    assert full.fingerprint == again.fingerprint != skipped.fingerprint
    cmp = full.compare(skipped)
    assert not cmp.same_access_order and not cmp.holds
    first_skipped = next(o.op_id for o in full.ops if o.module == "blocks.1")
    assert cmp.first_divergent_op == first_skipped
    assert "blocks.1" in cmp.reason or "blocks.2" in cmp.reason
    # the skipped block's parameters are never touched; they still belong to a layer
    w = skipped.tensor("blocks.1.weight")
    assert w.accesses == (skipped.ops[-1].op_id,)  # only the (modelled) optimizer step
    assert skipped.layers[-1].name == "blocks.1"


def test_fingerprint_ignores_timing_but_not_shapes():
    a = synthetic_transformer(layers=2, hidden=64, heads=4, seq=16, batch=2, vocab=128)
    b = synthetic_transformer(layers=2, hidden=64, heads=4, seq=16, batch=4, vocab=128)
    c = synthetic_transformer(layers=2, hidden=128, heads=4, seq=16, batch=2, vocab=128)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert "model states differ" in a.compare(c).reason
    assert a.compare(b).non_model_ratio > 1.5 and not a.compare(b).holds
    assert a.compare(b, tolerance=10).holds
