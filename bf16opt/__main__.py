"""Command line: ``bf16opt compare ...`` (also ``python -m bf16opt compare ...``)."""

from __future__ import annotations

import sys

COMMANDS = {"compare": "train a small language model once per precision preset and compare"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bf16opt COMMAND [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "compare":
        from .compare import main as compare_main
        return compare_main(rest)
    print(f"bf16opt: unknown command {command!r}; try 'bf16opt --help'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
