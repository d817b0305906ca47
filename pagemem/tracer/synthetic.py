"""The trace of a GPT-style transformer from its configuration alone, without running it.

Parameters, gradients and optimizer states are those of :class:`pagemem.models.GPT` (same names,
shapes and order, so byte counts equal a traced ``GPT`` exactly). The op sequence is the one the
tracer records for that model. Activations follow ANGEL-PTM Table 1, one record per row and
layer, mapped onto the pre-LayerNorm block (``d`` hidden, ``b*s`` tokens):

======================  ===========================  ========================================
Table 1 row             record (``blocks.i:<row>``)  elements
======================  ===========================  ========================================
LayerNorm               ``ln1``, ``ln2``             ``b*s*d`` each
Linear(Q,K,V)           ``qkv``                      ``3*b*s*d``
MatMul, Scaled-Softmax  ``scores``, ``softmax``      ``b*heads*s*s`` each, ``attention="math"`` only
MatMul                  ``context``                  ``b*s*d``
Add                     ``attn_add``, ``mlp_add``    ``b*s*d`` each
FFN Linear, GeLU        ``fc``, ``gelu``             ``b*s*ffn`` each
Linear (attn, FFN out)  (transient)                  ``b*s*d`` each
======================  ===========================  ========================================

Departures from the table, each because autograd keeps something else: the two Linear outputs
that feed a residual Add are needed by no backward formula (the Add saves nothing; the next
LayerNorm keeps the sum), so they count in ``non_model_bytes`` at the ops that produce and add
them but are not saved activations. Table 1 writes the score terms as ``4bs^2`` bytes without
the head count; materialised scores have ``b*heads*s*s`` elements. Fused (flash) attention, the
default, keeps no score matrix. Table 1 leaves out embeddings and the loss; added here:
``tokens``, ``targets`` and ``positions`` (int64), ``embed`` (the summed embeddings), ``ln_f``
(the head's input) and ``log_probs`` (``b*s*vocab`` fp32, what cross-entropy keeps); the logits
and their gradient add ``b*s*vocab`` elements to ``non_model_bytes`` around the head. LayerNorm
statistics and the attention log-sum-exp (a few bytes per token) are left out.

Each record is created at the op that computes it, touched where it is used, and released after
its backward use. Durations come from :class:`~pagemem.tracer.cost.CostModel` (a roofline
estimate).

Activation checkpointing (``checkpoint_activations=True``, as ``GPT`` with ``GPTConfig.checkpoint_activations`` runs
``torch.utils.checkpoint(block, x, use_reentrant=False)`` per block). Forward saves only each
block's input (``embed``, then ``blocks.i:mlp_add``, the previous block's output, saved at that
block's ``forward_post``); what a block computes inside lives only until Python drops it.
Backward reaches block ``i`` at ``blocks.i.mlp.proj``'s ``backward_pre``: the checkpoint unpacks
the block's input and recomputes the block's forward -- its ``forward_pre``/``forward_post`` ops,
in phase ``backward``, re-accessing its parameters -- up to ``mlp.proj``'s ``forward_pre``, where
the last tensor the block saves (``gelu``) exists again and torch stops early; ``mlp.proj``'s
backward then runs, and the block's input is released after ``ln1``'s backward. The recomputed
activations (Table 1's rows for the block, less ``mlp_add``) count in ``non_model_bytes`` from
their recomputation to their backward use but get no records: the checkpoint keeps them behind
its own saved-tensor hooks, so the live tracer records none either and the two traces' records
agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from pagemem.checks import check_int
from pagemem.errors import ConfigError
from pagemem.models.gpt import GPTConfig
from pagemem.tracer.builder import ParamSpec, StateSpec, build_trace
from pagemem.tracer.cost import CostModel
from pagemem.tracer.optstate import OPTIMIZER_MODELS, itemsize, modelled_states
from pagemem.tracer.recorder import Recorder
from pagemem.tracer.tracedata import Trace

ATTENTION = ("flash", "math")


@dataclass(frozen=True)
class TransformerShape:
    """Configuration of a synthetic trace (validated at construction)."""

    layers: int = 24
    hidden: int = 2304
    ffn: int = 0
    """FFN width; 0 means ``4 * hidden``."""
    heads: int = 24
    seq: int = 1024
    """Tokens per sequence in the traced batch."""
    batch: int = 8
    dtype: str | torch.dtype = "float16"
    """Dtype of parameters, gradients and activations (a ``torch.dtype`` or its name)."""
    vocab: int = 50304
    positions: int = 0
    """Rows of the position embedding (``GPTConfig.seq``); 0 means ``seq``."""
    tie_embeddings: bool = True
    attention: str = "flash"
    """``"flash"``: fused attention keeps no score matrix; ``"math"``: Table 1's two
    ``b*heads*s*s`` tensors are kept."""
    optimizer_model: str = "adam"
    """``"adam"`` (mixed-precision Adam states and a ``step`` op) or ``"none"``."""
    checkpoint_activations: bool = False
    """Activation checkpointing per block (as ``GPTConfig.checkpoint_activations``): forward keeps
    each block's input only; backward recomputes each block's forward before its backward."""
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for name, lo in (("layers", 1), ("hidden", 1), ("heads", 1), ("seq", 1), ("batch", 1),
                         ("vocab", 1), ("ffn", 0), ("positions", 0)):
            check_int(name, getattr(self, name), lo)
        if self.hidden % self.heads:
            raise ConfigError(f"heads: must divide hidden={self.hidden}, got {self.heads}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.positions == 0:
            object.__setattr__(self, "positions", self.seq)
        if self.positions < self.seq:
            raise ConfigError(f"positions: must be >= seq={self.seq}, got {self.positions}")
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype) \
                or not getattr(torch, dtype).is_floating_point:
            raise ConfigError(f"dtype: must be a floating torch dtype, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings: must be True or False, got {self.tie_embeddings!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention: must be one of {ATTENTION}, got {self.attention!r}")
        if self.optimizer_model not in OPTIMIZER_MODELS:
            raise ConfigError(f"optimizer_model: must be one of {OPTIMIZER_MODELS}, got {self.optimizer_model!r}")
        if not isinstance(self.checkpoint_activations, bool):
            raise ConfigError(f"checkpoint_activations: must be True or False, got {self.checkpoint_activations!r}")
        if not isinstance(self.cost, CostModel):
            raise ConfigError(f"cost: must be a CostModel, got {type(self.cost).__name__}")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["cost"] = self.cost.to_dict()
        return d


def synthetic_transformer(layers: int = 24, hidden: int = 2304, ffn: int = 0, heads: int = 24,
                          seq: int = 1024, batch: int = 8, dtype: str | torch.dtype = torch.float16,
                          *, vocab: int = 50304, positions: int = 0, tie_embeddings: bool = True,
                          attention: str = "flash", optimizer_model: str = "adam", checkpoint_activations: bool = False,
                          cost: CostModel | None = None) -> Trace:
    """Trace of one training iteration of a GPT with this shape, built from the configuration
    alone (closed-form footprint of ANGEL-PTM Table 1; see the module docs). Fields are those of
    :class:`TransformerShape`."""
    return build_synthetic(TransformerShape(
        layers=layers, hidden=hidden, ffn=ffn, heads=heads, seq=seq, batch=batch, dtype=dtype, vocab=vocab,
        positions=positions, tie_embeddings=tie_embeddings, attention=attention,
        optimizer_model=optimizer_model, checkpoint_activations=checkpoint_activations,
        cost=cost if cost is not None else CostModel()))


def synthetic_from_config(cfg: GPTConfig, *, batch: int, seq: int | None = None,
                          dtype: str | torch.dtype = torch.float32, attention: str = "flash",
                          optimizer_model: str = "adam", cost: CostModel | None = None) -> Trace:
    """Synthetic trace of ``GPT(cfg)`` on a ``batch x seq`` batch (``seq`` defaults to
    ``cfg.seq``), with activation checkpointing if ``cfg.checkpoint_activations``."""
    if not isinstance(cfg, GPTConfig):
        raise ConfigError(f"cfg: expected a GPTConfig, got {type(cfg).__name__}")
    return synthetic_transformer(cfg.layers, cfg.hidden, cfg.ffn, cfg.heads, seq or cfg.seq, batch, dtype,
                                 vocab=cfg.vocab, positions=cfg.seq, tie_embeddings=cfg.tie_embeddings,
                                 attention=attention, optimizer_model=optimizer_model,
                                 checkpoint_activations=cfg.checkpoint_activations, cost=cost)


def build_synthetic(shape: TransformerShape) -> Trace:
    """Emit the GPT's op sequence into a recorder, as the live tracer would see it."""
    return _Emitter(shape).run()


