"""`bf16opt compare`, the main job, on a tiny setting: files written, tables printed."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from bf16opt.compare import main

TINY = ["--steps", "8", "--width", "16", "--layers", "1", "--batch", "4", "--block", "16", "--no-progress"]


def test_compare_writes_csvs_plot_and_tables(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(TINY + ["--presets", "fp32,bf16-kahan", "--corpus", str(corpus), "--out", str(tmp_path / "out")])
    assert code == 0
    printed = capsys.readouterr().out
    for text in ("Memory breakdown", "| master | 4.00 (fp32) | - |", "| compensation | - | 2.00 (bf16) |",
                 "Final loss", "Swallowed updates", "| bf16-kahan |"):
        assert text in printed
    for preset in ("fp32", "bf16-kahan"):
        rows = list(csv.DictReader((tmp_path / "out" / f"loss_{preset}.csv").open()))
        assert [int(r["step"]) for r in rows] == list(range(1, 9))
        assert all(float(r["loss"]) > 0 for r in rows)
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[plot]) draws loss_comparison.png")
    assert (tmp_path / "out" / "loss_comparison.png").stat().st_size > 1000


def test_console_entry_point_and_module_agree(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bf16opt", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "compare" in result.stdout
    result = subprocess.run([sys.executable, "-m", "bf16opt", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown command" in result.stderr


def test_compare_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        main(["--steps", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="precision"):
        main(TINY + ["--presets", "nonsense", "--out", str(tmp_path)])
