"""The ``bf16opt`` command line's parser and checks: ``bf16opt compare ...``, ``bf16opt --version``.

Imports no torch (nor numba): a bad argument is reported before the seconds torch takes to
import, with exit status 2 and one line on stderr, ``PROG: error: argument --NAME: ...``.
:func:`parse` returns arguments that passed every check; :mod:`bf16opt.__main__` runs them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

from . import __version__

__all__ = ["BACKENDS", "DEFAULT_LR", "DEFAULT_PRESETS", "HEADS", "PRESET_NAMES", "RESULTS_JSON", "SUMMARY",
           "Corpus", "Parser", "add_arguments", "build_parser", "check", "model_params", "parse",
           "stdlib_corpus"]

SUMMARY = "train one small language model per precision preset, side by side."
#: the names of ``bf16opt.PRESETS``, in its order, without importing torch (a test keeps them equal)
PRESET_NAMES = ("fp32", "bf16", "bf16-master", "bf16-states", "bf16-sr", "bf16-kahan", "fp32-remainder",
                "fp32-remainder-bf16-states", "fp32-remainder-q8", "bf16-sr-q8")
DEFAULT_PRESETS = ("fp32", "bf16", "bf16-kahan", "bf16-sr", "fp32-remainder")
#: default peak learning rate per optimizer (--lr overrides); its keys are --optimizer's choices
DEFAULT_LR = {"adamw": 3e-3, "adam": 3e-3, "lion": 3e-4, "sgd": 0.3}
HEADS = 4  # attention heads of every block: --width must be a multiple
BACKENDS = ("auto", "numba", "reference")  # the model is on the CPU: no "cupy"
RESULTS_JSON = "results.json"


# ---------------------------------------------------------------- data
def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Text every Python installation carries: its standard library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}; pass --corpus FILE")
    return b"".join(chunks)[:max_bytes]


# ---------------------------------------------------------------- arguments
class Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported on one line (no usage dump): the line names the
    argument and ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


Number = TypeVar("Number", int, float)


def _parsed(text: str, convert: Callable[[str], Number], accept: Callable[[Number], bool],
            wanted: str) -> Number:
    """``convert(text)`` if it parses and ``accept`` takes it; else argparse's usage error."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _parsed(text, int, lambda value: value >= 1, "an integer >= 1")


def _seed(text: str) -> int:
    return _parsed(text, int, lambda value: 0 <= value < 2 ** 63, "an integer in [0, 2**63)")


def _learning_rate(text: str) -> float:
    return _parsed(text, float, lambda value: math.isfinite(value) and value > 0, "a finite number > 0")


