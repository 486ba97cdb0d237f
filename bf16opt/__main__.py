"""The ``bf16opt`` command's entry point (setup.cfg's console script, ``python -m bf16opt``).

:mod:`bf16opt.cli` parses and checks the arguments without torch; the job's module, which
imports torch, is imported only once every check has passed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import parse


def main(argv: Sequence[str] | None = None) -> int:
    """``bf16opt ARGV`` (default ``sys.argv[1:]``); returns the exit status."""
    args, corpus = parse(argv)
    from .compare import execute  # torch: after the checks

    return execute(args, corpus)


if __name__ == "__main__":
    sys.exit(main())
