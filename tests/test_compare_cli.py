"""`bf16opt compare`, the main job, on a tiny setting: files written, tables printed.

The command line itself (parser, argument errors, progress output, --json) is tests/test_cli.py.
"""

from __future__ import annotations

import csv
import string
import sysconfig
from pathlib import Path

import pytest

from bf16opt.compare import main, stdlib_corpus

TINY = ["--steps", "8", "--width", "16", "--layers", "1", "--batch", "4", "--block", "16", "--no-progress"]


def unpadded(text: str) -> str:
    """The printed tables without their alignment padding: ``| a | b |``."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_compare_writes_csvs_plot_and_tables(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(TINY + ["--presets", "fp32,bf16-kahan", "--corpus", str(corpus),
                        "--out", str(tmp_path / "out")])
    assert code == 0
    printed = unpadded(capsys.readouterr().out)
    for text in ("Memory breakdown", "| master | 4.00 (fp32) | - |", "| compensation | - | 2.00 (bf16) |",
                 "Final loss", "Swallowed updates", "| bf16-kahan |", "| step peak extra RSS (MiB; "):
        assert text in printed
    for preset in ("fp32", "bf16-kahan"):
        rows = list(csv.DictReader((tmp_path / "out" / f"loss_{preset}.csv").open()))
        assert [int(r["step"]) for r in rows] == list(range(1, 9))
        assert all(float(r["loss"]) > 0 for r in rows)
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[plot]) draws loss_comparison.png")
    assert (tmp_path / "out" / "loss_comparison.png").stat().st_size > 1000


def test_compare_rejects_bad_arguments(tmp_path, capsys):
    """Usage errors exit with status 2 before anything trains (all cases: tests/test_cli.py)."""
    for argv, argument in ((["--steps", "0"], "--steps"), (["--presets", "nonsense"], "--presets")):
        with pytest.raises(SystemExit) as exit_info:
            main(TINY + argv + ["--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert f"error: argument {argument}: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compare_runs_lion(tmp_path, capsys):
    """`--optimizer lion`: Lion's default lr 3e-4, no exp_avg_sq in the memory table, finite losses."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(TINY + ["--optimizer", "lion", "--presets", "fp32,bf16", "--corpus", str(corpus),
                        "--out", str(tmp_path / "out")])
    assert code == 0
    printed = unpadded(capsys.readouterr().out)
    assert printed.startswith("bf16opt compare: lion, 8 steps, 2 presets")
    for text in ("| master | 4.00 (fp32) | - |", "| exp_avg | 4.00 (fp32) | 2.00 (bf16) |", "| bf16 |"):
        assert text in printed
    assert "| exp_avg_sq |" not in printed  # Lion's buffers only
    for preset in ("fp32", "bf16"):
        rows = list(csv.DictReader((tmp_path / "out" / f"loss_{preset}.csv").open()))
        assert [int(r["step"]) for r in rows] == list(range(1, 9))
        assert float(rows[0]["lr"]) == pytest.approx(3e-4)  # one warm-up step: the full lr
        assert all(0 < float(r["loss"]) < 10 for r in rows)


def test_default_corpus_is_the_standard_library_sources(tmp_path, capsys):
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
