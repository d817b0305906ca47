"""What a fixed staleness costs AdamW, in plain PyTorch: the counting task of issue 33 with the
gradients computed at the weights of ``delay`` updates ago, and the corrections tried for it.

No engine: a model whose gradient at step ``s`` is taken at the weights of step ``s - delay``
(``delay`` 0: synchronous training), the same fused-free ``torch.optim.AdamW`` (lr 3e-3, weight
decay 0.01), 120 steps, the project's GPT or a Hugging Face GPT-2 (3 layers, hidden 128,
vocabulary 64, sequences of 64 counting up from a random start, batch 8), three data orders.
Corrections: ``predict`` (the weights extrapolated by the last update, ``alpha`` times per step
of delay: the engine's ``staleness_correction="predict"``), ``lrscale`` (lr / (1 + delay)),
``lrsqrt`` (lr / sqrt(1 + delay)), ``predlr`` (both), ``halflr`` (lr / 2, no delay: what
``lrscale`` costs by itself); ``warmup`` steps synchronous first (DeepSpeed's delayed parameter
update). Tail = the mean loss of the last 20 steps. A study beside ``lockfree_quality.py``
(not a speed benchmark, so not in ``run_all.SUITE``). The engine's default was chosen from these
([Note: the lock-free default] in ``engine/updates/staleness.py``).

Usage: ``python benchmarks/lockfree_delay.py --model gpt|hf-gpt2 [--task counting|branching] SPEC...``, each SPEC
``delay:mode[:warmup[:alpha]]`` (e.g. ``1:predict``, ``2:none:20``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import table, write_json

from pagemem.models.gpt import GPT, GPTConfig
from pagemem.models.tasks import BranchingTask

V, SEQ, B, STEPS, LR = 64, 64, 8, 120, 3e-3


def make(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt":
        return GPT(GPTConfig(layers=3, hidden=128, heads=4, vocab=V, seq=SEQ))
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=128, n_head=4, vocab_size=V, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


TASK = "counting"


def batch(step: int, seed: int) -> torch.Tensor:
    if TASK == "branching":  # as lockfree_quality.py's
        return BranchingTask(vocab=V, seq=SEQ, batch=B, branches=4, seed=0).batch_at(1_000_003 * seed + step)
    g = torch.Generator().manual_seed(10_000 + step + 1000 * seed)
    return (torch.randint(0, V, (B, 1), generator=g) + torch.arange(SEQ + 1)) % V


def loss_of(m: torch.nn.Module, x: torch.Tensor, model: str) -> torch.Tensor:
    if model != "gpt":
        return m(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    return torch.nn.functional.cross_entropy(m(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))


def tail(model: str, seed: int, delay: int, mode: str, warmup: int = 0, alpha: float = 1.0) -> float:
    """The tail loss of one run (see the module's docstring)."""
    live, stale = make(model), make(model)
    opt = torch.optim.AdamW(live.parameters(), lr=LR, weight_decay=0.01)
    params = list(live.parameters())
    history = [[p.detach().clone() for p in params]]  # the weights after each of the last updates
    losses = []
    for s in range(STEPS):
        d = min(0 if s < warmup else delay, len(history) - 1)
        at = history[len(history) - 1 - d]
        with torch.no_grad():
            for i, q in enumerate(stale.parameters()):
                if mode in ("predict", "predlr") and d > 0 and len(history) - 2 - d >= 0:
                    q.copy_(at[i] + alpha * d * (at[i] - history[len(history) - 2 - d][i]))
                else:
                    q.copy_(at[i])
        loss = loss_of(stale, batch(s, seed), model)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(params, stale.parameters()):
            p.grad, q.grad = q.grad, None
        scale = {"lrscale": 1 / (1 + d), "predlr": 1 / (1 + d), "lrsqrt": (1 + d) ** -0.5, "halflr": 0.5}.get(mode, 1.0)
        for group in opt.param_groups:
            group["lr"] = LR * scale
        opt.step()
        opt.zero_grad()
        history = (history + [[p.detach().clone() for p in params]])[-(delay + 2):]
    return statistics.mean(losses[-20:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["gpt", "hf-gpt2"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--task", default=TASK, choices=["counting", "branching"])
    ap.add_argument("specs", nargs="+", help="delay:mode[:warmup[:alpha]]")
    args = ap.parse_args()
    globals()["TASK"] = args.task
    torch.set_num_threads(1)
    rows, out = [], {}
    for spec in args.specs:
        parts = spec.split(":")
        delay, mode = int(parts[0]), parts[1]
        warmup = int(parts[2]) if len(parts) > 2 else 0
        alpha = float(parts[3]) if len(parts) > 3 else 1.0
        tails = [tail(args.model, s, delay, mode, warmup, alpha) for s in range(args.seeds)]
        out[spec] = tails
        rows.append([spec, " ".join(f"{t:.4f}" for t in tails), f"{statistics.mean(tails):.4f}"])
        print(" | ".join(rows[-1]), flush=True)
    print(table(["delay:mode[:warmup[:alpha]]", "tail per data order", "mean"], rows,
                title=f"{args.model}, {TASK} task, plain PyTorch with stale gradients"))
    print("wrote", write_json(f"bench_lockfree_delay_{TASK}_{args.model}", {"tails": out}))


if __name__ == "__main__":
    main()
