"""Gradient sums reduce-scattered per unit: each rank keeps its share of every averaged sum.

[Note: sharded gradient sums]
With ``shard_parameters`` (ZeRO stage 3: [Note: gathered units] in ``unit_gather.py``) a rank's
fp32 gradient sums are its share of them only, the same elements as its share of the master and
the moments (``ParamBank.is_sharded(i, "grad")``): 4/W bytes per parameter at rest instead of 4.
Within a backward a unit's gradients are added into a *local buffer* on the cpu tier (taken at
the unit's first gradient, through the store, so the budget counts it), laid out as the
reduce-scatter sends it: one chunk per rank, each rank's owned elements of the unit's parameters
back to back in parameter order, zero-padded to the largest rank's (``gather.placed``'s order, as
the unit gather sends the compute copy). Once every hooked parameter of the unit handed its
gradient off (its backward is done with it) the unit is *ready*. The ranks must reduce-scatter
the same units in the same order, and a unit is ready on one rank before another (a parameter
a rank's batch does not reach is never handed off there), so readiness is agreed where the ranks
already meet: the header of every unit gather (backward fetches units evicted since forward)
carries each rank's ready flags, and so does one small header at the end of each
parameter-owning module's backward (``on_op``); the units ready on every rank are
reduce-scattered right after, in unit order, on the collectives' thread while backward goes on (two in
flight at most). The buffer is scaled by 1 / world size first, as DDP's reducer scales; when it
lands this rank's chunk is written into its shares (added where they already hold a sum of this
step: accumulation) and the buffer is freed. So the peak is the shares plus the buffers of the
units not yet sent (about a module's worth behind backward), not the whole model's sums. At
the end of backward one header says which units each rank still holds, and each held anywhere is
reduce-scattered (with a header of its own saying which parameters have a gradient on any rank):
a unit some rank never touched sends zeros there, so a parameter unused on one rank's batch gets
the others' average, as DDP's ``find_unused_parameters`` gives it.

Every backward reduce-scatters (accumulation included, as FSDP2 does by default): the shares
hold the running sum of averaged micro-batch gradients, so with ``accumulation_steps`` > 1 the
result is DDP's within rounding (DDP's ``no_sync`` sums locally first), bit for bit at 2 ranks
for one backward per step (``a + b`` is ``b + a``). What reads a gradient whole is a
collective: ``p.grad`` materialised gathers the shares (``whole``), a 2-norm (``clip_grad_norm_``,
``max_grad_norm``, the handles') is the square root of the ranks' summed squares of their
shares (``norms``: one all-reduce for all parameters, not torch's reduction order, so clipping
matches DDP to about 1e-7 of the coefficient, not bit for bit), and an fp16 overflow anywhere
is one on every rank (``all_finite``).
A backward that fails part-way is undone ([Note: a failed backward is undone]) only where it
fails on every rank alike; the shares it wrote were kept first (``before_write``)."""

from __future__ import annotations

import zlib
from collections import deque
from typing import Callable

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.ranks.collectives import Collectives, Pending
from pagemem.engine.ranks.gather import MasterGather
from pagemem.engine.units.bank import ParamBank
from pagemem.errors import InvalidRequest
from pagemem.store import Lease, PagedTensor
from pagemem.tracer import Op

_IN_FLIGHT = 2
"""Reduce-scatters issued and not yet landed, at most (the double buffer of ``average.py``)."""
Run = tuple[int, int, int, int]
"""(parameter, first element, end element, position in its rank's chunk)."""


class _Local:
    """One unit's local gradient buffer of this backward: ``W`` chunks of ``chunk`` elements."""

    __slots__ = ("tensor", "lease", "flat", "handed", "pending", "issued", "ready")

    def __init__(self, tensor: PagedTensor, lease: Lease) -> None:
        self.tensor = tensor
        self.lease = lease
        self.flat: torch.Tensor = lease.tensor.reshape(-1)
        self.handed: set[int] = set()
        """Parameters that handed a gradient off into it."""
        self.pending: Pending | None = None
        self.issued = False
        self.ready = False
        """Every hooked parameter of the unit handed its gradient off in this backward."""


