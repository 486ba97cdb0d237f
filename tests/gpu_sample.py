"""Which CUDA kernel instantiations a GPU run checks: a sample that changes from run to run.

Every instantiation the CuPy adapter can request, crossed with its algorithm's run-time
flags, is over 1,500 cases of a compile and a few launches each: hours on one GPU.  A GPU
run has minutes (issue 37: every GPU test module in 4 minutes on one H100), so each run
checks a sample, as the NVRTC sweep samples its second architecture:

* per algorithm, one case for each named precision preset (``bf16opt.PRESETS``), on a
  param dtype chosen at random among those where the preset keeps its compensation and
  rounding (fp32-remainder: bf16 params), with random template flags (amsgrad, SGD's
  momentum), telemetry on for about half of them and random run-time flags;
* then ``extra`` cases per algorithm drawn from every instantiation (fp16 masters, Kahan
  buffers of either dtype, ... -- the plans no preset names), so over many runs all are hit.

The sample is drawn from a seed: ``$BF16OPT_GPU_SAMPLE_SEED`` when set (to repeat a run),
else today's date (UTC), so every worker of one run draws the same sample and each day's
run another.  ``$BF16OPT_GPU_SAMPLE``: ``all`` for every case, or the number of extra
cases per algorithm.  The GPU module prints the seed.
"""

from __future__ import annotations

import datetime
import itertools
import os
import random

from bf16opt.algorithms import ALGORITHMS, kernel_config
from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import PARAM_DTYPES, PRESETS, plan_for

SEED_VARIABLE = "BF16OPT_GPU_SAMPLE_SEED"
SIZE_VARIABLE = "BF16OPT_GPU_SAMPLE"
DEFAULT_EXTRA = 6


def sample_seed(environ=os.environ) -> int:
    """The run's seed: ``$BF16OPT_GPU_SAMPLE_SEED``, else today's date as YYYYMMDD (UTC)."""
    value = environ.get(SEED_VARIABLE, "").strip()
    if not value:
        return int(datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"))
    try:
        return int(value, 0)
    except ValueError:
        raise ValueError(f"{SEED_VARIABLE} must be an integer, got {value!r}") from None


def sample_size(environ=os.environ):
    """``None`` for every case (``$BF16OPT_GPU_SAMPLE=all``), else the extra cases per algorithm."""
    value = environ.get(SIZE_VARIABLE, "").strip().lower()
    if not value:
        return DEFAULT_EXTRA
    if value == "all":
        return None
    if not value.isdigit():
        raise ValueError(f"{SIZE_VARIABLE} must be 'all' or a non-negative integer, got {value!r}")
    return int(value)


def _runtime_allowed(kind: str, flags: dict) -> bool:
    # SGD's nesterov and first step only exist with a momentum buffer
    return kind != "sgd" or flags.get("momentum") or not (flags.get("nesterov") or flags.get("first"))


def instantiations(kind: str) -> list:
    """Every kernel the adapter can request for ``kind`` crossed with the algorithm's
    run-time flags (SGD's nesterov and first only where a momentum buffer exists)."""
    algorithm = ALGORITHMS[kind]
    configs = []
    for config in cuda_backend.kernel_configs(kind).values():
        for values in itertools.product((False, True), repeat=len(algorithm.runtime_flags)):
            flags = {**dict(config.flags), **dict(zip(algorithm.runtime_flags, values))}
            if _runtime_allowed(kind, flags):
                configs.append(kernel_config(algorithm, config.plan, tuple(flags.items()), config.track))
    return configs


def config_id(config) -> str:
    extra = "".join(f",{name}" for name in config.algorithm.runtime_flags if config.flag(name))
    return cuda_backend.kernel_name(config).replace("bf16opt::", "").replace(" ", "") + extra


def _distinctive_plans(preset: str) -> list:
    """The preset's plans on the param dtypes where it keeps what sets it apart (its
    compensation, its stochastic rounding): fp32-remainder on fp32 params is plain fp32."""
    precision, plans = PRESETS[preset], []
    for dtype in PARAM_DTYPES:
        try:
            plan = plan_for(precision, dtype)
        except ValueError:  # e.g. an fp16 master for bf16 params
            continue
        if plan.compensation == precision.compensation and plan.rounding == precision.rounding:
            plans.append(plan)
    return plans


def _preset_case(kind: str, preset: str, track: bool, rng: random.Random):
    algorithm = ALGORITHMS[kind]
    plan = rng.choice(_distinctive_plans(preset))
    while True:
        flags = {name: rng.random() < 0.5 for name in algorithm.flags}
        if _runtime_allowed(kind, flags):
            break
    config = kernel_config(algorithm, plan, tuple(flags.items()), track)
    if cuda_backend.kernel_name(config) not in cuda_backend.kernel_configs(kind):
        raise AssertionError(f"{preset} on {plan.param} asks for a kernel the adapter does not list")
    return config


def sample(kind: str, seed: int, extra=DEFAULT_EXTRA) -> list:
    """The cases of ``kind`` a run with ``seed`` checks (every one when ``extra`` is None):
    one per preset, then ``extra`` more from every instantiation, without repeats, in a
    stable order."""
    everything = instantiations(kind)
    if extra is None:
        return everything
    rng = random.Random(f"{seed}:{kind}")
    first_tracked = rng.random() < 0.5
    chosen = {}
    for number, preset in enumerate(PRESETS):
        config = _preset_case(kind, preset, (number % 2 == 0) == first_tracked, rng)
        chosen.setdefault(config_id(config), config)
    rest = [config for config in everything if config_id(config) not in chosen]
    for config in rng.sample(rest, min(extra, len(rest))):
        chosen[config_id(config)] = config
    return list(chosen.values())


def describe(seed: int, extra, counts: dict) -> str:
    """One line for the run's output: the seed, how to repeat it, what was drawn."""
    drawn = ", ".join(f"{kind} {n} of {total}" for kind, (n, total) in counts.items())
    how = "every case" if extra is None else f"one per preset + {extra} more per algorithm"
    return (f"CUDA kernel sample: seed {seed} ({how}; {drawn}); repeat with {SEED_VARIABLE}={seed}, "
            f"{SIZE_VARIABLE}=all checks every case")


def compile_for_the_loader(kind: str, expression: str, arch: str) -> bool:
    """What ``cupy.load_kernel`` compiles for ``expression`` on a device of ``arch``, put in
    the on-disk NVRTC cache (run in worker processes ahead of the tests); True if stored or
    already there."""
    from bf16opt.backends import cuda_compile  # noqa: PLC0415

    before = cuda_compile.cache_stats().get("store_failures", 0)
    cuda_compile.cached_nvrtc_compile(cuda_compile.kernel_source(kind), [expression],
                                      cuda_compile.compile_options(arch), filename=f"{kind}.cu")
    return cuda_compile.cache_stats().get("store_failures", 0) == before
