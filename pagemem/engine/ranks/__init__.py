"""The engine's ranks: the process group it is data parallel over ([Note: data parallel over
the process group] in ``average.py``), its collectives on their own thread, and how a rank that
died or fell behind is named."""

from pagemem.engine.ranks.collectives import Collectives
from pagemem.engine.ranks.group import RankGroup

__all__ = ["Collectives", "RankGroup"]
