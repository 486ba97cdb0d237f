"""Numba backend: the CPU kernels of ``cpu_src/`` (installed as ``bf16opt._cpu``).

A thin adapter: it turns a :class:`Bucket` into one chunk table (byte addresses of every
tensor's buffers, see ``cpu_src/chunks.py``) plus the step's float32 scalars, the
random-stream keys of stochastic rounding and telemetry counters, picks the compiled
chunk function of the bucket's configuration, and makes one parallel kernel call per
bucket.  Tensors travel zero-copy: the kernels read and write the tensors' own memory;
bfloat16 and float16 are handled as 16-bit integers.

Every plan is supported: round to nearest or stochastic rounding, Kahan compensation,
the int16 remainder, and precision telemetry (``bucket.counts``), all bit-identical to
``reference.py``.

Importing this module compiles nothing; the kernels (and Numba itself) are imported on
the first step, and compiled on the first step of each configuration, or loaded from
Numba's on-disk cache.

Kernel calls are serialised by one process-wide lock: Numba's ``workqueue`` threading
layer (the one left when neither TBB nor OpenMP is installed) aborts the process when two
Python threads enter parallel code at once, and two parallel calls would only
oversubscribe the cores anyway.

Non-contiguous tensors: when every buffer of a param (param, grad, master, moments...) is
dense with the same strides, as with ``channels_last`` conv weights and states made with
``preserve_format``, the kernel walks them in memory order in place: the math is
elementwise, so the order does not matter -- except for stochastic rounding, whose random
bits depend on the element's logical index.  Everything else (strided views, mixed
layouts, stochastic rounding) is updated through contiguous copies that are written back
afterwards.  Both keep results identical to the reference.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Optional

import numpy as np
import torch

from ..storage import GOLDEN, MASK32, fmix32_int
from .base import AdamScalars, Bucket, LionScalars, same_dense_layout

name = "numba"

# element class of the view each storage dtype travels as (int16: the remainder, raw bits)
_VIEW_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16,
                torch.int16: np.int16}

_KERNEL_LOCK = threading.Lock()  # one parallel kernel at a time (see the module docstring)
_TABLE_CACHE: dict = {}
_TABLE_CACHE_SIZE = 16


def supports(plan) -> bool:
    """Every plan: nearest and stochastic rounding, Kahan, remainder, telemetry."""
    return True


def available() -> bool:
    """True when numba is importable (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def check_device(device: torch.device) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"backend='numba' runs on CPU tensors only, got device {device}; "
                         f"use backend='cupy' or 'auto' for CUDA tensors")
    if not available():
        raise ValueError("backend='numba' needs the numba package (pip install numba)")


def _kernels():
    from .._cpu import adam, chunks, lion  # noqa: PLC0415  (lazy: importing compiles nothing)
    return adam, lion, chunks


