"""NVMe I/O engines: Linux AIO through libaio, and a pread/pwrite thread pool as the fallback."""

from pagemem.tiers.io.base import EngineUnavailable, IOEngine, make_engine
from pagemem.tiers.io.faults import FaultyEngine

__all__ = ["IOEngine", "EngineUnavailable", "FaultyEngine", "make_engine"]
