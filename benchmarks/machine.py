"""What machine a benchmark ran on: printed beside every figure (these machines change
between sessions; never assume an instruction set)."""

from __future__ import annotations

import os


def cpu_name() -> str:
    """``model name, instruction set, cores of this process`` from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown CPU")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    isa = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")
    if " avx512_bf16" in flags:
        isa += " + AVX512-BF16"
    return f"{name}, {isa}, {len(os.sched_getaffinity(0))} cores"
