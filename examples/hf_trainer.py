"""Train a Hugging Face GPT-2 with ``transformers.Trainer`` through pagemem: ``PagememTrainer``.

The Trainer keeps its own knobs (clipping, gradient accumulation, a warm-up schedule, fused
AdamW, ``save_steps`` checkpoints); ``pagemem_config`` says where the states live: fp32 master
weights and Adam moments in page files in a temporary directory (the ``nvme`` tier), a gpu budget
too small for the model beside its activations, so layers are paged in and out every step (the
host stands in for the GPU: ``gpu_backend="host"``). The data is a synthetic task (each token has
four successors: the loss falls towards ln 4). Each checkpoint holds ``pagemem/`` (the engine's)
in place of ``optimizer.pt``; ``trainer.train(resume_from_checkpoint=True)`` resumes it.

Exits 0 with a message when ``transformers`` or ``accelerate`` is missing (``pip install pagemem[hf]``).

    python examples/hf_trainer.py [--steps 20] [--layers 2] [--hidden 64] [--batch 4] [--seq 32]
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
    """The least the scheduler accepts for one traced iteration, plus a third of the parameters:
    layers move every step (on a GPU you would give the engine what you have)."""
    tr = trace(model, lambda: model(input_ids=x, labels=x).loss.backward()).with_non_model_peak_reserved()
    params = 4 * sum(p.numel() for p in model.parameters())
    return -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params // 3) // PAGE) * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    try:
        import transformers
        from pagemem.integrations.hf import PagememTrainer
    except ImportError as exc:
        print(f"skipped: needs transformers and accelerate (pip install pagemem[hf]): {exc}")
        return 0
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    vocab = 256
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=vocab,
                                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    task = BranchingTask(vocab=vocab, seq=args.seq - 1, batch=args.batch)  # seq + 1 tokens: the model's longest
    table = task.table()
    data = [{"input_ids": x, "labels": x} for b in range(2 * args.steps) for x in task.batch_at(b, table)]
    states = 12 * sum(p.numel() for p in model.parameters())  # fp32 master weights and two moments
    budget = gpu_budget(transformers.GPT2LMHeadModel(config), task.batch_at(0, table))
    with tempfile.TemporaryDirectory(prefix="pagemem-example-") as tmp:
        store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                    cpu_bytes=3 * states + (64 << 20), nvme_bytes=2 * states + (64 << 20),
                                    nvme_path=tmp)
        targs = transformers.TrainingArguments(
            output_dir=os.path.join(tmp, "out"), max_steps=args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=3e-3, warmup_steps=5,
            weight_decay=0.01, optim="adamw_torch_fused", logging_steps=5, save_steps=10, report_to=[],
            use_cpu=True, disable_tqdm=True)
        trainer = PagememTrainer(model, targs, train_dataset=data,
                                 pagemem_config=pagemem.EngineConfig(store=store, optimizer_tier="nvme"))
        trainer.train()
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']:>4}  loss {h['loss']:.4f}  lr {h['learning_rate']:.2e}")
        stats = trainer.engine.stats()
        ckpt = os.path.join(targs.output_dir, "checkpoint-10")
        print(f"checkpoint-10 holds {sorted(os.listdir(ckpt))}")
        trainer.engine.close()  # the model keeps its trained weights, as plain parameters
    moved = stats["moved_bytes"]
    print(f"gpu budget {budget >> 10} KiB; layers paged in: {moved.get('cpu->gpu', 0) >> 10} KiB; optimizer "
          f"states read from nvme: {moved.get('nvme->cpu', 0) >> 10} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