class _Launch:
    """The buffers of a bucket as contiguous memory, with write-back for copies."""

    def __init__(self, columns: list[list[Optional[torch.Tensor]]], dtypes: list, written: tuple,
                 any_memory_order: bool):
        # columns[b][t]: buffer b of tensor t (None when the configuration has no such buffer);
        # any_memory_order: results do not depend on the order the elements are visited in
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.columns = []
        self.itemsizes = _itemsizes(dtypes)
        in_place: dict = {}  # tensor t -> its buffers can be walked in memory order in place

        def walk_in_place(t: int) -> bool:
            if t not in in_place:  # asked only for non-contiguous buffers: rare, so checked lazily
                in_place[t] = any_memory_order and same_dense_layout(
                    [column[t] for column in columns if column[t] is not None])
            return in_place[t]

        for b, (column, dtype) in enumerate(zip(columns, dtypes)):
            if dtype is None:  # a buffer this configuration does not have
                if any(tensor is not None for tensor in column):
                    raise ValueError(f"numba backend: buffer {b} is not part of this configuration")
                self.columns.append(list(column))
                continue
            out = []
            for t, tensor in enumerate(column):
                # (is_cpu, not device.type: this loop runs for every buffer of every param, every step)
                if tensor is None or tensor.dtype != dtype or not tensor.is_cpu:
                    raise TypeError(f"numba backend: expected a CPU {dtype} tensor, got "
                                    f"{'None' if tensor is None else f'{tensor.dtype} on {tensor.device}'}")
                if not tensor.is_contiguous() and not walk_in_place(t):
                    copy = tensor.contiguous()
                    if b in written:
                        self.write_back.append((tensor, copy))
                    tensor = copy
                out.append(tensor)
            self.columns.append(out)

    def table(self, numels: list[int], chunks) -> tuple[np.ndarray, np.ndarray]:
        """The chunk table and each thread's range of its rows (memoised: a training loop
        sees the same addresses each step)."""
        from numba import get_num_threads  # noqa: PLC0415  (numba is imported on the first step)

        threads = get_num_threads()
        addresses = [[0 if tensor is None else tensor.data_ptr() for tensor in column]
                     for column in self.columns]
        key = (tuple(map(tuple, addresses)), tuple(numels), self.itemsizes.tobytes(), chunks.CHUNK,
               threads)
        cached = _TABLE_CACHE.get(key)
        if cached is None:
            if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
                _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
            table = chunks.build_chunk_table(np.array(addresses, dtype=np.int64).T, self.itemsizes,
                                             np.array(numels, dtype=np.int64), chunk=chunks.CHUNK)
            cached = _TABLE_CACHE[key] = (table, chunks.balanced_bounds(table, threads))
        return cached

    def finish(self, touched: list[torch.Tensor]) -> None:
        for tensor, copy in self.write_back:
            tensor.copy_(copy)
        # the kernels wrote through raw pointers: tell autograd the tensors changed
        torch.autograd.graph.increment_version(touched)


def _itemsizes(column_dtypes: list[Optional[torch.dtype]]) -> np.ndarray:
    return np.array([0 if d is None else np.dtype(_VIEW_DTYPES[d]).itemsize for d in column_dtypes],
                    dtype=np.int64)


def _format(dtype: Optional[torch.dtype]):
    """Element class a kernel is specialised on (absent buffers: float32, never touched)."""
    return np.float32 if dtype is None else _VIEW_DTYPES[dtype]


def _weights_policy(plan) -> str:
    """How the master weights are held (a key of ``cpu_src/adam.py``'s WEIGHTS)."""
    if plan.compensation is not None:
        return plan.compensation            # "kahan" or "remainder"
    if plan.master is not None:
        return "master"
    return "stochastic" if plan.rounding == "stochastic" else "param"


def _extra(bucket: Bucket) -> tuple[list, Optional[torch.dtype]]:
    """The Kahan compensations or int16 remainders of a bucket, and their dtype."""
    plan = bucket.plan
    if plan.compensation == "kahan":
        return list(bucket.compensations), plan.compensation_dtype
    if plan.compensation == "remainder":
        return list(bucket.remainders), torch.int16
    return [None] * len(bucket.params), None


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3 fmix32 on uint64 arrays holding uint32 values."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & np.uint64(MASK32)
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & np.uint64(MASK32)
    return h ^ (h >> np.uint64(16))


def stream_keys(seed: int, step: int, indices: list[int]) -> np.ndarray:
    """uint32 (len(indices), 4): ``storage.stream_key(seed, step, index, buffer)`` for the
    buffers WEIGHTS, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ (0..3), vectorised over tensors."""
    key = 0
    for word in (seed & MASK32, (seed >> 32) & MASK32, step & MASK32):
        key = fmix32_int(((key ^ word) + GOLDEN) & MASK32)
    golden, mask = np.uint64(GOLDEN), np.uint64(MASK32)
    tensor = np.asarray(indices, dtype=np.int64).astype(np.uint64) & mask
    keys = _fmix32(((np.uint64(key) ^ tensor) + golden) & mask)
    buffers = np.arange(4, dtype=np.uint64)
    keys = _fmix32(((keys[:, None] ^ buffers[None, :]) + golden) & mask)
    return np.ascontiguousarray(keys.astype(np.uint32))


