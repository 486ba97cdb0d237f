"""CuPy backend: the CUDA kernels of ``cuda_src/`` (shipped as ``bf16opt._cuda``).

A thin adapter.  Per bucket it builds a launch plan (one chunk table covering every
tensor, :func:`build_launch_plan`, pure numpy), picks the kernel instantiation for the
bucket's storage plan and flags (:func:`kernel_name`), and launches it once on
torch's current CUDA stream.  Tensors are passed by ``data_ptr()``.

Every storage plan runs in the kernels, quality plans included (:func:`supports`):
stochastic rounding is a storage type (``Stochastic<...>``), Kahan compensation and
the int16 remainder are master policies, precision telemetry is the kernel's TRACK
flag.  The stochastic-rounding streams ``storage.stream_key(seed, step, index,
buffer)`` are computed in the kernel from the seed and step (kernel arguments) and
each tensor's optimizer index (a row of the chunk table), so the table of a training
loop stays the same from step to step; telemetry counts are added by the kernel into
an unsigned 64-bit (tensors, 3) array that is copied into ``bucket.counts``.

Compilation: :func:`load_kernel` is the one loader, memoised per (device, kernel
name).  It compiles :func:`kernel_source` (the ``.cu`` file with its headers inlined
between ``#line`` markers, so compiler messages name the real files) with
:func:`compile_options` through NVRTC (:func:`nvrtc_compile`) and loads the result
into CuPy.  The compile test (``tests/test_cuda_compile.py``) and the CPU emulation
(``tests/cuda_emulation``) call the same functions, so what they check is what runs.

Why NVRTC is called directly instead of through ``cupy.RawModule(code=...)``:
RawModule appends ``-ftz=true`` to every compilation, and NVRTC lets the last option
win.  Flush-to-zero changes results on subnormal values, so the kernels would no
longer be bit-identical to the reference backend (DESIGN.md section 3).  The
instantiations are still requested by name expression (``nvrtcAddNameExpression``)
and the compiled module is loaded through CuPy.

CuPy is imported lazily: ``import bf16opt`` and this module work without it;
:func:`check_available` raises a ValueError naming the extra to install.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import re
import threading
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..precision import all_plans
from .base import AdamScalars, Bucket, LionScalars, same_dense_layout

name = "cupy"

INSTALL_HINT = ("install CuPy for your CUDA version: pip install 'bf16opt[cuda12]' (CUDA 12) "
                "or pip install 'bf16opt[cuda13]' (CUDA 13)")

# ---------------------------------------------------------------- kernel names
STORAGE_TYPES = {torch.float32: "bf16opt::Fp32", torch.bfloat16: "bf16opt::Bf16",
                 torch.float16: "bf16opt::Fp16"}
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

# Chunk-table roles, in the order of the enums in cuda_src/adam.cu and lion.cu.  The
# companion is the master policy's array: master copy, Kahan compensation or remainder.
ADAM_ROLES = ("param", "grad", "companion", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
LION_ROLES = ("param", "grad", "companion", "exp_avg")
ROLES = {"adam": ADAM_ROLES, "lion": LION_ROLES}
KINDS = ("adam", "lion")
# Telemetry columns the kernels fill (reference.py: Lion has no exp_avg_sq column).
COUNT_COLUMNS = {"adam": 3, "lion": 2}


def supports(plan) -> bool:
    """Whether the kernels implement ``plan``: every plan of ``all_plans(quality=True)``."""
    try:
        kernel_name("adam", plan)
    except (NotImplementedError, KeyError):
        return False
    return True


def _cxx_bool(flag: bool) -> str:
    return "true" if flag else "false"


def _storage(dtype, stochastic: bool) -> str:
    """Storage type of a buffer: stochastic rounding only for 16-bit storage."""
    base = STORAGE_TYPES[dtype]
    return f"bf16opt::Stochastic<{base}>" if stochastic and dtype != torch.float32 else base


def _param_storage(plan) -> str:
    # stochastic only when the param is the master; a param written from a float32
    # master copy (or with a Kahan buffer) is rounded to nearest
    return _storage(plan.param, plan.rounding == "stochastic" and plan.master is None
                    and plan.compensation is None)


def _master_policy(plan) -> str:
    if plan.compensation == "remainder":
        if plan.param != torch.bfloat16 or plan.master is not None:
            raise NotImplementedError(f"the int16 remainder completes a bfloat16 param: {plan}")
        return "bf16opt::Remainder"
    if plan.compensation == "kahan":
        if plan.master is not None:
            raise NotImplementedError(f"Kahan compensation needs the param as master: {plan}")
        return f"bf16opt::Kahan<{STORAGE_TYPES[plan.compensation_dtype]}>"
    if plan.compensation is not None:
        raise NotImplementedError(f"the CUDA kernels do not implement compensation={plan.compensation!r}")
    if plan.master is None:
        return "bf16opt::NoMaster"
    return f"bf16opt::Master<{STORAGE_TYPES[plan.master]}>"


def kernel_name(kind: str, plan, *, amsgrad: bool = False, track: bool = False) -> str:
    """Name expression of the kernel instantiation for a storage plan, amsgrad and telemetry.

    maximize and Adam's L2 decay are run-time flags (:func:`kernel_flags`), not part of
    the instantiation.
    """
    if plan.rounding not in ("nearest", "stochastic"):
        raise NotImplementedError(f"the CUDA kernels do not implement rounding={plan.rounding!r}")
    stochastic = plan.rounding == "stochastic"
    param, master = _param_storage(plan), _master_policy(plan)
    exp_avg = _storage(plan.exp_avg, stochastic)
    if kind == "adam":
        return (f"bf16opt::adam_kernel<{param}, {master}, {exp_avg}, "
                f"{_storage(plan.exp_avg_sq, stochastic)}, {_cxx_bool(amsgrad)}, {_cxx_bool(track)}>")
    if kind == "lion":
        if amsgrad:
            raise ValueError("Lion has no amsgrad variant")
        return f"bf16opt::lion_kernel<{param}, {master}, {exp_avg}, {_cxx_bool(track)}>"
    raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")


# Bits of the kernels' ``flags`` argument (AdamFlag / LionFlag in cuda_src/).
FLAG_BITS = {"maximize": 1, "l2": 2}


def kernel_flags(kind: str, *, maximize: bool = False, l2: bool = False) -> int:
    """The kernels' run-time ``flags`` argument."""
    if kind == "lion" and l2:
        raise ValueError("Lion has no L2 variant")
    return (FLAG_BITS["maximize"] if maximize else 0) | (FLAG_BITS["l2"] if l2 else 0)


