"""A training process for the resume tests: trains the tiny GPT to ``--steps`` updates, saving a
checkpoint after every update, resuming from ``--ckpt`` if one exists; writes the final weights
as raw float32 files (no pickle) into ``--out_dir``. Prints ``saving N`` / ``saved N`` lines."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pagemem  # noqa: E402
from pagemem.models.gpt import GPT, GPTConfig  # noqa: E402

from conftest import engine_gpu_budget  # noqa: E402

PAGE = 64 * 1024


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 128, (2, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--nvme_path", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=16))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    # the activations plus a third of the parameters, as the in-process tests (nbytes // 2 ran over it)
    gpu = engine_gpu_budget(model, lambda m: torch.nn.functional.cross_entropy(
        m(batch(0)[0]).reshape(-1, 128), batch(0)[1].reshape(-1)).backward(), PAGE, 1 / 3)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=gpu, cpu_bytes=16 * nbytes + 64 * PAGE,
                                nvme_bytes=16 * nbytes + 64 * PAGE, nvme_path=args.nvme_path)
    cfg = pagemem.EngineConfig(store=store, optimizer_tier="nvme", adam_threads=1,
                               optimizer=pagemem.AdamW(lr=3e-3, weight_decay=0.1))
    if os.path.exists(os.path.join(args.ckpt, "latest")):
        engine = pagemem.Engine.load(args.ckpt, model, cfg)
    else:
        engine = pagemem.Engine(model, cfg)
    with engine:
        print("start", engine.global_step, flush=True)
        while engine.global_step < args.steps:
            idx, targets = batch(engine.global_step)
            logits = engine(idx)
            engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1)))
            engine.step()
            if args.save:
                print("saving", engine.global_step, flush=True)
                engine.save(args.ckpt)
                print("saved", engine.global_step, flush=True)
        os.makedirs(args.out_dir, exist_ok=True)
        for k, v in engine.state_dict().items():
            v.float().numpy().tofile(os.path.join(args.out_dir, k))
    print("done", flush=True)


if __name__ == "__main__":
    main()
