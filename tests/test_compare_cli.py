"""`bf16opt compare`, the main job, on a tiny setting: other optimizers, the default corpus.

The command line itself (parser, argument errors, progress output, files written, --json) is
tests/test_cli.py.
"""

from __future__ import annotations

import csv
import json
import string
import sysconfig
from pathlib import Path

import pytest

from bf16opt import compare
from bf16opt.__main__ import main as cli_main
from bf16opt.cli import stdlib_corpus


def main(argv: list) -> int:
    return cli_main(["compare", *argv])

TINY = ["--steps", "4", "--width", "16", "--layers", "1", "--batch", "4", "--block", "16", "--no-progress"]


def unpadded(text: str) -> str:
    """The printed tables without their alignment padding: ``| a | b |``."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


@pytest.fixture
def no_plot(monkeypatch):
    """For runs whose figure nobody looks at (drawing it is most of a tiny run's time)."""
    monkeypatch.setattr(compare, "plot", lambda results, out: None)


def test_compare_runs_lion(tmp_path, capsys, no_plot):
    """`--optimizer lion`: Lion's default lr 3e-4, no exp_avg_sq in the memory table, finite losses."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(TINY + ["--optimizer", "lion", "--presets", "fp32,bf16", "--corpus", str(corpus),
                        "--out", str(tmp_path / "out")])
    assert code == 0
    printed = unpadded(capsys.readouterr().out)
    assert printed.startswith("bf16opt compare: lion, 4 steps, 2 presets")
    for text in ("| master | 4.00 (fp32) | - |", "| exp_avg | 4.00 (fp32) | 2.00 (bf16) |", "| bf16 |"):
        assert text in printed
    assert "| exp_avg_sq |" not in printed  # Lion's buffers only
    for preset in ("fp32", "bf16"):
        rows = list(csv.DictReader((tmp_path / "out" / f"loss_{preset}.csv").open()))
        assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
        assert float(rows[0]["lr"]) == pytest.approx(3e-4)  # one warm-up step: the full lr
        assert all(0 < float(r["loss"]) < 10 for r in rows)


def test_default_corpus_is_the_standard_library_sources(tmp_path, capsys, no_plot):
    """stdlib_corpus is real Python source text from the sorted stdlib *.py files, and it is what
    `compare` trains on without --corpus."""
    text = stdlib_corpus(max_bytes=200_000)
    assert len(text) == 200_000
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    assert text.startswith(first[:10_000])
    decoded = text.decode("utf-8", errors="replace")
    assert decoded.count("\ufffd") <= 1  # at most a character cut at the end
    printable = sum(c in string.printable for c in decoded)
    assert printable / len(decoded) > 0.99
    for word in ("def ", "import ", "class ", "return"):
        assert decoded.count(word) > 20, word
    assert main(TINY + ["--steps", "2", "--presets", "bf16", "--out", str(tmp_path / "out")]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(f"{len(stdlib_corpus()):,} bytes of text (Python standard library sources)")


def test_a_run_of_one_step_measures_no_step_time_or_peak(tmp_path, capsys, no_plot):
    """The first step allocates the state and compiles: with no other, the tables say n/a."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(TINY + ["--steps", "1", "--presets", "bf16", "--corpus", str(corpus), "--json",
                        "--out", str(tmp_path / "out")])
    assert code == 0
    printed = unpadded(capsys.readouterr().out)
    peak_row = next(line for line in printed.splitlines() if line.startswith("| step peak extra RSS"))
    assert peak_row.endswith("| n/a |")
    loss_row = next(line for line in printed.splitlines() if line.startswith("| bf16 |"))
    assert "| n/a |" in loss_row
    saved = json.loads((tmp_path / "out" / "results.json").read_text(encoding="utf-8"))
    assert saved["loss"][0]["mean_step_ms"] is None and saved["memory"][0]["step_peak_extra_mib"] is None