@functools.lru_cache(maxsize=None)
def kernel_configs(kind: str) -> dict:
    """Every instantiation the adapter can request for ``kind``, name -> (plan, flags).

    All plans of ``all_plans(quality=True)`` x amsgrad (Adam) x telemetry on/off.  Lion
    ignores exp_avg_sq, so plans that differ only there share a kernel (the first plan
    is kept).
    """
    configs = {}
    for plan in all_plans(quality=True):
        if kind == "adam":
            flag_sets = [dict(amsgrad=a, track=t) for a, t in itertools.product((False, True), repeat=2)]
        else:
            flag_sets = [dict(track=t) for t in (False, True)]
        for flags in flag_sets:
            configs.setdefault(kernel_name(kind, plan, **flags), (plan, flags))
    return configs


def all_kernel_names(kind: str) -> list:
    """Every instantiation the adapter can request for ``kind`` (all plans x flags)."""
    return list(kernel_configs(kind))


# ---------------------------------------------------------------- source and options
def source_dir() -> Path:
    """Directory of the shipped CUDA sources (``cuda_src/`` in a checkout)."""
    return Path(str(resources.files("bf16opt._cuda")))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$')


def _inline(path: Path, seen: set) -> list:
    lines = [f'#line 1 "{path.as_posix()}"']
    text = path.read_text().splitlines()
    for number, line in enumerate(text, start=1):
        match = _INCLUDE.match(line)
        if match is None:
            # inlined once already (``seen``); a kept #pragma once would warn in a main file
            lines.append("" if _PRAGMA_ONCE.match(line) else line)
            continue
        header = (path.parent / match.group(1)).resolve()
        if header not in seen:
            seen.add(header)
            lines.extend(_inline(header, seen))
        lines.append(f'#line {number + 1} "{path.as_posix()}"')
    return lines


