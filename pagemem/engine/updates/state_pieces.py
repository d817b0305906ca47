"""A parameter's four fp32 states as runs of page memory, cut so each run is one view of each."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from pagemem.engine.updates.adam import Chunk

if TYPE_CHECKING:
    from pagemem.engine.units.bank import ParamBank
    from pagemem.store import PageStore

KINDS = ("master", "grad", "exp_avg", "exp_avg_sq")
"""A parameter's four states, in ``Chunk``'s order."""

StatePiece = tuple[int, Chunk]
"""``(first element, chunk)``: a run of a parameter's elements whose four states are each one
view of page memory."""


def aligned(master: list, grad: list, exp_avg: list, exp_avg_sq: list) -> list[StatePiece]:
    """The four states' pieces (``(first element, flat view)`` each, as ``Lease.pieces``) cut at
    every piece boundary of any of them, so that each run is one view of each state. Boundaries
    fall on page boundaries of 256-byte-aligned tensors: multiples of 64 elements, which keeps
    the fused kernel bit-identical to one call (see ``pagemem.engine.updates.adam``)."""
    parts = (master, grad, exp_avg, exp_avg_sq)
    if all(len(p) == 1 for p in parts):
        return [(master[0][0], Chunk(*(p[0][1] for p in parts)))]
    n = master[-1][0] + master[-1][1].numel()
    cuts = sorted({start for p in parts for start, _ in p} | {n})
    out, at = [], [0, 0, 0, 0]
    for lo, hi in zip(cuts, cuts[1:]):
        views = []
        for k, p in enumerate(parts):
            while p[at[k]][0] + p[at[k]][1].numel() <= lo:
                at[k] += 1
            start, x = p[at[k]]
            views.append(x[lo - start:hi - start])
        out.append((lo, Chunk(*views)))
    return out


def norm_of_pieces(pieces: list[torch.Tensor]) -> torch.Tensor:
    """``torch.linalg.vector_norm`` of a gradient as one tensor (pieces joined first)."""
    return torch.linalg.vector_norm(pieces[0] if len(pieces) == 1 else torch.cat(pieces), 2.0)


def lend(bank: "ParamBank", store: "PageStore", params: list[int],
         grads: bool = True) -> tuple[list[tuple[int, list[StatePiece]]], list]:
    """Flat fp32 master weights, gradient and moments of each parameter, as pieces that are
    views of page memory: the bank's lasting views where it has them, else split leases
    (returned: release them when done), never a merged copy. ``grads=False``: the caller gives
    the gradients (``with_grad``): the gradient pages are not lent (they may be on nvme), and
    each piece's ``grad`` is its master view until replaced."""
    kinds = KINDS if grads else tuple(k for k in KINDS if k != "grad")
    bank.grads_landed(params)
    views = {i: [bank.lasting_view(kind, i) for kind in kinds] for i in params}
    pieces = {i: [[(0, v)] for v in vs] for i, vs in views.items() if all(v is not None for v in vs)}
    leased = [i for i in params if i not in pieces]
    leases = _leases_of(bank, store, [bank.where(i) for i in leased], kinds) if leased else []
    n_kinds = len(kinds)
    for n, i in enumerate(leased):
        pieces[i] = [x.pieces for x in leases[n_kinds * n:n_kinds * n + n_kinds]]
    if bank.shards is not None:  # [Note: sharded moments]: this rank's elements of each
        for i, ps in pieces.items():
            a, b = bank.owned(i)
            ps[:] = [_shifted(p, a) if bank.is_sharded(i, kind) else _window(p, a, b) for kind, p in zip(kinds, ps)]
    if not grads:  # the master's pieces stand in for the gradient's (the same cuts)
        pieces = {i: [p[0], p[0], p[1], p[2]] for i, p in pieces.items()}
    return [(i, aligned(*pieces[i])) for i in params], leases

def _window(pieces: list[tuple[int, torch.Tensor]], a: int, b: int) -> list[tuple[int, torch.Tensor]]:
    """The parts of ``(first element, flat view)`` pieces that hold elements ``[a, b)``."""
    out = []
    for start, x in pieces:
        lo, hi = max(a, start), min(b, start + x.numel())
        if lo < hi:
            out.append((lo, x[lo - start:hi - start]))
    return out


def _shifted(pieces: list[tuple[int, torch.Tensor]], a: int) -> list[tuple[int, torch.Tensor]]:
    """Pieces of a sharded moment, which holds elements from ``a`` on, numbered as the parameter's."""
    return [(start + a, x) for start, x in pieces]


def _leases_of(bank: "ParamBank", store: "PageStore", where: list, kinds: tuple[str, ...] = KINDS) -> list:
    """The four leases (master, grad, exp_avg, exp_avg_sq) of each (layer, k), in order, taken
    with one store call per tier (``ParamBank.lend_tier_of``: the gpu for states kept there,
    else the cpu, where states and gradient sums on nvme were brought)."""
    by_tier: dict[str, list[int]] = {}
    for n, (layer, _k) in enumerate(where):
        by_tier.setdefault(bank.lend_tier_of(layer.index), []).append(n)
    k = len(kinds)
    out: list = [None] * (k * len(where))
    taken: list = []
    try:
        for tier, ns in by_tier.items():
            tensors = [getattr(where[n][0], kind)[where[n][1]] for n in ns for kind in kinds]
            leases = store.lease_many(tensors, tier, split=True)
            taken += leases
            for j, n in enumerate(ns):
                out[k * n:k * n + k] = leases[k * j:k * j + k]
    except BaseException:
        for lease in taken:
            lease.release()
        raise
    return out


def with_grad(pieces: list[StatePiece], flat: torch.Tensor) -> list[StatePiece]:
    """``pieces`` with their gradient views taken from ``flat`` (a parameter's whole gradient,
    flat) instead of the gradient pages."""
    return [(s, dataclasses.replace(c, grad=flat[s:s + c.param.numel()])) for s, c in pieces]
