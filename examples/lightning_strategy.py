"""Train a Hugging Face GPT-2 under Lightning through pagemem: ``Trainer(strategy=PagememStrategy(...))``.

Importing ``pagemem.integrations.lightning`` registers the strategy as ``"pagemem"``
(``Trainer(strategy="pagemem")`` sizes the budgets from the model); here it is given a config
that puts the fp32 master weights and Adam moments in page files in a temporary directory (the
``nvme`` tier) with a gpu budget too small for the model beside its activations, so layers are
paged in and out every step (the host stands in for the GPU: ``gpu_backend="host"``). Lightning
keeps its knobs: ``gradient_clip_val``, ``accumulate_grad_batches``, the schedule and the AdamW
``configure_optimizers`` returns, ``ModelCheckpoint``. A checkpoint is a directory (the engine's
checkpoint and Lightning's loops and schedulers); ``fit(..., ckpt_path="last")`` resumes it, as
the second run here does. The data is a synthetic task (each token has four successors).

Exits 0 with a message when ``lightning`` or ``transformers`` is missing
(``pip install pagemem[lightning,hf]``).

    python examples/lightning_strategy.py [--steps 20] [--layers 2] [--hidden 64] [--batch 4] [--seq 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

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
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import ModelCheckpoint
        from pagemem.integrations.lightning import PagememStrategy
    except ImportError as exc:
        print(f"skipped: needs lightning and transformers (pip install pagemem[lightning,hf]): {exc}")
        return 0
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="lightning")

    vocab = 256
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=vocab,
                                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    task = BranchingTask(vocab=vocab, seq=args.seq - 1, batch=args.batch)  # seq + 1 tokens: the model's longest
    table = task.table()
    data = [x for b in range(2 * args.steps) for x in task.batch_at(b, table)]

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.GPT2LMHeadModel(config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
            warm_up = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm_up, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=args.batch)

    class Report(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.stats = trainer.strategy.engine.stats()  # the engine closes when fit ends

    states = 12 * sum(p.numel() for p in LM().parameters())  # fp32 master weights and two moments
    budget = gpu_budget(transformers.GPT2LMHeadModel(config), task.batch_at(0, table))
    with tempfile.TemporaryDirectory(prefix="pagemem-example-") as tmp:
        store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                    cpu_bytes=3 * states + (64 << 20), nvme_bytes=2 * states + (64 << 20),
                                    nvme_path=tmp)
        engine_config = pagemem.EngineConfig(store=store, optimizer_tier="nvme")

        def fit(max_steps: int, report: Report, ckpt_path: str | None = None) -> float:
            module = LM()
            trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
                                 strategy=PagememStrategy(engine_config), accelerator="cpu", devices=1,
                                 logger=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[report, ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"),
                                                                    every_n_train_steps=10, save_last=True)])
            trainer.fit(module, ckpt_path=ckpt_path)
            return float(trainer.callback_metrics["loss"])

        first, second = Report(), Report()
        loss = fit(args.steps // 2, first)
        print(f"step {args.steps // 2:>4}  loss {loss:.4f}  (stopped; last.ckpt holds "
              f"{sorted(os.listdir(os.path.join(tmp, 'ckpt', 'last.ckpt')))})")
        loss = fit(args.steps, second, ckpt_path="last")
        print(f"step {args.steps:>4}  loss {loss:.4f}  (resumed from last.ckpt)")
    moved = second.stats["moved_bytes"]
    print(f"gpu budget {budget >> 10} KiB; layers paged in: {moved.get('cpu->gpu', 0) >> 10} KiB; optimizer "
          f"states read from nvme: {moved.get('nvme->cpu', 0) >> 10} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
