"""``pagemem export RUN_DIR``: a run's weights out of pagemem's checkpoint format, as safetensors
sharded in Hugging Face's layout, and, for a ``model.hf`` run, a Hugging Face model directory
(``config.json``, the tokenizer's files) that ``from_pretrained`` loads. ``train.export`` does
the same at the end of ``pagemem train``.

[Note: exporting without the model in host memory] The model is built on ``meta`` and resumed
from the checkpoint by ``Engine.load``: its states stay in their pages (on nvme where they
were), and ``engine.save_weights`` reads one shard at a time, so host memory holds at most one
shard (``--max_shard_bytes``) beside the engine's own budgets.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from pagemem.commands.run_dir import RunDir
from pagemem.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "generation_config.json")
"""Files of a model or tokenizer directory an export copies beside the weights."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a pagemem train run directory (its latest checkpoint)")
    parser.add_argument("--out_dir", metavar="DIR", default=None, help="where to write (default: RUN_DIR/export)")
    parser.add_argument("--max_shard_bytes", default="2GiB", metavar="SIZE",
                        help="the largest safetensors shard ('2GiB' style; default 2GiB)")


def run(args: argparse.Namespace) -> int:
    from pagemem.commands.models import shapes_only
    from pagemem.commands.train_config import resolve
    from pagemem.engine import Engine

    rd = RunDir.named(args.run_dir)
    out = args.out_dir or rd.file("export")
    cfg = resolve(rd.read_config(), rd.path)
    model = shapes_only(cfg.model, cfg.data.seed)  # [Note: exporting without the model in host memory]
    with Engine.load(rd.checkpoints, model, cfg.engine) as engine:
        path = export_weights(engine, cfg, out, args.max_shard_bytes)
    print(f"pagemem export: step {rd.latest_step()} of {rd.path} -> {path}")
    return 0


def export_weights(engine: Any, cfg: Any, out: str, max_shard_bytes: int | str = "2GiB") -> str:
    """Write ``engine``'s weights into ``out``: safetensors in Hugging Face's layout and, for a
    ``model.hf`` model, its ``config.json`` and the tokenizer's files (``data.tokenizer``, or the
    ``model.hf`` directory's). Returns ``out``."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"out: {out} exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    engine.save_weights(out, max_shard_bytes=max_shard_bytes)
    config = getattr(engine.module, "config", None)
    if cfg.model.hf is not None and config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
        if getattr(engine.module, "generation_config", None) is not None:
            try:
                engine.module.generation_config.save_pretrained(out)
            except (ValueError, OSError):
                pass  # a generation config the model's own checks refuse is not the weights' business
        for source in (cfg.data.tokenizer, cfg.model.hf):
            if source is not None and os.path.exists(source):
                _copy_tokenizer(source, out)
                break
    return out


def _copy_tokenizer(source: str, out: str) -> None:
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(out, "tokenizer.json"))
        return
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path) and not os.path.exists(os.path.join(out, name)):
            shutil.copyfile(path, os.path.join(out, name))
