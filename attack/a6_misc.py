import sys, torch
from launch import launch, diff
which = sys.argv[1]
if which == "sd_rank0":
    rcs, texts, res, t = launch("sd_rank0", 2, "/tmp/att/a6_sd", timeout=150, sleep=sys.argv[2] if len(sys.argv) > 2 else "5")
    print(rcs, f"{t:.0f}s"); [print(f"--- rank {r}:", "\n".join(l for l in x.splitlines() if "rank" in l or "Error" in l)[-1500:]) for r, x in enumerate(texts)]
elif which == "readone":
    for extra in ({}, {"dtype": "bf16", "compute": "bf16"}, {"model": "gpt", "gpu_bytes": str(1 << 20)}):
        out = {}
        for shard in ("1", "0"):
            rcs, texts, res, t = launch("readone", 2, f"/tmp/att/a6_ro{shard}", timeout=150, shard=shard, **extra)
            print(extra, shard, rcs, f"{t:.0f}s"); [print(x[-1500:]) for r, x in zip(rcs, texts) if r]
            out[shard] = res
        if out["1"][0] and out["0"][0]:
            print("  reads equal:", [a[:3] == b[:3] for a, b in zip(out["1"][0]["res"], out["0"][0]["res"])], "times", [round(a[3], 2) for a in out["1"][0]["res"]])
            print("  final:", diff(out["0"][0]["model_sd"], out["1"][0]["model_sd"]))
elif which == "optim_rt":
    for extra in ({}, {"dtype": "bf16", "compute": "bf16"}):
        out = {}
        for shard in ("1", "0"):
            rcs, texts, res, t = launch("optim_rt", 2, f"/tmp/att/a6_ort{shard}", timeout=150, shard=shard, **extra)
            print(extra, shard, rcs, f"{t:.0f}s", [l for x in texts for l in x.splitlines() if "roundtrip" in l]); [print(x[-1500:]) for r, x in zip(rcs, texts) if r]
            out[shard] = res
        if out["1"][0] and out["0"][0]:
            print("  model:", diff(out["0"][0]["model_sd"], out["1"][0]["model_sd"]), "engine:", diff(out["0"][0]["engine_sd"], out["1"][0]["engine_sd"]))
            print("  rank1 vs rank0:", diff(out["1"][0]["model_sd"], out["1"][1]["model_sd"]))
