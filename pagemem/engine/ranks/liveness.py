"""Which rank died or fell behind, told from heartbeats on the process group's store.

[Note: naming the rank that failed]
A collective that fails (a peer's connection closed: it died) or times out (a peer never came)
says nothing of which rank it was. So each rank's engine writes a heartbeat to the group's
store (the rendezvous ``TCPStore`` that ``init_process_group`` made) every ``BEAT_S``: how many
beats it sent and how many collectives it entered. When a collective fails, the rank reads
every rank's heartbeat twice, ``STALE_S`` apart: a rank whose beats did not move is dead; a live
rank that entered fewer collectives than this one is behind (it raised, or waits elsewhere).
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

    def diagnose(self) -> tuple[str, tuple[int, ...]]:
        """What the other ranks are doing, in words, and the ranks to blame (dead, else behind)."""
        try:
            first = self._read()
            time.sleep(STALE_S)
            second = self._read()
        except Exception as exc:  # noqa: BLE001 - any store failure means its host is gone
            return (f"the group's store cannot be reached ({type(exc).__name__}): its host, rank 0 unless torchrun's "
                    "agent holds it, is gone", (0,))
        others = [r for r in range(self.ranks.world_size) if r != self.ranks.rank]
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
        self._stop.set()
        self._thread.join(timeout=5)
