"""Train a Hugging Face GPT-2 through pagemem, optimizer states on NVMe.

The model is built from a small ``transformers.GPT2Config`` (nothing is downloaded) and trained
on a synthetic task (each token has four successors: the loss falls towards ln 4). Its fp32
master weights and Adam moments live in page files in a temporary directory (the ``nvme``
tier), and are read back for each update; the gpu budget is too small for the model's states
beside its activations, so its layers are paged in and out every step (the host stands in for
the GPU: ``gpu_backend="host"``). At the end the trained weights are read back with
``model.state_dict()`` and saved with ``save_pretrained``, as for any Hugging Face model.

Exits 0 with a message when ``transformers`` is not installed (``pip install transformers``).

    python examples/huggingface_gpt2.py [--steps 30] [--layers 4] [--hidden 128] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import pagemem
from pagemem.models.tasks import BranchingTask
from pagemem.sched import least_gpu_bytes
from pagemem.tracer import trace

PAGE = 64 * 1024


def gpu_budget(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The least the scheduler accepts for one traced iteration, plus three quarters of the
    parameters: layers move every step (on a GPU you would give the engine what you have)."""
    tr = trace(model, lambda: model(input_ids=x, labels=x).loss.backward()).with_non_model_peak_reserved()
    params = 4 * sum(p.numel() for p in model.parameters())
    return -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params * 3 // 4) // PAGE) * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    try:
        import transformers
    except ImportError:
        print("skipped: transformers is not installed (pip install transformers)")
        return 0
    transformers.utils.logging.disable_progress_bar()

    vocab = 256
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=vocab,
                                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    task = BranchingTask(vocab=vocab, seq=args.seq - 1, batch=args.batch)  # seq + 1 tokens: the model's longest
    table = task.table()
    model = make()
    states = 12 * sum(p.numel() for p in model.parameters())  # fp32 master weights and two moments
    budget = gpu_budget(make(), task.batch_at(0, table))
    with tempfile.TemporaryDirectory(prefix="pagemem-example-") as nvme:
        store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                    cpu_bytes=3 * states + (64 << 20),
                                    nvme_bytes=2 * states + (64 << 20), nvme_path=nvme)
        engine = pagemem.Engine(model, pagemem.EngineConfig(
            store=store, optimizer=pagemem.AdamW(lr=3e-3, weight_decay=0.01), optimizer_tier="nvme"))
        try:
            for step in range(args.steps):
                x = task.batch_at(step, table)
                out = engine(input_ids=x, labels=x)  # the model shifts the labels
                engine.backward(out.loss)
                engine.step()
                if step == 0 or (step + 1) % 10 == 0 or step + 1 == args.steps:
                    print(f"step {step + 1:>4}  loss {out.loss.item():.4f}")
            stats = engine.stats()
            files = sorted(os.listdir(nvme))
        finally:
            engine.close()  # the model keeps its trained weights, as plain parameters
    moved = stats["moved_bytes"]
    print(f"optimizer states on nvme: {stats['optimizer_state_bytes'] >> 10} KiB in page files {files}; "
          f"read {moved.get('nvme->cpu', 0) >> 10} KiB, written {moved.get('cpu->nvme', 0) >> 10} KiB "
          f"over {args.steps} steps")
    print(f"gpu budget {budget >> 10} KiB, gpu peak {stats['gpu_peak_bytes'] >> 10} KiB; layers paged in: "
          f"{moved.get('cpu->gpu', 0) >> 10} KiB")
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        again = transformers.GPT2LMHeadModel.from_pretrained(out)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    print(f"save_pretrained / from_pretrained round trip: {'same weights' if same else 'DIFFERENT weights'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
