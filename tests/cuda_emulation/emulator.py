"""The CUDA kernels of cuda_src/, compiled by the host C++ compiler and run on the CPU.

Every kernel instantiation the CuPy adapter can request (``all_kernel_names``) is
compiled from the exact source the adapter's loader gives NVRTC (``kernel_source``,
headers inlined with ``#line`` markers) after ``emulation.h``, into one shared
library loaded with ctypes.  A launch runs every (block, thread) of the grid in turn
with the chunk table that ``prepare_launch`` built for the bucket (CPU data pointers
instead of device pointers); a q8 kernel's threads, whose warps exchange values, run as
fibers in lockstep (``emulate_launch_warps`` in emulation.h).

The library is cached by a hash of everything that goes into it, in
``$BF16OPT_EMULATION_CACHE`` or ``<tmp>/bf16opt-cuda-emulation``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

from bf16opt.algorithms import ALGORITHMS
from bf16opt.backends import cupy as cuda_backend
from bf16opt.backends.cuda_compile import kernel_source

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
# -O0: the emulation checks the kernels' arithmetic, which no optimisation level may change
# (SSE float math, no fast-math, no contraction); -O2 would only lengthen the build.
CXXFLAGS = ("-std=c++17", "-O0", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing",
            "-fPIC", "-Wall", "-Wno-unknown-pragmas", "-Werror")
PER_UNIT = 24  # instantiations per translation unit; units are compiled in parallel


def compiler_problem() -> str | None:
    """Why the emulation can't be built here (None when it can)."""
    if shutil.which(CXX) is None:
        return f"no host C++ compiler ({CXX}) on PATH"
    return None


def scalar_count(kind: str) -> int:
    """Float scalars of ``kind``'s kernels (after ``flags``), from its description."""
    return len(ALGORITHMS[kind].scalars._fields)


def symbol(kind: str, index: int) -> str:
    return f"bf16opt_emulated_{kind}_{index}"


def _wrapper(kind: str, expression: str, symbol_name: str) -> str:
    """An extern "C" function that runs ``expression``'s kernel over an emulated grid."""
    scalars = ", ".join(f"s[{k}]" for k in range(scalar_count(kind)))
    launch = "emulate_launch_warps" if "Q8<" in expression else "emulate_launch"  # (q8: warps in lockstep)
    return (f'extern "C" void {symbol_name}(unsigned grid, unsigned block, '
            f"const long long* table, int n_tensors, long long n_chunks, int chunk_size, "
            f"unsigned long long seed, long long step, unsigned long long* counts, int flags, "
            f"const void* live_lr, double lr_value, double decay_rate, const double* bias, "
            f"long long bias_rows, const float* grad_scale, const float* found_inf, "
            f"const float* s) {{\n"
            f"  {launch}(grid, block, [&] {{ {expression}(table, n_tensors, "
            f"n_chunks, chunk_size, seed, step, counts, flags, live_lr, lr_value, decay_rate, "
            f"bias, bias_rows, grad_scale, found_inf, {scalars}); }});\n}}")