class _Emitter:
    def __init__(self, shape: TransformerShape) -> None:
        self.shape = shape
        self.dt = str(shape.dtype)
        self.it = itemsize(self.dt)
        d, f, V = shape.hidden, shape.ffn, shape.vocab
        self.specs: list[ParamSpec] = []
        self.index: dict[str, int] = {}
        self.owned: dict[str, tuple[int, ...]] = {}
        self._param("wte", "weight", (V, d))
        self._param("wpe", "weight", (shape.positions, d))
        for i in range(shape.layers):
            p = f"blocks.{i}"
            self._param(f"{p}.ln1", "weight", (d,), "bias", (d,))
            self._param(f"{p}.attn.qkv", "weight", (3 * d, d), "bias", (3 * d,))
            self._param(f"{p}.attn.proj", "weight", (d, d), "bias", (d,))
            self._param(f"{p}.ln2", "weight", (d,), "bias", (d,))
            self._param(f"{p}.mlp.fc", "weight", (f, d), "bias", (f,))
            self._param(f"{p}.mlp.proj", "weight", (d, f), "bias", (d,))
        self._param("ln_f", "weight", (d,), "bias", (d,))
        if shape.tie_embeddings:
            self.owned["head"] = (self.index["wte.weight"],)
        else:
            self._param("head", "weight", (V, d))
        self.rec = Recorder(len(self.specs), [True] * len(self.specs))
        self.est: list[float] = []
        self.keys: dict[str, int] = {}
        self.phase = "forward"
        """Phase of forward ops: ``"backward"`` once backward began (checkpoint recomputation)."""
        self.in_checkpoint = False
        """Inside a checkpointed block: its saved activations are held, not recorded."""
        self.held: dict[str, int] = {}
        """Bytes of what checkpointed blocks hold (see :meth:`keep`), by name."""

    def _param(self, module: str, *pairs: object) -> None:
        owned = []
        for name, shp in zip(pairs[::2], pairs[1::2]):
            full = f"{module}.{name}"
            shp = tuple(shp)  # type: ignore[arg-type]
            self.index[full] = len(self.specs)
            owned.append(len(self.specs))
            self.specs.append(ParamSpec(full, self.dt, shp, math.prod(shp) * self.it, True))
        self.owned[module] = tuple(owned)

    # ---- events ----------------------------------------------------------------------------
    def _op(self, event: str, module: str, phase: str, seconds: float) -> None:
        self.rec.begin_op(event, module, phase)
        self.est.append(seconds)

    def _key(self, module: str) -> int:
        return self.keys.setdefault(module, len(self.keys))

    def fpre(self, module: str, seconds: float = 0.0) -> None:
        self._op("forward_pre", module, self.phase, seconds)
        if module in self.owned:
            self.rec.forward_enter(self._key(module), self.owned[module], self.phase == "backward")

    def fpost(self, module: str, seconds: float = 0.0) -> None:
        self._op("forward_post", module, self.phase, seconds)
        if module in self.owned:
            self.rec.forward_exit(self._key(module))

    def bpre(self, module: str, seconds: float) -> None:
        self.rec.drop_recompute_windows()
        self._op("backward_pre", module, "backward", seconds)
        self.rec.backward_enter(self._key(module), self.owned[module])

    def bpost(self, module: str, seconds: float = 0.0) -> None:
        self.rec.drop_recompute_windows()
        self._op("backward_post", module, "backward", seconds)
        self.rec.backward_exit(self._key(module))

    def ready(self, *names: str) -> None:
        for name in names:
            self.rec.drop_recompute_windows()
            self._op("grad_ready", name, "backward", 0.0)
            self.rec.touch_grad(self.index[name])

    def save(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        dtype = dtype or self.dt
        self.rec.save_activation(name, "", dtype, shape, math.prod(shape) * itemsize(dtype), name=name)

    def keep(self, name: str, shape: tuple[int, ...]) -> None:
        """A block saves ``name`` for backward: a record, or (inside a checkpointed block) bytes
        held without one -- dropped in forward, kept by the checkpoint after recomputation."""
        if self.in_checkpoint:
            self.held[name] = math.prod(shape) * self.it
            self.rec.hold(self.held[name])
        else:
            self.save(name, shape)

    def use(self, *names: str) -> None:
        if self.in_checkpoint:  # the checkpoint's own saved-tensor hooks see these accesses
            return
        for name in names:
            self.rec.use_activation(name)

    def free(self, *names: str) -> None:
        for name in names:
            if name in self.held:
                self.rec.hold(-self.held.pop(name))
            else:
                self.rec.use_activation(name)
                self.rec.release_activation(name)

    # ---- cost helpers ----------------------------------------------------------------------
    def mm(self, k: int, n: int, backward: bool = False) -> float:
        tokens, it, c = self.shape.batch * self.shape.seq, self.it, self.shape.cost
        mult = 2 if backward else 1
        return c.seconds(2 * mult * tokens * k * n, mult * (tokens * k + k * n + tokens * n) * it)

    def mem(self, elements: int, passes: int) -> float:
        return self.shape.cost.seconds(nbytes=elements * passes * self.it)

    # ---- the iteration ---------------------------------------------------------------------
    def block_forward(self, i: int, x: str, recompute: bool = False) -> None:
        """Block ``i``'s forward on input record ``x``; its output is ``blocks.i:mlp_add``.

        Checkpointed (``shape.checkpoint_activations``), the block's saved activations are only held: in
        forward until Python drops them, in a recomputation (``recompute``, phase backward) until
        their backward use. A recomputation stops where the block saves its last tensor (the
        input of ``mlp.proj``), as ``torch.utils.checkpoint`` does (non-reentrant, early stop)."""
        sh, rec = self.shape, self.rec
        b, s, d, f, a = sh.batch, sh.seq, sh.hidden, sh.ffn, sh.heads
        T, it, c = b * s, self.it, sh.cost
        bsd, bsf = (b, s, d), (b, s, f)
        p = f"blocks.{i}"
        scores_bytes = 2 * b * a * s * s * it if sh.attention == "math" else 0
        self.fpre(p)
        self.fpre(f"{p}.ln1", self.mem(T * d, 2))
        self.use(x)
        self.keep(f"{p}:ln1", bsd)
        self.fpost(f"{p}.ln1")
        self.fpre(f"{p}.attn")
        self.fpre(f"{p}.attn.qkv", self.mm(d, 3 * d))
        self.use(f"{p}:ln1")
        self.keep(f"{p}:qkv", (b, s, 3 * d))
        self.fpost(f"{p}.attn.qkv", c.seconds(4 * b * s * s * d, 4 * T * d * it + scores_bytes))
        self.use(f"{p}:qkv")
        if sh.attention == "math":
            self.keep(f"{p}:scores", (b, a, s, s))
            self.keep(f"{p}:softmax", (b, a, s, s))
        self.keep(f"{p}:context", bsd)
        self.fpre(f"{p}.attn.proj", self.mm(d, d))
        self.use(f"{p}:context")
        rec.transient(T * d * it)
        self.fpost(f"{p}.attn.proj")
        rec.transient(T * d * it)
        self.fpost(f"{p}.attn", self.mem(T * d, 3))
        rec.transient(T * d * it)
        self.use(x)
        self.keep(f"{p}:attn_add", bsd)
        if self.in_checkpoint and not recompute:  # attention's inputs and internals die with its call
            self.free(f"{p}:ln1", f"{p}:qkv", f"{p}:context")
            if sh.attention == "math":
                self.free(f"{p}:scores", f"{p}:softmax")
        self.fpre(f"{p}.ln2", self.mem(T * d, 2))
        self.use(f"{p}:attn_add")
        self.keep(f"{p}:ln2", bsd)
        self.fpost(f"{p}.ln2")
        self.fpre(f"{p}.mlp")
        self.fpre(f"{p}.mlp.fc", self.mm(d, f))
        self.use(f"{p}:ln2")
        self.keep(f"{p}:fc", bsf)
        self.fpost(f"{p}.mlp.fc", self.mem(T * f, 2))
        self.use(f"{p}:fc")
        self.keep(f"{p}:gelu", bsf)
        if recompute:  # mlp.proj saves its input: recomputation stops; mlp.proj's backward runs
            self.fpre(f"{p}.mlp.proj", self.mm(f, d, backward=True))
            return
        self.fpre(f"{p}.mlp.proj", self.mm(f, d))
        self.use(f"{p}:gelu")
        rec.transient(T * d * it)
        self.fpost(f"{p}.mlp.proj")
        rec.transient(T * d * it)
        self.fpost(f"{p}.mlp", self.mem(T * d, 3))
        rec.transient(T * d * it)
        self.use(f"{p}:attn_add")
        if not self.in_checkpoint:
            self.save(f"{p}:mlp_add", bsd)
            self.fpost(p)
            return
        self.free(f"{p}:attn_add", f"{p}:ln2", f"{p}:fc", f"{p}:gelu")
        self.in_checkpoint = False
        self.fpost(p)
        self.save(f"{p}:mlp_add", bsd)  # the output, saved as the next checkpoint's (or ln_f's) input

    def block_backward(self, i: int) -> None:
        """Block ``i``'s backward (after recomputing its forward when checkpointed)."""
        sh = self.shape
        b, s, d, f = sh.batch, sh.seq, sh.hidden, sh.ffn
        T, it, c = b * s, self.it, sh.cost
        scores_bytes = 2 * b * sh.heads * s * s * it if sh.attention == "math" else 0
        p = f"blocks.{i}"
        x_in = "embed" if i == 0 else f"blocks.{i - 1}:mlp_add"
        if sh.checkpoint_activations:
            # mlp.proj's backward unpacks a checkpointed tensor: the checkpoint reads its saved
            # input and recomputes the block; mlp.proj's backward runs after that
            self.bpre(f"{p}.mlp.proj", 0.0)
            self.use(x_in)
            self.in_checkpoint = True
            self.block_forward(i, x_in, recompute=True)
            self.in_checkpoint = False
        else:
            self.bpre(f"{p}.mlp.proj", self.mm(f, d, backward=True))
        self.free(f"{p}:gelu")
        self.ready(f"{p}.mlp.proj.bias", f"{p}.mlp.proj.weight")
        self.bpost(f"{p}.mlp.proj", self.mem(T * f, 3))
        self.free(f"{p}:fc")
        self.bpre(f"{p}.mlp.fc", self.mm(d, f, backward=True))
        self.free(f"{p}:ln2")
        self.ready(f"{p}.mlp.fc.bias", f"{p}.mlp.fc.weight")
        self.bpost(f"{p}.mlp.fc")
        self.bpre(f"{p}.ln2", self.mem(T * d, 4))
        self.free(f"{p}:attn_add")
        self.bpost(f"{p}.ln2")
        self.ready(f"{p}.ln2.weight", f"{p}.ln2.bias")
        self.bpre(f"{p}.attn.proj", self.mm(d, d, backward=True))
        self.ready(f"{p}.attn.proj.bias", f"{p}.attn.proj.weight")
        self.bpost(f"{p}.attn.proj", c.seconds(8 * b * s * s * d, 8 * T * d * it + 2 * scores_bytes))
        self.free(f"{p}:qkv", f"{p}:context")
        if sh.attention == "math":
            self.free(f"{p}:scores", f"{p}:softmax")
        self.bpre(f"{p}.attn.qkv", self.mm(d, 3 * d, backward=True))
        self.free(f"{p}:ln1")
        self.ready(f"{p}.attn.qkv.bias", f"{p}.attn.qkv.weight")
        self.bpost(f"{p}.attn.qkv")
        self.bpre(f"{p}.ln1", self.mem(T * d, 4))
        if sh.checkpoint_activations:  # the recomputed ln1 saved the checkpoint's input, which goes with the block
            self.bpost(f"{p}.ln1")
            self.rec.release_activation(x_in)
        else:
            self.free(x_in)
            self.bpost(f"{p}.ln1")
        self.ready(f"{p}.ln1.weight", f"{p}.ln1.bias")

    def run(self) -> Trace:
        sh = self.shape
        b, s, d, V, L = sh.batch, sh.seq, sh.hidden, sh.vocab, sh.layers
        T = b * s
        bsd = (b, s, d)
        rec, c = self.rec, sh.cost
        logits = T * V * self.it

        # forward
        self.fpre("")
        self.fpre("wte", self.mem(T * d, 1))
        self.save("tokens", (b, s), "int64")
        self.fpost("wte")
        self.fpre("wpe", self.mem(s * d, 1))
        self.save("positions", (s,), "int64")
        self.fpost("wpe", self.mem(T * d, 3))
        self.save("embed", bsd)
        x = "embed"
        for i in range(L):
            self.in_checkpoint = sh.checkpoint_activations
            self.block_forward(i, x)
            x = f"blocks.{i}:mlp_add"
        self.fpre("ln_f", self.mem(T * d, 2))
        self.use(x)
        self.save("ln_f", bsd)
        self.fpost("ln_f")
        self.fpre("head", self.mm(d, V))
        self.use("ln_f")
        rec.transient(logits)
        self.fpost("head", c.seconds(nbytes=T * V * (self.it + 8)))
        rec.transient(logits)
        self.save("log_probs", (T, V), "float32")
        self.save("targets", (T,), "int64")
        # backward starts inside the root's forward_post: the loss backward runs there
        self.fpost("", c.seconds(nbytes=2 * T * V * (self.it + 4)))
        rec.transient(T * V * 4 + logits)
        self.free("log_probs", "targets")

        self.phase = "backward"  # forward ops from here on are recomputations
        self.bpre("head", self.mm(d, V, backward=True))
        rec.transient(logits)
        self.free("ln_f")
        self.bpost("head")
        if not sh.tie_embeddings:
            self.ready("head.weight")
        self.bpre("ln_f", self.mem(T * d, 4))
        self.free(x)
        self.bpost("ln_f")
        self.ready("ln_f.weight", "ln_f.bias")
        for i in reversed(range(L)):
            self.block_backward(i)
        self.bpre("wpe", self.mem(T * d + sh.positions * d, 1))
        self.free("positions")
        self.bpost("wpe")
        self.ready("wpe.weight")
        self.bpre("wte", self.mem(T * d + V * d, 1))
        self.free("tokens")
        self.bpost("wte")
        self.ready("wte.weight")

        states: list[StateSpec] = []
        if sh.optimizer_model != "none":
            n = len(self.specs)
            pbytes = sum(sp.nbytes for sp in self.specs)
            sbytes = 0
            self._op("step", "optimizer", "step", 0.0)
            rec.touch_params(range(n), grads=True)
            for i, sp in enumerate(self.specs):
                for st in modelled_states(sh.optimizer_model, sp.dtype, sp.shape):
                    states.append(StateSpec(i, st.key, st.dtype, st.shape, st.nbytes, [rec.n_ops - 1]))
                    sbytes += st.nbytes
            self.est[-1] = c.adam_step_seconds(pbytes, pbytes, sbytes)
        rec.finish()

        candidates = [("wte", [self.index["wte.weight"]]), ("wpe", [self.index["wpe.weight"]])]
        candidates += [(f"blocks.{i}", [self.index[sp.name] for sp in self.specs
                                         if sp.name.startswith(f"blocks.{i}.")]) for i in range(L)]
        candidates.append(("ln_f", [self.index["ln_f.weight"], self.index["ln_f.bias"]]))
        candidates.append(("head", list(self.owned["head"])))
        meta = {
            "source": "synthetic",
            "model": "GPT",
            "device": "none",
            "dtype": self.dt,
            "optimizer": "modelled adam" if sh.optimizer_model == "adam" else "none",
            "non_model_memory": "synthetic",
            "config": sh.to_dict(),
            "cost_model": c.to_dict(),
        }
        return build_trace(rec, self.specs, states, candidates, meta, self.est,
                           [None] * len(self.est), list(self.est))
