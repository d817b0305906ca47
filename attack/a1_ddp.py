"""fp32 Odd model (tied, frozen, 0-dim, 1-element, >1 page): sharded vs replicas vs DDP fused AdamW, bit for bit."""
import sys
from launch import launch, diff
extra = dict(a.split("=", 1) for a in sys.argv[1:])
world = int(extra.pop("world", 2))
base = dict(steps=5, clip="0.5", **extra)
out = {}
for name, scen, o in [("ddp", "ddp", {}), ("shard", "engine", {"shard": "1"}), ("repl", "engine", {"shard": "0"})]:
    rcs, texts, res, t = launch(scen, world, f"/tmp/att/a1_{name}", **{**base, **o})
    print(name, rcs, f"{t:.0f}s")
    for r, tx in enumerate(texts):
        if rcs[r] != 0: print(f"--- rank {r}\n", tx[-3000:])
    out[name] = res
for name in ("shard", "repl"):
    if out[name][0] is None: continue
    print(name, "vs ddp model_sd:", diff(out["ddp"][0]["model_sd"], out[name][0]["model_sd"]))
    print(name, "vs ddp losses:", out["ddp"][0]["losses"] == out[name][0]["losses"])
    for r in range(1, world):
        print(name, f"rank{r} vs rank0 model_sd:", diff(out[name][0]["model_sd"], out[name][r]["model_sd"]))
    print(name, "engine_sd vs model_sd:", diff(out[name][0]["model_sd"], out[name][0]["engine_sd"]))
    print(name, "ranks stats:", out[name][0]["ranks"], "per step (sent, plan)", out[name][0]["per_step"])
if out["shard"][0] and out["repl"][0]:
    import torch
    a, b = out["shard"][0]["optim"], out["repl"][0]["optim"]
    bad = [(k, s) for k in a["state"] for s in a["state"][k] if not torch.equal(a["state"][k][s], b["state"][k][s])]
    print("optim shard vs repl:", bad, len(a["state"]), len(b["state"]))
    d = out["ddp"][0]["optim"]
    bad = [(k, s) for k in d["state"] for s in ("exp_avg", "exp_avg_sq") if not torch.equal(sorted(a["state"].values(), key=lambda v: -v["exp_avg"].numel())[0][s] if False else a["state"][k][s], d["state"][k][s])] if set(a["state"]) == set(d["state"]) else (sorted(a["state"]), sorted(d["state"]))
    print("optim shard vs ddp:", bad)
if out["shard"][0] and out["repl"][0]:
    print("shard vs repl model_sd:", diff(out["repl"][0]["model_sd"], out["shard"][0]["model_sd"]))
    print("shard vs repl engine_sd:", diff(out["repl"][0]["engine_sd"], out["shard"][0]["engine_sd"]))
    print("shard vs repl losses:", out["repl"][0]["losses"] == out["shard"][0]["losses"])
    for r in range(1, world):
        print(f"shard engine_sd rank{r} vs rank0:", diff(out["shard"][0]["engine_sd"], out["shard"][r]["engine_sd"]))