def _translation_units() -> list:
    units = []
    for kind in ALGORITHMS:
        names = cuda_backend.all_kernel_names(kind)
        parts = -(-len(names) // PER_UNIT)
        for part in range(parts):
            lines = [f'#include "{(HERE / "emulation.h").as_posix()}"',
                     kernel_source(kind)]
            for index in range(part, len(names), parts):
                lines.append(_wrapper(kind, names[index], symbol(kind, index)))
            units.append((f"{kind}_{part}.cpp", "\n".join(lines) + "\n"))
    units.append(("probe.cpp", f'#include "{(HERE / "emulation.h").as_posix()}"\n'
                  + kernel_source("lion") + PROBE_SOURCE))
    return units


# Direct access to the storage helpers of cuda_src/storage.cuh (encoders, stream keys,
# the remainder split), for unit tests against bf16opt/storage.py.
PROBE_FORMATS = ("bf16", "fp16", "bf16-stochastic", "fp16-stochastic")
PROBE_SOURCE = r"""
namespace probe {
using namespace bf16opt;
template <class S>
void encode_all(const float* x, long long n, unsigned key, int buffer, unsigned short* out) {
  for (long long i = 0; i < n; ++i)
    out[i] = S::encode(x[i], EncodeContext{key, static_cast<u32>(i), (buffer & 1) != 0});
}
}  // namespace probe

extern "C" void bf16opt_probe_encode(int format, const float* x, long long n, unsigned key, int buffer,
                                     unsigned short* out) {
  using namespace bf16opt;
  switch (format) {
    case 0: probe::encode_all<Bf16>(x, n, key, buffer, out); break;
    case 1: probe::encode_all<Fp16>(x, n, key, buffer, out); break;
    case 2: probe::encode_all<Stochastic<Bf16>>(x, n, key, buffer, out); break;
    case 3: probe::encode_all<Stochastic<Fp16>>(x, n, key, buffer, out); break;
  }
}

extern "C" unsigned long long bf16opt_probe_misaligned_vector_accesses() {
  return misaligned_vector_accesses;
}

extern "C" unsigned bf16opt_probe_stream_key(unsigned long long seed, long long step, long long index,
                                             unsigned stream) {
  return bf16opt::stream_key(seed, step, index, stream);
}

// Remainder::write then Remainder::read for each value: (param, remainder, joined master).
extern "C" void bf16opt_probe_remainder(const float* x, long long n, unsigned short* param,
                                        unsigned short* remainder, float* joined) {
  using namespace bf16opt;
  for (long long i = 0; i < n; ++i) {
    Remainder::write<Bf16>(0.0f, x[i], param[i], remainder[i], EncodeContext{0u, 0u, false});
    joined[i] = Remainder::read<Bf16>(param[i], remainder[i]);
  }
}
"""


def _compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


def cache_dir() -> Path:
    root = os.environ.get("BF16OPT_EMULATION_CACHE")
    return Path(root) if root else Path(tempfile.gettempdir()) / "bf16opt-cuda-emulation"


def build_library(units: list = None, prefix: str = "kernels") -> Path:
    """Compile (or find in the cache) the emulation library of ``units`` (default: every
    instantiation the adapter can request); returns its path."""
    units = _translation_units() if units is None else units
    digest = hashlib.sha256()
    for item in (CXX, _compiler_version(), " ".join(CXXFLAGS), (HERE / "emulation.h").read_text(encoding="utf-8")):
        digest.update(item.encode())
    for filename, text in units:
        digest.update(filename.encode() + b"\0" + text.encode())
    target = cache_dir() / f"{prefix}-{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        work = Path(work)
        def compile_unit(unit):
            filename, text = unit
            (work / filename).write_text(text)
            done = subprocess.run([CXX, *CXXFLAGS, "-c", str(work / filename), "-o",
                                   str(work / (filename + ".o"))],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"emulation build of {filename} failed:\n{done.stdout}")

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(compile_unit, units))
        library = work / "kernels.so"
        subprocess.run([CXX, "-shared", "-o", str(library), *(str(work / (f + ".o")) for f, _ in units)],
                       check=True, capture_output=True, text=True)
        os.replace(library, target)  # atomic: concurrent builders agree on the result
    return target


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    return ctypes.CDLL(str(build_library()))


@functools.lru_cache(maxsize=None)
def _function(kind: str, expression: str):
    index = cuda_backend.all_kernel_names(kind).index(expression)
    return _typed(getattr(library(), symbol(kind, index)))


def _typed(function):
    function.restype = None
    function.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int,
                         ctypes.c_longlong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_longlong,
                         ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_double, ctypes.c_double,
                         ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_float)]
    return function


# Live kernels (capturable=True's instantiations, ``kernel_name(config, live=True)``) are not in
# the library of every instantiation: they are built on request, in batches (build_live).
_live_functions: dict = {}  # (kind, expression) -> function


def build_live(kernels) -> None:
    """Build the live kernels ``kernels`` ((kind, expression) pairs) not built yet, in one
    library (cached on disk like the other)."""
    missing = sorted(set(kernels) - set(_live_functions))
    if not missing:
        return
    units = []
    for kind in ALGORITHMS:
        names = [expression for k, expression in missing if k == kind]
        if names:
            wrappers = [_wrapper(kind, name, f"bf16opt_emulated_live_{kind}_{i}") for i, name in enumerate(names)]
            units.append((f"live_{kind}.cpp", "\n".join([f'#include "{(HERE / "emulation.h").as_posix()}"',
                                                           kernel_source(kind), *wrappers]) + "\n"))
    built = ctypes.CDLL(str(build_library(units, "live")))
    for kind in ALGORITHMS:
        for i, name in enumerate(expression for k, expression in missing if k == kind):
            _live_functions[(kind, name)] = _typed(getattr(built, f"bf16opt_emulated_live_{kind}_{i}"))


