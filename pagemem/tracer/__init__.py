"""The tracer: record every tensor's lifetime in one warm-up training iteration.

>>> from pagemem.tracer import trace, synthetic_transformer, Trace
>>> tr = trace(model, step)          # step() runs one forward + backward of model
>>> tr.tensors, tr.ops, tr.layers, tr.fingerprint
>>> tr.save("trace.json"); Trace.load("trace.json"); tr.to_chrome("trace.chrome.json")
>>> synthetic_transformer(layers=96, hidden=12288, heads=96, seq=2048, batch=1)  # no model needed

Logical time: ops are numbered ``0 .. len(tr.ops) - 1``; every id in a record is an op id (see
:mod:`pagemem.tracer.records`). The tracer imports only ``pagemem.errors``, ``pagemem.units``
and ``pagemem.models`` from the rest of pagemem.
"""

from pagemem.tracer.api import TraceOptions, trace
from pagemem.tracer.compare import TraceComparison
from pagemem.tracer.cost import CostModel
from pagemem.tracer.errors import TraceError
from pagemem.tracer.records import Layer, OpRecord, TensorRecord
from pagemem.tracer.synthetic import TransformerShape, synthetic_from_config, synthetic_transformer
from pagemem.tracer.tracedata import Trace

__all__ = [
    "trace",
    "TraceOptions",
    "synthetic_transformer",
    "synthetic_from_config",
    "TransformerShape",
    "Trace",
    "TensorRecord",
    "OpRecord",
    "Layer",
    "TraceComparison",
    "CostModel",
    "TraceError",
]
