"""Launch N ranks of w.py; return (returncodes, stderrs, results)."""
from __future__ import annotations
import os, socket, subprocess, sys, time
from pathlib import Path
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = "/work/main/.venv/bin/python"


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scen, world, out, timeout=180, during=None, **opts):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "OMP_NUM_THREADS": "1"}
    p = port()
    args = [f"{k}={v}" for k, v in opts.items()]
    procs, errs = [], []
    for r in range(world):
        ef = open(f"{out}_r{r}.err", "w+")
        errs.append(ef)
        procs.append(subprocess.Popen([PY, str(HERE / "w.py"), scen, str(r), str(world), str(p), str(out), *args],
                                      env=env, stdout=ef, stderr=subprocess.STDOUT))
    t0 = time.time()
    if during:
        during(procs)
    rcs = []
    for pr in procs:
        try:
            rcs.append(pr.wait(timeout=max(1, timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            pr.kill(); pr.wait(); rcs.append("TIMEOUT")
    texts = []
    for e in errs:
        e.seek(0); texts.append(e.read()); e.close()
    res = []
    for r in range(world):
        f = f"{out}_r{r}.pt"
        res.append(torch.load(f, weights_only=False) if os.path.exists(f) else None)
    return rcs, texts, res, time.time() - t0


def diff(a, b):
    """max abs diff over common keys; and set of keys whose bits differ."""
    bad = []
    for k in a:
        if k not in b:
            bad.append((k, "missing")); continue
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append((k, f"shape/dtype {x.shape}{x.dtype} vs {y.shape}{y.dtype}")); continue
        if not torch.equal(x, y):
            bad.append((k, float((x.float() - y.float()).abs().max())))
    return bad
