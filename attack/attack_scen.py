"""Extra scenarios for w.py."""
import os, sys, time, torch
import pagemem
from w import make, config, batch


def sd_rank0(rank, world, out, opts):
    """A bf16 model: engine.state_dict() on rank 0 only (a DDP habit)."""
    model = make({**opts, "dtype": "bf16"})
    engine = pagemem.Engine(model, config({**opts, "compute": "bf16"}))
    for step in range(2):
        x = batch(step, rank, world)
        engine.backward(engine(x)); engine.step()
    t0 = time.time()
    if rank == 0:
        try:
            sd = engine.state_dict()
            print(f"rank0 state_dict RETURNED after {time.time()-t0:.1f}s", {k: float(v.float().sum()) for k, v in list(sd.items())[:3]}, flush=True)
        except BaseException as e:
            print(f"rank0 state_dict raised after {time.time()-t0:.1f}s: {type(e).__name__}: {e}", flush=True)
    else:
        time.sleep(float(opts.get("sleep", 5)))
        try:
            x = batch(2, rank, world)
            engine.backward(engine(x)); engine.step()
            print(f"rank{rank} next step ok", flush=True)
        except BaseException as e:
            print(f"rank{rank} next step raised: {type(e).__name__}: {e}", flush=True)
    # what does the engine do afterwards on rank 0?
    if rank == 0:
        try:
            x = batch(2, rank, world)
            engine.backward(engine(x)); engine.step()
            print("rank0 next step ok", flush=True)
        except BaseException as e:
            print(f"rank0 next step raised: {type(e).__name__}: {e}", flush=True)


def readone(rank, world, out, opts):
    """Rank 0 alone reads parameters / model.state_dict() / p.data between steps; must be local."""
    model = make(opts)
    engine = pagemem.Engine(model, config(opts))
    res = []
    for step in range(4):
        if rank == 0:
            t0 = time.time()
            s = sum(float(p.float().sum()) for _, p in model.named_parameters())
            sd = model.state_dict()
            s2 = sum(float(v.float().sum()) for v in sd.values())
            s3 = sum(float(p.data.float().sum()) for p in model.parameters())
            res.append((s, s2, s3, time.time() - t0))
        x = batch(step, rank, world)
        engine.backward(engine(x)); engine.step()
    torch.save({"res": res, "model_sd": {k: v.clone() for k, v in model.state_dict().items()}}, f"{out}_r{rank}.pt")
    engine.close()


def optim_rt(rank, world, out, opts):
    """optimizer.state_dict() then load_state_dict() of it (every rank), a modified lr, then train; also
    load a state dict whose moments were doubled and compare with replicas."""
    model = make(opts)
    engine = pagemem.Engine(model, config(opts))
    for step in range(6):
        if step == 2:
            sd = engine.optimizer.state_dict()
            for st in sd["state"].values():
                st["exp_avg"] = st["exp_avg"] * 2
                st["exp_avg_sq"] = st["exp_avg_sq"] * 3
            sd["param_groups"][0]["lr"] = 1e-3
            engine.optimizer.load_state_dict(sd)
            sd2 = engine.optimizer.state_dict()
            ok = all(torch.equal(sd["state"][k][s], sd2["state"][k][s]) for k in sd["state"] for s in ("exp_avg", "exp_avg_sq"))
            print("roundtrip equal:", ok, sd2["param_groups"][0]["lr"], flush=True)
        x = batch(step, rank, world)
        engine.backward(engine(x)); engine.step()
    torch.save({"model_sd": {k: v.clone() for k, v in model.state_dict().items()},
                "engine_sd": engine.state_dict(), "optim": engine.optimizer.state_dict()}, f"{out}_r{rank}.pt")
    engine.close()


def kill_in_save(rank, world, out, opts):
    """Save after step 2 (whole), then rank 1 SIGKILLs itself while writing its share of the save after step 4."""
    import signal
    from pagemem.engine.checkpoints import checkpoint as ck
    model = make(opts)
    engine = pagemem.Engine(model, config(opts))
    for step in range(5):
        x = batch(step, rank, world)
        engine.backward(engine(x)); engine.step()
        if step == 1:
            engine.save(opts["save_dir"])
        if step == 3:
            if rank == 1:
                orig = ck.write_share
                def die(*a, **k):
                    os.kill(os.getpid(), signal.SIGKILL)
                ck.write_share = die
            t0 = time.time()
            try:
                engine.save(opts["save_dir"])
                print(f"rank{rank} save returned", flush=True)
            except BaseException as e:
                print(f"rank{rank} save raised after {time.time()-t0:.1f}s: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return


def kill_in_gather(rank, world, out, opts):
    """Rank 1 SIGKILLs itself as step 3's master gather starts (after its update); rank 0 must raise
    RankFailed quickly, and refuse everything after."""
    import signal
    from pagemem.engine.ranks import gather
    model = make(opts)
    engine = pagemem.Engine(model, config(opts))
    for step in range(5):
        if step == 3 and rank == 1:
            orig = gather.MasterGather.__call__
            gather.MasterGather.__call__ = lambda self, params: os.kill(os.getpid(), signal.SIGKILL)
        x = batch(step, rank, world)
        engine.backward(engine(x))
        t0 = time.time()
        try:
            engine.step()
        except BaseException as e:
            print(f"rank{rank} step {step} raised after {time.time()-t0:.1f}s: {type(e).__name__}: {str(e)[:250]}", flush=True)
            try:
                sd = model.state_dict()
                print("model.state_dict() after failure ok; finite:", all(torch.isfinite(v).all() for v in sd.values()), flush=True)
                engine.save(opts["save_dir"])
                print("save after failure returned!", flush=True)
            except BaseException as e2:
                print(f"after: {type(e2).__name__}: {str(e2)[:200]}", flush=True)
            return