@functools.lru_cache(maxsize=None)
def kernel_source(kind: str) -> str:
    """``cuda_src/<kind>.cu`` with its local headers inlined between ``#line`` markers."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    path = (source_dir() / f"{kind}.cu").resolve()
    return "\n".join(_inline(path, {path})) + "\n"


# IEEE float32 arithmetic, each operation rounded on its own (DESIGN.md section 3).
BASE_COMPILE_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                        "--ftz=false")


def compile_options(arch: str) -> tuple:
    """NVRTC options for ``arch`` (``"sm_90"`` for a cubin, ``"compute_90"`` for PTX)."""
    return BASE_COMPILE_OPTIONS + (f"--gpu-architecture={arch}",)


class CompiledModule(NamedTuple):
    binary: bytes        # cubin for sm_XX, PTX for compute_XX
    lowered: dict        # name expression -> mangled kernel name
    log: str


class CompileError(RuntimeError):
    pass


def nvrtc_compile(source: str, names: Sequence[str], options: Sequence[str],
                  filename: str = "bf16opt.cu") -> CompiledModule:
    """Compile ``source`` with NVRTC, instantiating ``names``; no GPU needed."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, filename, (), ())
    try:
        for expression in names:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, tuple(options))
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed ({exc}) with options {tuple(options)}:\n"
                               f"{nvrtc.getProgramLog(program)}") from None
        log = nvrtc.getProgramLog(program)
        lowered = {expression: nvrtc.getLoweredName(program, expression) for expression in names}
        cubin = any(str(o).split("=")[-1].startswith("sm_") for o in options
                    if str(o).startswith(("--gpu-architecture", "-arch")))
        binary = nvrtc.getCUBIN(program) if cubin else nvrtc.getPTX(program)
        return CompiledModule(bytes(binary), lowered, log)
    finally:
        nvrtc.destroyProgram(program)


def device_arch(compute_capability: int) -> str:
    """NVRTC target for a device: a cubin when NVRTC knows the arch, else PTX for the
    newest arch it knows below it (the driver JIT-compiles PTX)."""
    from cupy_backends.cuda.libs import nvrtc

    supported = sorted(int(a) for a in nvrtc.getSupportedArchs())
    if compute_capability in supported:
        return f"sm_{compute_capability}"
    lower = [a for a in supported if a <= compute_capability]
    if not lower:
        raise ValueError(f"this NVRTC cannot compile for compute capability {compute_capability}")
    return f"compute_{lower[-1]}"


# ---------------------------------------------------------------- availability
_available_lock = threading.Lock()


def _import_problem() -> Optional[str]:
    """Why CuPy (with NVRTC) can't be imported (None when it can)."""
    try:
        importlib.import_module("cupy")
        importlib.import_module("cupy_backends.cuda.libs.nvrtc")
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); {INSTALL_HINT}"
    return None


@functools.lru_cache(maxsize=None)
def _device_problem() -> Optional[str]:
    """Why CuPy sees no device (None when it does); asked once per process."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old for this CuPy, ...
        return (f"CuPy cannot use the CUDA driver ({exc}); is the CuPy build for this CUDA "
                f"version? {INSTALL_HINT}")
    return None if count > 0 else "CuPy found no CUDA device"


def check_available(device: torch.device) -> None:
    """Raise ValueError unless the CUDA kernels can run on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"backend='cupy' runs CUDA kernels and needs params on a CUDA device, "
                         f"got params on {device}; use backend='auto' or 'reference' for {device}")
    problem = _import_problem()
    if problem is None and not torch.cuda.is_available():
        problem = "torch.cuda.is_available() is False (no CUDA device or driver)"
    if problem is None:
        with _available_lock:
            problem = _device_problem()
    if problem is not None:
        raise ValueError(f"backend='cupy' is unavailable: {problem}")


def is_available(device: torch.device) -> bool:
    try:
        check_available(device)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- loader
