"""Logical pages: stable ids that tensors hold, mapped to the slots that hold their copies.

A page has one *home* copy (``tier``, ``slot``) and at most one *replica* per other tier
(``replicas``): a read copy made by ``PageStore.copy`` and dropped by ``PageStore.release``.
Operations queued on a page and not yet finished that change where its copies are (moves,
copies, replica drops) are its *intents*; ``future_tier`` and ``future_copies`` replay them over
the present state, so a failed operation simply drops out of the replay and the page's future
is right again (never stuck pointing at a destination that failed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pagemem.store.ordering import Op
    from pagemem.tiers import Tier

IntentKind = Literal["move", "copy", "drop"]


class Page:
    """One logical page. Guarded by the store's lock."""

    __slots__ = ("id", "tier", "slot", "replicas", "live", "fill", "last_op", "pending", "intents",
                 "pins", "written", "torn")

    def __init__(self, page_id: int, tier: "Tier", slot: int) -> None:
        self.id = page_id
        self.tier = tier
        self.slot = slot
        self.replicas: dict["Tier", int] = {}
        """Extra read copies: tier -> slot (never the home tier)."""
        self.live = 0
        """Bytes of live tensors on this page; the page is released when it drops to 0."""
        self.fill = 0
        """Bytes from the page's start that have been handed out; a later group may continue
        after them (``allocate_group(..., after=)``)."""
        self.last_op: Op | None = None
        """The newest unfinished operation on this page (later ones wait for it)."""
        self.pending = 0
        """Unfinished operations on this page."""
        self.intents: list[tuple["Op", IntentKind, "Tier"]] = []
        """Unfinished placement changes in issue order: (op, kind, tier)."""
        self.pins = 0
        """Open leases and live views: while > 0 the page's copies cannot move or be freed."""
        self.written = False
        """True once any data landed on the page (a write or a move); before that a disk page
        needs no copy-on-write, having nothing to lose."""
        self.torn: list[tuple[int, int]] = []
        """Byte ranges lost to a failed in-place disk write and not rewritten since."""

    # ------------------------------------------------------------------ copies

    def copies(self) -> dict["Tier", int]:
        """Every copy: tier -> slot, home first."""
        return {self.tier: self.slot, **self.replicas}

    def copy_on(self, tier: "Tier") -> int | None:
        """Slot of the copy on ``tier``, or None."""
        if tier is self.tier:
            return self.slot
        return self.replicas.get(tier)

    def future(self) -> tuple["Tier", set["Tier"]]:
        """(home tier, tiers holding a copy) once the queued intents have run."""
        home = self.tier
        if not self.intents and not self.replicas:
            return home, {home}
        have = {home, *self.replicas}
        for _op, kind, tier in self.intents:
            if kind == "move":
                if tier is not home:
                    have.discard(home)
                    have.add(tier)
                    home = tier
            elif kind == "copy":
                have.add(tier)
            elif len(have) > 1:  # a drop; dropping the home copy promotes the slowest replica
                have.discard(tier)
                if tier is home:
                    home = slowest(have)
        return home, have

    @property
    def future_tier(self) -> "Tier":
        return self.future()[0]

    def forget(self, op: "Op") -> None:
        """Drop ``op``'s intents (it finished, successfully or not)."""
        intents = self.intents
        if len(intents) == 1 and intents[0][0] is op:
            self.intents = []
        elif intents:
            self.intents = [i for i in intents if i[0] is not op]

    # ------------------------------------------------------------------ torn ranges

    def tear(self, page_bytes: int) -> None:
        """A failed in-place write: every byte of the page is now unknown (including bytes a
        later group is given: they refuse reads too until written)."""
        self.torn = [(0, page_bytes)]

    def tear_range(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` can no longer be trusted (their copies disagree)."""
        self.mend(lo, hi)
        self.torn.append((lo, hi))

    def mend(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` were rewritten successfully."""
        if not self.torn:
            return
        out = []
        for a, b in self.torn:
            if b <= lo or a >= hi:
                out.append((a, b))
                continue
            if a < lo:
                out.append((a, lo))
            if b > hi:
                out.append((hi, b))
        self.torn = out

    def is_torn(self, lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in self.torn)

    def __repr__(self) -> str:
        extra = "".join(f", {t.name}:{s}" for t, s in self.replicas.items())
        return f"Page({self.id}, {self.tier.name}:{self.slot}{extra}, live={self.live})"


_SPEED = {"gpu": 0, "cpu": 1, "nvme": 2}


def slowest(tiers) -> "Tier":
    """The tier furthest from the GPU among ``tiers`` (where a promoted home copy goes)."""
    return max(tiers, key=lambda t: _SPEED[t.name])


def fastest(tiers) -> "Tier":
    return min(tiers, key=lambda t: _SPEED[t.name])


class PageIds:
    """Recycles logical page ids (O(1))."""

    __slots__ = ("_next", "_free")

    def __init__(self) -> None:
        self._next = 0
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def give(self, page_id: int) -> None:
        self._free.append(page_id)
