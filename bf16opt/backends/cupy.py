"""CuPy backend: the CUDA kernels of ``cuda_src/`` (shipped as ``bf16opt._cuda``).

A thin adapter.  Per bucket it stages the arrays (``staging.py``), builds a launch plan
(one chunk table covering every tensor, :func:`build_launch_plan`, pure numpy), picks the
kernel instantiation of the bucket's :class:`~bf16opt.algorithms.KernelConfig`
(:func:`kernel_name`) and launches it once on torch's current CUDA stream.

Every configuration runs in the kernels: stochastic rounding is a storage type
(``Stochastic<...>``), how the master is held is a master policy (``NoMaster``,
``Master<S>``, ``Kahan<C>``, ``Remainder``), an algorithm's template flags (amsgrad, SGD's
momentum) and telemetry are template parameters, its run-time flags (maximize, L2, ...)
bits of the ``flags`` argument, as is the grads' dtype (float32 grads of 16-bit params: the
shared ``kFloat32Grad`` bit, ``KernelConfig.flag_bits``).  The stochastic-rounding streams are computed in the
kernel from the seed, the step and each tensor's optimizer index (a row of the chunk
table), so the table of a training loop stays the same from step to step.

Compilation (``cuda_compile.py``): :func:`load_kernel` is the one loader, memoised per
(device, kernel name); NVRTC's output is cached on disk across processes (keyed by source,
options, architecture and NVRTC version), so a second process does not recompile.  CuPy is imported lazily: ``import bf16opt`` and this module work
without it; :func:`check_available` raises a ValueError naming the extra to install.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import threading
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..algorithms import ALGORITHMS, LIVE_LR_DOUBLE_BIT, KernelConfig, kernel_config
from ..precision import all_plans, q8_plans
from ..storage import Q8, Q8_BLOCK, q8_signed
from .base import Bucket, check_scalars
from .cuda_compile import cached_nvrtc_compile, compile_options, device_arch, kernel_source
from .staging import Staged, check, stage

name = "cupy"
live = True  # runs live steps (capturable=True: step and lr read on the device, bf16opt/capture.py)

INSTALL_HINT = ("install CuPy for your CUDA version: pip install cupy-cuda12x (CUDA 12) or cupy-cuda13x "
                "(CUDA 13); in a bf16opt checkout: pip install '.[cuda12]' or '.[cuda13]'")

# ---------------------------------------------------------------- kernel names
STORAGE_TYPES = {torch.float32: "bf16opt::Fp32", torch.bfloat16: "bf16opt::Bf16",
                 torch.float16: "bf16opt::Fp16"}


def _cxx_bool(flag: bool) -> str:
    return "true" if flag else "false"


def _storage(dtype, stochastic: bool, signed: bool = False, q8_stochastic: bool = False) -> str:
    """Storage type of a buffer: stochastic rounding only for 16-bit storage; a q8 moment
    as ``Q8<signed, stochastic>`` (``signed``: its map, :func:`_field_q8_signed`)."""
    if dtype == Q8:
        return f"bf16opt::Q8<{_cxx_bool(signed)}, {_cxx_bool(q8_stochastic)}>"
    base = STORAGE_TYPES[dtype]
    return f"bf16opt::Stochastic<{base}>" if stochastic and dtype != torch.float32 else base


@functools.lru_cache(maxsize=None)  # (asked at every launch)
def _field_q8_signed(algorithm, field: str) -> bool:
    """The q8 map of ``algorithm``'s states stored as the plan field ``field`` (their rows of
    ``roles.STATE_ROLES``): one template argument serves them all (Adam's exp_avg_sq and
    max_exp_avg_sq), so they share one map."""
    signs = {q8_signed(role.name) for role in algorithm.moment_roles if role.storage == field}
    if len(signs) != 1:
        raise ValueError(f"{algorithm.name}: the states stored as {field!r} need one q8 map, "
                         f"got {sorted(signs)}")
    return signs.pop()


_MASTER_POLICIES = {"param": "bf16opt::NoMaster", "param-stochastic": "bf16opt::NoMaster",
                    "remainder": "bf16opt::Remainder"}


def _master_policy(config: KernelConfig) -> str:
    if config.weights == "copy":
        return f"bf16opt::Master<{STORAGE_TYPES[config.plan.master]}>"
    if config.weights == "kahan":
        return f"bf16opt::Kahan<{STORAGE_TYPES[config.plan.compensation_dtype]}>"
    return _MASTER_POLICIES[config.weights]


def kernel_name(config: KernelConfig, live: bool = False) -> str:
    """Name expression of the kernel instantiation of ``config``:
    ``bf16opt::<algorithm>_kernel<param storage, master policy, moment storages...,
    template flags..., track>``, and ``live`` (capturable=True: the kernel reads its step and
    lr on the device) appended as ``true`` (the template's default is false).  A moment
    storage no present role uses (SGD without momentum) is written as Fp32, so such
    configurations share one instantiation."""
    algorithm, plan = config.algorithm, config.plan
    used = {role.storage for _, role, _, _ in config.present()}
    arguments = [_storage(plan.param, config.weights == "param-stochastic"), _master_policy(config)]
    arguments += [_storage(getattr(plan, field), plan.rounding == "stochastic",
                           _field_q8_signed(algorithm, field), plan.q8_rounding == "stochastic")
                  if field in used else STORAGE_TYPES[torch.float32] for field in algorithm.storage_parameters]
    arguments += [_cxx_bool(flag) for flag in (*config.template_flags, config.track)] + (["true"] if live else [])
    return f"bf16opt::{algorithm.name}_kernel<{', '.join(arguments)}>"


@functools.lru_cache(maxsize=None)
def kernel_configs(kind: str) -> dict:
    """Every instantiation the adapter can request for ``kind``, name -> KernelConfig
    (the first configuration of each name): all plans of ``all_plans(quality=True)`` and
    ``q8_plans()`` x
    the algorithm's template flags x telemetry on/off."""
    algorithm = ALGORITHMS[kind]
    configs = {}
    for plan in all_plans(quality=True) + q8_plans():
        for values in itertools.product((False, True), repeat=len(algorithm.template_flags) + 1):
            flags = tuple(zip(algorithm.template_flags, values[:-1]))
            config = kernel_config(algorithm, plan, flags, track=values[-1])
            configs.setdefault(kernel_name(config), config)
    return configs


def all_kernel_names(kind: str) -> list:
    """Every instantiation the adapter can request for ``kind`` (all plans x flags)."""
    return list(kernel_configs(kind))


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
        compiled = cached_nvrtc_compile(kernel_source(kind), [expression], compile_options(arch),
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

    table: np.ndarray        # int64: pointers [roles x tensors], sizes, stream ids, first chunks (+ total),
                             # first elements
    n_tensors: int
    n_chunks: int
    chunk_size: int
    grid: int
    block: int
    columns: tuple = ()      # position in the caller's list of each tensor in the table


def build_launch_plan(pointers: Sequence[Sequence[int]], sizes: Sequence[int], *,
                      indices: Optional[Sequence[int]] = None, offsets: Optional[Sequence[int]] = None,
                      counters: Optional[Sequence[int]] = None,
                      chunk_size: int = DEFAULT_CHUNK_SIZE, block: int = DEFAULT_BLOCK,
                      max_grid: int = MAX_GRID) -> Optional[LaunchPlan]:
    """Chunk table for tensors with ``pointers[t][role]`` and ``sizes[t]`` elements.

    ``indices[t]`` is tensor t's index in the optimizer (it names the tensor's random
    streams; default t); ``offsets[t]`` the global index of its first element (a shard's
    offset in its param; default 0); ``counters[t]`` the address of its step counter (a live
    step's; default: none, and no such row).  Pure numpy.  Empty tensors are left out (``columns`` lists
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
    if not offsets:
        offsets = [0] * len(sizes)
    if len(offsets) != len(sizes):
        raise ValueError("offsets and sizes must have one entry per tensor")
    if counters is not None and len(counters) != len(sizes):
        raise ValueError("counters and sizes must have one entry per tensor")
    keep = [t for t, size in enumerate(sizes) if size > 0]
    if not keep:
        return None
    roles = len(pointers[keep[0]])
    n = len(keep)
    table = np.zeros((roles + (4 if counters is None else 5)) * n + 1, dtype=np.int64)
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
    table[(roles + 2) * n:(roles + 3) * n + 1] = first
    table[(roles + 3) * n + 1:(roles + 4) * n + 1] = [offsets[t] for t in keep]
    if counters is not None:
        table[(roles + 4) * n + 1:] = [counters[t] for t in keep]
    n_chunks = int(first[-1])
    return LaunchPlan(table, n, n_chunks, chunk_size, min(n_chunks, max_grid), block, tuple(keep))


#: a launch's live-step arguments (cuda_src/multi_tensor.cuh's LiveStep: lr's address, lr_value,
#: decay_rate, the bias table's address and rows, the loss scale's and inf flag's addresses)
#: when its step is not live
NO_LIVE = (0, 0.0, 0.0, 0, 0, 0, 0)


class PreparedLaunch(NamedTuple):
    kind: str
    expression: str
    plan: LaunchPlan
    scalars: tuple           # numpy float32, kernel argument order
    staged: Staged           # the arrays the table points into (kept alive through the launch)
    seed: int = 0            # stochastic rounding: seed and step of the random streams
    step: int = 0
    counts: Optional[torch.Tensor] = None  # telemetry: int64 (tensors in the table, 3), zeros
    flags: int = 0           # run-time flags (KernelConfig.flag_bits: maximize, L2, ...)
    live: tuple = NO_LIVE    # a live step's arguments (capturable=True)

    @property
    def is_live(self) -> bool:
        """A live kernel's launch (``kernel_name(config, live=True)``)."""
        return self.live is not NO_LIVE


def prepare_launch(bucket: Bucket, scalars, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   block: int = DEFAULT_BLOCK, max_grid: int = MAX_GRID) -> Optional[PreparedLaunch]:
    """Kernel name, launch plan and scalars for one bucket (no CuPy, no device needed)."""
    config = bucket.config
    kind = config.algorithm.name
    check_scalars(bucket, scalars)
    if config.stochastic and len(bucket.indices) != len(bucket.params):
        raise ValueError("stochastic rounding needs bucket.indices (each param's index in the "
                         "optimizer names its random streams)")
    indices = bucket.streams() if len(bucket.indices) == len(bucket.params) else range(len(bucket.params))
    if not 0 <= bucket.seed < 2 ** 64:
        raise ValueError(f"bucket.seed must be in [0, 2**64), got {bucket.seed}")
    staged = stage(bucket, "cupy")
    if config.quantized:  # chunks of whole q8 blocks, blocks of whole warps (q8.cuh)
        chunk_size = -(-chunk_size // Q8_BLOCK) * Q8_BLOCK
        block = min(-(-block // 32) * 32, 1024)
    live = bucket.live
    launch_plan = build_launch_plan(staged.pointers.tolist(), staged.numels, indices=list(indices),
                                    offsets=list(bucket.offsets),
                                    counters=None if live is None else [c.data_ptr() for c in bucket.counters],
                                    chunk_size=chunk_size, block=block, max_grid=max_grid)
    if launch_plan is None:
        return None
    values = tuple(np.float32(v) for v in scalars)
    for field, value, original in zip(scalars._fields, values, scalars):
        if float(value) != float(original) and not (np.isnan(value) and np.isnan(original)):
            raise ValueError(f"scalar {field}={original!r} is not a float32 value")
    counts = None
    if config.track:
        counts = torch.zeros((launch_plan.n_tensors, 3), dtype=torch.int64,
                             device=bucket.params[0].device)
    flags, live_arguments = config.flag_bits, NO_LIVE
    if live is not None:
        flags |= LIVE_LR_DOUBLE_BIT if live.lr is not None and live.lr.dtype == torch.float64 else 0
        live_arguments = (_address(live.lr), float(live.lr_value), float(live.decay_rate), _address(live.bias),
                          0 if live.bias is None else live.bias.shape[0], _address(live.grad_scale),
                          _address(live.found_inf))
    return PreparedLaunch(kind, kernel_name(config, live is not None), launch_plan, values, staged,
                          int(bucket.seed), int(bucket.step), counts, flags, live_arguments)


def _address(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def check_live(bucket: Bucket) -> None:
    """A live bucket's step counters, lr tensor and bias table are what the kernels can read:
    float64 counters (one per param) and bias rows, a float32/float64 lr, all on the params'
    device and contiguous (raises ValueError)."""
    live, device = bucket.live, bucket.params[0].device
    if len(bucket.counters) != len(bucket.params):
        raise ValueError("a live bucket needs one step counter per param")
    for i, counter in enumerate(bucket.counters):
        if not (isinstance(counter, torch.Tensor) and counter.dtype == torch.float64 and counter.numel() == 1
                and counter.device == device):
            raise ValueError(f"the step counter of param {bucket.indices[i] if bucket.indices else i} must be "
                             f"a one-element float64 tensor on {device} for capturable=True")
    if live.lr is not None and not (live.lr.dtype in (torch.float32, torch.float64) and live.lr.numel() == 1
                                    and live.lr.device == device):
        raise ValueError(f"lr must be a number or a one-element float32/float64 tensor on {device} for "
                         f"capturable=True, got a {live.lr.dtype} tensor of shape {tuple(live.lr.shape)} "
                         f"on {live.lr.device}")
    if live.bias is not None and not (live.bias.dtype == torch.float64 and live.bias.dim() == 2
                                      and live.bias.shape[1] == 2 and live.bias.is_contiguous()
                                      and live.bias.device == device):
        raise ValueError("the bias-correction table must be a contiguous float64 (rows, 2) tensor on the "
                         "params' device")
    for name, value in (("grad_scale", live.grad_scale), ("found_inf", live.found_inf)):
        if value is not None and not (value.dtype == torch.float32 and value.numel() == 1 and value.device == device):
            raise ValueError(f"{name} must be a one-element float32 tensor on {device} for a captured step, got "
                             f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}")


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


def _live_arguments(live: tuple) -> tuple:
    """The kernel arguments of ``live`` (a PreparedLaunch's ``live``), typed for CuPy."""
    if live is NO_LIVE:
        return _NO_LIVE_ARGUMENTS
    lr, lr_value, decay_rate, bias, rows, grad_scale, found_inf = live
    return (np.uint64(lr), np.float64(lr_value), np.float64(decay_rate), np.uint64(bias), np.int64(rows),
            np.uint64(grad_scale), np.uint64(found_inf))


_NO_LIVE_ARGUMENTS = (np.uint64(0), np.float64(0.0), np.float64(0.0), np.uint64(0), np.int64(0), np.uint64(0),
                      np.uint64(0))


# Chunk tables of captured launches (CUDA graphs): a graph's copy node reads its host table at
# every replay, so each captured table gets host and device memory of its own that nothing
# reuses; both are allocated outside capture (eager live launches keep room for the next).
_CAPTURE_ROOM_WORDS = 1 << 16


class _CaptureArena:
    def __init__(self, device: torch.device, words: int):
        self.host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        self.device = torch.empty(words, dtype=torch.int64, device=device)
        self.used = 0

    def free(self) -> int:
        return self.host.numel() - self.used


_capture_arenas: dict = {}  # device index -> list of arenas (the last has room; all stay alive)
# device index -> ({a live launch's first param address: its chunk-table words}, their sum)
_live_tables: dict = {}


def _capture_room(device: torch.device, words: int, reserve: int = 0) -> None:
    """Room for captured tables of ``words`` entries on ``device``, an arena of at least
    ``reserve`` words where one is made (not while capturing)."""
    arenas = _capture_arenas.setdefault(device.index, [])
    if not arenas or arenas[-1].free() < words:
        arenas.append(_CaptureArena(device, max(words, reserve, _CAPTURE_ROOM_WORDS)))


def _reserve_capture_room(device: torch.device, table: np.ndarray) -> None:
    """After an eager live launch: room for a capture of every live launch seen on ``device``
    (a captured step records all of its tables), an arena for eight such captures where one
    is made.  A launch is known by its first param's address (``table[0]``), so its later
    steps replace its size rather than add to the sum."""
    sizes, total = _live_tables.get(device.index, ({}, 0))
    total += int(table.size) - sizes.get(int(table[0]), 0)
    sizes[int(table[0])] = int(table.size)
    _live_tables[device.index] = (sizes, total)
    _capture_room(device, total, 8 * total)


def _captured_table(table: np.ndarray, device: torch.device, stream) -> int:
    """The device address of ``table``, copied there by a copy the capture records."""
    import cupy

    arenas = _capture_arenas.get(device.index)
    if not arenas or arenas[-1].free() < table.size:
        raise RuntimeError("capturable=True: no room for this launch's chunk table in the capture's memory; "
                           "run the same step eagerly (a warm-up step, with the same param groups) before "
                           "capturing it")
    arena = arenas[-1]
    start, arena.used = arena.used, arena.used + table.size
    arena.host[start:arena.used].numpy()[:] = table
    nbytes = table.size * 8
    cupy.cuda.runtime.memcpyAsync(arena.device.data_ptr() + start * 8, arena.host.data_ptr() + start * 8, nbytes,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream.cuda_stream)
    return arena.device.data_ptr() + start * 8


def cupy_stream(cupy, torch_stream):
    """CuPy's handle of ``torch_stream``, to launch on it: through the CUDA stream protocol
    where CuPy and torch have it (CuPy 14 warns at every ``ExternalStream``)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


def _run_on_gpu(prepared: PreparedLaunch, device: torch.device) -> None:
    import cupy

    device_index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", device_index)
    kernel = load_kernel(device_index, prepared.kind, prepared.expression)
    torch_stream = torch.cuda.current_stream(device)
    plan = prepared.plan
    counts = 0 if prepared.counts is None else prepared.counts.data_ptr()
    with cupy.cuda.Device(device_index):
        if torch.cuda.is_current_stream_capturing():
            table_address = _captured_table(plan.table, device, torch_stream)
        else:
            table_address = _device_table(plan.table, device, torch_stream).data_ptr()
            if prepared.is_live:  # (this launch may be captured next, with the step's others)
                _reserve_capture_room(device, plan.table)
        with cupy_stream(cupy, torch_stream):
            kernel((plan.grid,), (plan.block,), kernel_arguments(prepared, table_address, counts))


def kernel_arguments(prepared: PreparedLaunch, table_address: int, counts: int = 0) -> tuple:
    """A kernel's arguments, typed for CuPy, in the order of its signature (cuda_src/<kind>.cu):
    the chunk table on the device at ``table_address``, the counts' address (0: untracked), the
    live step's, then the scalars."""
    plan = prepared.plan
    return (np.uint64(table_address), np.int32(plan.n_tensors), np.int64(plan.n_chunks),
            np.int32(plan.chunk_size), np.uint64(prepared.seed), np.int64(prepared.step),
            np.uint64(counts), np.int32(prepared.flags)) + _live_arguments(prepared.live) + prepared.scalars


def prepare(bucket: Bucket, scalars, execute: Optional[Callable[[PreparedLaunch], None]] = None,
            **plan_options):
    """Everything that can fail, done now: checks, device availability, the kernel
    (compiled or loaded).  Returns the launch, which cannot fail on user input.

    ``execute`` replaces the GPU launch (the CPU emulation passes its own);
    ``plan_options`` (chunk_size, block, max_grid) go to :func:`build_launch_plan`.
    """
    config = bucket.config
    check_scalars(bucket, scalars)
    if not bucket.params:
        return lambda: None
    if kernel_name(config) not in kernel_configs(config.algorithm.name):
        # a hand-made plan no precision produces (e.g. a remainder for float16 params) would
        # compile and read the wrong bits: only the instantiations the policy allows run
        raise NotImplementedError(f"backend='cupy' has no kernel for {config.plan}; no precision "
                                  f"produces it")
    check(bucket, "cupy")
    for field, value in zip(scalars._fields, scalars):
        if float(np.float32(value)) != float(value) and not np.isnan(value):
            raise ValueError(f"scalar {field}={value!r} is not a float32 value")
    if config.stochastic and len(bucket.indices) != len(bucket.params):
        raise ValueError("stochastic rounding needs bucket.indices (each param's index in the "
                         "optimizer names its random streams)")
    if not 0 <= bucket.seed < 2 ** 64:
        raise ValueError(f"bucket.seed must be in [0, 2**64), got {bucket.seed}")
    if bucket.live is not None:
        check_live(bucket)
    if execute is None:
        device = bucket.params[0].device
        check_available(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        load_kernel(index, config.algorithm.name, kernel_name(config, bucket.live is not None))

    def launch() -> None:
        columns = len(config.algorithm.counters)
        prepared = prepare_launch(bucket, scalars, **plan_options)
        if prepared is None:  # every param is empty
            if bucket.counts is not None:
                bucket.counts[:, :columns] = 0
            return
        if execute is None:
            _run_on_gpu(prepared, bucket.params[0].device)
        else:
            execute(prepared)
        prepared.staged.finish()
        if prepared.counts is not None:
            # the reference writes every param's row (empty params count nothing)
            counts = prepared.counts[:, :columns].to(bucket.counts.device)
            bucket.counts[:, :columns] = 0
            bucket.counts[list(prepared.plan.columns), :columns] = counts

    return launch


def run(bucket: Bucket, scalars, execute: Optional[Callable[[PreparedLaunch], None]] = None,
        **plan_options) -> None:
    """Prepare and launch one bucket (see :func:`prepare`)."""
    prepare(bucket, scalars, execute, **plan_options)()


# ---------------------------------------------------------------- a launch kept between steps
_NO_COUNTERS = np.zeros(0, dtype=np.int64)
_NO_STEPS = np.zeros(0, dtype=np.float64)
_NO_PLACES = np.zeros(3, dtype=np.int64)


class Relaunch:
    """A bucket's launch kept for later steps by the optimizer's step cache (``step_cache.py``):
    the kernel, the chunk table (on the device, uploaded again only when a grad's address
    changed) and the launch's fixed arguments; per step, the scalars and the step number are
    kernel arguments.  Valid while the other tensors keep their addresses and the grads their
    forms (the cache checks); made by :func:`relaunch`."""

    def __init__(self, bucket: Bucket, prepared: PreparedLaunch, grad_positions: list, execute):
        self.config = bucket.config
        self.prepared = prepared._replace(staged=None)  # (its lists hold this step's grads)
        self.execute = execute
        self.n_kept = prepared.plan.n_tensors
        # the table's grad column (role 1), and which grad of the group's each of its entries is
        self.grad_slice = slice(self.n_kept, 2 * self.n_kept)
        self.grad_of_column = np.asarray(grad_positions, dtype=np.int64)[list(prepared.plan.columns)]
        self.table = prepared.plan.table.copy()
        self.table_stale = True  # the device copy lags the host table (a grad moved since)
        self.device_table = None
        self.table_stream = None  # the stream the device copy was made on, and is read on
        self.kernel = None
        if execute is None:
            device = bucket.params[0].device
            self.device = torch.device("cuda", device.index if device.index is not None
                                       else torch.cuda.current_device())
            self.kernel = load_kernel(self.device.index, prepared.kind, prepared.expression)

    def arguments(self, scalars, inv_grad_scale: float, step: int) -> "tuple | None":
        """A step's kernel scalars (each rounded to float32 once, ``inv_grad_scale`` last) and
        its step number, for :meth:`run`; None when a scalar is not a finite float32."""
        values = np.array((*scalars[:-1], inv_grad_scale), dtype=np.float32)  # (each rounded once)
        if not all(map(math.isfinite, values.tolist())):
            return None
        return tuple(values), step

    def run(self, grad_addresses: np.ndarray, values: tuple, step: int, counters: np.ndarray = _NO_COUNTERS,
            steps: np.ndarray = _NO_STEPS, written: np.ndarray = _NO_COUNTERS,
            places: np.ndarray = _NO_PLACES) -> None:
        """The launch with the grads at ``grad_addresses`` (indexed by the ``grad_positions``
        given at construction); first, the float64 step counters at ``counters`` advanced with
        their kept copy ``steps``, and the version counters of the objects whose ids are
        ``written`` bumped (a group's first launch does both for all of its tensors)."""
        if counters.size or written.size:
            from . import numba as numba_backend  # (its compiled bookkeeping helpers, memoised)

            numba_backend.helpers().advance_counters(counters, steps)
            numba_backend.helpers().bump_versions(written, places)
        grads = grad_addresses[self.grad_of_column]
        if not np.array_equal(grads, self.table[self.grad_slice]):
            self.table[self.grad_slice] = grads
            self.table_stale = True
        prepared = self.prepared._replace(scalars=values, step=step)
        if self.execute is not None:  # (the emulation reads the host table)
            self.execute(prepared._replace(plan=prepared.plan._replace(table=self.table)))
            return
        self._launch_on_gpu(prepared)

    def _launch_on_gpu(self, prepared: PreparedLaunch) -> None:
        import cupy

        stream = torch.cuda.current_stream(self.device)
        # a new table tensor (the last launch may still read the old one), also for a launch on
        # another stream: a table is read only on the stream it was copied and allocated on, so
        # the allocator reuses its memory only after those launches
        if self.table_stale or stream != self.table_stream:
            self.device_table = torch.from_numpy(self.table).pin_memory().to(self.device, non_blocking=True)
            self.table_stale, self.table_stream = False, stream
        plan = prepared.plan
        with cupy.cuda.Device(self.device.index), cupy_stream(cupy, stream):
            self.kernel((plan.grid,), (plan.block,), kernel_arguments(prepared, self.device_table.data_ptr()))


def relaunch(bucket: Bucket, grad_positions: list, execute: Optional[Callable[[PreparedLaunch], None]] = None,
             **plan_options) -> "Relaunch | None":
    """``bucket``'s launch for reuse, or None when it cannot be reused: telemetry (fresh counts
    every step), shards (element offsets), live steps (capturable=True: the step cache reads
    host counters), tensors staged through copies (new every step), or only empty tensors.
    ``bucket`` has passed :func:`prepare`'s checks; ``execute`` as there."""
    config = bucket.config
    if config.track or bucket.offsets or bucket.live is not None:
        return None
    scalars = config.algorithm.scalars(*([0.0] * len(config.algorithm.scalars._fields)))
    prepared = prepare_launch(bucket, scalars, **plan_options)
    if prepared is None or any(copy is not tensor for column, copies in zip(bucket.tensors, prepared.staged.tensors)
                               for tensor, copy in zip(column, copies)):
        return None
    return Relaunch(bucket, prepared, grad_positions, execute)