def _kernel(kind: str, expression: str, live: bool):
    if not live:
        return _function(kind, expression)
    build_live([(kind, expression)])  # (one by one unless build_live was given them together)
    return _live_functions[(kind, expression)]


def execute(prepared: cuda_backend.PreparedLaunch) -> None:
    """Run one prepared launch (what the adapter would send to the GPU) on the CPU."""
    plan = prepared.plan
    table = np.ascontiguousarray(plan.table, dtype=np.int64)
    scalars = np.asarray(prepared.scalars, dtype=np.float32)
    assert scalars.size == scalar_count(prepared.kind)
    counts = prepared.counts
    if counts is not None:
        assert counts.device.type == "cpu" and counts.dtype == torch.int64 and counts.is_contiguous()
    misaligned_before = misaligned_vector_accesses()
    _kernel(prepared.kind, prepared.expression, prepared.is_live)(
        plan.grid, plan.block, table.ctypes.data, plan.n_tensors, plan.n_chunks, plan.chunk_size,
        prepared.seed, prepared.step, None if counts is None else counts.data_ptr(), prepared.flags,
        *prepared.live, scalars.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    misaligned = misaligned_vector_accesses() - misaligned_before
    if misaligned:
        raise AssertionError(f"{prepared.expression}: {misaligned} vector accesses at misaligned "
                             f"addresses (a GPU would fault on them)")


def misaligned_vector_accesses() -> int:
    """Vector accesses the emulated kernels made at misaligned addresses, so far."""
    function = library().bf16opt_probe_misaligned_vector_accesses
    function.restype = ctypes.c_ulonglong
    return function()


def encode(format: str, x: np.ndarray, key: int = 0, buffer: int = 0) -> np.ndarray:
    """uint16 bits of ``x`` (float32) encoded by the CUDA helper ``format`` (PROBE_FORMATS);
    element i uses buffer ``buffer``'s half of the random stream (key, i)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.size, dtype=np.uint16)
    function = library().bf16opt_probe_encode
    function.restype = None
    function(ctypes.c_int(PROBE_FORMATS.index(format)), ctypes.c_void_p(x.ctypes.data),
             ctypes.c_longlong(x.size), ctypes.c_uint(key), ctypes.c_int(buffer),
             ctypes.c_void_p(out.ctypes.data))
    return out


def stream_key(seed: int, step: int, index: int, stream: int) -> int:
    function = library().bf16opt_probe_stream_key
    function.restype = ctypes.c_uint
    return function(ctypes.c_ulonglong(seed), ctypes.c_longlong(step), ctypes.c_longlong(index),
                    ctypes.c_uint(stream))


def remainder_split_join(x: np.ndarray) -> tuple:
    """(param bits, remainder bits, joined float32) of the CUDA Remainder policy."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    param = np.empty(x.size, dtype=np.uint16)
    remainder = np.empty(x.size, dtype=np.uint16)
    joined = np.empty(x.size, dtype=np.float32)
    function = library().bf16opt_probe_remainder
    function.restype = None
    function(ctypes.c_void_p(x.ctypes.data), ctypes.c_longlong(x.size), ctypes.c_void_p(param.ctypes.data),
             ctypes.c_void_p(remainder.ctypes.data), ctypes.c_void_p(joined.ctypes.data))
    return param, remainder, joined


def backend(execute=execute):
    """The cupy adapter with the launch swapped for ``execute`` (default: the CPU emulation),
    as the optimizer sees a backend (``resolve_backend``'s answer)."""
    return types.SimpleNamespace(
        name="cupy-emulated", live=cuda_backend.live,
        run=functools.partial(cuda_backend.run, execute=execute),
        prepare=functools.partial(cuda_backend.prepare, execute=execute),
        relaunch=functools.partial(cuda_backend.relaunch, execute=execute))
