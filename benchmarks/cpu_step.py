"""CPU step-time benchmark of the numba backend against its limit kernel and its peers.

Run:  DS_ACCELERATOR=cpu python benchmarks/cpu_step.py [--log2-params 25] [--repeats 11] [--runs K]

For 2^N params and each preset (bf16 params; plus fp32 params with "fp32") it measures, in
one run and with repetitions interleaved across the contenders (these machines are noisy;
medians are reported):

* ``bf16opt``: one ``bf16opt.AdamW(..., backend="numba").step()``;
* ``memory``: a trivial parallel Numba kernel that reads and writes the same arrays in the
  same dtypes (``p += g; master += g; m += g; v += g``; the Kahan compensation or int16
  remainder in the master's place), the memory-bound limit of the configuration
  (the memory floor: no implementation can move less data), and bf16opt's fraction of it;
* ``in cache``: bf16opt's own kernel doing the same number of element updates on a small
  block per thread that stays in cache, i.e. the kernel's compute time with memory taken
  out.  A kernel whose in-cache time is near or above the limit is compute-bound (exactly
  rounded sqrt and division dominate the all-bf16 AdamW), and no memory tuning gets it
  to the limit;
* ``compute``: the compute-limit kernel (``compute_limit.py``: the work no bit-identical
  implementation can avoid) in cache, through the same driver.  The ceiling is the slower of
  ``memory`` and the compute ceiling, the faster of ``compute`` and ``in cache`` (where
  bf16opt's own kernel beats the limit kernel, it shows the work can be done that fast; the
  row says so);
* ``streamed``: the compute-limit kernel once over the step's own tensors (the arrays of
  ``memory``), out of cache: the unavoidable instructions with the step's memory traffic.  The ceiling above assumes
  memory and compute overlap perfectly; where compute and memory times are close, this says
  how much of that overlap the plainest kernel doing only the unavoidable work gets here;
* ``limit step``: that kernel inside the least Python a drop-in optimizer's step runs
  (``ProtocolStep``: torch's hooks and profiler scope, autograd off, the grads fetched, the
  version counters bumped) with the caches cold after the last stream, as a real step: the
  share of the ceiling within reach of any optimizer users can swap in for torch.optim's;
* ``torch fused``: ``torch.optim.AdamW(fused=True)`` where torch has the same
  configuration (its states have the param's dtype, so: bf16 params with bf16 states, and
  fp32 params with fp32 states);
* ``DeepSpeedCPUAdam`` (adamw_mode=True) when deepspeed is installed: bf16 params with
  bf16 states (``fp32_optimizer_states=False``), bf16 params with fp32 states
  (``fp32_optimizer_states=True``), fp32 params with fp32 states.

``--peers``: only bf16opt against each peer with the same storage, as the median of paired
per-repetition ratios (the robust figure for "never slower than a peer"): the two above, and,
where installed from PyPI (never a dependency), ``torchao``'s ``_AdamW(bf16_stochastic_round=True)``
against ``bf16-sr``, ``torch-optimi``'s AdamW, Lion and SGD (``kahan_sum`` on and off) against
``bf16-kahan`` and ``bf16``, and ``lion-pytorch``'s Lion against Lion ``bf16``.
``--same-arrays``: AdamW with fp32 params and states (then bf16 params with fp32 states, against
DeepSpeed), bf16opt and the peers stepping one set of arrays, beside the memory limit and the
streamed limit, exact and with fused multiply-adds (what the fusing a peer's C compiler does is
worth here), and the streamed limit's exact work hand-written in C (``exact_adamw.c``, built
with the system's compiler: what the loop's form is worth apart from the numerics), and
bf16opt's hand-vectorised Adam blocks without its chunk driver (``vector_adam.py``;
``same_array_table``).

``--runs K``: the preset table K times, then each row over the runs: its share of the ceiling
and its class against the 90% target (``classify``: met; out of reach, where the streamed
limit or the limit step is itself below it; not met), with its kernel call's share alone, and
each run's counts (the machine's speed swings between runs: quote several).

Then the multi-tensor check: the step for a GPT-2-small-shaped param list (~124M params in
~150 tensors) against one flat tensor of the same size.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import get_num_threads, njit, prange  # noqa: E402

import bf16opt  # noqa: E402
from bf16opt import _cpu  # noqa: E402
from bf16opt._cpu import vector_blocks  # noqa: E402

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.cpu_step
    import compute_limit  # noqa: E402
    import vector_adam  # noqa: E402
    from machine import cpu_name  # noqa: E402
except ImportError:  # pragma: no cover
    from benchmarks import compute_limit, vector_adam  # noqa: E402
    from benchmarks.machine import cpu_name  # noqa: E402

VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.int16: torch.int16, torch.uint8: torch.uint8}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
# algorithm -> (optimizer, hyper-parameters, compute_limit kernel family)
OPTIMIZERS = {
    "AdamW": (bf16opt.AdamW, HYPER, "adam"),
    "Lion": (bf16opt.Lion, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2), "lion"),
    "SGD": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4), "sgd"),
}


# ---------------------------------------------------------------- memory-limit kernels
# (not cached on disk: each is compiled for several dtype combinations, and Numba's cache
# index of one function is not safe for processes adding different entries at once -- see
# cpu_src/chunks.py's chunk_compiler; they compile in about a second)
@njit(parallel=True, nogil=True)
def _limit2(g, p, m):
    for i in prange(p.size):
        x = g[i]
        p[i] += x
        m[i] += x


@njit(parallel=True, nogil=True)
def _limit3(g, p, m, v):
    for i in prange(p.size):
        x = g[i]
        p[i] += x
        m[i] += x
        v[i] += x


@njit(parallel=True, nogil=True)
def _limit4(g, p, w, m, v):
    for i in prange(p.size):
        x = g[i]
        p[i] += x
        w[i] += x
        m[i] += x
        v[i] += x


LIMITS = {2: _limit2, 3: _limit3, 4: _limit4}


@njit(parallel=True, nogil=True)
def _limit_q8(g, p, m, v):
    """The memory limit of a configuration with q8 moments and no companion: ``p += g`` per
    element, then every 4-byte word of the q8 rows of ``m`` and ``v`` (flat int32 views of the
    rows; ``v`` empty for one moment) incremented: two flat passes (a loop per q8 block inside
    the parallel loop was not vectorised: twice the time of the element limits' for fewer bytes)."""
    for i in prange(p.size):
        p[i] += g[i]
    for j in prange(m.size):
        m[j] += 1
    for j in prange(v.size):
        v[j] += 1


@njit(parallel=True, nogil=True)
def _limit_q8_companion(g, p, w, m, v):
    """:func:`_limit_q8` with a 16-bit companion ``w`` (the remainder): ``w += g`` too."""
    for i in prange(p.size):
        x = g[i]
        p[i] += x
        w[i] += x
    for j in prange(m.size):
        m[j] += 1
    for j in prange(v.size):
        v[j] += 1


def _raw(t: torch.Tensor) -> np.ndarray:
    """Integer view (same bytes, trivial adds) of a tensor's memory."""
    return t.view(VIEW[t.dtype]).numpy()


def limit_step(param, grad, buffers):
    """Read the grad, read and write the param and every state buffer, in their dtypes (q8
    moments, uint8: their rows' bytes, :func:`_limit_q8` / :func:`_limit_q8_companion`)."""
    quantized = [b for b in buffers if b.dtype == torch.uint8]
    if quantized:
        elements = [_raw(b) for b in buffers if b.dtype != torch.uint8]
        if len(elements) > 1 or len(quantized) > 2:
            raise ValueError(f"no q8 memory limit for {len(elements)} element and {len(quantized)} q8 buffers")
        rows = [b.view(torch.int32).numpy().reshape(-1) for b in quantized]
        m, v = rows[0], rows[1] if len(rows) == 2 else rows[0][:0]
        g, p = _raw(grad), _raw(param)
        if elements:
            return lambda: _limit_q8_companion(g, p, elements[0], m, v)
        return lambda: _limit_q8(g, p, m, v)
    arrays = [_raw(grad), _raw(param)] + [_raw(b) for b in buffers]
    kernel = LIMITS[len(arrays) - 1]
    return lambda: kernel(*arrays)


def compute_limit_step(n: int, algorithm: str, dtype: torch.dtype, preset: str, block: int = 1 << 13,
                       static: bool = False):
    """The compute-limit kernel (``compute_limit.py``) doing ``n`` element updates over one
    cache-resident block per thread (``static``: through the chunk driver without stealing)."""
    storage = compute_limit.FP32_PARAMS if dtype == torch.float32 else compute_limit.PRESET_STORAGE[preset]
    threads = get_num_threads()
    operands = compute_limit.arrays(threads, block, algorithm, storage)
    return compute_limit.runner(algorithm, storage, operands, max(1, n // (threads * block)), static=static)


def streamed_limit_step(param, grad, buffers, algorithm: str, preset: str, contract: bool = False):
    """The compute-limit kernel doing one update of every element of the step's own tensors
    (the memory-limit kernel's arrays, out of cache): the unavoidable instructions together
    with the step's memory traffic, on the same memory, with nothing else in the way.
    ``buffers``: the state's tensors, the master's companion first (``state_buffers``);
    ``contract``: its multiply-adds fused (``compute_limit.chunk_function``; not a limit).  Where
    bf16opt's blocks prefetch (``vector_blocks.prefetching``), the kernel's prefetching form: the
    same memory access, so the streamed limit is not one a step beats by its prefetches alone."""
    storage = compute_limit.FP32_PARAMS if param.dtype == torch.float32 else compute_limit.PRESET_STORAGE[preset]
    threads = get_num_threads()
    # blocks of bf16opt's chunk size, as the step's chunk table has (the driver's threads then
    # share them out as they do the step's chunks)
    blocks = threads * max(1, param.numel() // (threads * _cpu.chunks.CHUNK))
    if param.numel() % (2 * blocks):
        raise ValueError(f"{param.numel()} elements do not split into {blocks} even blocks")

    def rows(t):  # [block, element] view of the tensor's memory (only addresses and shapes are used)
        return _raw(t).reshape(blocks, -1)

    companion = storage.master == "copy" or storage.master == "remainder" or storage.kahan
    if len(buffers) != int(companion) + compute_limit.MOMENTS[algorithm]:
        raise ValueError(f"{preset}: {len(buffers)} state buffers, the compute limit's storage has "
                         f"{int(companion) + compute_limit.MOMENTS[algorithm]}")
    w = rows(buffers[0]) if companion else np.zeros((blocks, 0), dtype=np.float32)
    moments = [rows(b) for b in buffers[int(companion):]]
    m = moments[0]
    v = moments[1] if compute_limit.MOMENTS[algorithm] == 2 else m[:, :0]
    keys = np.arange(1, blocks * compute_limit.KEYS + 1, dtype=np.uint32).reshape(blocks, compute_limit.KEYS)
    operands = compute_limit.Operands(rows(grad), rows(param), w, m, v,
                                      np.array(compute_limit.SCALARS[algorithm], dtype=np.float32), keys)
    return compute_limit.runner(algorithm, storage, operands, 1, contract=contract,
                                prefetch=vector_blocks.available() and vector_blocks.prefetching())


class ProtocolStep(torch.optim.Optimizer):
    """The least a drop-in torch optimizer's step does around its kernel call: torch's step
    protocol (the step pre- and post-hooks and the profiler scope, through bf16opt's wrapper
    of them, the cheapest known; autograd off), every param's grad fetched and its address
    read, the kernel called, and autograd's version counters of the tensors it wrote bumped
    (the kernel writes through addresses).  No checks, no step counter, no scalars: a floor
    for the Python of any optimizer users can swap in for torch.optim's, measured with the
    caches as cold as the real step meets them.  ``kernel``: a call with no arguments."""

    profile_hook_step = staticmethod(bf16opt.optimizer.MixedPrecisionOptimizer.profile_hook_step)

    def __init__(self, params: list, kernel, written: list):
        super().__init__(params, {})
        self.kernel, self.written = kernel, written

    def step(self, closure=None):
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.data_ptr()
            self.kernel()
            torch.autograd.graph.increment_version(self.written)
        finally:
            torch._C._set_grad_enabled(enabled)


def protocol_step(params: list, kernel, written: list):
    """``kernel`` inside :class:`ProtocolStep`'s step over ``params``."""
    return ProtocolStep(params, kernel, written).step


# ---------------------------------------------------------------- contenders
def _param(n: int, dtype: torch.dtype, seed: int) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g).mul_(0.02).to(dtype))
    p.grad = torch.randn(n, generator=g).mul_(1e-3).to(dtype)
    return p


def bf16opt_step(params: list, preset: str, algorithm: str = "AdamW"):
    cls, hyper, _ = OPTIMIZERS[algorithm]
    opt = cls(params, precision=preset, backend="numba", **hyper)
    opt.step()  # creates state, compiles or loads the kernel
    return opt.step, opt


def driver_users() -> None:
    """Import what binds bf16opt's parallel chunk driver at its import (the step helpers: a
    kept launch's compiled call), before a benchmark replaces the driver for a while: imported
    meanwhile, they would keep the replacement, and a reused step compiled later (a fresh
    Numba cache) would fail to type it."""
    from bf16opt.backends import numba as backend  # noqa: PLC0415

    backend.helpers()


def captured_kernel_call(opt) -> tuple:
    """The arguments of the kernel call one step of ``opt`` makes (the step runs without it:
    its counters advance, its tensors stay); :func:`kernel_driver` runs them as the step does.
    A full step (the launches the optimizer kept are dropped first: a reused step makes the
    same call from compiled code)."""
    calls = []
    driver_users()
    drivers = _cpu.chunks.run_chunks, _cpu.chunks.run_chunks_serial
    _cpu.chunks.run_chunks = _cpu.chunks.run_chunks_serial = lambda *args: calls.append(args)
    opt._group_launches.clear()
    try:
        opt.step()
    finally:
        _cpu.chunks.run_chunks, _cpu.chunks.run_chunks_serial = drivers
    if len(calls) != 1:
        raise RuntimeError(f"expected one kernel call per step, got {len(calls)}")
    return calls[0]


def kernel_driver(table: np.ndarray):
    """The chunk driver a step runs ``table`` with: the calling thread's for one row, else the
    parallel one (the numba backend's rule)."""
    from bf16opt.backends import numba as backend  # noqa: PLC0415

    return _cpu.chunks.run_chunks_serial if backend.on_calling_thread(table) else _cpu.chunks.run_chunks


def kernel_step(opt):
    """``opt``'s step's kernel call alone, replayed with the arguments a step gave it: the
    step without its Python bookkeeping (which runs with cold caches after a stream)."""
    args = captured_kernel_call(opt)
    driver = kernel_driver(args[1])
    return lambda: driver(*args)


def in_cache_call(n: int, dtype: torch.dtype, preset: str, block: int = 1 << 13,
                  algorithm: str = "AdamW") -> tuple:
    """The arguments of ``run_chunks`` for bf16opt's kernel updating ``n`` elements as repeated
    passes over one cache-resident ``block`` per thread: its chunk table, captured from a real
    step, with every thread's rows pointing at that thread's block; and the optimizer."""
    threads = get_num_threads()
    params = [_param(block, dtype, 10 + t) for t in range(threads)]
    _, opt = bf16opt_step(params, preset, algorithm)
    address, table, scalars, keys, _, _ = captured_kernel_call(opt)
    if table.shape[0] != threads:
        raise RuntimeError(f"expected one chunk-table row per block, got {table.shape[0]}")
    # each thread runs one contiguous range of rows (then takes the rows left in the others'): fill
    # thread t's range with block t's row
    rows = n // block
    per_thread = -(-rows // threads)
    big = np.repeat(table, per_thread, axis=0)[:rows]
    bounds = np.minimum(np.arange(threads + 1, dtype=np.int64) * per_thread, rows)
    counts = np.zeros((rows, _cpu.chunks.COUNTERS), dtype=np.int64)
    return (address, big, scalars, keys, counts, bounds), opt


def in_cache_step(n: int, dtype: torch.dtype, preset: str, block: int = 1 << 13, algorithm: str = "AdamW",
                  static: bool = False):
    """bf16opt's kernel in cache (:func:`in_cache_call`), through the chunk driver (``static``:
    without stealing, which moves a block between cores here)."""
    args, opt = in_cache_call(n, dtype, preset, block, algorithm)
    run = compute_limit.run_chunks_static if static else _cpu.chunks.run_chunks
    return (lambda: run(*args)), opt


def torch_fused_step(params: list):
    opt = torch.optim.AdamW(params, fused=True, **HYPER)
    opt.step()
    return opt.step, opt


def python_peer_step(params: list, module: str, make):
    """A peer from PyPI built by ``make(imported module, params)``, stepped once; (None, None)
    when it is not installed or does not build or run here (these peers are never dependencies)."""
    import importlib  # noqa: PLC0415
    try:
        opt = make(importlib.import_module(module), params)
        opt.step()  # (torchao's compiles here)
    except Exception:  # noqa: BLE001
        return None, None
    return opt.step, opt


def deepspeed_step(params: list, fp32_states: bool):
    return python_peer_step(params, "deepspeed.ops.adam", lambda m, p: m.DeepSpeedCPUAdam(
        p, adamw_mode=True, fp32_optimizer_states=fp32_states, **HYPER))


LION_HYPER, SGD_HYPER = OPTIMIZERS["Lion"][1], OPTIMIZERS["SGD"][1]
# peers that store a configuration's bytes the way a bf16opt preset does, all bf16 params:
# (algorithm, preset, peer name, module, maker(module, params)).  Their arithmetic differs (torch's
# eager or compiled ops on float32 values); torchao rounds the moments to nearest (bf16opt's
# "bf16-sr" rounds them stochastically too); optimi's SGD is torch's with ``torch_init``.
PYPI_PEERS = [
    ("AdamW", "bf16", "optimi AdamW", "optimi", lambda m, p: m.AdamW(p, kahan_sum=False, **HYPER)),
    ("AdamW", "bf16-kahan", "optimi AdamW(kahan_sum)", "optimi",
     lambda m, p: m.AdamW(p, kahan_sum=True, **HYPER)),
    ("AdamW", "bf16-sr", "torchao _AdamW(bf16 SR)", "torchao.optim",
     lambda m, p: m._AdamW(p, bf16_stochastic_round=True, **HYPER)),
    ("Lion", "bf16", "lion-pytorch Lion", "lion_pytorch", lambda m, p: m.Lion(p, **LION_HYPER)),
    ("Lion", "bf16", "optimi Lion", "optimi", lambda m, p: m.Lion(p, kahan_sum=False, **LION_HYPER)),
    ("Lion", "bf16-kahan", "optimi Lion(kahan_sum)", "optimi",
     lambda m, p: m.Lion(p, kahan_sum=True, **LION_HYPER)),
    ("SGD", "bf16", "optimi SGD", "optimi",
     lambda m, p: m.SGD(p, kahan_sum=False, torch_init=True, **SGD_HYPER)),
    ("SGD", "bf16-kahan", "optimi SGD(kahan_sum)", "optimi",
     lambda m, p: m.SGD(p, kahan_sum=True, torch_init=True, **SGD_HYPER)),
]


def timings(contenders: dict, repeats: int, seed: int = 0) -> dict:
    """Seconds of each repetition per contender, repetitions interleaved, in an order shuffled
    anew for each repetition (``seed``): what ran just before a contender (a stream over the
    same tensors, or kernels in cache) leaves the caches in a state that favours or hinders
    it, and a fixed order would give each contender the same neighbour every time."""
    times = {name: [] for name, fn in contenders.items() if fn is not None}
    for name in times:  # warm-up
        contenders[name]()
    order = random.Random(seed)
    for _ in range(repeats):
        for name in order.sample(list(times), len(times)):
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return times


def measure(contenders: dict, repeats: int) -> dict:
    """Median seconds per contender, repetitions interleaved."""
    return {name: statistics.median(t) for name, t in timings(contenders, repeats).items()}


def ceiling_of(memory: float, compute: float, in_cache: float) -> float:
    """The slower of the memory limit and the compute ceiling (the faster of the compute-limit
    kernel and bf16opt's own kernel in cache)."""
    return max(memory, min(compute, in_cache))


def fold_static(runs: dict) -> dict:
    """``runs`` with each in-cache kernel's time the faster of its two forms in each repetition:
    through bf16opt's chunk driver, and through it without stealing (``<name> static``, dropped)."""
    for name in ("compute", "in cache"):
        static = runs.pop(f"{name} static", None)
        if static is not None:
            runs[name] = [min(a, b) for a, b in zip(runs[name], static)]
    return runs


# ---------------------------------------------------------------- tables
CONFIGS = [  # (label, param dtype, preset, torch fused equivalent?, DeepSpeed fp32 states or None)
    ("bf16 params, fp32", torch.bfloat16, "fp32", False, None),
    ("bf16 params, bf16", torch.bfloat16, "bf16", True, False),
    ("bf16 params, bf16-master", torch.bfloat16, "bf16-master", False, True),
    ("bf16 params, bf16-states", torch.bfloat16, "bf16-states", False, None),
    ("fp32 params, fp32", torch.float32, "fp32", True, True),
    # quality presets (issue 5): same arrays as a plain preset plus the extra buffer
    ("bf16 params, bf16-sr", torch.bfloat16, "bf16-sr", False, None),
    ("bf16 params, bf16-kahan", torch.bfloat16, "bf16-kahan", False, None),
    ("bf16 params, fp32-remainder", torch.bfloat16, "fp32-remainder", False, None),
    ("bf16 params, fp32-rem-bf16st", torch.bfloat16, "fp32-remainder-bf16-states", False, None),
    # q8 moments (issue 40): the memory limit moves their rows' bytes, the compute limit decodes
    # and quantizes them (compute_limit.q8_chunk_function)
    ("bf16 params, fp32-remainder-q8", torch.bfloat16, "fp32-remainder-q8", False, None),
    ("bf16 params, bf16-sr-q8", torch.bfloat16, "bf16-sr-q8", False, None),
]


def _ms(t):
    return "-" if t is None else f"{1e3 * t:8.1f}"


def _x(a, b):
    return "-" if a is None or b is None else f"{b / a:5.2f}x"


def state_buffers(state: dict) -> list:
    """An optimizer's state tensors but its step counter (bf16opt's, torch's, DeepSpeed's)."""
    return [value for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor)]


def preset_table(n: int, repeats: int, presets=None, algorithms=("AdamW", "Lion", "SGD")) -> list:
    """One row per (algorithm, configuration); returns the rows as dicts (times in seconds)."""
    print(f"step of 2^{n.bit_length() - 1} params, {get_num_threads()} Numba threads, {cpu_name()}, "
          f"median of {repeats} interleaved repetitions; times in ms.\n"
          f"memory: the memory-limit kernel (same arrays, trivial math); compute: the compute-limit kernel "
          f"in cache (compute_limit.py); in cache: bf16opt's kernel in cache (both: each repetition's faster "
          f"of the chunk driver with and without stealing);\n"
          f"ceiling = the slower of memory and the faster of compute and in cache; shares are "
          f"medians of each repetition's ratio;\n"
          f"streamed: the compute-limit kernel over the step's own tensors (out of cache), of str: the step's "
          f"share of it, str/ceil: its share of the ceiling; lim step: the share of the ceiling of the "
          f"streamed kernel inside the least Python a drop-in step runs (ProtocolStep);\n"
          f"kernel: bf16opt's kernel call alone (the step without its Python), of ceil: its share")
    header = (f"{'configuration':36} {'bf16opt':>8} {'memory':>8} {'compute':>8} {'of ceil':>7} "
              f"{'in cache':>8} {'streamed':>8} {'of str':>6} {'str/ceil':>8} {'lim step':>8} {'kernel':>7} "
              f"{'of ceil':>7} "
              f"{'torch fused':>11} {'DeepSpeed':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for algorithm in algorithms:
        family = OPTIMIZERS[algorithm][2]
        for label, dtype, preset, has_torch, ds_fp32 in CONFIGS:
            if presets and preset not in presets:
                continue
            has_torch = has_torch and algorithm == "AdamW"
            ds_fp32 = ds_fp32 if algorithm == "AdamW" else None
            mine = [_param(n, dtype, 0)]
            ours, opt = bf16opt_step(mine, preset, algorithm)
            state = opt.state[mine[0]]
            contenders = {"bf16opt": ours, "memory": limit_step(mine[0], mine[0].grad, state_buffers(state)),
                          "compute": compute_limit_step(n, family, dtype, preset),
                          "streamed": streamed_limit_step(mine[0], mine[0].grad, state_buffers(state), family,
                                                          preset)}
            contenders["limit step"] = protocol_step(mine, contenders["streamed"], [mine[0], *state_buffers(state)])
            contenders["kernel"] = kernel_step(opt)
            contenders["in cache"], cache_opt = in_cache_step(n, dtype, preset, algorithm=algorithm)
            # the in-cache kernels also without the driver's stealing (see in_cache_step); the faster
            # of the two forms in each repetition is taken (fold_static)
            contenders["compute static"] = compute_limit_step(n, family, dtype, preset, static=True)
            contenders["in cache static"], static_opt = in_cache_step(n, dtype, preset, algorithm=algorithm,
                                                                      static=True)
            keep = [opt, cache_opt, static_opt]
            if has_torch:
                theirs = [_param(n, dtype, 0)]
                contenders["torch"], t_opt = torch_fused_step(theirs)
                keep.append(t_opt)
            if ds_fp32 is not None:
                ds = [_param(n, dtype, 0)]
                contenders["deepspeed"], ds_opt = deepspeed_step(ds, ds_fp32)
                keep.append(ds_opt)
            runs = fold_static(timings(contenders, repeats))
            t = {name: statistics.median(times) for name, times in runs.items()}
            ceiling = ceiling_of(t["memory"], t["compute"], t["in cache"])
            # shares as medians of each repetition's own ratio: the speed of memory and of the
            # cores drifts between repetitions, and a ratio within one repetition cancels most of it
            of_ceiling = statistics.median(ceiling_of(*parts) / ours for ours, *parts in
                                           zip(runs["bf16opt"], runs["memory"], runs["compute"], runs["in cache"]))
            of_streamed = statistics.median(s / ours for ours, s in zip(runs["bf16opt"], runs["streamed"]))
            kernel_of_ceiling = statistics.median(
                ceiling_of(*parts) / kernel for kernel, *parts in
                zip(runs["kernel"], runs["memory"], runs["compute"], runs["in cache"]))
            # the limit's own share: where the plainest kernel doing the unavoidable work over the
            # step's tensors is below 90%, the ceiling's perfect overlap of memory and compute is
            # not to be had on this machine
            streamed_of_ceiling = statistics.median(
                ceiling_of(*parts) / streamed for streamed, *parts in
                zip(runs["streamed"], runs["memory"], runs["compute"], runs["in cache"]))
            # and with the least Python a drop-in step runs around it (ProtocolStep)
            limit_step_of_ceiling = statistics.median(
                ceiling_of(*parts) / limit for limit, *parts in
                zip(runs["limit step"], runs["memory"], runs["compute"], runs["in cache"]))
            row = dict(algorithm=algorithm, configuration=label, preset=preset, ceiling=ceiling,
                       of_ceiling=of_ceiling, of_streamed=of_streamed, kernel_of_ceiling=kernel_of_ceiling,
                       streamed_of_ceiling=streamed_of_ceiling, limit_step_of_ceiling=limit_step_of_ceiling, **t)
            rows.append(row)
            warn = f" (compute limit {100 * (t['compute'] / t['in cache'] - 1):.0f}% slower than bf16opt in " \
                f"cache: not a limit; in cache taken)" if t["compute"] > t["in cache"] else ""
            print(f"{algorithm + ' ' + label:36} {_ms(t['bf16opt'])} {_ms(t['memory'])} {_ms(t['compute'])} "
                  f"{100 * row['of_ceiling']:6.0f}% {_ms(t['in cache'])} {_ms(t['streamed'])} "
                  f"{100 * row['of_streamed']:5.0f}% {100 * streamed_of_ceiling:7.0f}% "
                  f"{100 * limit_step_of_ceiling:7.0f}% {1e3 * t['kernel']:7.1f} "
                  f"{100 * kernel_of_ceiling:6.0f}% "
                  f"{_ms(t.get('torch')):>11} {_ms(t.get('deepspeed')):>9}{warn}", flush=True)
            del contenders, keep, mine, opt, state
            gc.collect()
    return rows


TARGET = 0.90  # issue 15: every preset at >= 90% of its ceiling


def classify(row: dict, target: float = TARGET) -> str:
    """A preset row's standing against the target share of its ceiling: "met"; "out of reach"
    where the plainest kernel doing the unavoidable work over the step's tensors (streamed),
    bare or inside the least Python a drop-in step runs (limit step), is itself below it --
    no implementation gets there in that run; else "not met"."""
    if row["of_ceiling"] >= target:
        return "met"
    if min(row["streamed_of_ceiling"], row["limit_step_of_ceiling"]) < target:
        return "out of reach"
    return "not met"


def runs_summary(runs: list) -> None:
    """Each row over several runs of :func:`preset_table` (the machine's speed swings between
    runs): per run its share of the ceiling, its class (:func:`classify`: m met, o out of reach,
    N not met) and its kernel call's share alone; then each run's counts."""
    marks = {"met": "m", "out of reach": "o", "not met": "N"}
    print(f"\n{len(runs)} runs: the step's share of its ceiling and its class (m: >= {100 * TARGET:.0f}%; "
          f"o: out of reach, the streamed limit or the limit step below it; N: not met), then the kernel "
          f"call's share alone")
    for k, row in enumerate(runs[0]):
        same = [run[k] for run in runs]
        shares = " ".join(f"{100 * r['of_ceiling']:3.0f}{marks[classify(r)]}" for r in same)
        kernels = " ".join(f"{100 * r['kernel_of_ceiling']:3.0f}" for r in same)
        print(f"{row['algorithm'] + ' ' + row['configuration']:36} {shares}   kernel {kernels}")
    for number, run in enumerate(runs, 1):
        classes = [classify(row) for row in run]
        print(f"run {number}: " + ", ".join(f"{name} {classes.count(name)}" for name in marks))


def peer_table(n: int, repeats: int) -> list:
    """bf16opt against each peer doing the same storage (AdamW: torch's fused and DeepSpeed's;
    then the PyPI peers of ``PYPI_PEERS`` for AdamW, Lion and SGD), as the median over
    repetitions of each repetition's paired ratio (the two steps run back to back, so a
    drift of memory bandwidth between repetitions cancels); returns the rows."""
    print(f"\nSteps against peers with the same storage, 2^{n.bit_length() - 1} params, {get_num_threads()} "
          f"Numba threads, {cpu_name()}; {repeats} interleaved repetitions; ms (medians) and the median of "
          f"the paired ratios bf16opt / peer (below 1: bf16opt faster);\n"
          f"of limit: each step's share of the memory-limit kernel run on its own tensors (a tensor's placement "
          f"alone changes a memory-bound step by up to 1.5x on a VM; these shares do not carry that)")
    header = (f"{'configuration':36} {'peer':24} {'bf16opt':>8} {'peer':>8} {'ratio':>6} {'range':>11} "
              f"{'bf16opt of limit':>16} {'peer of limit':>13}")
    print(header)
    print("-" * len(header))
    pairs = [  # (label, algorithm, param dtype, preset, peer name, peer step maker)
        ("AdamW bf16 params, bf16", "AdamW", torch.bfloat16, "bf16", "torch AdamW(fused=True)",
         torch_fused_step),
        ("AdamW bf16 params, bf16", "AdamW", torch.bfloat16, "bf16", "DeepSpeedCPUAdam bf16",
         lambda p: deepspeed_step(p, False)),
        ("AdamW bf16 params, bf16-master", "AdamW", torch.bfloat16, "bf16-master", "DeepSpeedCPUAdam fp32",
         lambda p: deepspeed_step(p, True)),
        ("AdamW fp32 params, fp32", "AdamW", torch.float32, "fp32", "torch AdamW(fused=True)",
         torch_fused_step),
        ("AdamW fp32 params, fp32", "AdamW", torch.float32, "fp32", "DeepSpeedCPUAdam fp32",
         lambda p: deepspeed_step(p, True)),
    ] + [(f"{algorithm} bf16 params, {preset}", algorithm, torch.bfloat16, preset, peer,
          lambda p, module=module, make=make: python_peer_step(p, module, make))
         for algorithm, preset, peer, module, make in PYPI_PEERS]
    rows = []
    for label, algorithm, dtype, preset, peer, make in pairs:
        mine, theirs = [_param(n, dtype, 0)], [_param(n, dtype, 0)]
        ours, opt = bf16opt_step(mine, preset, algorithm)
        other, peer_opt = make(theirs)
        if other is None:
            print(f"{label:36} {peer:24} (not installed or does not build here)")
            continue
        limits = {"bf16opt limit": limit_step(mine[0], mine[0].grad, state_buffers(opt.state[mine[0]])),
                  "peer limit": limit_step(theirs[0], theirs[0].grad, state_buffers(peer_opt.state[theirs[0]]))}
        times = timings({"bf16opt": ours, "peer": other, **limits}, repeats)
        ratios = sorted(a / b for a, b in zip(times["bf16opt"], times["peer"]))
        of_limit = {name: statistics.median(limit / step for step, limit in zip(times[name], times[f"{name} limit"]))
                    for name in ("bf16opt", "peer")}
        row = dict(configuration=label, peer=peer, ratio=statistics.median(ratios),
                   bf16opt=statistics.median(times["bf16opt"]), peer_time=statistics.median(times["peer"]),
                   bf16opt_of_limit=of_limit["bf16opt"], peer_of_limit=of_limit["peer"])
        rows.append(row)
        quartiles = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        print(f"{label:36} {peer:24} {_ms(row['bf16opt'])} {_ms(row['peer_time'])} {row['ratio']:6.3f} "
              f"{quartiles:>11} {100 * of_limit['bf16opt']:15.0f}% {100 * of_limit['peer']:12.0f}%", flush=True)
        del mine, theirs, opt, peer_opt, ours, other, limits
        gc.collect()
    return rows


_EXACT_C = None  # exact_adamw.c's kernels once built (exact_c_kernels())


def exact_c_kernels() -> dict:
    """``exact_adamw.c``'s kernels this CPU runs, built with the system's C compiler (name ->
    ctypes function of (p, g, m, v, scalars, n), float32 arrays, n a multiple of 128; as many
    OpenMP threads as Numba's); empty when there is no C compiler or OpenMP."""
    global _EXACT_C
    if _EXACT_C is None:
        import ctypes  # noqa: PLC0415
        import pathlib  # noqa: PLC0415
        import shutil  # noqa: PLC0415
        import subprocess  # noqa: PLC0415
        import tempfile  # noqa: PLC0415

        from llvmlite import binding as llvm  # noqa: PLC0415

        _EXACT_C = {}
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            return _EXACT_C
        source = pathlib.Path(__file__).resolve().parent / "exact_adamw.c"
        with tempfile.TemporaryDirectory(prefix="bf16opt-exact-") as build:
            library = pathlib.Path(build) / "exact_adamw.so"
            built = subprocess.run([compiler, "-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared",
                                    "-fPIC", str(source), "-o", str(library)], capture_output=True, text=True)
            if built.returncode != 0:
                return _EXACT_C
            loaded = ctypes.CDLL(str(library))  # (mapped: the file may go)
        loaded.exact_threads(get_num_threads())
        features = llvm.get_host_cpu_features()
        for name, feature in (("exact_avx2", "avx2"), ("exact_avx512_x8", "avx512f")):
            if features.get(feature):
                function = getattr(loaded, name)
                function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long]
                _EXACT_C[name] = function
    return _EXACT_C


def exact_c_step(name: str, param, grad, buffers):
    """One of :func:`exact_c_kernels` over an fp32 param, its grad and ``buffers`` (exp_avg,
    exp_avg_sq), with ``compute_limit``'s Adam scalars."""
    function = exact_c_kernels()[name]
    scalars = np.array(compute_limit.SCALARS["adam"], dtype=np.float32)
    tensors = [param, grad, *buffers]
    if param.numel() % 128 or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("exact_adamw.c takes contiguous float32 tensors of a multiple of 128 elements")
    arguments = [t.data_ptr() for t in tensors] + [scalars.ctypes.data, param.numel()]

    def call():
        function(*arguments)
    call.keep = scalars
    return call


def vector_step(param, grad, buffers):
    """bf16opt's hand-vectorised Adam blocks alone (``vector_adam.py``) over an fp32 param,
    its grad and ``buffers`` (exp_avg, exp_avg_sq), with ``compute_limit``'s Adam scalars."""
    parts = get_num_threads()
    arrays = [t.numpy() for t in (param.detach(), grad, *buffers)]
    if param.numel() % (parts * vector_adam.BLOCK) or any(a.dtype != np.float32 for a in arrays):
        raise ValueError(f"vector_adam.py takes float32 arrays of a multiple of {parts * vector_adam.BLOCK} elements")
    scalars = vector_adam.scalars(compute_limit.SCALARS["adam"])
    run = vector_adam.kernel()

    def call():
        run(*arrays, scalars, parts)
    return call


def same_array_table(n: int, repeats: int, preset: str = "fp32") -> list:
    """AdamW with fp32 states, every contender stepping the very same four arrays (param,
    grad, exp_avg, exp_avg_sq).  ``preset`` "fp32" (fp32 params): bf16opt,
    ``torch.optim.AdamW(fused=True)`` and
    ``DeepSpeedCPUAdam`` (each given bf16opt's moment tensors as its state), bf16opt's kernel
    call alone (its step without the Python around it), the memory-limit
    kernel, and the streamed compute-limit kernel over them, exact and with its multiply-adds
    fused (``contract``: what fusing, which DeepSpeed's compiled kernel does and bf16opt's
    numerics contract forbids, gains on this machine), and ``exact_adamw.c``'s hand-written
    kernels doing the streamed limit's exact work (its bits; when a C compiler is there: what
    the loop's form is worth, apart from the numerics), and bf16opt's hand-vectorised Adam
    blocks alone (``vector_adam.py``, its bits too).  On one set of arrays, placement
    (which moves a memory-bound step by up to 1.5x on a VM) cannot favour one contender.
    ``preset`` "bf16-master" (bf16 params, their own master): bf16opt, DeepSpeedCPUAdam with
    fp32 states, bf16opt's kernel call alone, the memory limit and the streamed limit (torch's
    fused AdamW keeps bf16 states for bf16 params: not the same storage).  Prints medians and
    each contender's median paired ratio to bf16opt; returns the rows."""
    fp32_params = preset == "fp32"
    if preset not in ("fp32", "bf16-master"):
        raise ValueError(f"same_array_table: preset 'fp32' or 'bf16-master', got {preset!r}")
    param = _param(n, torch.float32 if fp32_params else torch.bfloat16, 0)
    ours, opt = bf16opt_step([param], preset)
    state = opt.state[param]
    moments = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    contenders = {"bf16opt": ours}
    peers = [("torch AdamW(fused=True)", torch_fused_step)] if fp32_params else []
    peers.append(("DeepSpeedCPUAdam fp32", lambda p: deepspeed_step(p, True)))
    keep = [opt]
    for name, make in peers:
        step, peer_opt = make([param])
        if step is None:
            continue
        peer_opt.state[param].update(moments)  # (made by its first step: same dtype and shape)
        contenders[name] = step
        keep.append(peer_opt)
    buffers = list(moments.values())
    contenders["bf16opt kernel alone"] = kernel_step(opt)  # (its step without the step's Python)
    contenders["memory limit"] = limit_step(param, param.grad, buffers)
    contenders["streamed limit"] = streamed_limit_step(param, param.grad, buffers, "adam", preset)
    if fp32_params:
        contenders["streamed limit, fused"] = streamed_limit_step(param, param.grad, buffers, "adam", "fp32",
                                                                   contract=True)
        for name in exact_c_kernels():  # the same exact work written in C (exact_adamw.c)
            contenders[f"C {name}"] = exact_c_step(name, param, param.grad, buffers)
        contenders["vector blocks alone"] = vector_step(param, param.grad, buffers)
    runs = timings(contenders, repeats)
    params = "fp32 params" if fp32_params else "bf16 params (bf16-master)"
    print(f"\nAdamW, {params}, fp32 states, all contenders on the same four arrays (2^{n.bit_length() - 1} params), "
          f"{get_num_threads()} Numba threads, {cpu_name()}; {repeats} interleaved repetitions; ms (medians); "
          f"bf16opt / it: the median of the paired ratios (above 1: bf16opt slower)")
    header = f"{'contender':26} {'ms':>8} {'bf16opt / it':>12} {'range':>11}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, times in runs.items():
        ratios = sorted(a / b for a, b in zip(runs["bf16opt"], times))
        row = dict(contender=name, time=statistics.median(times), ratio=statistics.median(ratios))
        rows.append(row)
        quartiles = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        print(f"{name:26} {_ms(row['time'])} {row['ratio']:12.3f} {quartiles:>11}", flush=True)
    del contenders, keep
    gc.collect()
    return rows


class _ChunkFunctionsKept:
    """While entered, every chunk function the numba backend gets is kept alive here, and
    :meth:`forget` drops the ones memoised in this process (their memo keys do not hold the
    blocks' prefetching), so the next are compiled anew -- while the tables captured earlier
    still point at the forgotten ones' machine code, which must outlive them."""

    def __enter__(self):
        from bf16opt._cpu import adam, lion, sgd  # noqa: PLC0415

        self.kept, self.originals = [], {module: module.chunk_function for module in (adam, lion, sgd)}
        for module, original in self.originals.items():
            module.chunk_function = self._keeping(original)
        return self

    def _keeping(self, original):
        def chunk_function(*args, **kwargs):
            function = original(*args, **kwargs)
            self.kept.append(function)
            return function
        return chunk_function

    def forget(self) -> None:
        for original in self.originals.values():
            original.cache_clear()

    def __exit__(self, *exc):
        for module, original in self.originals.items():
            module.chunk_function = original
        self.forget()


def prefetch_table(n: int, repeats: int, presets=None, algorithms=("AdamW", "Lion", "SGD")) -> None:
    """``--prefetch-ab``: bf16opt's kernel call with and without the hand-vectorised blocks'
    prefetches (``vector_blocks.PREFETCH``) on one chunk table -- streamed, over the step's own
    2^N-element tensors, and in cache, as the ``in cache`` column -- as the median of the paired
    per-repetition ratios (below 1: prefetching faster).  A configuration without blocks (AdamW
    ``bf16-sr``, or every one on a CPU without AVX-512) runs the same code twice: the harness's
    own spread."""
    print(f"\nThe blocks' prefetches ({vector_blocks.PREFETCH_DISTANCE} bytes ahead) on and off, 2^"
          f"{n.bit_length() - 1} params, {get_num_threads()} Numba threads, {cpu_name()}; {repeats} "
          f"interleaved repetitions; ms (medians), with / without: the median of the paired ratios")
    header = (f"{'configuration':38} {'streamed off':>12} {'on':>7} {'ratio':>6} {'in cache off':>12} "
              f"{'on':>7} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    with _ChunkFunctionsKept() as chunk_functions:
        try:
            for algorithm in algorithms:
                for label, dtype, preset, _, _ in CONFIGS:
                    if presets is None or preset in presets:
                        cells = [_prefetch_cell(n, repeats, algorithm, dtype, preset, in_cache,
                                                chunk_functions) for in_cache in (False, True)]
                        print(f"{algorithm + ' ' + label:38} {cells[0]} {cells[1]}", flush=True)
        finally:
            vector_blocks.PREFETCH_ON = None


def _prefetch_cell(n: int, repeats: int, algorithm: str, dtype: torch.dtype, preset: str, in_cache: bool,
                   chunk_functions: _ChunkFunctionsKept) -> str:
    """One half of a row of :func:`prefetch_table`: off and on (ms), and the ratio."""
    calls, alive = {}, []  # (the tables point into the optimizers' tensors)
    for on in (False, True):
        vector_blocks.PREFETCH_ON = on
        chunk_functions.forget()
        if in_cache:
            args, opt = in_cache_call(n, dtype, preset, algorithm=algorithm)
        else:
            _, opt = bf16opt_step([_param(n, dtype, 1)], preset, algorithm)
            args = captured_kernel_call(opt)
        calls[on] = args
        alive.append(opt)
    on_address, args = calls[True][0], calls[False]  # the same table (arrays) for both
    driver = kernel_driver(args[1])
    runs = timings({"off": lambda: driver(*args), "on": lambda: driver(on_address, *args[1:])}, repeats)
    ratio = statistics.median(b / a for a, b in zip(runs["off"], runs["on"]))
    del calls, alive
    gc.collect()
    return f"{_ms(statistics.median(runs['off'])):>12} {_ms(statistics.median(runs['on'])):>7} {ratio:6.3f}"


def gpt2_small_shapes() -> list:
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def multi_tensor_table(repeats: int) -> None:
    shapes = gpt2_small_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    print(f"\nGPT-2-small-shaped param list ({len(shapes)} tensors, {total} params) vs one flat "
          f"tensor of the same size; bf16opt AdamW, numba backend, times in ms")
    header = f"{'configuration':26} {'list':>8} {'flat':>8} {'list/flat':>9}"
    print(header)
    print("-" * len(header))
    for label, dtype, preset in [("bf16 params, bf16", torch.bfloat16, "bf16"),
                                 ("fp32 params, fp32", torch.float32, "fp32")]:
        listed = []
        for i, s in enumerate(shapes):
            p = torch.nn.Parameter(torch.empty(s, dtype=dtype).normal_(0, 0.02))
            p.grad = torch.empty(s, dtype=dtype).normal_(0, 1e-3)
            listed.append(p)
        flat = [_param(total, dtype, 1)]
        step_list, opt_list = bf16opt_step(listed, preset)
        step_flat, opt_flat = bf16opt_step(flat, preset)
        t = measure({"list": step_list, "flat": step_flat}, repeats)
        print(f"{label:26} {_ms(t['list'])} {_ms(t['flat'])} {t['list'] / t['flat']:9.3f}", flush=True)
        del listed, flat, opt_list, opt_flat, step_list, step_flat
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-params", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--presets", help="comma-separated presets to time (default: all)")
    parser.add_argument("--algorithms", default="AdamW,Lion,SGD", help="comma-separated (default: %(default)s)")
    parser.add_argument("--skip-multi-tensor", action="store_true")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of the preset table, then each row's shares and classes over them")
    parser.add_argument("--peers", action="store_true",
                        help="only the paired comparisons with the peers doing the same storage, "
                             "--repeats repetitions")
    parser.add_argument("--same-arrays", action="store_true",
                        help="only AdamW with fp32 states (fp32 params, then bf16-master): bf16opt, the peers "
                             "and the limits on the same arrays")
    parser.add_argument("--prefetch-ab", action="store_true",
                        help="only bf16opt's kernel call with and without the blocks' prefetches, streamed "
                             "and in cache, --repeats repetitions")
    args = parser.parse_args()
    presets = set(args.presets.split(",")) if args.presets else None
    if args.prefetch_ab:
        prefetch_table(1 << args.log2_params, args.repeats, presets, tuple(args.algorithms.split(",")))
        return
    if args.peers or args.same_arrays:
        if args.peers:
            peer_table(1 << args.log2_params, args.repeats)
        if args.same_arrays:
            for preset in ("fp32", "bf16-master"):
                same_array_table(1 << args.log2_params, args.repeats, preset)
        return
    runs = [preset_table(1 << args.log2_params, args.repeats, presets, tuple(args.algorithms.split(",")))
            for _ in range(args.runs)]
    if len(runs) > 1:
        runs_summary(runs)
    if not args.skip_multi_tensor:
        multi_tensor_table(args.repeats)


if __name__ == "__main__":
    main()
