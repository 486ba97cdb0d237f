"""Command line: ``bf16opt compare ...`` (also ``python -m bf16opt compare ...``), ``bf16opt --version``.

One ``argparse`` parser with a sub-command per job.  Usage errors end with exit status 2
and one line on stderr, ``PROG: error: argument --NAME: ...``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from . import __version__


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported on one line (no usage dump): the line names the
    argument and ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The ``bf16opt`` parser and its sub-command parsers by name."""
    from . import compare_args  # no torch: the arguments are checked first

    parser = Parser(prog="bf16opt", description="Optimizers with bf16/fp16/fp32 master weights and states: "
                                                "the command-line jobs.")
    parser.add_argument("--version", action="version", version=f"bf16opt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    compare_parser = commands.add_parser(
        "compare", help="train a small language model once per precision preset and compare",
        description=compare_args.SUMMARY,
        epilog="example: bf16opt compare --presets fp32,bf16,bf16-sr --steps 200 --corpus my_text.txt "
               "--out runs/mine --json")
    compare_args.add_arguments(compare_parser)
    return parser, {"compare": compare_parser}


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if unknown:  # reported by the sub-command whose options they are not
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "compare":
        from .compare_args import run

        return run(args, commands["compare"])
    parser.error(f"argument COMMAND: unknown command {args.command!r}")  # unreachable: argparse checks


if __name__ == "__main__":
    sys.exit(main())
