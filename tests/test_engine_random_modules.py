"""Property: any small module hypothesis builds (children called before and after a module reads
its own parameters, modules shared between parents, parameters of one module read inside
another's forward, parameters read in the loss) trains through the engine bit for bit as in
plain PyTorch, or is refused with a ``PageMemError`` that says why."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import pagemem
from exactness import same_loop

WIDTH = 32


class Node(nn.Module):
    """A module that runs ``program``: ``("kid", k)`` calls child ``k``; ``("w",)`` multiplies by
    its own weight; ``("b",)`` adds its own bias; ``("act",)`` calls its GELU child; ``("foreign",
    path)`` scales by a parameter of the module at ``path`` (read outside that module)."""

    def __init__(self, program: list[tuple], kids: list[nn.Module], root: list[nn.Module]) -> None:
        super().__init__()
        uses = {op[0] for op in program}
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / math.sqrt(WIDTH)) if "w" in uses else None
        self.b = nn.Parameter(torch.randn(WIDTH) * 0.1) if "b" in uses else None
        self.kids = nn.ModuleList(kids)
        self.act = nn.GELU()
        self.program = program
        self._root = root  # a list, so the root is not registered as a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for op in self.program:
            if op[0] == "kid":
                x = self.kids[op[1] % len(self.kids)](x) if len(self.kids) else x
            elif op[0] == "w":
                x = x @ self.w
            elif op[0] == "b":
                x = x + self.b
            elif op[0] == "act":
                x = self.act(x)
            else:
                p = foreign_param(self._root[0], op[1])
                if p is not None:
                    x = x * (1 + 0.1 * p.mean())
        return x


def foreign_param(root: nn.Module, k: int) -> nn.Parameter | None:
    params = [p for _, p in root.named_parameters()]
    return params[k % len(params)] if params else None


OPS = st.one_of(st.just(("w",)), st.just(("b",)), st.just(("act",)), st.tuples(st.just("kid"), st.integers(0, 3)),
                st.tuples(st.just("foreign"), st.integers(0, 20)))


@st.composite
def specs(draw, depth: int = 0):
    """A module's description: its program and its children's descriptions (a child may be a
    reference to an earlier sibling: a shared module)."""
    program = draw(st.lists(OPS, min_size=1, max_size=5))
    kids = [] if depth >= 2 else draw(st.lists(specs(depth + 1), max_size=2))
    if len(kids) == 1 and draw(st.booleans()):
        kids.append("shared")
    return (program, kids)


def build(spec, root: list[nn.Module]) -> Node:
    program, kid_specs = spec
    kids: list[nn.Module] = []
    for k in kid_specs:
        kids.append(kids[-1] if k == "shared" else build(k, root))
    return Node(program, kids, root)


class Root(nn.Module):
    """The drawn module, then a head (so that there is always something to train)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(spec):
    def make() -> nn.Module:
        torch.manual_seed(0)
        root: list[nn.Module] = []
        model = Root(build(spec, root))
        root.append(model)
        return model
    return make


_g = torch.Generator().manual_seed(3)
XS = [torch.randn(4, WIDTH, generator=_g) for _ in range(3)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs(), loss_reads=st.lists(st.integers(0, 20), max_size=2))
def test_random_modules_train_exactly_or_are_refused(spec, loss_reads, tmp_path):
    def loss(run, model, s):
        out = run(XS[s])
        value = out.pow(2).mean()
        for k in loss_reads:  # parameters read in the loss, outside every module
            p = foreign_param(model, k)
            value = value + 1e-2 * p.pow(2).sum()
        return value

    def loop(run, model, opt, s, loss):
        opt.zero_grad()
        loss(run, model, s).backward()
        opt.step()

    try:
        stats = same_loop(make_model(spec), loss, loop, 3, tmp_path)
    except pagemem.PageMemError as exc:  # refused: it must say why
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("exact, " + ("with unforeseen reads" if stats["unforeseen_reads"] else "all reads foreseen"))
