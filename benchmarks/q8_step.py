"""Numba step time of the q8 presets against bf16-states on the same params, and against a
memory-limit kernel moving the q8 configuration's bytes.

    python benchmarks/q8_step.py [--log2-params 22] [--repeats 9]

One flat bf16 param of 2^N elements, AdamW, ``backend="numba"``; repetitions interleaved
across the contenders (these machines are noisy), medians.  The memory limit reads and writes
the arrays of fp32-remainder-q8 (param, grad, remainder, two q8 moments: 2 + 2 + 2 + 2 x 1.016
bytes read and the same written but the grad) with a trivial parallel kernel.  Issue 40's
target: fp32-remainder-q8 no slower than bf16-states (fewer bytes per param).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from numba import njit, prange

import bf16opt

PRESETS = ("bf16-states", "fp32-remainder-bf16-states", "fp32-remainder-q8", "bf16-sr", "bf16-sr-q8")


@njit(parallel=True)
def _q8_memory_limit(p, g, r, m, v):
    """p += g, r += g (int16 views), and every q8 byte of m and v incremented: the bytes of a
    fp32-remainder-q8 step, no arithmetic."""
    for i in prange(p.size):
        p[i] += g[i]
        r[i] += g[i]
    for b in prange(m.shape[0]):
        for j in range(m.shape[1]):
            m[b, j] += np.uint8(1)
            v[b, j] += np.uint8(1)


def optimizer(preset: str, n: int):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    param.grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    opt = bf16opt.AdamW([param], lr=1e-3, precision=preset, backend="numba")
    opt.step()  # state made, kernel compiled
    return opt.step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-params", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    n = 1 << args.log2_params
    contenders = {preset: optimizer(preset, n) for preset in PRESETS}
    p, g, r = (np.zeros(n, dtype=np.int16) for _ in range(3))
    m, v = (np.zeros((n // 256, 260), dtype=np.uint8) for _ in range(2))
    _q8_memory_limit(p, g, r, m, v)
    contenders["memory limit (q8)"] = lambda: _q8_memory_limit(p, g, r, m, v)
    times = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, call in contenders.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    base, limit = medians["bf16-states"], medians["memory limit (q8)"]
    print(f"AdamW step, 2^{args.log2_params} bf16 params, numba backend; medians of {args.repeats}")
    for name, value in medians.items():
        print(f"  {name:28s} {1000 * value:8.2f} ms   x{value / base:5.2f} bf16-states   "
              f"x{value / limit:5.2f} the q8 memory limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
