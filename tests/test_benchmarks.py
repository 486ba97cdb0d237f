"""The CPU benchmarks run and print their tables on a tiny size, so they do not rot.

(Figures at this size mean nothing; the benchmark is run by hand at 2^25 params.)
"""

from __future__ import annotations

import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
BENCHMARK = BENCHMARKS / "cpu_step.py"


def test_cpu_benchmark_prints_its_table():
    """Three presets (stochastic, Kahan, remainder: the compute-limit kernels the next test
    compiles too) keep the table code running; the full table is run by hand."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, str(BENCHMARK), "--log2-params", "16", "--repeats", "1",
                             "--algorithms", "AdamW", "--presets", "bf16-sr,bf16-kahan,fp32-remainder",
                             "--skip-multi-tensor"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("AdamW ")]
    assert len(rows) == 3, result.stdout
    for row in rows:
        # bf16opt, memory limit, compute limit, share of the ceiling, in-cache time: all
        # measured (in ms to 0.1: tiny times print as 0.0)
        ours, memory, compute, share, in_cache = re.split(r"\s{2,}", row.strip())[1:6]
        assert float(ours) > 0 and float(memory) >= 0 and float(compute) >= 0 and float(in_cache) >= 0
        assert share.endswith("%") and int(share[:-1]) >= 0


@pytest.mark.parametrize("preset", ["bf16-sr", "bf16-kahan", "fp32-remainder"])
def test_compute_limit_kernel_does_the_work(preset):
    """The compute-limit kernel is not dead code: it rewrites every stored operand, and its
    16-bit encodes are real roundings of the float32 results (bf16 bits of a value near 0.02)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import compute_limit
    finally:
        sys.path.remove(str(BENCHMARKS))
    storage = compute_limit.PRESET_STORAGE[preset]
    operands = compute_limit.arrays(1, 64, "adam", storage)
    before = [a.copy() for a in (operands.p, operands.w, operands.m, operands.v)]
    compute_limit.runner("adam", storage, operands, 1)()
    for name, old, new in zip("pwmv", before, (operands.p, operands.w, operands.m, operands.v)):
        if name == "w" and not (storage.kahan or storage.master != "param"):
            continue
        assert not np.array_equal(old, new), name


@pytest.mark.skipif(shutil.which("valgrind") is None or platform.machine() != "x86_64",
                    reason="counts instructions with valgrind's callgrind (x86-64 client requests)")
def test_kernel_instructions_prints_its_table():
    """One preset's row: instructions per element of bf16opt's kernel and of its limit, counted."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_instructions.py"), "--algorithms", "SGD",
                             "--presets", "bf16"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("SGD ")]
    assert len(rows) == 1, result.stdout
    ours, limit, ratio = re.split(r"\s{2,}", rows[0].strip())[1:4]
    assert float(ours) > 1 and float(limit) > 1 and ratio.endswith("x")
