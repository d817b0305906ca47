"""[Note: closing releases everything] ``PageStore.close()`` and ``Engine.close()`` give back
every file, fd and thread even when a part of closing raises, then raise the first error; and
[Note: page files of dead owners]: a new store removes the page files a killed process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pagemem
from pagemem.engine.updates import update as update_mod
from pagemem.engine.updates.adam_threads import WorkerDied
from pagemem.errors import TierIOError
from pagemem.tiers.io import FaultyEngine
from pagemem.tiers.io.threads import ThreadEngine
from pagemem.tiers.pagefile import remove_stale

from conftest import PAGE, random_tensor
from test_no_lost_ops import outcome
from test_engine_checkpoint import make as make_engine_config, train


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def page_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".pages"))


def store_config(tmp_path, engine: str, **kw) -> pagemem.StoreConfig:
    cfg = dict(page_bytes=PAGE, gpu_bytes=8 * PAGE, cpu_bytes=16 * PAGE, nvme_bytes=32 * PAGE,
               nvme_path=str(tmp_path), staging_pages=4, io_engine=engine, copy_threads=2)
    cfg.update(kw)
    return pagemem.StoreConfig(**cfg)


def test_store_close_after_a_failed_write_back_releases_everything(tmp_path, engine):
    pagemem.PageStore(store_config(tmp_path, engine)).close()  # first use opens what stays open
    before_fds, before_threads = fds(), threads()
    store = pagemem.PageStore(store_config(tmp_path, engine))
    assert page_files(tmp_path) and fds() - before_fds
    ok, t = (store.allocate((2 * PAGE,), torch.uint8, tier="cpu") for _ in range(2))
    ok.move("nvme").wait()  # the engine's threads run
    faults = FaultyEngine(store.tier("nvme").engine)
    store.tier("nvme").engine = faults
    faults.fail_next("write", "eio", count=3)
    t.copy_(random_tensor((2 * PAGE,), torch.uint8))
    with pytest.raises(TierIOError):
        t.move("nvme").wait()
    assert threads() - before_threads
    assert outcome(store.close) is None
    assert fds() == before_fds and threads() == before_threads and not page_files(tmp_path)


def test_store_close_releases_everything_when_a_part_of_closing_raises(tmp_path, engine, monkeypatch):
    pagemem.PageStore(store_config(tmp_path, engine)).close()
    before_fds, before_threads = fds(), threads()
    store = pagemem.PageStore(store_config(tmp_path, engine))
    t = store.allocate((2 * PAGE,), torch.uint8, tier="cpu")
    for tier in ("gpu", "nvme", "cpu"):  # every engine's threads run
        t.move(tier).wait()
    io = store.tier("nvme").engine
    real_close = type(io).close

    def failing_close(self):
        real_close(self)  # its threads stop, then it reports a failure
        raise OSError("planted: the engine's close failed")

    monkeypatch.setattr(type(io), "close", failing_close)
    err = outcome(store.close)
    assert isinstance(err, OSError) and "planted" in str(err)
    assert fds() == before_fds and threads() == before_threads and not page_files(tmp_path)
    assert outcome(store.close) is None  # closed once is closed


def _train_with_failing_write_back(tmp_path):
    model, cfg = make_engine_config(tmp_path)
    engine = pagemem.Engine(model, cfg)
    train(engine, 1)
    nvme = engine.store.tier("nvme")
    faults = FaultyEngine(nvme.engine)
    nvme.engine = faults
    faults.fail_next("write", "eio", count=10_000)
    return engine, model, faults


def test_engine_close_after_a_failed_write_back_releases_everything(tmp_path):
    nvme_dir = tmp_path / "nvme"
    model, cfg = make_engine_config(tmp_path)
    with pagemem.Engine(model, cfg) as warm:  # first use opens what stays open
        train(warm, 1)
    before_fds, before_threads = fds(), threads()
    engine, model, faults = _train_with_failing_write_back(tmp_path)
    assert page_files(nvme_dir) and threads() - before_threads
    assert outcome(lambda: train(engine, 2)) is None  # its write-back of the states to nvme fails...
    err = outcome(engine.close)  # ...which close() reports once everything is released
    assert faults.injected > 0
    assert isinstance(err, TierIOError), err
    assert fds() == before_fds and threads() == before_threads and not page_files(nvme_dir)
    assert engine.store.closed
    # the other behaviour of close is kept: the module has its weights back, as plain parameters
    assert all(type(p) is torch.nn.Parameter and torch.isfinite(p).all() for p in model.parameters())


def test_a_dead_adam_worker_fails_steps_and_close_still_releases(tmp_path, monkeypatch):
    """The engine's Adam workers: a worker killed inside an update fails the step with
    WorkerDied; the next step raises too instead of hanging; close releases everything."""
    model, cfg = make_engine_config(tmp_path)
    with pagemem.Engine(model, cfg) as warm:
        train(warm, 1)
    before_fds, before_threads = fds(), threads()
    model, cfg = make_engine_config(tmp_path)
    engine = pagemem.Engine(model, cfg)
    train(engine, 1)

    def dying(*args, **kwargs):
        raise SystemExit("planted: the worker ends")

    monkeypatch.setattr(update_mod, "fused_steps", dying)
    first = outcome(lambda: train(engine, 2))  # the update is left unfinished ([Note: a step is a transaction])
    assert isinstance(first, pagemem.StepFailed) and isinstance(first.__cause__, WorkerDied)
    assert isinstance(first.__cause__.__cause__, SystemExit)
    monkeypatch.undo()
    again = outcome(engine.step)  # finishing it needs the dead worker: raises again, no hang
    assert isinstance(again, WorkerDied)
    err = outcome(engine.close)
    assert err is None or isinstance(err, WorkerDied)
    assert fds() == before_fds and threads() == before_threads and not page_files(tmp_path / "nvme")


# ---------------------------------------------------------------- page files of dead owners

_CHILD = """
import os, sys, pagemem
cfg = pagemem.StoreConfig(page_bytes=4096, cpu_bytes=4 * 4096, nvme_bytes=8 * 4096, nvme_path=sys.argv[1])
store = pagemem.PageStore(cfg)
print(store.tier("nvme").paths[0], flush=True)
sys.stdin.read()  # until killed
"""


def test_a_new_store_removes_the_page_file_of_a_killed_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        left = child.stdout.readline().strip()
        assert os.path.basename(left).startswith(f"pagemem-{child.pid}-") and os.path.exists(left)
        alive = pagemem.PageStore(store_config(tmp_path, "threads"))
        assert os.path.exists(left)  # a live owner's file is never touched
        alive.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdin.close()
        child.stdout.close()
    assert os.path.exists(left)  # SIGKILL: nothing cleaned up
    with pagemem.PageStore(store_config(tmp_path, "threads")) as store:
        assert not os.path.exists(left)
        assert page_files(tmp_path) == [os.path.basename(p) for p in store.tier("nvme").paths]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_sweep_removes_only_unlocked_page_files_of_dead_pids(tmp_path):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        names = {
            "stale": f"pagemem-{dead}-0123456789ab.pages",
            "live_owner": f"pagemem-{sleeper.pid}-0123456789ab.pages",
            "not_a_page_file": f"pagemem-{dead}-0123456789ab.pages.bak",
            "lookalike": f"pagemem-{dead}-notahexname.pages",
            "locked": f"pagemem-{dead}-ba9876543210.pages",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"x")
        import fcntl

        holder = os.open(tmp_path / names["locked"], os.O_RDONLY)  # as a child of the owner would
        fcntl.flock(holder, fcntl.LOCK_SH)
        try:
            removed = remove_stale(str(tmp_path))
        finally:
            os.close(holder)
        assert [os.path.basename(p) for p in removed] == [names["stale"]]
        assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "stale")
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("stepped", [False, True])
def test_after_close_no_parameter_keeps_a_gradient_handle(stepped):
    """The handles read pages ``close()`` gives back: every ``p.grad`` is None after it, whether a
    step took the gradients or not, and the weights read as plain tensors."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    cfg = pagemem.EngineConfig(store=pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                                                         page_bytes=PAGE))
    engine = pagemem.Engine(model, cfg)
    engine(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    if stepped:
        engine.optimizer.step()
    engine.close()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
