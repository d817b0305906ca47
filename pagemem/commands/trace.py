"""``pagemem trace``: trace one iteration of the project's GPT (or build its synthetic trace) and
write ``trace.json`` and ``trace.chrome.json``."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from pagemem.commands.flags import add_shape_arguments, shape_overrides
from pagemem.errors import ConfigError, PageMemError, one_line
from pagemem.models import GPT, gpt_config

DTYPES = ("float32", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="GPT preset: tiny, small, gpt2, gpt2-medium, gpt-1.3b, gpt-6.7b, gpt3-175b (default tiny)")
    add_shape_arguments(parser)  # --checkpoint_activations: traced, or modelled with --synthetic
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's seq)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda[:N], or meta: the cpu trace without memory for the model's values, "
                             "for a model larger than host memory (default cpu)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "modelled", "none"),
                        help="trace a real AdamW step, model Adam's states, or no step (default adamw)")
    parser.add_argument("--synthetic", action="store_true",
                        help="build the trace from the configuration (ANGEL-PTM Table 1) without running it")
    parser.add_argument("--attention", default="flash", choices=("flash", "math"),
                        help="synthetic traces: keep no score matrix (flash) or Table 1's two (math)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default="trace-out",
                        help="directory for trace.json and trace.chrome.json (default trace-out)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = gpt_config(args.model, **shape_overrides(args))
        seq = args.seq or cfg.seq
        if not 1 <= seq <= cfg.seq:
            raise ConfigError(f"seq: must be in [1, {cfg.seq}] for this model, got {seq}")
        if args.batch < 1:
            raise ConfigError(f"batch: must be >= 1, got {args.batch}")
        dtype = getattr(torch, args.dtype)
        t0 = time.perf_counter()
        if args.synthetic:
            from pagemem.tracer.synthetic import synthetic_from_config

            tr = synthetic_from_config(cfg, batch=args.batch, seq=seq, dtype=dtype, attention=args.attention,
                                       optimizer_model="none" if args.optimizer == "none" else "adam")
        else:
            tr = _trace_gpt(cfg, args.batch, seq, dtype, args.device, args.optimizer, args.seed)
        took = time.perf_counter() - t0
    except PageMemError as e:
        print(f"pagemem trace: {one_line(str(e))}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "trace.json")
    chrome_path = os.path.join(args.out_dir, "trace.chrome.json")
    tr.save(json_path)
    tr.to_chrome(chrome_path)
    print(tr.summary())
    print(f"{len(tr.ops)} ops, {len(tr.tensors)} tensors in {took:.2f} s; wrote {json_path} and {chrome_path}")
    return 0


def _trace_gpt(cfg, batch: int, seq: int, dtype: torch.dtype, device: str, optimizer: str, seed: int):
    from pagemem.tracer.api import TraceOptions, trace

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device: cannot parse {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: CUDA is not available here")
    torch.manual_seed(seed)
    if dev.type == "meta":  # nothing is allocated or drawn: shapes are all a meta trace reads
        with torch.device("meta"):
            model = GPT(cfg).to(dtype=dtype)
            idx = torch.empty((batch, seq), dtype=torch.long)
            tgt = torch.empty((batch, seq), dtype=torch.long)  # its own storage, as on cpu
    else:
        model = GPT(cfg).to(device=dev, dtype=dtype)
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randint(0, cfg.vocab, (batch, seq), generator=g).to(dev)
        tgt = torch.randint(0, cfg.vocab, (batch, seq), generator=g).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer == "adamw" else None
    options = TraceOptions(optimizer_model="none" if optimizer == "none" else "adam")

    def step() -> None:
        model(idx, tgt).backward()

    return trace(model, step, opt, options=options)
