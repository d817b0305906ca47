"""Flip one byte in a share file of a 2-rank checkpoint; load with 2 and 1 ranks: must refuse."""
import sys, os, shutil, glob
from launch import launch
extra = dict(a.split("=", 1) for a in sys.argv[1:])
ck = "/tmp/att/ck_corrupt"
shutil.rmtree(ck, ignore_errors=True)
base = dict(steps=4, **extra)
rcs, texts, full, t = launch("engine", 2, "/tmp/att/a5_full", **base, save_at=2, save_dir=ck)
print("full", rcs)
step = glob.glob(ck + "/step-*")[0]
pristine = ck + "_pristine"
shutil.rmtree(pristine, ignore_errors=True); shutil.copytree(step, pristine)
for fname in ("exp_avg.pages", "master.pages", "exp_avg_sq.pages", "compute.pages"):
    for where in ("first", "last", "mid"):
        shutil.rmtree(step); shutil.copytree(pristine, step)
        path = os.path.join(step, fname)
        n = os.path.getsize(path)
        off = {"first": 10, "last": n - 10, "mid": n // 2 + 3}[where]
        with open(path, "r+b") as f:
            f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10]))
        for w in (2, 1):
            rcs, texts, res, t = launch("engine", w, f"/tmp/att/a5_{fname}_{w}", **base, resume=ck, timeout=120)
            msg = [l for x in texts for l in x.splitlines() if "Error" in l or "Corrupt" in l][:1]
            print(f"{fname} size={n} byte@{off}({where}) world={w}: rcs={rcs}", msg)
