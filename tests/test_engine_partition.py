"""The host stand-in's core partition ([Note: a core partition] in ``engine/updates/partition.py``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import pagemem
from pagemem.engine.updates.partition import CorePartition, host_partition
from exactness import engine_config
from test_engine_exactness import CASES

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")


@two_cores
def test_the_compute_and_the_engines_threads_get_their_own_cores_and_the_caller_its_own_back(tmp_path):
    make, loss = CASES["parameter read after a child"]
    model = make()
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    part = CorePartition.split()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path, "nvme", lock_free=True)) as engine:
        with part.applied():
            for s in range(2):
                engine.backward(loss(engine, model, s))
                engine.step()
            placed = part.apply()
            seen = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                    if t.name.startswith("pagemem-")}
            mine = os.sched_getaffinity(0), torch.get_num_threads()
    assert placed == len(seen) and any(n.startswith("pagemem-lockfree") for n in seen)
    assert all(c == part.others for c in seen.values())
    assert mine == (part.compute, len(part.compute))
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)


def test_a_bad_partition_is_refused_naming_the_field():
    n = len(os.sched_getaffinity(0))
    for bad in (0, n, -1, True, "1"):
        with pytest.raises(pagemem.ConfigError, match=r"^compute_cores: must be an integer in \[1, "):
            CorePartition.split(bad)
    with pytest.raises(pagemem.ConfigError, match="^compute, others: must not share cores"):
        CorePartition(frozenset({0}), frozenset({0}))
    with pytest.raises(pagemem.ConfigError, match="^compute, others: both need a core"):
        CorePartition(frozenset({0}), frozenset())
    assert host_partition(False, True) is None and host_partition(True, False) is None
