"""Lending tensor memory out: views, and leases (an alias, a merged copy, or pieces).

The rules are in ``pagemem.store.lease`` (the Note on views). A ``Lender`` works on the page
table under the store's queue and lock, and writes through the ``DataPath``.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable

import torch

import pagemem.process as process
from pagemem.errors import InvalidRequest
from pagemem.store.data import DataPath, copy_tiers, refuse_torn, source_bytes
from pagemem.store.lease import Lease, Piece
from pagemem.store.queue import OpQueue
from pagemem.store.tensor import PagedTensor
from pagemem.tiers import Tier, TierSet


class Lender:
    def __init__(self, queue: OpQueue, tiers: TierSet, data: DataPath,
                 check: Callable[[PagedTensor], None]) -> None:
        self.queue = queue
        self.tiers = tiers
        self.data = data
        self.check = check
        """Raises InvalidRequest for a freed tensor, another store's tensor, or a closed store."""
        self.views = 0
        self.view_copies = 0

    def _closed(self) -> bool:
        return self.data.closed

    def viewable(self, t: PagedTensor) -> bool:
        with self.queue.lock:
            self.check(t)
            return self._alias_tier(t, None) is not None and not any(p.intents for p in t.page_refs)

    def view_many(self, ts: list[PagedTensor], tier_name: str | None = None) -> list[torch.Tensor]:
        """Views of ``ts`` taken under one operation (one wait, one queue entry), all or none:
        every tensor is checked before any is pinned."""
        want = self._memory_tier(tier_name)
        pages = {id(p): p for t in ts for p in t.page_refs}

        def check() -> None:
            for t in ts:
                self.check(t)

        def body() -> list[torch.Tensor]:
            with self.queue.lock:
                check()
                tiers = []
                for n, t in enumerate(ts):
                    tier = self._alias_tier(t, want) if t.nbytes else None
                    if t.nbytes and tier is None:
                        which = f"tensor {n}'s" if len(ts) > 1 else "the tensor's"
                        raise InvalidRequest(
                            f"view(): {which} pages are not adjacent in one memory tier (tiers {copy_tiers(t)}); "
                            "use to_torch() for a copy, lease() for a pinned copy, or move it to a memory tier first")
                    refuse_torn(t)
                    tiers.append(tier)
                return [self._alias(t, tier, lifetime=True) if tier is not None else self._empty(t, want)
                        for t, tier in zip(ts, tiers)]

        return self.queue.exclusive(list(pages.values()), body, check)

    def lease_many(self, ts: list[PagedTensor], tier_name: str | None, write: bool,
                   split: bool = False) -> list[Lease]:
        """Leases of ``ts`` taken under one operation (one wait, one queue entry); ``split``:
        a tensor on pages that are not adjacent is lent in pieces instead of a merged copy."""
        want = self._memory_tier(tier_name)
        pages = {id(p): p for t in ts for p in t.page_refs}

        def check() -> None:
            for t in ts:
                self.check(t)

        def body() -> list[Lease]:
            leases: list[Lease] = []
            try:
                for t in ts:
                    leases.append(self._lease_held(t, want, write, split))
            except BaseException:
                for lease in leases:
                    lease.release()
                raise
            return leases

        return self.queue.exclusive(list(pages.values()), body, check)

    def _empty(self, t: PagedTensor, want: Tier | None) -> torch.Tensor:
        """A tensor with no bytes, on the device of the memory tier asked for (or its home's)."""
        tier = want or self.tiers[t.home]
        return torch.empty(t.shape, dtype=t.dtype, device=tier.device if tier.resident else "cpu")

    def _memory_tier(self, tier_name: str | None) -> Tier | None:
        want = self.tiers[tier_name] if tier_name is not None else None
        if want is not None and not want.resident:
            raise InvalidRequest(f"tier {tier_name!r} is not memory; views and leases are of 'gpu' or 'cpu'")
        return want

    def _lease_held(self, t: PagedTensor, want: Tier | None, write: bool, split: bool = False) -> Lease:
        """A lease of ``t``, whose pages the caller holds (an exclusive operation)."""
        with self.queue.lock:
            self.check(t)
            refuse_torn(t)
            tier = self._alias_tier(t, want) if t.nbytes else (want or self.tiers[t.home])
            if tier is not None:
                if t.nbytes:
                    tensor = self._alias(t, tier, lifetime=False)
                else:
                    tensor = self._empty(t, tier)
                    self._pin(t)
                pieces = [(0, tensor.reshape(-1))] if split else None
                return Lease(t, tier.name, tensor, False, write, self._end_alias, self._closed, pieces)
            tier = self._full_copy_tier(t, want)
            if split:
                pieces = self._pieces(t, tier)
                self._pin(t)
                self.views += 1
                return Lease(t, tier.name, None, False, write, self._end_alias, self._closed, pieces)
            segments = [(page.copy_on(tier), lo, hi, pos) for page, lo, hi, pos in t.segments()]
            self._pin(t)
            self.view_copies += 1
        merged = torch.empty(t.nbytes, dtype=torch.uint8, device=tier.device)
        for slot, lo, hi, pos in segments:
            merged[pos:pos + hi - lo].copy_(tier.buffer(slot)[lo:hi])
        tensor = merged.view(t.dtype).view(t.shape)
        lease = Lease(t, tier.name, tensor, True, write, self._end_copy, self._closed)
        if not write:  # it reads as an alias would: later writes reach it ([Note: read-only merged copies follow writes])
            with self.queue.lock:
                self.data.follow(t, id(lease), merged, tier)
        return lease

    def _memory_order(self, want: Tier | None) -> list[Tier]:
        """The memory tiers to lend from, nearest first (only ``want`` when one is asked for)."""
        return [want] if want is not None else [self.tiers.gpu, self.tiers.cpu]

    def _full_copy_tier(self, t: PagedTensor, want: Tier | None) -> Tier:
        order = self._memory_order(want)
        for tier in order:
            if all(p.copy_on(tier) is not None for p in t.page_refs):
                return tier
        raise InvalidRequest(f"lease: the tensor has no complete copy in {'/'.join(x.name for x in order)} "
                             f"(its pages are on {copy_tiers(t)}); move or copy it there first")

    def _alias_tier(self, t: PagedTensor, want: Tier | None) -> Tier | None:
        """The memory tier where the tensor's pages sit on adjacent slots, nearest first."""
        pages = t.page_refs
        if not pages:
            return self.tiers[t.home] if self.tiers[t.home].resident else None
        for tier in self._memory_order(want):
            first = pages[0].copy_on(tier)
            if first is not None and all(p.copy_on(tier) == first + i for i, p in enumerate(pages)):
                return tier
        return None

    def _alias(self, t: PagedTensor, tier: Tier, lifetime: bool) -> torch.Tensor:
        """An alias of ``t``'s memory on ``tier``, its pages pinned (caller holds the lock): for
        the alias's lifetime, or (``lifetime=False``) until the caller unpins."""
        pages = t.page_refs
        raw = tier.span(pages[0].copy_on(tier), len(pages))[t.offset:t.offset + t.nbytes]
        storage, owner = _own_storage(raw)
        alias = storage.view(t.dtype).view(t.shape)
        self._pin(t)
        self.views += 1
        if lifetime:
            # [Note: pins follow the storage] every tensor derived from the alias, by slicing,
            # reshaping, reinterpreting its dtype or being saved by autograd, shares the alias's
            # own storage, which holds ``owner``: the pin goes when the last of them does
            process.finalize(owner, self._unpin, t)  # run in this process only (process.py)
        return alias

    def _pieces(self, t: PagedTensor, tier: Tier) -> list[Piece]:
        """``(first element, flat alias)`` of each run of ``t``'s pages on adjacent slots of
        ``tier`` (caller holds the lock and pins)."""
        runs: list[list[int]] = []  # [first slot, pages, start in first page, position, bytes]
        for page, lo, hi, pos in t.segments():
            slot = page.copy_on(tier)
            if runs and slot == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
                runs[-1][4] += hi - lo
            else:
                runs.append([slot, 1, lo, pos, hi - lo])
        size = t.dtype.itemsize
        out = []
        for slot, n, lo, pos, nbytes in runs:
            if pos % size:
                raise InvalidRequest(f"lease: a page boundary falls inside an element of {t!r}")
            storage, _owner = _own_storage(tier.span(slot, n)[lo:lo + nbytes])
            out.append((pos // size, storage.view(t.dtype)))
        return out

    def _end_alias(self, lease: Lease, payload: "torch.Tensor | list[Piece]") -> None:
        t = lease.source
        try:
            if lease.write and not self.data.closed and self._replicated(t):
                # bring the other copies up to date
                self.data.write_bytes(t, PieceBytes(payload) if isinstance(payload, list) else source_bytes(t, payload))
        except BaseException:
            # the leased copy holds the new bytes, the others could not be updated: the copies
            # disagree, so the tensor's bytes refuse reads until written again
            with self.queue.lock:
                for page, lo, hi, _pos in t.segments():
                    page.tear_range(lo, hi)
            raise
        finally:
            self._unpin(t)

    def _replicated(self, t: PagedTensor) -> bool:
        with self.queue.lock:
            return any(p.replicas for p in t.page_refs)

    def _end_copy(self, lease: Lease, tensor: torch.Tensor) -> None:
        if not lease.write:
            self.data.unfollow(lease.source, id(lease))
        try:
            if lease.write and not self.data.closed:
                self.data.write(lease.source, tensor)
        finally:
            self._unpin(lease.source)

    def _pin(self, t: PagedTensor) -> None:
        t.pins += 1
        for p in t.page_refs:
            p.pins += 1

    def _unpin(self, t: PagedTensor) -> None:
        with self.queue.lock:
            t.pins -= 1
            for p in t.page_refs:
                p.pins -= 1


class _CudaMemory:
    """Device memory presented through ``__cuda_array_interface__``, so a tensor made from it
    gets a storage of its own that keeps this object (and ``base``) alive."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.__cuda_array_interface__ = {"shape": (base.numel(),), "typestr": "|u1",
                                         "data": (base.data_ptr(), False), "version": 2}


def _own_storage(raw: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A uint8 tensor over the same memory as ``raw`` but with a storage of its own, and the
    object that storage keeps alive (weak-referenceable)."""
    if raw.is_cuda:
        owner = _CudaMemory(raw)
        return torch.as_tensor(owner, device=raw.device), owner
    owner = raw.numpy()
    return torch.from_numpy(owner), owner


class PieceBytes:
    """The bytes of a split lease's pieces, sliced by position as one uint8 tensor would be (a
    slice never crosses two pieces: each write segment lies within one page)."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.parts = [(start * x.element_size(), x.view(torch.uint8)) for start, x in pieces]
        self.starts = [p for p, _ in self.parts]

    def __getitem__(self, s: slice) -> torch.Tensor:
        at = bisect_right(self.starts, s.start) - 1
        pos, raw = self.parts[at]
        return raw[s.start - pos:s.stop - pos]
