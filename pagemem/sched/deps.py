"""What each task of a queue waits for, by the one rule of the task table (``pagemem.sched.tasks``):
a reader waits for the last taker or writer of each holding it reads, a taker for the release
that last gave the holding back, a release for every task that touched what it gives back; a
home copy read before anything in this iteration wrote it waits for its last writer in the
previous iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagemem.sched.holdings import Key, Setting, effects, paused_gc
from pagemem.sched.tasks import Task

@dataclass(frozen=True, slots=True)
class Deps:
    """What one task waits for: indices into the plan's queue."""

    same: tuple[int, ...] = ()
    """Earlier tasks of the same iteration."""
    previous: tuple[int, ...] = ()
    """Tasks of the previous iteration (none in the first)."""


class Link(NamedTuple):
    """A wait for task ``on`` (of the previous iteration if ``previous``), through holding ``key``."""

    on: int
    key: Key
    previous: bool


def links(tasks: list[Task], setting: Setting) -> list[list[Link]]:
    """Per task, every wait the table's rule gives it, with the holding it goes through."""
    with paused_gc():
        return _walk(tasks, setting, True)


def dependencies(tasks: list[Task], setting: Setting) -> tuple[Deps, ...]:
    """Per task, the tasks it waits for (see the module docs), as indices into ``tasks``."""
    with paused_gc():
        return tuple(Deps(tuple(sorted(same)), tuple(sorted(prev))) for same, prev in _walk(tasks, setting, False))


def _walk(tasks: list[Task], setting: Setting, detail: bool) -> list:
    """One pass over the queue keeping, per holding, its last taker or writer, every task that
    touched it since it was taken, and the release that last gave it back. With ``detail`` a list
    of ``Link`` per task, else a pair of sets (this iteration, the previous one) per task.
    (Holdings are their integer ids here: this runs once per plan over every page of the queue.)"""
    writer: dict[int, int] = {}
    touched: dict[int, list[int]] = {}
    released: dict[int, int] = {}
    all_fx = [effects(task, setting) for task in tasks]
    key_of = setting.key_of
    home_keys = set(setting.at_rest())
    homes = {i for i, k in enumerate(key_of) if k in home_keys}
    out: list = []
    from_previous: list[tuple[int, int]] = []
    get_writer, get_touched, get_released = writer.get, touched.get, released.get
    for i, fx in enumerate(all_fx):
        waits: list[tuple[int, int]] = []  # (task, holding)
        prev: list[tuple[int, int]] = []
        out.append((waits, prev))
        if fx is None:
            continue
        takes, reads, writes, frees = fx.ids
        for k in reads:
            w = get_writer(k)
            if w is not None:
                waits.append((w, k))
            elif k in homes:
                from_previous.append((i, k))
            ts = get_touched(k)
            if ts is None:
                touched[k] = [i]
            else:
                ts.append(i)
        for k in takes:
            r = get_released(k)
            if r is not None:
                waits.append((r, k))
        for k in frees:
            ts = touched.pop(k, None)
            if ts:
                waits.extend((j, k) for j in ts if j != i)
            writer.pop(k, None)
            released[k] = i
        for keys in (takes, writes):
            for k in keys:
                writer[k] = i
                ts = get_touched(k)
                if ts is None:
                    touched[k] = [i]
                else:
                    ts.append(i)
    for i, k in from_previous:
        w = writer.get(k)
        if w is not None:
            out[i][1].append((w, k))
    if detail:
        new = tuple.__new__
        return [[new(Link, (j, key_of[k], False)) for j, k in waits]
                + [new(Link, (j, key_of[k], True)) for j, k in prev] for waits, prev in out]
    return [({j for j, _ in waits}, {j for j, _ in prev}) for waits, prev in out]
