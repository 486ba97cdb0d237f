"""What machine a benchmark ran on: printed beside every figure (these machines change
between sessions; never assume an instruction set)."""

from __future__ import annotations

import os


def cpu_name() -> str:
    """``model name (family, model), instruction set, cores of this process`` from
    /proc/cpuinfo (family and model tell apart CPUs a hypervisor names alike, e.g. "Intel(R)
    Xeon(R) Processor")."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown CPU")
    fields = {}
    for line in info.splitlines():  # (the first processor's)
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    isa = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")
    if " avx512_bf16" in flags:
        isa += " + AVX512-BF16"
    return f"{name}, {isa}, {len(os.sched_getaffinity(0))} cores"
