"""Grouping parameters into layers."""

from __future__ import annotations

import torch
from torch import nn

from pagemem.tracer import TraceOptions, trace


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gate = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x + self.gate * self.ff(self.norm(x))


class Net(nn.Module):
    """Embedding, a stack of blocks, two loose modules, a parameter on the root, a tied head."""

    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.stack = nn.ModuleList(Block(d) for _ in range(3))
        self.extra = Block(d)  # not in a container: its modules are layers of their own
        self.scale = nn.Parameter(torch.ones(()))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for block in reversed(self.stack):  # used in reverse registration order
            x = block(x)
        x = self.extra(x) * self.scale
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


def _run(model, options=None):
    idx = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    return trace(model, lambda: model(idx).backward(), options=options)


def test_layers_follow_containers_and_first_use():
    torch.manual_seed(0)
    tr = _run(Net())
    names = [lay.name for lay in tr.layers]
    # the root owns `scale` directly, so its window (and layer) opens with the root's forward
    assert names == ["", "emb", "stack.2", "stack.1", "stack.0", "extra", "extra.norm", "extra.ff.0",
                     "extra.ff.2"]
    ids = sorted(t for lay in tr.layers for t in lay.tensor_ids)
    assert ids == [t.tensor_id for t in tr.of_kind("param")]  # each parameter exactly once
    by_name = {lay.name: [tr.tensors[t].name for t in lay.tensor_ids] for lay in tr.layers}
    assert by_name["emb"] == ["emb.weight"]  # the tied head weight stays with its first use
    assert by_name["stack.1"] == ["stack.1.gate", "stack.1.norm.weight", "stack.1.norm.bias",
                                  "stack.1.ff.0.weight", "stack.1.ff.0.bias", "stack.1.ff.2.weight",
                                  "stack.1.ff.2.bias"]
    assert by_name["extra"] == ["extra.gate"] and by_name[""] == ["scale"]
    assert [lay.first_id for lay in tr.layers] == sorted(lay.first_id for lay in tr.layers)
    # the root's own parameter is used from its forward_pre to its forward_post
    scale = tr.tensor("scale")
    fwd = [a for a in scale.accesses if tr.ops[a].phase == "forward"]
    assert fwd == list(range(0, fwd[-1] + 1)) and tr.ops[fwd[-1]].module == ""


def test_layer_types_override():
    torch.manual_seed(0)
    tr = _run(Net(), TraceOptions(layer_types=(Block,)))
    assert [lay.name for lay in tr.layers] == ["", "emb", "stack.2", "stack.1", "stack.0", "extra"]
    assert len(tr.layers[5].tensor_ids) == 7
