"""The CPU benchmark runs and prints a full table on a tiny size, so it does not rot.

(Figures at this size mean nothing; the benchmark is run by hand at 2^25 params.)
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

BENCHMARK = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_step.py"


def test_cpu_benchmark_prints_every_configuration():
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, str(BENCHMARK), "--log2-params", "16", "--repeats", "1",
                             "--skip-multi-tensor"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("bf16 params", "fp32 params"))]
    assert len(rows) == 9, result.stdout
    for row in rows:
        # bf16opt, limit, share of limit, in-cache time: all measured (in ms to 0.1: tiny
        # times print as 0.0)
        ours, limit, share, in_cache = re.split(r"\s{2,}", row.strip())[1:5]
        assert float(ours) > 0 and float(limit) >= 0 and float(in_cache) >= 0
        assert share.endswith("%") and int(share[:-1]) >= 0
