"""Flags the commands share. A flag is spelled as the field it sets (``--gpu_bytes`` sets
``StoreConfig.gpu_bytes``, ``--checkpoint_activations`` sets ``GPTConfig.checkpoint_activations``);
the glossary is in DEVELOPERS.md ("Glossary: one name per knob")."""

from __future__ import annotations

import argparse
from typing import Any

SHAPE = ("layers", "hidden", "heads", "ffn", "vocab")
"""``GPTConfig`` fields a command may override on a preset (integers)."""
SWITCHES = ("tie_embeddings", "checkpoint_activations")
"""``GPTConfig`` fields a command may override on a preset (True or False)."""


def parse_bool(text: str) -> bool:
    """``true`` or ``false`` (as in TOML, and as ``pagemem train`` reads them)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def add_switch(parser: Any, name: str, default: bool | None, help: str) -> None:
    """A boolean flag: ``--NAME`` alone is true, ``--NAME false`` false."""
    parser.add_argument(f"--{name}", type=parse_bool, nargs="?", const=True, default=default, metavar="true|false",
                        help=help)


def add_shape_arguments(parser: Any) -> None:
    """``--layers``, ``--hidden``, ``--heads``, ``--ffn``, ``--vocab``, ``--tie_embeddings`` and
    ``--checkpoint_activations``: overrides of the preset's ``GPTConfig`` fields."""
    for name in SHAPE:
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    add_switch(parser, "tie_embeddings", None, "tie the output head to the token embedding (default: the preset's)")
    add_switch(parser, "checkpoint_activations", None,
               "activation checkpointing per block: recompute each block in backward (default: the preset's)")


def shape_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GPTConfig`` fields given on the command line."""
    return {k: getattr(args, k) for k in (*SHAPE, *SWITCHES) if getattr(args, k) is not None}
