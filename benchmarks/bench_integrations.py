"""What the framework integrations cost: a Hugging Face GPT-2 trained by ``PagememTrainer`` and by
Lightning's ``strategy="pagemem"``, beside the engine's own loop with the same knobs and beside
each framework without pagemem.

Same model (GPT-2 from a config, dropout off), same batches, fp32, accumulation 2, clipping at
1.0, a warm-up schedule, fused AdamW in the plain runs; the engine's gpu budget is the least the
scheduler accepts plus a third of the parameters, states on ``cpu``, so pages move every step
(the host stands in for the GPU). Each row is the median wall time of an optimizer step (two
forwards and backwards, clipping, the update) after ``--warmup`` steps. Anchors, measured in the
same run: the engine's own loop (``engine(**batch)``, ``engine.backward``, ``clip_grad_norm_``,
``optimizer.step``, ``zero_grad``, ``scheduler.step``), which the integrations add to; and the
framework without pagemem. The run also checks that each integration's weights equal its plain
framework's bit for bit. torch runs on ``--threads`` intra-op threads (1 by default: on a loaded
2-core machine more threads make plain PyTorch erratic).

Usage: ``python benchmarks/bench_integrations.py [--layers 4] [--hidden 256] [--seq 128]
[--batch 4] [--steps 12] [--warmup 3] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import warnings

import torch
from common import table, write_json

import pagemem
from pagemem.sched import least_gpu_bytes
from pagemem.tracer import trace

PAGE = 64 * 1024
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl
    import transformers
    from pagemem.integrations.hf import PagememTrainer
    from pagemem.integrations.lightning import PagememStrategy

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    gcfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=args.vocab,
                                   n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(gcfg)

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, args.vocab, (args.seq,), generator=g) for _ in range(2 * args.batch * args.steps)]
    warm = args.warmup

    def lr_lambda(s: int) -> float:
        return min(1.0, (s + 1) / warm)

    def median_ms(ends: list[float]) -> float:
        gaps = [b - a for a, b in zip(ends, ends[1:])][warm - 1:]
        return 1000 * statistics.median(gaps)

    x = torch.stack(seqs[:args.batch])
    model = gpt2()
    tr = trace(model, lambda: model(input_ids=x, labels=x).loss.backward()).with_non_model_peak_reserved()
    params = sum(p.numel() * 4 for p in model.parameters())
    budget = -(-(least_gpu_bytes(tr, page_bytes=PAGE) + params // 3) // PAGE) * PAGE
    config = pagemem.EngineConfig(store=pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=budget,
                                                            cpu_bytes=40 * params + 64 * PAGE),
                                  optimizer=pagemem.AdamW(**HP), adam_threads=2, accumulation_steps=2)
    # the engine lays the model out in its own units, which can need more than the plain trace says: one
    # iterations tell, and the budget grows to the least that works plus the same third (as `pagemem train` does)
    try:
        model = gpt2()
        with pagemem.Engine(model, config) as probe:
            for _ in range(2):  # traced, then planned: a plan without room is refused at its forward
                probe.backward(probe(input_ids=x, labels=x).loss)
                probe.zero_grad()
    except pagemem.OutOfMemory as exc:
        if not getattr(exc, "least_bytes", None):
            raise
        budget = -(-(exc.least_bytes + params // 3) // PAGE) * PAGE
        config = dataclasses.replace(config, store=dataclasses.replace(config.store, gpu_bytes=budget))
    ms: dict[str, float] = {}
    moved: dict[str, int] = {}

    # the engine's own loop, the integrations' knobs by hand
    model = gpt2()
    with pagemem.Engine(model, config, param_groups=pagemem.decay_groups(model, HP["weight_decay"])) as engine:
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lr_lambda)
        ends = [time.perf_counter()]
        for s in range(args.steps):
            for m in range(2):
                b = torch.stack(seqs[(2 * s + m) * args.batch:(2 * s + m + 1) * args.batch])
                engine.backward(engine(input_ids=b, labels=b).loss / 2)
            engine.clip_grad_norm_(1.0)
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            sched.step()
            ends.append(time.perf_counter())
        ms["engine_loop"] = median_ms(ends)
        moved["engine_loop"] = engine.stats()["moved_bytes"].get("cpu->gpu", 0)

    # the Hugging Face Trainer, plain and through pagemem
    class StepEnds(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, *a, **k) -> None:
            self.ends.append(time.perf_counter())

    data = [{"input_ids": s_, "labels": s_} for s_ in seqs]
    weights = {}
    with tempfile.TemporaryDirectory() as out:
        for name, cls, extra in (("plain_trainer", transformers.Trainer, {}),
                                 ("pagemem_trainer", PagememTrainer,
                                  {"pagemem_config": dataclasses.replace(config, accumulation_steps=1)})):
            targs = transformers.TrainingArguments(
                output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=HP["lr"], adam_beta1=HP["betas"][0],
                adam_beta2=HP["betas"][1], weight_decay=HP["weight_decay"], warmup_steps=warm,
                optim="adamw_torch_fused", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                logging_strategy="no", dataloader_drop_last=True)
            ends = StepEnds()
            trainer = cls(gpt2(), targs, train_dataset=data, callbacks=[ends], **extra)
            ends.ends = [time.perf_counter()]
            trainer.train()
            ms[name] = median_ms(ends.ends)
            weights[name] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            if cls is PagememTrainer:
                moved[name] = trainer.engine.stats()["moved_bytes"].get("cpu->gpu", 0)
                trainer.engine.close()

    # Lightning, plain and through pagemem
    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), fused=True, **HP)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
                                                       "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(seqs, batch_size=args.batch)

    class BatchEnds(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.moved = 0

        def on_train_start(self, trainer, module) -> None:
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if batch_idx % 2 == 1:
                self.ends.append(time.perf_counter())

        def on_train_end(self, trainer, module) -> None:
            if isinstance(trainer.strategy, PagememStrategy):
                self.moved = trainer.strategy.engine.stats()["moved_bytes"].get("cpu->gpu", 0)

    for name, strategy in (("plain_lightning", "auto"),
                           ("pagemem_lightning", PagememStrategy(dataclasses.replace(config, accumulation_steps=1)))):
        ends, module = BatchEnds(), LM()
        pl.Trainer(max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu",
                   devices=1, strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[ends]).fit(module)
        ms[name] = median_ms(ends.ends)
        weights[name] = {k: v.clone() for k, v in module.state_dict().items()}
        if name.startswith("pagemem"):
            moved[name] = ends.moved

    equal = {fw: all(torch.equal(weights[f"plain_{fw}"][k], weights[f"pagemem_{fw}"][k]) for k in weights[f"plain_{fw}"])
             for fw in ("trainer", "lightning")}
    rows = [["engine's own loop", ms["engine_loop"], "-", "-", moved["engine_loop"] >> 10, "-"]]
    for fw, what in (("trainer", "PagememTrainer"), ("lightning", "strategy='pagemem'")):
        pm, plain = ms[f"pagemem_{fw}"], ms[f"plain_{fw}"]
        rows.append([what, pm, f"{pm / ms['engine_loop']:.2f}", f"{pm / plain:.2f}", moved[f"pagemem_{fw}"] >> 10,
                     "bit-identical" if equal[fw] else "DIFFERENT"])
        rows.append([f"  plain {fw} (anchor)", plain, "-", "-", "-", "-"])
    print(table(["run", "ms/step", "x engine loop", "x plain", "paged in KiB", "weights vs plain"], rows,
                title=f"GPT-2 {args.layers}L h{args.hidden}, batch {args.batch} x seq {args.seq}, accumulation 2, "
                      f"{args.steps} steps (median after {warm}); gpu budget {budget >> 10} KiB; "
                      f"{args.threads} torch thread(s)"))
    path = write_json("bench_integrations", {
        "config": {**vars(args), "gpu_bytes": budget, "param_bytes": params},
        "ms_per_step": ms, "paged_in_bytes": moved, "bit_identical": equal})
    print(f"wrote {path}")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
