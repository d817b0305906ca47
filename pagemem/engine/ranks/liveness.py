"""Which rank died or fell behind, told from heartbeats on the process group's store.

[Note: naming the rank that failed]
A collective that fails (a peer's connection closed: it died) or times out (a peer never came)
says nothing of which rank it was. So each rank's engine writes a heartbeat to the group's
store (the rendezvous ``TCPStore`` that ``init_process_group`` made) every ``BEAT_S``: how many
beats it sent and how many collectives it entered. When a collective fails, the rank reads
every rank's heartbeat twice, ``STALE_S`` apart: a rank whose beats did not move is dead; a live
rank that entered fewer collectives than this one is behind (it raised, or waits elsewhere). A
rank whose engine closes says so on the store: a rank waiting for it gives up at once (a rank
that ran out of data closed its engine and went on) instead of waiting out the timeout; the
waiting rank also looks, every ``LOOK_S``, for a peer whose heartbeat stopped (a process
stopped, not dead: a dead one's connections close and the collective fails at once).
A store that cannot be reached names its host, which is rank 0 unless torchrun's agent holds
it. The store is reached through ``torch.distributed``'s private ``_get_process_group_store``
(no public call hands it out); it is used only for these small keys."""

from __future__ import annotations

import threading
import time
from typing import Any

from pagemem.engine.ranks.group import RankGroup

BEAT_S = 1.0
STALE_S = 2.5
LOOK_S = 2.0


class Liveness:
    """This rank's heartbeat, and the diagnosis of the others' (see the Note)."""

    def __init__(self, ranks: RankGroup, serial: int) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.ranks = ranks
        self.entered = 0
        """Collectives this rank has entered (its progress, compared with the others')."""
        self._store: Any = dist.PrefixStore(f"pagemem/engine-{serial}/", c10d._get_process_group_store(ranks.group))
        self._beats = 0
        self._last_look = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {}
        """Each peer's last beat count and when it was first seen (``closed_or_dead``)."""
        self._stop = threading.Event()
        self._beat()  # the first beat before any collective: a rank that never beats never started
        self._thread = threading.Thread(target=self._run, name=f"pagemem-heartbeat-r{ranks.rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"beat/{self.ranks.rank}", f"{self._beats} {self.entered}")

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # the store's host is gone: the collectives find out and diagnose
                return

    def _read(self) -> dict[int, tuple[int, int]]:
        out = {}
        for r in range(self.ranks.world_size):
            key = f"beat/{r}"
            if r != self.ranks.rank and self._store.check([key]):
                beats, entered = self._store.get(key).decode().split()
                out[r] = (int(beats), int(entered))
        return out

    def _others(self) -> list[int]:
        return [r for r in range(self.ranks.world_size) if r != self.ranks.rank]

    def _closed(self) -> list[int]:
        return [r for r in self._others() if self._store.check([f"closed/{r}"])]

    def closed_or_dead(self) -> str | None:
        """Why waiting for the others is hopeless (a peer closed its engine, or its heartbeat
        stopped for ``4 * STALE_S``), or None; looks at most every ``LOOK_S``."""
        now = time.monotonic()
        if now - self._last_look < LOOK_S:
            return None
        self._last_look = now
        try:
            closed = self._closed()
            if closed:
                return (f"rank(s) {', '.join(map(str, closed))} closed their engine (close(), or its construction or load "
                        "failed) while this rank waits")
            stale = []
            for r, (beats, _) in self._read().items():
                last = self._seen.get(r)
                if last is None or last[0] != beats:
                    self._seen[r] = (beats, now)
                elif now - last[1] > 4 * STALE_S:
                    stale.append(r)
        except Exception:  # noqa: BLE001 - the store's host is gone: the collective fails on its own
            return None
        if stale:
            return f"rank(s) {', '.join(map(str, stale))} stopped beating for {4 * STALE_S:.0f} s"
        return None

    def diagnose(self) -> tuple[str, tuple[int, ...]]:
        """What the other ranks are doing, in words, and the ranks to blame (closed, dead, else
        behind)."""
        try:
            closed = tuple(self._closed())
            if closed:
                return (f"rank(s) {', '.join(map(str, closed))} closed their engine (close(), or its construction or "
                        "load failed) while this rank was in a collective with them", closed)
            first = self._read()
            time.sleep(STALE_S)
            second = self._read()
        except Exception as exc:  # noqa: BLE001 - any store failure means its host is gone
            return (f"the group's store cannot be reached ({type(exc).__name__}): its host, rank 0 unless torchrun's "
                    "agent holds it, is gone", (0,))
        others = self._others()
        dead = tuple(r for r in others if r not in second or second[r][0] == first.get(r, (None,))[0])
        behind = tuple(r for r in others if r not in dead and second[r][1] < self.entered)
        parts = []
        if dead:
            parts.append(f"rank(s) {', '.join(map(str, dead))} stopped (no heartbeat for {STALE_S:.1f} s: the "
                         "process died or hangs)")
        if behind:
            parts.append("rank(s) " + ", ".join(f"{r} (at collective {second[r][1]})" for r in behind)
                         + f" did not reach collective {self.entered}: raised, or wait elsewhere")
        if not parts:
            parts.append("every other rank is alive and reached this collective")
        return "; ".join(parts), dead or behind

    def close(self) -> None:
        """This rank's engine closed: said on the store (a rank waiting for it gives up), no more beats."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._store.set(f"closed/{self.ranks.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody waits on it
            pass
