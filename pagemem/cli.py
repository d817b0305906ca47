"""The ``pagemem`` command: one runner over the commands of ``pagemem.commands``. A
``PageMemError`` (bad input, a budget too small, a damaged checkpoint) ends with one line on
stderr and exit status 2, never a traceback; Ctrl-C with 130 (SIGTERM in ``pagemem train``: 143)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from pagemem.commands import COMMANDS
from pagemem.errors import PageMemError, one_line

USAGE_ERROR = 2
INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagemem", allow_abbrev=False,
                     description="pagemem: train PyTorch models larger than GPU memory, and the tools around it "
                                 "(`pagemem COMMAND --help` for each)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, module_name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except PageMemError as exc:
        print(f"pagemem {args.command}: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as exc:  # a path the command was given cannot be read or written
        where = f" {exc.filename}" if exc.filename else ""
        print(f"pagemem {args.command}: cannot use{where}: {exc.strerror or exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt as exc:  # Ctrl-C; pagemem train's SIGTERM exits 143 (train_signals.py)
        print(f"pagemem {args.command}: interrupted", file=sys.stderr)
        return int(getattr(exc, "exit_status", INTERRUPTED))


if __name__ == "__main__":
    sys.exit(main())