@functools.lru_cache(maxsize=None)
def _load_module(device_index: int, kind: str, expression: str) -> tuple:
    import cupy

    with cupy.cuda.Device(device_index):
        arch = device_arch(int(cupy.cuda.Device(device_index).compute_capability))
        compiled = nvrtc_compile(kernel_source(kind), [expression], compile_options(arch),
                                 filename=f"{kind}.cu")
        module = cupy.cuda.function.Module()
        module.load(compiled.binary)
        return module, module.get_function(compiled.lowered[expression])


def load_kernel(device_index: int, kind: str, expression: str):
    """The compiled kernel ``expression`` on CUDA device ``device_index`` (memoised).

    The one place that compiles: source from :func:`kernel_source`, options from
    :func:`compile_options`, target from the device's compute capability.  The module
    stays cached (and loaded) with its function.
    """
    return _load_module(device_index, kind, expression)[1]


# ---------------------------------------------------------------- launch plan
DEFAULT_CHUNK_SIZE = 65536   # elements per chunk (multiple of every vector width)
DEFAULT_BLOCK = 256          # threads per block
MAX_GRID = 2 ** 31 - 1


class LaunchPlan(NamedTuple):
    """Everything one launch needs besides the scalars (see cuda_src/multi_tensor.cuh)."""

    table: np.ndarray        # int64: pointers [roles x tensors], sizes, indices, first chunks (+ total)
    n_tensors: int
    n_chunks: int
    chunk_size: int
    grid: int
    block: int
    columns: tuple = ()      # position in the caller's list of each tensor in the table


def build_launch_plan(pointers: Sequence[Sequence[int]], sizes: Sequence[int], *,
                      indices: Optional[Sequence[int]] = None,
                      chunk_size: int = DEFAULT_CHUNK_SIZE, block: int = DEFAULT_BLOCK,
                      max_grid: int = MAX_GRID) -> Optional[LaunchPlan]:
    """Chunk table for tensors with ``pointers[t][role]`` and ``sizes[t]`` elements.

    ``indices[t]`` is tensor t's index in the optimizer (it names the tensor's random
    streams; default t).  Pure numpy.  Empty tensors are left out (``columns`` lists
    the kept positions); returns None when nothing is left.  ``chunk_size`` must be a
    multiple of 8 (the widest vector step) so every chunk of a 16-byte aligned tensor
    starts 16-byte aligned.
    """
    if chunk_size <= 0 or chunk_size % 8 or chunk_size > 2 ** 31 - 1:
        raise ValueError(f"chunk_size must be a positive multiple of 8 below 2**31, got {chunk_size}")
    if block <= 0 or block > 1024:
        raise ValueError(f"block must be in [1, 1024], got {block}")
    if indices is None:
        indices = range(len(sizes))
    if len(indices) != len(sizes):
        raise ValueError("indices and sizes must have one entry per tensor")
    keep = [t for t, size in enumerate(sizes) if size > 0]
    if not keep:
        return None
    roles = len(pointers[keep[0]])
    n = len(keep)
    table = np.zeros((roles + 3) * n + 1, dtype=np.int64)
    size_array = np.asarray([sizes[t] for t in keep], dtype=np.int64)
    for column, t in enumerate(keep):
        if len(pointers[t]) != roles:
            raise ValueError("every tensor needs the same number of role pointers")
        for role, pointer in enumerate(pointers[t]):
            table[role * n + column] = np.int64(np.uint64(pointer).astype(np.int64))
    table[roles * n:(roles + 1) * n] = size_array
    table[(roles + 1) * n:(roles + 2) * n] = [indices[t] for t in keep]
    chunks = (size_array + chunk_size - 1) // chunk_size
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(chunks, out=first[1:])
    table[(roles + 2) * n:] = first
    n_chunks = int(first[-1])
    return LaunchPlan(table, n, n_chunks, chunk_size, min(n_chunks, max_grid), block, tuple(keep))


