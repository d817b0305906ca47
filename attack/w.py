"""One rank of an attack scenario. python w.py SCEN RANK WORLD PORT OUT [k=v ...]
Writes OUT_r<rank>.pt with what it saw."""
from __future__ import annotations
import os, sys, time, traceback, signal
from datetime import timedelta
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist

V, SEQ, PER = 128, 8, 6
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(24, 700)          # 16800 elements: a bit more than a 64 KiB page of fp32
        self.l2 = nn.Linear(700, 24, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))   # 0-dim
        self.one = nn.Parameter(torch.ones(1))         # 1 element
        self.head = nn.Linear(24, V, bias=False)
        self.head.weight = self.emb.weight             # tied

    def forward(self, x):
        h = self.frozen(self.emb(x))
        h = torch.tanh(self.l1(h)) * self.scale
        h = self.l2(h) * self.one
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), x[:, 1:].reshape(-1))


class GPTLoss(nn.Module):
    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.m = transformers.GPT2LMHeadModel(cfg)

    def forward(self, x):
        return self.m(input_ids=x, labels=x).loss


def make(opts):
    m = GPTLoss() if opts.get("model") == "gpt" else Odd()
    if opts.get("dtype") == "bf16":
        m = m.to(torch.bfloat16)
    return m


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, V, (PER, SEQ), generator=g)
    per = PER // world
    return x[rank * per:(rank + 1) * per]


def config(opts):
    import pagemem
    nv = opts.get("nvme")
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=int(opts.get("gpu_bytes", 8 << 20)), cpu_bytes=64 << 20,
                                page_bytes=64 << 10, nvme_bytes=(256 << 20) if nv else 0, nvme_path=nv)
    clip = opts.get("clip")
    cd = opts.get("compute")
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(**HP), optimizer_tier="nvme" if nv else "cpu",
                                max_grad_norm=float(clip) if clip and opts.get("loop") != "1" else None,
                                compute_dtype={"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[cd],
                                accumulation_steps=int(opts.get("accum", 1)), adam_threads=1,
                                collective_timeout_s=float(opts.get("timeout", 30)),
                                shard_optimizer_states=opts.get("shard", "1") == "1")


def hooks(opts, step, model, rank, engine=None):
    """Between-step manipulations, identical on every rank (unless said)."""
    if opts.get("mutate") and int(opts["mutate"]) == step:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("l1.weight") or n.endswith("c_fc.weight") or n.endswith("scale"):
                    if opts.get("mutvia") == "param":
                        p.mul_(0.5)
                    elif opts.get("mutvia") == "partial":   # only elements of one rank's share
                        p.data.view(-1)[-5:].mul_(0.5)
                    else:
                        p.data.mul_(0.5)
    if opts.get("unfreeze") and int(opts["unfreeze"]) == step:
        for n, p in model.named_parameters():
            pass
        for mod in model.modules():
            if hasattr(mod, "weight") and mod is getattr(model, "frozen", None):
                mod.weight.requires_grad_(True)
    if opts.get("readone") and rank == 0:
        s = sum(float(p.float().sum()) for _, p in model.named_parameters())


def run_engine(rank, world, out, opts):
    import pagemem
    model = make(opts)
    steps = int(opts.get("steps", 6))
    accum = int(opts.get("accum", 1))
    first = 0
    res = {}
    if opts.get("resume"):
        engine = pagemem.Engine.load(opts["resume"], model, config(opts))
        first = engine.global_step
    else:
        engine = pagemem.Engine(model, config(opts))
    sched = None
    if opts.get("sched") == "1":
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
        if first:
            for _ in range(first):
                sched.step()
    losses = []
    res["per_step"] = []
    for step in range(first, steps):
        sent0 = engine.stats()["ranks"]["sent_bytes"] if world > 1 else 0
        hooks(opts, step, model, rank, engine)
        if opts.get("osd_roundtrip") and int(opts["osd_roundtrip"]) == step:
            sd = engine.optimizer.state_dict()
            engine.optimizer.load_state_dict(sd)
        for micro in range(accum):
            x = batch(step * accum + micro, rank, world)
            loss = engine(x)
            losses.append(float(loss))
            if opts.get("loop") == "1":
                (loss / accum).backward()
            else:
                engine.backward(loss / accum if accum > 1 and opts.get("divide") == "1" else loss)
        if opts.get("loop") == "1":
            if opts.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(opts["clip"]))
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=opts.get("none", "1") == "1")
        else:
            engine.step()
        if sched:
            sched.step()
        if world > 1:
            pl = engine.pager.last_plan
            res["per_step"].append((engine.stats()["ranks"]["sent_bytes"] - sent0,
                                    pl.bytes_moved()["network"] if pl is not None else None))
        if opts.get("save_at") and int(opts["save_at"]) == step + 1:
            engine.save(opts["save_dir"])
    res["losses"] = losses
    res["model_sd"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if opts.get("final") != "0":
        res["engine_sd"] = {k: v.clone() for k, v in engine.state_dict().items()}
        res["optim"] = engine.optimizer.state_dict()
    st = engine.stats()
    res["ranks"] = st.get("ranks")
    plan = engine.pager.last_plan
    res["plan_network"] = plan.bytes_moved()["network"] if plan is not None else None
    if opts.get("weights_dir"):
        engine.save_weights(opts["weights_dir"])
    engine.close()
    torch.save(res, f"{out}_r{rank}.pt")


def run_ddp(rank, world, out, opts):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = make(opts)
    ddp = DDP(model) if world > 1 else model
    groups = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(groups, **HP, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if opts.get("sched") == "1" else None
    steps = int(opts.get("steps", 6))
    losses = []
    for step in range(steps):
        if opts.get("mutate") and int(opts["mutate"]) == step:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("l1.weight") or n.endswith("c_fc.weight") or n.endswith("scale"):
                        if opts.get("mutvia") == "partial":
                            p.data.view(-1)[-5:].mul_(0.5)
                        else:
                            p.data.mul_(0.5)
        x = batch(step, rank, world)
        loss = ddp(x)
        losses.append(float(loss))
        loss.backward()
        if opts.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(opts["clip"]))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    torch.save({"losses": losses, "model_sd": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": opt.state_dict()}, f"{out}_r{rank}.pt")


def main():
    scen, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    opts = dict(a.split("=", 1) for a in sys.argv[6:])
    torch.set_num_threads(1)
    if world > 1 or scen != "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    try:
        if scen == "ddp":
            run_ddp(rank, world, out, opts)
        elif scen == "engine":
            run_engine(rank, world, out, opts)
        else:
            import attack_scen
            getattr(attack_scen, scen)(rank, world, out, opts)
    except BaseException as e:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
