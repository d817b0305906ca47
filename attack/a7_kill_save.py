import os, shutil, glob
from launch import launch, diff
ck = "/tmp/att/ck_kill"; shutil.rmtree(ck, ignore_errors=True)
rcs, texts, res, t = launch("kill_in_save", 2, "/tmp/att/a7", timeout=120, save_dir=ck)
print(rcs, f"{t:.0f}s"); [print(f"rank {r}:", [l for l in x.splitlines() if "save" in l][-2:]) for r, x in enumerate(texts)]
print(sorted(os.listdir(ck)), open(ck + "/latest").read())
rcs, texts, res, t = launch("engine", 2, "/tmp/att/a7_resume", timeout=120, resume=ck, steps=4)
print("resume", rcs); [print(x[-1500:]) for r, x in zip(rcs, texts) if r]
rcs, texts, ref, t = launch("engine", 2, "/tmp/att/a7_ref", timeout=120, steps=4)
print("resume vs uninterrupted:", diff(ref[0]["model_sd"], res[0]["model_sd"]) if res[0] else None)
