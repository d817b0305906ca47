"""One process: a write through p.data to a FROZEN parameter between steps (no version counter)."""
import sys, torch
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from w import Odd, batch, HP
import pagemem
def run(use_engine, via):
    m = Odd()
    if use_engine:
        e = pagemem.Engine(m, pagemem.EngineConfig(store=pagemem.StoreConfig(gpu_backend="host", gpu_bytes=8 << 20, cpu_bytes=64 << 20, page_bytes=64 << 10),
                           optimizer=pagemem.AdamW(**HP), adam_threads=1))
        opt = e.optimizer
    else:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **HP, fused=True)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                (m.frozen.weight.data if via == "data" else m.frozen.weight).mul_(0.5)
        x = batch(step, 0, 1)
        loss = e(x) if use_engine else m(x)
        loss.backward(); opt.step(); opt.zero_grad()
    return {k: v.clone() for k, v in m.state_dict().items()}
for via in ("param", "data"):
    a, b = run(False, via), run(True, via)
    print(via, [(k, float((a[k]-b[k]).abs().max())) for k in a if not torch.equal(a[k], b[k])])
