"""A training process for the fork tests (tests/test_fork.py): trains a small model through an
engine with optimizer states on nvme beside plain PyTorch doing the same arithmetic, and forks
at chosen points of its loop. Each child does what its fork says and leaves the way a script
does (``sys.exit(0)``: atexit handlers, finalizers and the interpreter's teardown run), while the
parent trains on; the parent reaps each child with a timeout (a child still alive then is killed
and reported as hung). Prints one JSON line: what every child reported, whether the page files
stayed while the parent trained, whether its weights equal plain PyTorch's, save and close.

Argument: one JSON object, {"nvme_path", "ckpt", "io_engine", "steps", "lock_free", "timeout",
"forks": [{"step", "at", "child"}]}; ``at`` is one of POINTS, ``child`` one of CHILDREN.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import time
import weakref

import torch
from torch import nn

import pagemem
from pagemem.errors import WrongProcess

D = 128
POINTS = ("before_forward", "after_forward", "after_backward", "after_step")
CHILDREN = ("exit", "del-gc", "calls", "new-engine")


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.ReLU())], nn.Linear(D, 1))


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)


def config(nvme_path: str, io_engine: str, lock_free: bool = False) -> pagemem.EngineConfig:
    store = pagemem.StoreConfig(page_bytes="64KiB", gpu_bytes="384KiB", cpu_bytes="8MiB", gpu_backend="host",
                                nvme_bytes="8MiB", nvme_path=nvme_path, io_engine=io_engine)
    extra = {"lock_free": True, "max_staleness": 0} if lock_free else {}
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=1e-2, weight_decay=0.1),
                                optimizer_tier="nvme", **extra)


class Reference:
    def __init__(self) -> None:
        self.model = make()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    def train(self, i: int) -> None:
        x, y = batch(i)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def differing(engine: pagemem.Engine, ref: Reference) -> list[str]:
    got, want = engine.state_dict(), ref.model.state_dict()
    return [k for k in want if not torch.equal(got[k], want[k])]


class Live:
    """What the loop holds: the child of a fork drops it all for ``del-gc``."""
    engine: pagemem.Engine | None = None
    model: nn.Module | None = None
    loss: torch.Tensor | None = None


S = Live()


def child_calls(spec: dict, i: int) -> dict:
    """Each engine entry point raises WrongProcess at once."""
    engine, model = S.engine, S.model
    x, y = batch(i)

    def no_grad_forward():
        with torch.no_grad():
            return engine(x)

    calls = {
        "forward under no_grad": no_grad_forward,
        "forward": lambda: engine(x),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "optimizer.step": engine.optimizer.step,
        "state_dict": engine.state_dict,
        "model.state_dict": model.state_dict,
        "save": lambda: engine.save(spec["ckpt"] + "-child"),
        "stats": engine.stats,
        "read a parameter": lambda: model[0].weight.sum(),
        "close": engine.close,
    }
    if S.loss is not None:
        calls["engine.backward"] = lambda: engine.backward(S.loss)
        calls["loss.backward"] = lambda: S.loss.backward()
    out = {}
    for name, fn in calls.items():
        t0 = time.monotonic()
        try:
            fn()
            outcome = "returned"
        except WrongProcess:
            outcome = "WrongProcess"
        except BaseException as exc:  # reported, not raised: the report is the point
            outcome = f"{type(exc).__name__}: {exc}"
        out[name] = [outcome, round(time.monotonic() - t0, 3)]
    return {"calls": out}


def child_new_engine(spec: dict) -> dict:
    """A new engine made in the child is the child's own: it trains exactly, in the same directory."""
    model, ref = make(), Reference()
    engine = pagemem.Engine(model, config(spec["nvme_path"], spec["io_engine"]))
    for i in range(3):
        x, y = batch(100 + i)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref.train(100 + i)
    bad = differing(engine, ref)
    engine.close()
    return {"new_engine_differs": bad}


