"""The tracer: record every tensor's lifetime in one warm-up training iteration.

>>> from pagemem.tracer import trace, synthetic_transformer, Trace
>>> tr = trace(model, step)          # step() runs one forward + backward of model
>>> tr.tensors, tr.ops, tr.layers, tr.fingerprint
>>> tr.save("trace.json"); Trace.load("trace.json"); tr.to_chrome("trace.chrome.json")
>>> synthetic_transformer(layers=96, hidden=12288, heads=96, seq=2048, batch=1)  # no model needed

Design, in short (details in each module):

- Logical time (:mod:`~pagemem.tracer.records`): ops are numbered ``0 .. len(tr.ops) - 1`` in the
  order seen (module forward pre/post; backward pre/post of leaf modules and of modules owning
  parameters; gradient ready; optimizer step); every id in a record is an op id. The numbering is
  an :class:`~pagemem.tracer.clock.OpClock`'s, the hook set an executor subscribes to as well, so
  that it fires a plan's tasks at the very op ids the trace has. An op's
  ``duration`` is the time until the next op. A tensor lists every op that accesses it, not only
  the first and last.
- What counts as an access (:mod:`~pagemem.tracer.recorder`): a module's own parameters at every
  op of its forward and backward windows; saved-for-backward tensors where saved and unpacked.
  A traced activation's first access is where autograd saved it, which can be one op after the
  op that computed it.
- Non-model memory per op: on CUDA the peak of ``torch.cuda.memory_allocated`` during the op less
  the parameters, gradients and optimizer states on the device (tracing resets the CUDA peak
  statistics); without CUDA the bytes of saved-for-backward storages alive during the op, plus a
  module's unsaved outputs at its ``forward_post`` -- a lower bound, since temporaries inside an
  op and activation gradients are invisible there. ``tr.meta["non_model_memory"]`` says which.
- Optimizer states: a traced optimizer step records the optimizer's real state tensors; without
  one, ``TraceOptions.optimizer_model`` ("adam", the default) adds mixed-precision Adam states and
  a modelled ``step`` op (:mod:`~pagemem.tracer.optstate`), as synthetic traces do.
- Layers (:mod:`~pagemem.tracer.layers`): transformer blocks and other parameter groups, ordered
  by first use; tied weights belong to the layer that uses them first.
- On ``meta`` (:mod:`~pagemem.tracer.metaguard`): a model built under ``torch.device("meta")``
  traces as its cpu twin does, without memory for its values (storages are told apart by
  identity, :mod:`~pagemem.tracer.storages`); code that needs values raises :class:`TraceError`.
- Synthetic traces (:mod:`~pagemem.tracer.synthetic`): ANGEL-PTM Table 1 mapped onto
  :class:`pagemem.models.GPT`, same op sequence and model states as tracing it, with or without
  activation checkpointing (``checkpoint_activations=True``: block inputs kept, blocks recomputed in
  backward); durations from a roofline :class:`CostModel`.

The tracer imports only ``pagemem.errors``, ``pagemem.units`` and ``pagemem.models`` from the
rest of pagemem.
"""

from pagemem.tracer.api import Recording, TraceOptions, trace
from pagemem.tracer.clock import Op, OpClock
from pagemem.tracer.compare import TraceComparison
from pagemem.tracer.cost import CostModel
from pagemem.tracer.errors import TraceError
from pagemem.tracer.live import SavedTensor
from pagemem.tracer.records import Layer, OpRecord, TensorRecord
from pagemem.tracer.synthetic import TransformerShape, synthetic_from_config, synthetic_transformer
from pagemem.tracer.tracedata import Trace

__all__ = [
    "Recording",
    "SavedTensor",
    "trace",
    "TraceOptions",
    "OpClock",
    "Op",
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