class PreparedLaunch(NamedTuple):
    kind: str
    expression: str
    plan: LaunchPlan
    scalars: tuple           # numpy float32, kernel argument order
    write_back: list         # (original, staged copy) pairs to copy back after the launch
    seed: int = 0            # stochastic rounding: seed and step of the random streams
    step: int = 0
    counts: Optional[torch.Tensor] = None  # telemetry: int64 (tensors in the table, 3), zeros
    flags: int = 0           # run-time flags (kernel_flags: maximize, L2)
    # every staged copy, read-only ones (grads) included: the table points into them, so
    # they must outlive the launch (a freed copy's memory is soon reused by the next one)
    staged: tuple = ()


def _companion(bucket: Bucket, i: int):
    plan = bucket.plan
    if plan.compensation == "remainder":
        return bucket.remainders[i], torch.int16
    if plan.compensation == "kahan":
        return bucket.compensations[i], plan.compensation_dtype
    return bucket.masters[i], plan.master


def _role_tensors(kind: str, bucket: Bucket, i: int) -> list:
    companion, _ = _companion(bucket, i)
    tensors = [bucket.params[i], bucket.grads[i], companion, bucket.exp_avgs[i]]
    if kind == "adam":
        tensors.append(bucket.exp_avg_sqs[i])
        tensors.append(bucket.max_exp_avg_sqs[i] if bucket.amsgrad else None)
    return tensors


def prepare_launch(kind: str, bucket: Bucket, scalars, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   block: int = DEFAULT_BLOCK, max_grid: int = MAX_GRID) -> Optional[PreparedLaunch]:
    """Kernel name, launch plan and scalars for one bucket (no CuPy, no device needed).

    A param whose buffers share one dense layout (``channels_last`` weights) is updated in
    place in memory order unless stochastic rounding, which hashes each element's row-major
    index, is on; other non-contiguous tensors are staged through contiguous copies
    (``write_back``), so every array of an element lines up at its row-major index.
    """
    plan = bucket.plan
    track = bucket.counts is not None
    expression = kernel_name(kind, plan, amsgrad=kind == "adam" and bucket.amsgrad, track=track)
    flags = kernel_flags(kind, maximize=bucket.maximize, l2=kind == "adam" and bucket.l2)
    if plan.rounding == "stochastic" and len(bucket.indices) != len(bucket.params):
        raise ValueError("stochastic rounding needs bucket.indices (each param's index in the "
                         "optimizer names its random streams)")
    indices = bucket.indices if len(bucket.indices) == len(bucket.params) else range(len(bucket.params))
    if not 0 <= bucket.seed < 2 ** 64:
        raise ValueError(f"bucket.seed must be in [0, 2**64), got {bucket.seed}")
    pointers, sizes, write_back, staged_copies = [], [], [], []
    for i in range(len(bucket.params)):
        tensors = _role_tensors(kind, bucket, i)
        expected = {"param": plan.param, "grad": plan.param, "companion": _companion(bucket, i)[1],
                    "exp_avg": plan.exp_avg, "exp_avg_sq": plan.exp_avg_sq,
                    "max_exp_avg_sq": plan.exp_avg_sq}
        numel = tensors[0].numel()
        in_place = None  # decided at the first non-contiguous buffer (rare: checked lazily)
        row = []
        for role, tensor in zip(ROLES[kind], tensors):
            if tensor is None:
                if role == "companion" and expected[role] is not None:
                    raise ValueError(f"param {i} has no {plan.compensation or 'master'} buffer; "
                                     f"the bucket's plan needs one")
                row.append(0)
                continue
            if tensor.dtype != expected[role] or tensor.numel() != numel:
                raise ValueError(f"{role} of param {i} is {tensor.dtype} with {tensor.numel()} "
                                 f"elements; the bucket's plan needs {expected[role]} with {numel}")
            if not tensor.is_contiguous():
                if in_place is None:
                    in_place = plan.rounding != "stochastic" and \
                        same_dense_layout([t for t in tensors if t is not None])
                if not in_place:
                    staged = tensor.contiguous()
                    staged_copies.append(staged)
                    if role != "grad":
                        write_back.append((tensor, staged))
                    tensor = staged
            row.append(tensor.data_ptr())
        pointers.append(row)
        sizes.append(numel)
    launch_plan = build_launch_plan(pointers, sizes, indices=list(indices), chunk_size=chunk_size,
                                    block=block, max_grid=max_grid)
    if launch_plan is None:
        return None
    values = tuple(np.float32(v) for v in scalars)
    for field, value, original in zip(scalars._fields, values, scalars):
        if float(value) != float(original) and not (np.isnan(value) and np.isnan(original)):
            raise ValueError(f"scalar {field}={original!r} is not a float32 value")
    counts = None
    if track:
        counts = torch.zeros((launch_plan.n_tensors, 3), dtype=torch.int64,
                             device=bucket.params[0].device)
    return PreparedLaunch(kind, expression, launch_plan, values, write_back, int(bucket.seed),
                          int(bucket.step), counts, flags, tuple(staged_copies))


