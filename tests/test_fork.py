"""An engine and its store belong to the process that made them ([Note: an engine belongs to its
process], ``pagemem/process.py``).

Real ``os.fork()``: a child reports through a pipe and the parent waits for it with a timeout (a
child still alive then is killed, and the test fails: a hang never hangs the suite). In a forked
child every call into the parent's engine or store raises ``WrongProcess`` at once, and nothing
the child does (leave through ``sys.exit``, ``del engine`` and ``gc.collect()``) touches the
parent's page files, fds, AIO context or threads: the parent trains on, bit for bit as plain
PyTorch, saves and closes. The children that leave as scripts do run in ``fork_worker.py``, a
process of its own (a child of pytest itself cannot unwind through pytest).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pagemem
from pagemem.errors import WrongProcess
from pagemem.store import PageStore
from pagemem.tiers.pagefile import remove_stale

from conftest import ENGINES
from fork_worker import CHILDREN, POINTS, Reference, batch, config, differing, make

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "fork"),
                                reason="os.fork() on Linux")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_worker.py")
IO = [e for e in ENGINES if isinstance(e, str)]
"""The I/O engines this machine runs (aio first when it has libaio)."""
CHILD_SECONDS = 20
"""A child not done by then is killed and counted as hung."""


# ---------------------------------------------------------------------------------- helpers

def run_worker(tmp_path, io_engine: str, forks: list[dict], steps: int = 6, lock_free: bool = False) -> dict:
    """Run fork_worker.py; its verdict, with its stderr (children's included) as ``stderr``."""
    spec = {"nvme_path": str(tmp_path / "nvme"), "ckpt": str(tmp_path / "ckpt"), "io_engine": io_engine,
            "steps": steps, "lock_free": lock_free, "timeout": CHILD_SECONDS, "forks": forks}
    os.makedirs(spec["nvme_path"], exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(WORKER),
                                                                   os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, WORKER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=60 + CHILD_SECONDS * (len(forks) + 1), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    out["nvme_left"] = sorted(os.listdir(spec["nvme_path"]))
    return out


def assert_parent_unharmed(out: dict) -> None:
    """Every child ended on its own, quietly; the parent's files stayed while it trained; its
    weights are plain PyTorch's; save and close worked and close removed the files."""
    for c in out["children"]:
        assert not c["hung"], f"a child hung (killed after {CHILD_SECONDS} s): {c}"
        assert c["exit_code"] == 0, c
        assert c["report"] is not None and "error" not in c["report"], c
    assert not out["missing"], f"the parent's page file vanished while it trained: {out['missing']}"
    assert not out["differs"], f"weights differ from plain PyTorch: {out['differs']}"
    assert "saved" in out and out.get("closed"), out
    assert not out["files_left"] and not out["nvme_left"], out
    for bad in ("Traceback", "Exception ignored", "io_queue_release", "OSError"):
        assert bad not in out["stderr"], out["stderr"][-4000:]


class Child:
    """A child forked from this (pytest's) process that runs ``body(report)`` and leaves through
    ``os._exit`` (never back into pytest); ``report(obj)`` sends one JSON line to the parent."""

    def __init__(self, body) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                os.close(r)
                body(lambda obj: os.write(w, (json.dumps(obj) + "\n").encode()))
            except BaseException as exc:
                try:
                    os.write(w, (json.dumps({"crashed": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
                except BaseException:
                    pass
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self.r = pid, r

    def wait(self, seconds: float = CHILD_SECONDS) -> tuple[list[dict], bool, int | None]:
        """(reports, hung, exit code): reads until the child exits or ``seconds`` pass (then kills it)."""
        deadline = time.monotonic() + seconds
        data, status, hung = b"", None, False
        while status is None:
            ready = select.select([self.r], [], [], 0.05)[0]
            if ready:
                chunk = os.read(self.r, 65536)
                data += chunk
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                status = st
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                hung = True
                break
        while select.select([self.r], [], [], 0)[0]:
            chunk = os.read(self.r, 65536)
            if not chunk:
                break
            data += chunk
        os.close(self.r)
        reports = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        return reports, hung, None if status is None else os.waitstatus_to_exitcode(status)


def run_calls(calls: dict, report) -> None:
    """In a child: run each of ``calls``, reporting its outcome (and the first WrongProcess's message)."""
    torch.set_num_threads(1)
    for name, fn in calls.items():
        t0 = time.monotonic()
        try:
            fn()
            outcome = "returned"
        except WrongProcess as exc:
            outcome = "WrongProcess"
            if name == next(iter(calls)):
                report({"message": str(exc), "pid": os.getpid(), "owner": exc.owner_pid, "what": exc.what})
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        report({"name": name, "outcome": outcome, "seconds": time.monotonic() - t0})


def child_calls_done(child: Child, calls: dict, seconds: float = CHILD_SECONDS) -> dict:
    """Wait for a child running ``run_calls``; name -> its report. Fails on a hang; checks the
    first WrongProcess's message names both processes, the call, and what to do."""
    reports, hung, code = child.wait(seconds)
    got = {r["name"]: r for r in reports if "name" in r}
    assert not hung, f"the child hung at {next((n for n in calls if n not in got), '?')!r} (done: {list(got)})"
    assert code == 0, reports
    message = next((r for r in reports if "message" in r), None)
    assert message is not None, f"the first call did not raise WrongProcess: {got}"
    assert message["owner"] == os.getpid() and message["pid"] != os.getpid()
    for needle in (str(os.getpid()), str(message["pid"]), message["what"], "new engine"):
        assert needle in message["message"], message
    return got


def calls_in_child(calls: dict, seconds: float = CHILD_SECONDS) -> dict:
    """Run each of ``calls`` in a forked child; name -> its report. Fails on a hang."""
    return child_calls_done(Child(lambda report: run_calls(calls, report)), calls, seconds)


def assert_all_refused(got: dict, calls: dict) -> None:
    assert list(got) == list(calls)
    wrong = {n: r["outcome"] for n, r in got.items() if r["outcome"] != "WrongProcess"}
    assert not wrong, wrong
    slow = {n: r["seconds"] for n, r in got.items() if r["seconds"] > 5}
    assert not slow, slow


# ---------------------------------------------------------------------------------- 1: children that leave

@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_child_that_exits_leaves_the_parent_training(tmp_path, io_engine):
    """Forked while the parent trains (after a step, between forward and backward, between
    backward and step); two children leave through sys.exit(0), two first drop the engine and
    collect garbage (an engine never closed stays reachable through torch's global hooks: its
    finalizers then run at the child's exit). The parent's page file stays, its training is
    exact, save and close work."""
    out = run_worker(tmp_path, io_engine, [{"step": 1, "at": "after_step", "child": "exit"},
                                           {"step": 2, "at": "after_forward", "child": "exit"},
                                           {"step": 3, "at": "after_backward", "child": "del-gc"},
                                           {"step": 4, "at": "after_forward", "child": "del-gc"}])
    assert [c["fork"]["child"] for c in out["children"]] == ["exit", "exit", "del-gc", "del-gc"]
    assert_parent_unharmed(out)


def test_a_child_calling_the_engine_is_refused_then_exits_cleanly(tmp_path):
    """The child calls every entry point (with a live graph of the parent's: engine.backward and
    loss.backward by habit too), each raises WrongProcess at once; then it leaves by sys.exit.
    Another child makes its own engine, in the same directory: it trains exactly."""
    out = run_worker(tmp_path, IO[0],
                     [{"step": 1, "at": "after_forward", "child": "calls"},
                      {"step": 2, "at": "after_step", "child": "calls"},
                      {"step": 3, "at": "before_forward", "child": "new-engine"}])
    assert_parent_unharmed(out)
    calls = [c["report"]["calls"] for c in out["children"] if c["fork"]["child"] == "calls"]
    assert "loss.backward" in calls[0]
    for got in calls:
        assert {n: o for n, (o, s) in got.items() if o != "WrongProcess" or s > 5} == {}
    new = next(c["report"] for c in out["children"] if c["fork"]["child"] == "new-engine")
    assert new["new_engine_differs"] == []


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(forks=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(POINTS), st.sampled_from(CHILDREN[:3])),
                      min_size=1, max_size=3, unique_by=lambda f: f[:2]),
       io_engine=st.sampled_from(IO),
       lock_free=st.booleans())
def test_forking_anywhere_in_the_loop_never_harms_the_parent(tmp_path_factory, forks, io_engine, lock_free):
    """Fork at random points of the loop (the engine's threads busy: nvme write-backs, copies,
    the lock-free updater); the children leave in random ways."""
    out = run_worker(tmp_path_factory.mktemp("fork"), io_engine,
                     [{"step": s, "at": at, "child": child} for s, at, child in forks], steps=4, lock_free=lock_free)
    assert_parent_unharmed(out)


# ---------------------------------------------------------------------------------- 2: every call refused

@pytest.mark.parametrize("io_engine", ENGINES)
def test_every_engine_entry_point_raises_in_a_child(tmp_path, io_engine):
    """Mid-step (a backward summed, the gradient handles up; another forward's graph alive), a
    child calls each entry point: each raises WrongProcess at once. The parent then finishes the
    step and trains on exactly."""
    cfg = config(str(tmp_path), io_engine)
    cfg = pagemem.EngineConfig(store=cfg.store, optimizer=cfg.optimizer, optimizer_tier="nvme", accumulation_steps=2)
    model, ref = make(), Reference()
    engine = pagemem.Engine(model, cfg)
    paths = engine.store.tier("nvme").paths

    def ref_step(i):
        for j in (2 * i, 2 * i + 1):
            x, y = batch(j)
            nn.functional.mse_loss(ref.model(x), y).backward()
        ref.opt.step()
        ref.opt.zero_grad()

    for i in range(2):
        for j in (2 * i, 2 * i + 1):
            x, y = batch(j)
            engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref_step(i)
    x, y = batch(4)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    x, y = batch(5)
    loss = nn.functional.mse_loss(engine(x), y)
    assert model[0].weight.grad is not None  # a gradient handle
    params, resident_now = engine.bank.params, engine.guard._resident
    evicted = next(p for i, (_, p) in enumerate(params) if not resident_now(i))
    resident = next(p for i, (_, p) in enumerate(params) if resident_now(i))

    def no_grad_forward():
        with torch.no_grad():
            engine(x)

    calls = {
        "forward under no_grad": no_grad_forward,
        "forward": lambda: engine(x),
        "engine.backward": lambda: engine.backward(loss),
        "loss.backward by habit": lambda: loss.backward(),
        # before anything that sets p.grad to None in the child (the handles' metadata is the child's)
        "torch clip_grad_norm_ over model.parameters()": lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "a gradient handle's values": lambda: model[0].weight.grad.sum(),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "optimizer.step": engine.optimizer.step,
        "optimizer.zero_grad": engine.optimizer.zero_grad,
        "optimizer.state_dict": engine.optimizer.state_dict,
        "state_dict": engine.state_dict,
        "model.state_dict": model.state_dict,
        "save": lambda: engine.save(str(tmp_path / "child-ckpt")),
        "save_weights": lambda: engine.save_weights(tmp_path / "child-weights"),
        "stats": engine.stats,
        "clip_grad_norm_": lambda: engine.clip_grad_norm_(1.0),
        "clip_grad_norm_ inf": lambda: engine.clip_grad_norm_(1.0, float("inf")),
        "get_global_grad_norm": engine.get_global_grad_norm,
        "reading an evicted parameter": lambda: evicted.sum(),
        "reading a resident parameter": lambda: resident * 2,
        "the store's stats": engine.store.stats,
        "close": engine.close,
    }
    got = calls_in_child(calls)
    assert_all_refused(got, calls)
    assert not (tmp_path / "child-weights").exists()  # refused before it touched anything
    assert all(os.path.exists(p) for p in paths)
    engine.backward(loss)
    engine.step()
    ref_step(2)
    for i in range(3, 5):
        for j in (2 * i, 2 * i + 1):
            x, y = batch(j)
            engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref_step(i)
    assert not differing(engine, ref)
    assert all(os.path.exists(p) for p in paths)
    engine.save(str(tmp_path / "ckpt"))
    engine.close()
    assert not any(os.path.exists(p) for p in paths)


@contextlib.contextmanager
def held_by_another_thread(lock):
    """Another thread holds ``lock`` meanwhile: a child forked now gets it copied held."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        done.set()
        holder.join()


def test_calls_are_refused_before_any_lock_a_fork_copied_held(tmp_path):
    """Forked while other threads of the parent hold the engine's op-clock lock (the guard's
    fetches and the clock's hooks take it) and the store's lock: the child's calls raise
    WrongProcess at once instead of waiting for locks no thread of the child will release."""
    model, ref = make(), Reference()
    engine = pagemem.Engine(model, config(str(tmp_path), IO[0]))
    for i in range(2):
        x, y = batch(i)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref.train(i)
    store = engine.store
    evicted = next(p for i, (_, p) in enumerate(engine.bank.params) if not engine.guard._resident(i))

    def no_grad_forward():
        with torch.no_grad():
            engine(x)

    calls = {"forward under no_grad": no_grad_forward, "forward": lambda: engine(x), "step": engine.step,
             "state_dict": engine.state_dict, "model.state_dict": model.state_dict,
             "reading an evicted parameter": lambda: evicted.sum(), "stats": engine.stats,
             "store.stats": store.stats, "store.synchronize": store.synchronize, "close": engine.close,
             "store.close": store.close}
    with held_by_another_thread(engine.clock.lock), held_by_another_thread(store._queue.lock):
        child = Child(lambda report: run_calls(calls, report))
    got = child_calls_done(child, calls)
    assert_all_refused(got, calls)
    for i in range(2, 4):
        x, y = batch(i)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref.train(i)
    assert not differing(engine, ref)
    engine.close()


def test_with_block_left_by_an_exception_in_a_child_lets_it_through(tmp_path):
    """A child forked inside ``with engine:`` (or ``with store:``, ``with lease:``) that raises
    leaves with its own exception, not WrongProcess, and closes nothing."""
    engine = pagemem.Engine(make(), config(str(tmp_path), "threads"))
    t = engine.store.allocate((4,), torch.float32)
    lease = t.lease()

    def leave(cm):
        def fn():
            with cm:
                raise KeyError("the child")
        return fn

    calls = {"a plain call first": engine.stats, "with engine": leave(engine), "with store": leave(engine.store),
             "with lease": leave(lease)}
    got = calls_in_child(calls)
    assert {n: r["outcome"] for n, r in got.items()} == {
        "a plain call first": "WrongProcess", "with engine": "KeyError: 'the child'",
        "with store": "KeyError: 'the child'", "with lease": "KeyError: 'the child'"}
    lease.release()
    t.free()
    engine.close()


def store_calls(store: PageStore, tmp_path) -> dict:
    """A call of every public method of ``store``, with arguments that would work in its owner."""
    t = store.allocate((1024,), torch.float32, "cpu")
    u = store.allocate((1024,), torch.float32, "nvme")
    fd = os.open(str(tmp_path / "export"), os.O_RDWR | os.O_CREAT, 0o600)
    page = t.pages[0]
    return {
        "allocate": lambda: store.allocate((16,), torch.float32),
        "allocate_group": lambda: store.allocate_group([((16,), torch.float32)]),
        "close": store.close,
        "copies": lambda: store.copies(page),
        "copy": lambda: store.copy(t, "gpu"),
        "describe": store.describe,
        "export_page": lambda: store.export_page(page, fd, 0),
        "free": lambda: store.free(t),
        "lease": lambda: store.lease(t),
        "lease_many": lambda: store.lease_many([t]),
        "location": lambda: store.location(page),
        "move": lambda: store.move(t, "nvme"),
        "move_spans": lambda: store.move_spans(0.0),
        "page_count": lambda: store.page_count([t, u]),
        "read": lambda: store.read(u),
        "release": lambda: store.release(t, "cpu"),
        "resize": lambda: store.resize("gpu", 1),
        "stats": store.stats,
        "synchronize": store.synchronize,
        "tier": lambda: store.tier("nvme"),
        "tier_of": lambda: store.tier_of(t),
        "tiers_of": lambda: store.tiers_of(t),
        "view": lambda: store.view(t),
        "view_many": lambda: store.view_many([t]),
        "viewable": lambda: store.viewable(t),
        "write": lambda: store.write(t, torch.ones(1024)),
        "write_many": lambda: store.write_many([(t, torch.ones(1024))]),
        "write_packed": lambda: store.write_packed([t], torch.ones(1024)),
        "PagedTensor.to_torch": u.to_torch,
        "PagedTensor.copy_": lambda: u.copy_(torch.ones(1024)),
        "PagedTensor.move": lambda: u.move("cpu"),
    }


@pytest.mark.parametrize("io_engine", ENGINES)
def test_every_store_method_raises_in_a_child(tmp_path, io_engine):
    """Every public method of PageStore (the list is checked against the class), some through a
    PagedTensor; a MoveHandle's wait and a Lease's release too. The parent's store is whole."""
    store = PageStore(pagemem.StoreConfig(page_bytes=4096, gpu_bytes=8 * 4096, cpu_bytes=16 * 4096,
                                          nvme_bytes=32 * 4096, nvme_path=str(tmp_path), io_engine=io_engine))
    calls = store_calls(store, tmp_path)
    public = {n for n in dir(PageStore) if not n.startswith("_") and callable(getattr(PageStore, n))}
    assert public == {n for n in calls if "." not in n}, "a public method of PageStore has no case here"
    data = torch.arange(4096, dtype=torch.float32)
    w = store.allocate((4096,), torch.float32, "cpu")
    w.copy_(data)
    handle = w.move("nvme")  # possibly still in flight at the fork
    lease = store.allocate((8,), torch.float32).lease()
    calls = {**calls, "MoveHandle.wait": handle.wait, "Lease.release": lease.release}
    got = calls_in_child(calls)
    assert_all_refused(got, calls)
    handle.wait()
    lease.release()
    assert torch.equal(w.to_torch(), data)
    w.move("cpu").wait()
    assert torch.equal(w.to_torch(), data)
    paths = store.tier("nvme").paths
    assert all(os.path.exists(p) for p in paths)
    store.close()
    assert not any(os.path.exists(p) for p in paths)


def test_a_store_collected_in_a_child_is_left_whole(tmp_path):
    """The child drops its copy of a store (its tensors, a live view, a lease, a move in flight)
    and collects it: its finalizers release nothing of the parent's; the parent reads its data
    back and closes."""
    store = PageStore(pagemem.StoreConfig(page_bytes=4096, cpu_bytes=16 * 4096, nvme_bytes=32 * 4096,
                                          nvme_path=str(tmp_path), io_engine=IO[0]))
    data = torch.arange(8 * 1024, dtype=torch.float32)
    t, u = store.allocate(data.shape, data.dtype), store.allocate(data.shape, data.dtype)
    t.copy_(data)
    u.copy_(data * 2)
    live = {"store": store, "t": t, "u": u, "view": u.view(), "lease": u.lease(write=False), "move": t.move("nvme")}
    paths = store.tier("nvme").paths
    del store, t, u  # the child's only references are in ``live``

    def body(report):
        gone = weakref.ref(live["store"])
        live.clear()
        gc.collect()
        report({"collected": gone() is None})

    reports, hung, code = Child(body).wait()
    assert not hung and code == 0 and reports == [{"collected": True}], reports
    assert all(os.path.exists(p) for p in paths)
    live["move"].wait()
    live["lease"].release()
    assert torch.equal(live["t"].to_torch(), data) and torch.equal(live["view"], data * 2)
    live["t"].move("cpu").wait()
    assert torch.equal(live["t"].to_torch(), data)
    live.pop("view")
    live["store"].close()
    assert not any(os.path.exists(p) for p in paths)


# ---------------------------------------------------------------------------------- 3: DataLoader workers

def test_dataloader_fork_workers_beside_a_live_nvme_engine(tmp_path):
    """num_workers=2 with the fork context, new workers every epoch, each collecting garbage: the
    engine beside them trains exactly and keeps its page file."""

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            gc.collect()
            return batch(i)

    io_engine = IO[0]
    model, ref = make(), Reference()
    engine = pagemem.Engine(model, config(str(tmp_path), io_engine))
    paths = engine.store.tier("nvme").paths
    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=2, multiprocessing_context="fork",
                                         worker_init_fn=lambda _: gc.collect(), timeout=60)
    for _epoch in range(2):
        for i, (x, y) in enumerate(loader):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            ref.train(i)
            assert all(os.path.exists(p) for p in paths)
    assert not differing(engine, ref)
    engine.close()
    assert not any(os.path.exists(p) for p in paths)


# ---------------------------------------------------------------------------------- the sweeper

def test_a_dead_owners_page_file_is_swept_while_its_forked_child_lives(tmp_path):
    """A child holds none of its parent's page-file descriptors: once the parent is dead (gone
    without closing, as a SIGKILLed job), its file is swept even while the child still runs."""
    go_r, go_w = os.pipe()

    def owner(report):
        store = PageStore(pagemem.StoreConfig(page_bytes=4096, cpu_bytes=4 * 4096, nvme_bytes=8 * 4096,
                                              nvme_path=str(tmp_path), io_engine="threads"))
        pid = os.fork()
        if pid == 0:  # the grandchild: lives until the test says
            os.close(go_w)
            select.select([go_r], [], [], CHILD_SECONDS)
            os._exit(0)
        report({"grandchild": pid, "paths": store.tier("nvme").paths})
        os._exit(0)  # no close, no finalizer: the file stays, as a killed owner's does

    child = Child(owner)
    os.close(go_r)
    try:
        reports, hung, code = child.wait()
        assert not hung and code == 0, reports
        paths, grandchild = reports[0]["paths"], reports[0]["grandchild"]
        assert all(os.path.exists(p) for p in paths)
        removed = remove_stale(str(tmp_path))
        assert sorted(removed) == sorted(paths), "the live child still holds the dead owner's page file"
    finally:
        os.close(go_w)
        time.sleep(0.05)
    # the grandchild is not ours to reap (its parent is gone); it leaves once the pipe closes