def _presets(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    names = [name for name in names if name]
    if not names:
        raise argparse.ArgumentTypeError(f"names no preset ({text!r}); e.g. --presets fp32,bf16")
    for name in names:
        if name not in PRESET_NAMES:
            raise argparse.ArgumentTypeError(f"unknown preset {name!r}; "
                                             f"choose from {', '.join(PRESET_NAMES)}")
    for name in names:
        if names.count(name) > 1:
            raise argparse.ArgumentTypeError(f"preset {name!r} is given twice")
    return names


def _corpus(text: str) -> Path:
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("is empty; name a text file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"is not a file: {text}")
    return path


def _out_dir(text: str) -> Path:
    """Static checks of --out; whether it can be created and written is checked by check()."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name a directory (it is created if missing)")
    path = Path(text)
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                what = "names an existing file" if ancestor == path else f"is inside {ancestor}, a file"
                raise argparse.ArgumentTypeError(f"{what}, not a directory: {text}")
            break
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bf16opt compare``."""
    parser.add_argument("--presets", type=_presets, default=",".join(DEFAULT_PRESETS), metavar="P1,P2,...",
                        help=f"comma-separated precision presets, the first one is the baseline; from "
                             f"{', '.join(PRESET_NAMES)} (default: %(default)s)")
    parser.add_argument("--optimizer", choices=list(DEFAULT_LR), default="adamw",
                        help="adamw, adam, lion, or sgd (momentum 0.9) (default: %(default)s)")
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="training steps per run (default: %(default)s)")
    parser.add_argument("--lr", type=_learning_rate, default=None,
                        help="peak learning rate (default: " + ", ".join(
                            f"{value:g} {name}" for name, value in DEFAULT_LR.items()) + ")")
    parser.add_argument("--corpus", type=_corpus, default=None, metavar="FILE",
                        help="text file to train on (default: the Python standard library's sources)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="model, data order and rounding seed (default: %(default)s)")
    parser.add_argument("--batch", type=_positive_int, default=32,
                        help="sequences per step (default: %(default)s)")
    parser.add_argument("--block", type=_positive_int, default=64,
                        help="sequence length (default: %(default)s)")
    parser.add_argument("--width", type=_positive_int, default=128,
                        help=f"model width, a multiple of {HEADS} (default: %(default)s)")
    parser.add_argument("--layers", type=_positive_int, default=2,
                        help="transformer blocks (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="bf16opt kernel backend; the model runs on the CPU (default: %(default)s)")
    parser.add_argument("--out", type=_out_dir, default="runs/compare", metavar="DIR",
                        help="output directory, created if missing (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help=f"also write the tables to DIR/{RESULTS_JSON}")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or progress lines")


@dataclass
class Corpus:
    text: bytes
    name: str


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Corpus:
    """Checks that need more than one argument, or the file system; parser.error() on failure.
    Nothing is created before every check has passed."""
    if args.width % HEADS:
        parser.error(f"argument --width: must be a multiple of {HEADS} (the attention heads), "
                     f"got {args.width}")
    _check_fits_in_memory(args, parser)
    existing = next(path for path in (args.out, *args.out.parents) if path.exists())
    try:  # --out, or the directory it will be created in, takes files
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        parser.error(f"argument --out: cannot write to {existing}: {exc.strerror or exc}")
    if args.corpus is not None:
        try:
            corpus = Corpus(args.corpus.read_bytes(), str(args.corpus))
        except OSError as exc:
            parser.error(f"argument --corpus: cannot read {args.corpus}: {exc.strerror or exc}")
    else:
        corpus = Corpus(stdlib_corpus(), "Python standard library sources")
    if len(corpus.text) < args.block + 2:
        parser.error(f"argument --corpus: {corpus.name} has {len(corpus.text)} bytes; --block {args.block} "
                     f"needs at least {args.block + 2}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --out: cannot create {args.out}: {exc.strerror or exc}")
    return corpus


# ---------------------------------------------------------------- the command line
def model_params(width: int, layers: int, block: int) -> int:
    """The parameter count of compare's CharGPT (a test checks it against the model)."""
    per_block = 12 * width * width + 13 * width  # attention 4w^2+4w, MLP 8w^2+5w, two norms 4w
    return layers * per_block + 256 * width + block * width + 2 * width + 256 * width + 256


def _check_fits_in_memory(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse sizes no run could fit in this machine's memory (a floor, not an estimate: the
    model built in float32, and one step's embeddings and logits in float32)."""
    params = model_params(args.width, args.layers, args.block)
    weights = 4 * params
    activations = 4 * args.batch * args.block * (args.width + 256)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # (no sysconf: nothing to check against)
        return
    if weights + activations <= memory:
        return
    names = "--width and --layers" if weights >= activations else "--batch and --block"
    parser.error(f"arguments {names}: the run needs at least {(weights + activations) / 2**30:,.0f} GiB "
                 f"({params:,} params; batch {args.batch} x block {args.block}), more than this "
                 f"machine's {memory / 2**30:,.0f} GiB of memory")


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The ``bf16opt`` parser and its sub-command parsers by name."""
    parser = Parser(prog="bf16opt", description="Optimizers with bf16/fp16/fp32 master weights and states: "
                                                "the command-line jobs.")
    parser.add_argument("--version", action="version", version=f"bf16opt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    compare_parser = commands.add_parser(
        "compare", help="train a small language model once per precision preset and compare",
        description=SUMMARY,
        epilog="example: bf16opt compare --presets fp32,bf16,bf16-sr --steps 200 --corpus my_text.txt "
               "--out runs/mine --json")
    add_arguments(compare_parser)
    return parser, {"compare": compare_parser}


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Corpus]:
    """``bf16opt ARGV``'s arguments (default ``sys.argv[1:]``) once every check has passed, and
    the text to train on; a usage error exits with status 2 and one line on stderr."""
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if unknown:  # reported by the sub-command whose options they are not
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    return args, check(args, commands[args.command])
