"""Numba step time of the q8 presets against bf16-states on the same params, and against their
limits (``cpu_step.py``'s: the memory limit moving the preset's own bytes, q8 rows included;
the compute ceiling, the faster of the q8 compute-limit kernel and bf16opt's own kernel in
cache).

    python benchmarks/q8_step.py [--log2-params 22] [--repeats 11] [--algorithm AdamW]
                                 [--presets bf16-states,fp32-remainder-q8] [--steps-only]

One flat bf16 param of 2^N elements (``cpu_step._param``), ``backend="numba"``; repetitions
interleaved across the contenders in a shuffled order (these machines are noisy), medians;
shares as medians of each repetition's own ratio.  Issue 40's target: fp32-remainder-q8 no
slower than bf16-states (it moves fewer bytes per param).  ``in cache`` is each preset's kernel
over one cache-resident block per thread: its compute time with memory taken out.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from numba import get_num_threads

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.q8_step
    import cpu_step
    from machine import cpu_name
except ImportError:  # pragma: no cover
    from benchmarks import cpu_step
    from benchmarks.machine import cpu_name

PRESETS = ("bf16-states", "fp32-remainder-bf16-states", "fp32-remainder-q8", "bf16-sr", "bf16-sr-q8")
Q8_PRESETS = ("fp32-remainder-q8", "bf16-sr-q8")
FAMILY = {"AdamW": "adam", "Lion": "lion", "SGD": "sgd"}


def contenders(n: int, algorithm: str, presets=PRESETS, steps_only: bool = False) -> tuple:
    """(name -> call, objects to keep alive): each preset's step and memory limit, and unless
    ``steps_only``, its kernel in cache and each q8 preset's compute limit (more compiled kernels:
    minutes of a many-core host's cold start)."""
    calls, keep = {}, []
    for preset in presets:
        params = [cpu_step._param(n, torch.bfloat16, 0)]
        step, opt = cpu_step.bf16opt_step(params, preset, algorithm)
        calls[preset] = step
        keep += [params, opt]
        buffers = cpu_step.state_buffers(opt.state[params[0]])
        calls[f"{preset} memory"] = cpu_step.limit_step(params[0], params[0].grad, buffers)
        if steps_only:
            continue
        calls[f"{preset} in cache"], cache_opt = cpu_step.in_cache_step(n, torch.bfloat16, preset,
                                                                        algorithm=algorithm, static=True)
        keep.append(cache_opt)
        if preset in Q8_PRESETS:
            calls[f"{preset} compute"] = cpu_step.compute_limit_step(n, FAMILY[algorithm], torch.bfloat16, preset,
                                                                     static=True)
    return calls, keep


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-params", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--algorithm", default="AdamW", choices=sorted(FAMILY))
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated, bf16-states among them "
                        f"(the reference; default {','.join(PRESETS)})")
    parser.add_argument("--steps-only", action="store_true", help="the steps and memory limits alone")
    args = parser.parse_args(argv)
    presets = [preset for preset in args.presets.split(",") if preset]
    if "bf16-states" not in presets or not set(presets) <= set(PRESETS):
        parser.error(f"--presets: bf16-states and any of {', '.join(PRESETS)}, got {args.presets!r}")
    n = 1 << args.log2_params
    calls, keep = contenders(n, args.algorithm, presets, args.steps_only)
    runs = cpu_step.timings(calls, args.repeats)
    t = {name: statistics.median(times) for name, times in runs.items()}

    def share(name: str, other: str) -> float:  # median of the repetitions' ratios other / name
        return statistics.median(b / a for a, b in zip(runs[name], runs[other]))

    print(f"{args.algorithm} step, 2^{args.log2_params} bf16 params, numba backend, {get_num_threads()} threads, "
          f"{cpu_name()}; medians of {args.repeats} interleaved repetitions; ms")
    print(f"{'preset':28} {'step':>8} {'x bf16-states':>13} {'in cache':>9} {'x bf16-states':>13} "
          f"{'memory':>8} {'compute':>8} {'of ceiling':>10}")
    for preset in presets:
        cached = f"{'-':>9} {'-':>13}" if args.steps_only else (
            f"{1e3 * t[preset + ' in cache']:9.2f} {1 / share(preset + ' in cache', 'bf16-states in cache'):13.2f}")
        row = (f"{preset:28} {1e3 * t[preset]:8.2f} {1 / share(preset, 'bf16-states'):13.2f} {cached} "
               f"{1e3 * t[preset + ' memory']:8.2f}")
        if preset in Q8_PRESETS and not args.steps_only:
            ceiling = statistics.median(
                cpu_step.ceiling_of(memory, compute, cached) / step for step, memory, compute, cached in zip(
                    runs[preset], runs[f"{preset} memory"], runs[f"{preset} compute"], runs[f"{preset} in cache"]))
            row += (f" {1e3 * t[preset + ' compute']:8.2f} "
                    f"{100 * ceiling:9.0f}%")
        print(row)
    del keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
