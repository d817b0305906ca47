"""The task table (``pagemem.sched.tasks``) applied to the tasks of one plan: the concrete holdings
-- which pages of which layer, on which tier -- each task takes, reads, writes and gives back, what
it costs, and the plan's setting (page counts, world size, home tiers) the table's symbols stand for.

>>> s = Setting.of(plan)
>>> fx = effects(plan.tasks[i], s)        # fx.takes, fx.reads, fx.writes, fx.frees: Keys
>>> fx.pages("takes", s)                  # {"gpu": 1}
>>> costs(plan.tasks[i], s)               # (("h2d", 4194304),)
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Iterator, NamedTuple

from pagemem.sched.tasks import GRAD_SUM_BYTES_PER_ELEMENT, MASTER_BYTES_PER_ELEMENT, Effect, Target, Task, effect_of

if TYPE_CHECKING:
    from pagemem.sched.layout import Layout


class Key(NamedTuple):
    """One concrete holding: ``name@tier`` of ``layer``, page ``page`` (None for a group)."""

    name: str
    tier: str
    layer: int
    page: int | None

    def __str__(self) -> str:
        return f"{self.name}[{self.layer}]" + ("" if self.page is None else f".{self.page}") + f"@{self.tier}"


_key = tuple.__new__  # Key(...) without NamedTuple's Python-level constructor: _key(Key, (...))


@dataclass(frozen=True)
class Setting:
    """What the table's symbols stand for in one plan: page counts, world size, home tiers."""

    layout: "Layout"
    cached_layers: frozenset[int] = frozenset()
    optimizer_tier: str = "cpu"
    home_tier: str = "cpu"
    """Where the compute copies (``param``) of layers not cached on the gpu rest: ``cpu`` or
    ``nvme`` (then the cpu tier is a working set they are staged through)."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    key_of: list[Key] = field(default_factory=list, init=False, repr=False, compare=False, hash=False)
    """The holding each id of ``TaskEffects.ids`` stands for (filled as tasks are looked up)."""

    @classmethod
    def of(cls, plan) -> "Setting":
        """The setting of a ``Plan`` (anything with ``layout``, ``cached_layers``, ``optimizer_tier``
        and, optionally, ``home_tier``)."""
        return cls(plan.layout, frozenset(plan.cached_layers), plan.optimizer_tier, getattr(plan, "home_tier", "cpu"))

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def home(self, name: str, layer: int) -> str | None:
        if name == "param":  # a gathered layer (``units``) has no compute copy at rest
            return "gpu" if layer in self.cached_layers else None if self.layout.gathers_units else self.home_tier
        if name == "optim":
            return "gpu" if layer in self.cached_layers else self.optimizer_tier
        return None

    def pages(self, name: str, layer: int) -> int:
        """Pages one holding of ``name`` (one page of it, for a paged holding) is made of: what a
        transfer of it moves, and what it occupies except where ``held_pages`` says less."""
        memo = self._memo
        n = memo.get((name, layer))
        if n is None:
            lay = self.layout.layers[layer]
            optim = lay.pages_when_cached if layer in self.cached_layers else lay.optim_pages
            n = memo[(name, layer)] = {"param": 1, "grad": 1, "gathered": self.world_size - 1,
                                       "fullgrad": self.layout.grad_buffer_pages(layer), "optim": optim}[name]
        return n

    def streams(self, name: str, layer: int) -> bool:
        """Whether ``layer``'s update brings its ``name`` (``optim`` or ``grad``) from nvme through
        the cpu: not cached on the gpu, and its states rest on nvme (``optim``) or its gradients go
        through nvme, where its parameters rest there (``grad``)."""
        if layer in self.cached_layers:
            return False
        if name == "optim":
            return self.optimizer_tier == "nvme"
        return name == "grad" and self.home_tier == "nvme"

    def held_pages(self, key: Key) -> int:
        """Pages holding ``key`` occupies on its tier. [Note: a streamed update] in ``tasks.py``:
        the cpu copies of what a layer's update brings from nvme -- its states, then its gradient
        pages in order -- fill its ``update_pages``, each occupying what is left of them; every
        other holding occupies its ``pages``."""
        name, tier, L, page = key
        own = self.pages(name, L)
        if tier != "cpu" or not self.streams(name, L):
            return own
        memo = self._memo
        mk = ("held", name, L, page)
        n = memo.get(mk)
        if n is None:
            room = self.layout.layers[L].update_pages
            if name == "grad":  # after the states (where they stream too) and the pages before it
                room -= min(self.pages("optim", L), room) if self.streams("optim", L) else 0
                room -= page or 0
            n = memo[mk] = max(0, min(own, room))
        return n

    def group_pages(self, name: str, tier: str, layer: int) -> int:
        """Pages every page of holding ``name@tier`` of ``layer`` occupies together."""
        if name in ("optim", "fullgrad"):
            return self.held_pages(Key(name, tier, layer, None))
        return sum(self.held_pages(Key(name, tier, layer, j)) for j in range(self.layout.layers[layer].param_pages))

    def at_rest(self) -> Iterator[Key]:
        """The home copies, which exist before the iteration and after it."""
        for lay in self.layout.layers:
            tier = self.home("param", lay.index)
            for j in range(lay.param_pages if tier is not None else 0):
                yield Key("param", tier, lay.index, j)
            yield Key("optim", self.home("optim", lay.index), lay.index, None)

    def holds(self, cond: str, task: Task | None = None) -> bool:
        """Whether every condition of ``cond`` (the table's ``when``) holds for ``task``."""
        for c in cond.split():
            if c == "W>1":  # the parameters sharded over several ranks (ZeRO-3)
                ok = self.layout.shards_params
            elif c == "W=1":
                ok = not self.layout.shards_params
            elif c == "R>1":  # several ranks, the optimizer states sharded only (ZeRO-1)
                ok = self.layout.shards_states
            elif c == "U":  # several ranks, each layer gathered when it moves (``units``)
                ok = self.layout.gathers_units
            elif c == "C":  # a compute copy at rest (not ``units``)
                ok = not self.layout.gathers_units
            elif c == "D":  # several ranks whose gradient sums are combined whole (``states``, ``units``)
                ok = self.layout.shards_states or self.layout.gathers_units
            elif c == "grads":
                ok = task is not None and task.produces_grads
            elif c.startswith("T="):
                ok = task is not None and task.tier == c[2:]
            elif c.startswith("H="):
                ok = task is not None and self.home("param", task.target.layer) == c[2:]
            elif c.startswith("F="):
                ok = task is not None and (task.source or "cpu") == c[2:]
            else:
                raise ValueError(f"the task table has an unknown condition {c!r}")
            if not ok:
                return False
        return True


class TaskEffects(NamedTuple):
    """A row of the table applied to one task: the concrete holdings."""

    effect: Effect
    takes: tuple[Key, ...]
    reads: tuple[Key, ...]
    writes: tuple[Key, ...]
    frees: tuple[Key, ...]
    ids: tuple[tuple[int, ...], ...] = ()
    """The same four columns as small integers, one per holding of the setting (``Setting.key_of``)."""
    taken: tuple[tuple[str, int], ...] = ()
    """``(tier, pages)`` of ``takes``."""
    tier_ok: bool = True
    """Whether the task's tier is one its row allows."""

    def pages(self, which: str, setting: Setting) -> dict[str, int]:
        """Pages per tier ``takes`` or ``frees`` occupy (``Setting.held_pages``)."""
        out: dict[str, int] = {}
        for k in getattr(self, which):
            out[k.tier] = out.get(k.tier, 0) + setting.held_pages(k)
        return out


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a pass over a whole queue makes many small,
    acyclic objects (collections their count triggers would cost more than the pass)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def tier_allowed(task: Task, setting: Setting) -> bool:
    eff = effect_of(task)
    if eff is None or task.source is not None and task.source not in eff.sources:
        return False
    home = setting.home("optim", task.target.layer)
    return any(task.tier == t or (t == "home" and task.tier == home) or (t == "copy" and task.tier not in (None, home))
               for t in eff.tiers)


def effects(task: Task, setting: Setting) -> TaskEffects | None:
    """The concrete holdings ``task`` takes, reads, writes and gives back (None when the table has
    no row for it, its row's ``when`` does not hold, or its layer or page does not exist). Home
    copies are never given back. (Memoized per setting: tasks alike but for their trigger share
    one answer, and the answers for every page of a layer are made together.)"""
    row = _row(task, setting)
    if row is None:
        return None
    page = task.target.page
    if page is None:
        if row.whole is None:
            row.whole = row.make(None)
        return row.whole
    if not 0 <= page < row.n:
        return None
    if row.paged is None:
        row.paged = row.make_pages()
    return row.paged[page]


def _row(task: Task, setting: Setting) -> "_Row | None":
    tg = task.target
    rk = (task.operation, tg.kind, tg.layer, task.tier, task.produces_grads, task.source)
    memo = setting._memo
    row = memo.get(rk)
    if row is None:
        row = memo[rk] = _Row.resolve(task, setting) or False
    return row or None


class _Row:
    """A row of the table resolved for one layer, tier and gradient flag."""

    __slots__ = ("effect", "n", "columns", "tier_ok", "setting", "whole", "paged")

    def __init__(self, effect: Effect, n: int, columns: tuple, tier_ok: bool, setting: Setting) -> None:
        self.effect, self.n, self.columns, self.tier_ok, self.setting = effect, n, columns, tier_ok, setting
        self.whole: TaskEffects | None = None
        self.paged: list[TaskEffects] | None = None

    @classmethod
    def resolve(cls, task: Task, setting: Setting) -> "_Row | None":
        eff = effect_of(task)
        L = task.target.layer
        if eff is None or not 0 <= L < len(setting.layout.layers) or eff.when and not setting.holds(eff.when, task):
            return None
        n = setting.layout.layers[L].param_pages
        memo = setting._memo
        columns = []
        for which, holds in enumerate((eff.takes, eff.reads, eff.writes, eff.frees)):
            col = []
            for h in holds:
                if h.when and not setting.holds(h.when, task):
                    continue
                home = setting.home(h.name, L)
                tier = _tier_of(h.tier, task, home)
                if tier is None or which == 3 and tier == home:  # home copies are never given back
                    continue
                pk = ("keys", h.name, tier, L, h.paged)
                if pk not in memo:
                    keys = (tuple(_key(Key, (h.name, tier, L, j)) for j in range(n)) if h.paged
                            else (Key(h.name, tier, L, None),))
                    memo[pk] = (keys if h.paged else keys[0], len(setting.key_of))
                    setting.key_of.extend(keys)
                col.append((h.paged, *memo[pk]))
            columns.append(tuple(col))
        return cls(eff, n, tuple(columns), tier_allowed(task, setting), setting)

    def _taken(self, takes: tuple[Key, ...]) -> tuple[tuple[str, int], ...]:
        taken: dict[str, int] = {}
        for k in takes:
            taken[k.tier] = taken.get(k.tier, 0) + self.setting.held_pages(k)
        return tuple(taken.items())

    def make(self, page: int | None) -> TaskEffects:
        """The effects for one page (None: every page of the layer)."""
        lists, ids = [], []
        n = self.n
        for col in self.columns:
            keys: list[Key] = []
            nums: list[int] = []
            for paged, all_keys, base in col:
                if not paged:
                    keys.append(all_keys)
                    nums.append(base)
                elif page is None:
                    keys.extend(all_keys)
                    nums.extend(range(base, base + n))
                else:
                    keys.append(all_keys[page])
                    nums.append(base + page)
            lists.append(tuple(keys))
            ids.append(tuple(nums))
        return TaskEffects(self.effect, *lists, tuple(ids), self._taken(lists[0]), self.tier_ok)

    def make_pages(self) -> list[TaskEffects]:
        """``make(j)`` for every page j, made column by column."""
        n, keys, ids = self.n, [], []
        for col in self.columns:
            keys.append(list(zip(*(ks if paged else repeat(ks, n) for paged, ks, _ in col))) if col else [()] * n)
            ids.append(list(zip(*(range(b, b + n) if paged else repeat(b, n) for paged, _, b in col)))
                       if col else [()] * n)
        if not n:
            return []
        head = (self.effect,)
        tail = (self._taken(keys[0][0]), self.tier_ok)
        new = tuple.__new__
        return [new(TaskEffects, head + cols + (idc,) + tail)
                for cols, idc in zip(zip(*keys), zip(*ids))]


def costs(task: Task, setting: Setting) -> tuple[tuple[str, int], ...]:
    """``(resource, amount)`` terms of a task, in order (see ``RESOURCES``): bytes of a transfer,
    elements of an ``adam`` step, bytes of ``memory`` traffic. Empty: it takes no time."""
    eff = effect_of(task)
    return _amounts(task, setting, eff.cost) if eff is not None else ()


def host_cost(task: Task, setting: Setting) -> tuple[str, int] | None:
    """``(resource, amount)`` the task costs on the ``io`` stream while it runs (the CPU's share
    of a disk transfer), or None."""
    return _beside(task, setting, "host")


def executor_cost(task: Task, setting: Setting) -> tuple[str, int] | None:
    """``(resource, amount)`` of the executor's host time the task costs on the ``compute``
    stream (a window of a moved layer), or None."""
    return _beside(task, setting, "executor")


def _beside(task: Task, setting: Setting, column: str) -> tuple[str, int] | None:
    eff = effect_of(task)
    term = getattr(eff, column) if eff is not None else None
    amounts = _amounts(task, setting, (term,)) if term else ()
    return amounts[0] if amounts else None


def _amounts(task: Task, setting: Setting, terms) -> tuple[tuple[str, int], ...]:
    """The amounts of the terms whose condition (``Term.when``) holds for ``task``."""
    L = task.target.layer
    layer = setting.layout.layers[L]
    out = []
    for term in terms:
        when = getattr(term, "when", "")
        if when and not setting.holds(when, task):
            continue
        resource, unit = term
        if unit == "shard":
            amount = layer.shard_elements
        elif unit == "window":
            amount = 1
        elif unit == "refresh":  # no compute copy of its own (its parameters are the master): nothing
            amount = layer.shard_bytes + MASTER_BYTES_PER_ELEMENT * layer.shard_elements if layer.shard_bytes else 0
        elif unit == "sums":  # the layer's fp32 gradient sums, every element
            amount = GRAD_SUM_BYTES_PER_ELEMENT * (layer.elements if layer.elements is not None else layer.shard_elements)
        elif unit == "master":  # this rank's fp32 share of the updated weights, padded as gathered
            amount = MASTER_BYTES_PER_ELEMENT * (layer.gather_elements if layer.gather_elements is not None
                                                 else layer.shard_elements)
        elif unit == "grad_share":  # this rank's part of the layer's fp32 gradient sums' reduce-scatter
            amount = GRAD_SUM_BYTES_PER_ELEMENT * (layer.gather_elements if layer.gather_elements is not None
                                                   else layer.shard_elements)
        elif unit == "unit":  # this rank's part of the layer's all-gather, on its first page's move
            whole = (layer.unit_gather_bytes if layer.unit_gather_bytes is not None
                     else -(-layer.param_bytes // setting.world_size))
            amount = whole if not task.target.page else 0
        else:
            count = 1 if task.target.page is not None or unit == "optim" else layer.param_pages
            amount = count * setting.pages(unit, L) * setting.layout.page_bytes
        out.append((resource, amount))
    return tuple(out)


def pages_taken(operation: str, kind: str, setting: Setting, layer: int, *, tier: str | None = None,
                produces_grads: bool = False) -> dict[str, int]:
    """Pages per tier one task takes at issue, as they are held (``Setting.held_pages``; for a
    row whose target is a page, ``Effect.paged``: its first page; else every page of the layer)."""
    task = Task(operation, Target(kind, layer), 0, tier, produces_grads=produces_grads)  # type: ignore[arg-type]
    eff = effect_of(task)
    out: dict[str, int] = {}
    if eff is None or eff.when and not setting.holds(eff.when, task):
        return out
    for h in eff.takes:
        if not h.when or setting.holds(h.when, task):
            t = _tier_of(h.tier, task, setting.home(h.name, layer))
            if t is not None:
                if not h.paged:
                    pages = setting.held_pages(Key(h.name, t, layer, None))
                elif eff.paged:
                    pages = setting.held_pages(Key(h.name, t, layer, 0))
                else:  # a group target takes every page
                    pages = setting.group_pages(h.name, t, layer)
                out[t] = out.get(t, 0) + pages
    return out


def _tier_of(symbol: str, task: Task, home: str | None) -> str | None:
    """The tier a holding's ``tier`` symbol stands for in ``task`` (see ``Hold``)."""
    if symbol == "T":
        return task.tier
    if symbol == "home":
        return home
    if symbol == "F":
        return task.source or "cpu"
    return symbol
