"""Save with 2 ranks after step 3, resume with 1, 2, 3; compare with an uninterrupted 2-rank run.
Then corrupt a byte of each share file in the checkpoint and try to load."""
import sys, os, shutil, glob, torch
from launch import launch, diff
extra = dict(a.split("=", 1) for a in sys.argv[1:])
ck = f"/tmp/att/ck_{extra.get('dtype','fp32')}"
shutil.rmtree(ck, ignore_errors=True)
base = dict(steps=6, clip="0.5", **extra)
rcs, texts, full, t = launch("engine", 2, "/tmp/att/a4_full", **base, save_at=3, save_dir=ck)
print("full", rcs, f"{t:.0f}s"); [print(x[-2000:]) for r, x in zip(rcs, texts) if r]
print(sorted(os.listdir(ck)), sorted(os.listdir(glob.glob(ck + "/step-*")[0])))
for w in (2, 1, 3):
    rcs, texts, res, t = launch("engine", w, f"/tmp/att/a4_r{w}", **base, resume=ck)
    print(f"resume world={w}", rcs, f"{t:.0f}s"); [print(x[-2000:]) for r, x in zip(rcs, texts) if r]
    if res[0]:
        d = diff(full[0]["model_sd"], res[0]["model_sd"])
        print("  vs full model_sd:", "bit-equal" if not d else max(abs(v) for _, v in d if not isinstance(v, str)))
        d = diff(full[0]["engine_sd"], res[0]["engine_sd"])
        print("  vs full engine_sd:", "bit-equal" if not d else max(abs(v) for _, v in d if not isinstance(v, str)))
        print("  losses tail:", full[0]["losses"][3:], res[0]["losses"])