def _launch(bucket: Bucket, chunk, columns: list, dtypes: list, written: tuple, scalars: list,
            counters: int) -> None:
    """One parallel call of ``chunk`` over every tensor of the bucket."""
    _, _, chunks = _kernels()
    launch = _Launch(columns, dtypes, written, any_memory_order=bucket.plan.rounding != "stochastic")
    table, bounds = launch.table([p.numel() for p in bucket.params], chunks)
    n = len(bucket.params)
    if bucket.plan.rounding == "stochastic":
        if len(bucket.indices) != n:
            raise ValueError(f"numba backend: stochastic rounding needs each param's index "
                             f"(bucket.indices has {len(bucket.indices)} entries for {n} params)")
        keys = stream_keys(bucket.seed, bucket.step, bucket.indices)
    else:
        keys = np.zeros((n, chunks.KEYS), dtype=np.uint32)  # never read
    row_counts = np.zeros((table.shape[0], chunks.COUNTERS), dtype=np.int64)
    with _KERNEL_LOCK:
        chunks.run_chunks(chunk.address, table, np.array(scalars, dtype=np.float32), keys, row_counts,
                          bounds)
    launch.finish([t for b in written for t in columns[b] if t is not None])
    if bucket.counts is not None:
        totals = chunks.tensor_counts(table, row_counts, n)
        bucket.counts[:, :counters] = torch.from_numpy(totals[:, :counters])


def adam(bucket: Bucket, s: AdamScalars) -> None:
    if not bucket.params:
        return
    adam_module, _, _ = _kernels()
    plan = bucket.plan
    n = len(bucket.params)
    has_master = plan.master is not None
    extra, extra_dtype = _extra(bucket)
    columns = [bucket.params, bucket.grads,
               list(bucket.masters) if has_master else [None] * n,
               bucket.exp_avgs, bucket.exp_avg_sqs,
               bucket.max_exp_avg_sqs if bucket.amsgrad else [None] * n, extra]
    dtypes = [plan.param, plan.param, plan.master, plan.exp_avg, plan.exp_avg_sq,
              plan.exp_avg_sq if bucket.amsgrad else None, extra_dtype]
    formats = tuple(_format(dtypes[b]) for b in (0, 2, 3, 4, 6))
    chunk = adam_module.adam_chunk(formats, _weights_policy(plan), plan.rounding, bucket.amsgrad,
                                   bucket.l2, bucket.counts is not None)
    scalars = [s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.step_size,
               s.inv_sqrt_bias_correction2, s.eps, s.weight_decay, s.decay,
               -1.0 if bucket.maximize else 1.0]
    _launch(bucket, chunk, columns, dtypes, (0, 2, 3, 4, 5, 6), scalars, counters=3)


def lion(bucket: Bucket, s: LionScalars) -> None:
    if not bucket.params:
        return
    _, lion_module, _ = _kernels()
    plan = bucket.plan
    n = len(bucket.params)
    has_master = plan.master is not None
    extra, extra_dtype = _extra(bucket)
    columns = [bucket.params, bucket.grads,
               list(bucket.masters) if has_master else [None] * n, bucket.exp_avgs, extra]
    dtypes = [plan.param, plan.param, plan.master, plan.exp_avg, extra_dtype]
    formats = tuple(_format(dtypes[b]) for b in (0, 2, 3, 4))
    chunk = lion_module.lion_chunk(formats, _weights_policy(plan), plan.rounding,
                                   bucket.counts is not None)
    scalars = [s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.lr, s.decay,
               -1.0 if bucket.maximize else 1.0]
    # Lion has no second moment: the reference writes counters 0 and 1 only
    _launch(bucket, chunk, columns, dtypes, (0, 2, 3, 4), scalars, counters=2)
