import shutil, sys
from launch import launch
extra = dict(a.split("=", 1) for a in sys.argv[1:])
ck = "/tmp/att/ck_kg"; shutil.rmtree(ck, ignore_errors=True)
rcs, texts, res, t = launch("kill_in_gather", 2, "/tmp/att/a8", timeout=120, save_dir=ck, **extra)
print(rcs, f"{t:.0f}s"); [print(f"rank {r}:", "\n".join(l for l in x.splitlines() if "rank" in l or "after" in l)[-900:]) for r, x in enumerate(texts)]