def run_child(spec: dict, fork: dict, i: int, w: int) -> None:
    torch.set_num_threads(1)  # a forked OpenMP pool is not the child's
    kind = fork["child"]
    report: dict = {"child": kind, "pid": os.getpid()}
    try:
        if kind == "del-gc":
            store = weakref.ref(S.engine.store)
            S.engine = S.model = S.loss = None
            gc.collect()
            report["store_collected"] = store() is None
        elif kind == "calls":
            report.update(child_calls(spec, i))
        elif kind == "new-engine":
            report.update(child_new_engine(spec))
    except BaseException as exc:  # reported: the parent's verdict says what went wrong
        report["error"] = f"{type(exc).__name__}: {exc}"
    os.write(w, (json.dumps(report) + "\n").encode())
    os.close(w)
    sys.exit(0)  # the way a script ends: atexit handlers, finalizers and teardown run


class Child:
    def __init__(self, pid: int, r: int, fork: dict, deadline: float) -> None:
        self.pid, self.r, self.fork, self.deadline = pid, r, fork, deadline
        self.data = b""
        self.status: int | None = None

    def drain(self) -> None:
        while select.select([self.r], [], [], 0)[0]:
            chunk = os.read(self.r, 65536)
            if not chunk:
                break
            self.data += chunk

    def poll(self) -> bool:
        self.drain()
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def reap(self) -> dict:
        while not self.poll():
            if time.monotonic() > self.deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                self.drain()
                self.status = -1
                break
            time.sleep(0.01)
        os.close(self.r)
        lines = [json.loads(line) for line in self.data.decode().splitlines() if line.strip()]
        return {"fork": self.fork, "hung": self.status == -1,
                "exit_code": os.waitstatus_to_exitcode(self.status) if self.status not in (None, -1) else None,
                "report": lines[0] if lines else None}


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    ref = Reference()
    S.model = make()
    S.engine = pagemem.Engine(S.model, config(spec["nvme_path"], spec["io_engine"], spec.get("lock_free", False)))
    paths = list(S.engine.store.tier("nvme").paths)
    forks = {(f["step"], f["at"]): f for f in spec["forks"]}
    children: list[Child] = []
    done: list[dict] = []
    missing: list[str] = []

    def point(i: int, at: str) -> None:
        fork = forks.get((i, at))
        if fork is None:
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            run_child(spec, fork, i, w)
        os.close(w)
        children.append(Child(pid, r, fork, time.monotonic() + spec.get("timeout", 20)))

    def check_files(where: str) -> None:
        for p in paths:
            if not os.path.exists(p):
                missing.append(f"{p} at {where}")
        for c in list(children):
            if c.poll():
                children.remove(c)
                done.append(c.reap())

    for i in range(spec["steps"]):
        x, y = batch(i)
        point(i, "before_forward")
        S.loss = nn.functional.mse_loss(S.engine(x), y)
        point(i, "after_forward")
        check_files(f"step {i} forward")
        S.engine.backward(S.loss)
        S.loss = None
        point(i, "after_backward")
        check_files(f"step {i} backward")
        S.engine.step()
        ref.train(i)
        point(i, "after_step")
        check_files(f"step {i} step")
    for c in children:
        done.append(c.reap())
    children.clear()
    check_files("after every child")
    x, y = batch(999)  # one more step once every child is gone
    S.engine.backward(nn.functional.mse_loss(S.engine(x), y))
    S.engine.step()
    ref.train(999)
    check_files("the last step")
    result = {"children": done, "missing": missing, "differs": differing(S.engine, ref)}
    try:
        result["saved"] = S.engine.save(spec["ckpt"])
    except BaseException as exc:
        result["save_error"] = f"{type(exc).__name__}: {exc}"
    try:
        S.engine.close()
        result["closed"] = True
    except BaseException as exc:
        result["close_error"] = f"{type(exc).__name__}: {exc}"
    result["files_left"] = [p for p in paths if os.path.exists(p)]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
