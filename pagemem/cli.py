"""The ``pagemem`` command. Each subcommand lives in its own module, which provides
``configure(parser)`` to declare its arguments and ``run(args) -> int`` to carry it out."""

from __future__ import annotations

import argparse
import importlib
import sys

# (name, module, one-line help). Add a subcommand by adding a row.
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "pagemem.demo", "store a model-sized set of tensors across the tiers, move them, verify every byte"),
    ("trace", "pagemem.tracer.cli", "trace one training iteration of the GPT (or synthesise it) and write trace JSON files"),
    ("plan", "pagemem.sched.cli", "plan one training iteration: the task queue, its validated peak memory"),
    ("simulate", "pagemem.sched.simulate_cmd", "plan and simulate one training iteration on a hardware profile"),
    ("profile", "pagemem.profile_cmd", "measure this machine into a hardware profile for the simulator"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagemem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