class GradScatter:
    """Each unit's gradients of a backward reduce-scattered into this rank's shares (see the Note)."""

    def __init__(self, bank: ParamBank, coll: Collectives, ledger: GradLedger, masters: MasterGather,
                 before_write: Callable[[int], None]) -> None:
        """``before_write(i)``: called before parameter ``i``'s share is written in a backward
        (the updater keeps it for an undo)."""
        self.bank = bank
        self.coll = coll
        self.ledger = ledger
        self.masters = masters
        self.before_write = before_write
        self.world, self.rank = coll.ranks.world_size, coll.ranks.rank
        shares = bank.every_share()
        self._runs: list[list[list[Run]]] = []
        """Per unit, per rank: its runs, placed in its chunk."""
        self._chunk: list[int] = []
        """Per unit: elements of each rank's chunk (the largest rank's share of the unit)."""
        for layer in bank.layers:
            per_rank = []
            for share in shares:
                runs, at = [], 0
                for i in layer.params:
                    a, b = share.ranges[i]
                    if b > a:
                        runs.append((i, a, b, at))
                        at += b - a
                per_rank.append(runs)
            self._runs.append(per_rank)
            self._chunk.append(max((r[-1][3] + r[-1][2] - r[-1][1]) if r else 0 for r in per_rank))
        self._local: dict[int, _Local] = {}
        self._expected: list[int] = [0] * len(bank.layers)
        self._flight: deque[int] = deque()
        self._held: set[int] = set()
        self._in_backward = False
        self.scatters = 0
        """Units reduce-scattered so far."""
        self.early = 0
        """Of those, units reduce-scattered while their backward still ran."""
        self.scattered_bytes = 0
        """Bytes of averaged gradient written into this rank's shares."""
        self.local_bytes = 0
        """Bytes of the local buffers held now."""
        self.local_peak_bytes = 0
        """The most bytes of local buffers held at once so far."""

    # ------------------------------------------------------------------ a backward

    def begin_backward(self) -> None:
        """A backward starts: which parameters each unit expects, which shares hold a sum."""
        self._expected = [sum(1 for i in layer.params if self.bank.records[i].hooked) for layer in self.bank.layers]
        self._held = set(self.ledger.holding(GradState.SUMMED))
        self._in_backward = True

    def on_op(self, op_id: int, edge: str, op: Op) -> None:
        """The op clock: at the end of each parameter-owning module's backward (an op every rank
        reaches alike), the ranks agree on the units ready everywhere and send them."""
        if self._in_backward and edge == "start" and op.event == "backward_post" and op.params:
            _, low = self.coll.begin("agreeing on ready gradients", self.ready_flags())
            self.issue_agreed(low)

    def accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient of this backward (autograd's, from the hand-off)."""
        u = self.bank.layer_of[i]
        local = self._local.get(u)
        if local is None:
            local = self._local[u] = self._take(u)
        elif local.issued:
            raise InvalidRequest(f"parameter {self.bank.params[i][0]!r}: a second gradient in one backward after its "
                                 "unit's gradients were reduce-scattered (shard_parameters=True)")
        flat = grad.detach().reshape(-1)
        first = i not in local.handed
        chunk = self._chunk[u]
        with torch.no_grad():
            for r, runs in enumerate(self._runs[u]):
                for j, a, b, at in runs:
                    if j == i:
                        dst = local.flat[r * chunk + at:r * chunk + at + b - a]
                        src = flat[a:b].to(device=dst.device, dtype=torch.float32)
                        dst.copy_(src) if first else dst.add_(src)
        local.handed.add(i)
        if len(local.handed) == self._expected[u]:
            local.ready = True  # reduce-scattered once every rank says so (``issue_agreed``)

    def ready_flags(self) -> list[int]:
        """Per unit: 1 where its gradients of this backward are all here and not yet sent (what
        this rank's next unit gather's header carries)."""
        return [int(u in self._local and self._local[u].ready and not self._local[u].issued)
                for u in range(len(self.bank.layers))]

    def issue_agreed(self, everywhere: list[int]) -> None:
        """Reduce-scatter, in unit order, the units whose gradients every rank has ready
        (``everywhere``: the flags' minimum over the ranks, from a unit gather's header): the
        same units at the same point on every rank, with no header of their own (each rank
        holds every hooked parameter's gradient of them)."""
        for u, ready in enumerate(everywhere):
            if ready:
                self.early += 1
                self._issue(u, agreed=True)

    def end_backward(self, steps: tuple[int, int]) -> None:
        """The backward's autograd run is over: every rank says which units it still holds, each
        held anywhere is reduce-scattered (in unit order), and everything lands. ``steps``: this
        rank's updates and backwards so far (ranks at different steps raise ``RankFailed``)."""
        self._in_backward = False
        n = len(self.bank.layers)
        left = [int(u in self._local and not self._local[u].issued) for u in range(n)]
        top, low = self.coll.begin("reducing gradients", list(steps) + left)
        if top[:2] != low[:2]:
            self.coll.fail_out_of_step(f"the ranks are at different steps: updates {low[0]} to {top[0]}, backwards "
                                       f"(failed ones too) {low[1]} to {top[1]}; this rank {steps[0]} and {steps[1]}")
        for u in range(n):
            if top[2 + u]:
                if u not in self._local:
                    self._local[u] = self._take(u)
                self._issue(u)
        while self._flight:
            self._land(self._flight.popleft())

    def abort(self) -> None:
        """The backward failed: what is in flight lands nowhere and every buffer is freed."""
        self._in_backward = False
        try:
            self.coll.settle([self._local[u].pending for u in self._flight if u in self._local])
        finally:
            self._flight.clear()
            for u in list(self._local):
                self._free(u)

    # ------------------------------------------------------------------ one unit

    def _take(self, u: int) -> _Local:
        n = self.world * self._chunk[u]
        [t] = self.bank.store.allocate_group([(torch.Size([max(n, 1)]), torch.float32)], tier="cpu")
        try:
            lease = t.lease("cpu")
        except BaseException:
            t.free()
            raise
        local = _Local(t, lease)
        local.flat.zero_()
        self.local_bytes += t.nbytes
        self.local_peak_bytes = max(self.local_peak_bytes, self.local_bytes)
        return local

    def _free(self, u: int) -> None:
        local = self._local.pop(u)
        self.local_bytes -= local.tensor.nbytes
        try:
            local.lease.release()
        finally:
            local.tensor.free()

    def _issue(self, u: int, agreed: bool = False) -> None:
        """Start unit ``u``'s reduce-scatter (unless ``agreed``, its header first, which says
        which parameters have a gradient on any rank; landing the oldest in flight first when two
        already are)."""
        local = self._local[u]
        if not agreed:
            members = self.bank.layers[u].params
            mine = [int(i in local.handed) for i in members]
            top, low = self.coll.begin("reducing a unit's gradients", [u] + mine)
            if top[0] != low[0]:
                self.coll.fail_out_of_step(f"the ranks reduce different units' gradients (unit {low[0]} to unit "
                                           f"{top[0]}; this rank unit {u}, {self.bank.layers[u].name!r}): every rank "
                                           "must run the same modules")
            local.handed = {i for i, anywhere in zip(members, top[1:]) if anywhere}
        local.issued = True
        while len(self._flight) >= _IN_FLIGHT:
            self._land(self._flight.popleft())
        chunk = self._chunk[u]
        if chunk:
            local.flat.mul_(1.0 / self.world)  # as DDP scales each gradient before it sums
            out = torch.empty(chunk, dtype=torch.float32, device=self.coll.ranks.device)
            send = local.flat[:self.world * chunk].to(self.coll.ranks.device)
            local.pending = self.coll.reduce_scatter(out, send, "reducing a unit's gradients")
            local.flat = out  # what lands
        self._flight.append(u)

    def _land(self, u: int) -> None:
        """Unit ``u``'s reduce-scatter arrived: this rank's chunk into its shares."""
        local = self._local[u]
        try:
            if local.pending is not None:
                self.coll.wait(local.pending)
            got = local.flat.cpu() if local.pending is not None else None
            bank, ledger = self.bank, self.ledger
            for i, a, b, at in self._runs[u][self.rank]:
                if i not in local.handed:
                    continue
                self.before_write(i)
                assert got is not None
                value = got[at:at + b - a]
                with bank.grad_pieces(i) as pieces, torch.no_grad():
                    for start, view in pieces:
                        part = value[start:start + view.numel()]
                        view.copy_(part) if i not in self._held else view.add_(part)
                self.scattered_bytes += (b - a) * 4
            for i in self.bank.layers[u].params:
                if i in local.handed:
                    self._held.add(i)
                    if ledger.state(i) is not GradState.SUMMED:
                        ledger.move(i, GradState.SUMMED)
            self.scatters += 1
        finally:
            self._free(u)

    # ------------------------------------------------------------------ reading the shares

    def norms(self, params: list[int]) -> list[torch.Tensor]:
        """Each parameter's gradient 2-norm over every rank's share (one collective)."""
        top, low = self.coll.begin("reading gradient norms", [len(params), zlib.crc32(repr(list(params)).encode())])
        if top != low:
            self.coll.fail_out_of_step(f"reading gradient norms: the ranks read {low[0]} to {top[0]} gradients; every "
                                       "rank must clip or read norms alike")
        sq = torch.zeros(len(params), dtype=torch.float64)
        for n, i in enumerate(params):
            if self.bank.owned_numel(i):
                with self.bank.grad_pieces(i, write=False) as pieces:
                    sq[n] = sum(float(torch.linalg.vector_norm(v, 2.0, dtype=torch.float64)) ** 2 for _, v in pieces)
        total = self.coll.reduce_now(sq.to(self.coll.ranks.device), "reading gradient norms").cpu()
        return [torch.tensor(float(x) ** 0.5, dtype=torch.float32) for x in total]

    def whole(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole averaged gradient sum, flat (a collective every rank makes)."""
        return self.masters.whole_states([i], ("grad",), "reading the gradients")[i]["grad"].reshape(-1)

    def all_finite(self, params: list[int]) -> bool:
        """Whether every rank's shares of ``params``' sums are finite (an fp16 overflow anywhere
        skips the step everywhere)."""
        bad = 0
        for i in params:
            if self.bank.owned_numel(i):
                with self.bank.grad_pieces(i, write=False) as pieces:
                    bad |= any(not bool(torch.isfinite(v).all()) for _, v in pieces)
        top, _ = self.coll.begin("reading gradient norms", [int(bad)])
        return not top[0]

    def stats(self) -> dict[str, int]:
        return {"grad_scatters": self.scatters, "grad_scatters_early": self.early,
                "grad_scatter_bytes": self.scattered_bytes, "grad_local_peak_bytes": self.local_peak_bytes}
