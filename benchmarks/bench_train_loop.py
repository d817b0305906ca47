"""What ``pagemem train``'s loop adds to a step, beside the step itself (the anchor, measured in
the same run): the gradient norm it now logs in every mode (synchronous and lock-free, states on
nvme), an evaluation batch, and a batch of your own data (a token file by memory map; text
through a tokenizer) beside the synthetic task's batch.

    python benchmarks/bench_train_loop.py [--steps 12] [--layers 4 --hidden 256 ...]

Each row is the median over ``--steps`` steps after two (traced and planned) are dropped.
Writes ``results/bench_train_loop.json`` and prints a table. The machine may be shared: the
anchors are measured in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from common import table, write_json

import numpy as np
import torch


def _engine_rows(args: argparse.Namespace, lock_free: bool, tmp: str) -> dict:
    from pagemem.commands.models import build
    from pagemem.commands.train_config import layered, resolve
    from pagemem.engine import Engine

    os.makedirs(os.path.join(tmp, "nvme"), exist_ok=True)
    overrides = {"engine.lock_free": str(lock_free).lower(), "store.gpu_bytes": args.gpu_bytes,
                 "store.cpu_bytes": "256MiB", "store.nvme_bytes": "256MiB", "store.page_bytes": "256KiB",
                 "model.layers": str(args.layers), "model.hidden": str(args.hidden), "model.heads": str(args.heads),
                 "model.vocab": str(args.vocab), "model.seq": str(args.seq), "data.vocab": str(args.vocab),
                 "data.seq": str(args.seq), "data.batch": str(args.batch)}
    cfg = resolve(layered([], overrides), tmp)
    built = build(cfg.model, 0)
    step_s, norm_s, eval_s = [], [], []
    with Engine(built.model, cfg.engine) as engine:
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            engine.backward(built.loss_of(engine, cfg.data.batch_at(i)))
            t1 = time.perf_counter()
            engine.get_global_grad_norm()
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            with torch.no_grad():
                built.loss_of(engine, cfg.data.batch_at(1 << 40 | i))
            t4 = time.perf_counter()
            if i >= 2:
                step_s.append((t1 - t0) + (t3 - t2))
                norm_s.append(t2 - t1)
                eval_s.append(t4 - t3)
    return {"lock_free": lock_free, "step_s": statistics.median(step_s), "grad_norm_s": statistics.median(norm_s),
            "eval_batch_s": statistics.median(eval_s)}


def _batch_rows(args: argparse.Namespace, tmp: str) -> dict:
    from pagemem.commands.train_data import Batches, DataSettings

    path = os.path.join(tmp, "train.bin")
    np.random.default_rng(0).integers(0, args.vocab, 4_000_000).astype(np.uint16).tofile(path)
    synthetic = Batches(DataSettings(vocab=args.vocab, seq=args.seq, batch=args.batch))
    tokens = Batches(DataSettings(path=path, seq=args.seq, batch=args.batch))

    def per_batch(b: Batches) -> float:
        t0 = time.perf_counter()
        for i in range(200):
            b.train(i)
        return (time.perf_counter() - t0) / 200

    out = {"synthetic_batch_s": per_batch(synthetic), "token_file_batch_s": per_batch(tokens)}
    try:
        import tokenizers
    except ImportError:
        return out
    words = [f"w{i}" for i in range(500)]
    rng = np.random.default_rng(1)
    text = "\n".join(" ".join(rng.choice(words, 20)) for _ in range(20_000))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text[:200_000]], tokenizers.trainers.BpeTrainer(vocab_size=600,
                                                                              special_tokens=["<unk>"]))
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "corpus.txt"), "w") as f:
        f.write(text)
    t0 = time.perf_counter()
    corpus = Batches(DataSettings(path=os.path.join(tmp, "corpus.txt"), tokenizer=os.path.join(tmp, "tokenizer.json"),
                                  seq=args.seq, batch=args.batch)).corpus
    seconds = time.perf_counter() - t0
    out.update({"text_tokens": int(corpus.train_tokens), "text_tokenize_s": seconds,
                "text_tokens_per_s": corpus.train_tokens / seconds})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gpu_bytes", default="auto")
    args = ap.parse_args()
    if args.gpu_bytes == "auto":
        args.gpu_bytes = "64MiB"
    with tempfile.TemporaryDirectory() as tmp:
        engine = [_engine_rows(args, lf, tmp) for lf in (False, True)]
        batches = _batch_rows(args, tmp)
    rows = []
    for r in engine:
        mode = "lock-free" if r["lock_free"] else "synchronous"
        rows.append([f"{mode}: grad norm", 1e3 * r["grad_norm_s"], 1e3 * r["step_s"], r["grad_norm_s"] / r["step_s"]])
        rows.append([f"{mode}: one eval batch", 1e3 * r["eval_batch_s"], 1e3 * r["step_s"],
                     r["eval_batch_s"] / r["step_s"]])
    rows.append(["token-file batch (memmap)", 1e3 * batches["token_file_batch_s"], 1e3 * batches["synthetic_batch_s"],
                 batches["token_file_batch_s"] / batches["synthetic_batch_s"]])
    print(table(["what", "ms", "anchor ms", "ratio"], rows,
                "pagemem train's loop, per step (anchor: the step's forward, backward and update; for the "
                "token file: the synthetic task's batch)"))
    if "text_tokens_per_s" in batches:
        print(f"text through a BPE tokenizer: {batches['text_tokens_per_s']:,.0f} tokens/s "
              f"({batches['text_tokens']:,} tokens)")
    path = write_json("bench_train_loop", {"args": vars(args), "engine": engine, "batches": batches})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