# ---------------------------------------------------------------- running on a GPU
_TABLE_CACHE_SIZE = 64
_table_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def _device_table(table: np.ndarray, device: torch.device, stream) -> torch.Tensor:
    """The chunk table in device memory, copied on ``stream``; cached by content."""
    key = (device.index, stream.cuda_stream, table.tobytes())
    cached = _table_cache.get(key)
    if cached is not None:
        _table_cache.move_to_end(key)
        return cached
    host = torch.from_numpy(table).pin_memory()
    on_device = host.to(device, non_blocking=True)
    _table_cache[key] = on_device
    if len(_table_cache) > _TABLE_CACHE_SIZE:
        _table_cache.popitem(last=False)
    return on_device


def _run_on_gpu(prepared: PreparedLaunch, device: torch.device) -> None:
    import cupy

    device_index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", device_index)
    kernel = load_kernel(device_index, prepared.kind, prepared.expression)
    torch_stream = torch.cuda.current_stream(device)
    plan = prepared.plan
    table = _device_table(plan.table, device, torch_stream)
    counts = 0 if prepared.counts is None else prepared.counts.data_ptr()
    args = (np.uint64(table.data_ptr()), np.int32(plan.n_tensors), np.int64(plan.n_chunks),
            np.int32(plan.chunk_size), np.uint64(prepared.seed), np.int64(prepared.step),
            np.uint64(counts), np.int32(prepared.flags)) + prepared.scalars
    with cupy.cuda.Device(device_index):
        with cupy.cuda.ExternalStream(torch_stream.cuda_stream):
            kernel((plan.grid,), (plan.block,), args)


def run_bucket(kind: str, bucket: Bucket, scalars,
               execute: Optional[Callable[[PreparedLaunch], None]] = None, **plan_options) -> None:
    """Prepare and launch one bucket.

    ``execute`` replaces the GPU launch (the CPU emulation passes its own);
    ``plan_options`` (chunk_size, block, max_grid) go to :func:`build_launch_plan`.
    """
    if not bucket.params:
        return
    if not supports(bucket.plan):
        raise NotImplementedError(f"backend='cupy' does not implement {bucket.plan}; "
                                  f"use backend='auto' or 'reference'")
    prepared = prepare_launch(kind, bucket, scalars, **plan_options)
    if prepared is None:  # every param is empty
        if bucket.counts is not None:
            bucket.counts[:, :COUNT_COLUMNS[kind]] = 0
        return
    if execute is None:
        device = bucket.params[0].device
        check_available(device)
        _run_on_gpu(prepared, device)
    else:
        execute(prepared)
    for original, staged in prepared.write_back:
        original.copy_(staged)
    if prepared.counts is not None:
        # the reference writes every param's row (empty params count nothing)
        columns = COUNT_COLUMNS[kind]
        counts = prepared.counts[:, :columns].to(bucket.counts.device)
        bucket.counts[:, :columns] = 0
        bucket.counts[list(prepared.plan.columns), :columns] = counts
    # the kernel wrote through raw pointers: tell autograd these tensors changed
    written = [t for t in (*bucket.params, *bucket.masters, *bucket.exp_avgs, *bucket.exp_avg_sqs,
                           *bucket.max_exp_avg_sqs, *bucket.compensations, *bucket.remainders)
               if t is not None]
    torch.autograd.graph.increment_version(written)


def adam(bucket: Bucket, s: AdamScalars) -> None:
    run_bucket("adam", bucket, s)


def lion(bucket: Bucket, s: LionScalars) -> None:
    run_bucket("lion", bucket, s)
