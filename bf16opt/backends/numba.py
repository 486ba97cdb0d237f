"""Numba backend: the CPU kernels of ``cpu_src/`` (installed as ``bf16opt._cpu``).

A thin adapter: it turns a :class:`Bucket` into one chunk table (byte addresses of every
tensor's buffers, see ``cpu_src/chunks.py``) plus format tokens and float32 scalars, and
makes one kernel call per bucket.  Tensors travel zero-copy: the kernels read and write
the tensors' own memory; bfloat16 and float16 are handled as 16-bit integers.

Importing this module compiles nothing; the kernels (and Numba itself) are imported on
the first step, and compiled on the first step of each configuration, or loaded from
Numba's on-disk cache.  Results are bit-identical to ``reference.py``.

Buckets with precision telemetry (``bucket.counts``) are delegated to the reference
backend for now.

Non-contiguous tensors (rare: params are usually contiguous) are updated through
contiguous copies that are written back afterwards, which keeps results identical.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import numpy as np
import torch

from . import reference
from .base import AdamScalars, Bucket, LionScalars

name = "numba"

_VIEW_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}
# format token of each storage dtype (an empty array of its view dtype), and of "absent"
_FORMATS = {dtype: np.empty(0, dtype=view) for dtype, view in _VIEW_DTYPES.items()}
_ABSENT = np.empty(0, dtype=np.float32)

_TABLE_CACHE: dict = {}
_TABLE_CACHE_SIZE = 16


def supports(plan) -> bool:
    """Plans with round-to-nearest storage and no compensation buffer (the quality plans,
    stochastic rounding / Kahan / remainder, still go to the reference backend)."""
    return plan.rounding == "nearest" and plan.compensation is None


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

    def __init__(self, columns: list[list[Optional[torch.Tensor]]], dtypes: list, written: tuple):
        # columns[b][t]: buffer b of tensor t (None when the configuration has no such buffer)
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.columns = []
        self.itemsizes = _itemsizes(dtypes)
        for b, column in enumerate(columns):
            out = []
            for tensor in column:
                if tensor is None:
                    if dtypes[b] is not None:
                        raise ValueError(f"numba backend: a {dtypes[b]} buffer is missing")
                    out.append(None)
                    continue
                if tensor.dtype != dtypes[b] or tensor.device.type != "cpu":
                    raise TypeError(f"numba backend: expected a CPU {dtypes[b]} tensor, got "
                                    f"{tensor.dtype} on {tensor.device}")
                if not tensor.is_contiguous():
                    copy = tensor.contiguous()
                    if b in written:
                        self.write_back.append((tensor, copy))
                    tensor = copy
                out.append(tensor)
            self.columns.append(out)

    def table(self, numels: list[int], chunks) -> np.ndarray:
        """The chunk table (memoised: a training loop sees the same addresses each step)."""
        addresses = [[0 if tensor is None else tensor.data_ptr() for tensor in column]
                     for column in self.columns]
        key = (tuple(map(tuple, addresses)), tuple(numels), self.itemsizes.tobytes())
        table = _TABLE_CACHE.get(key)
        if table is None:
            if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
                _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
            table = chunks.build_chunk_table(np.array(addresses, dtype=np.int64).T, self.itemsizes,
                                             np.array(numels, dtype=np.int64))
            _TABLE_CACHE[key] = table
        return table

    def finish(self, touched: list[torch.Tensor]) -> None:
        for tensor, copy in self.write_back:
            tensor.copy_(copy)
        # the kernels wrote through raw pointers: tell autograd the tensors changed
        torch.autograd.graph.increment_version(touched)


def _itemsizes(column_dtypes: list[Optional[torch.dtype]]) -> np.ndarray:
    return np.array([0 if d is None else np.dtype(_VIEW_DTYPES[d]).itemsize for d in column_dtypes],
                    dtype=np.int64)


def _format(dtype: Optional[torch.dtype]) -> np.ndarray:
    return _ABSENT if dtype is None else _FORMATS[dtype]


def _needs_reference(bucket: Bucket) -> bool:
    # precision telemetry (bucket.counts) is not computed by the kernels yet
    if not supports(bucket.plan):
        raise NotImplementedError(f"backend='numba' does not implement {bucket.plan}")
    return bucket.counts is not None


def adam(bucket: Bucket, s: AdamScalars) -> None:
    if not bucket.params:
        return
    if _needs_reference(bucket):
        reference.adam(bucket, s)
        return
    adam_module, _, chunks = _kernels()
    plan = bucket.plan
    n = len(bucket.params)
    has_master = plan.master is not None
    columns = [bucket.params, bucket.grads,
               list(bucket.masters) if has_master else [None] * n,
               bucket.exp_avgs, bucket.exp_avg_sqs,
               bucket.max_exp_avg_sqs if bucket.amsgrad else [None] * n]
    dtypes = [plan.param, plan.param, plan.master, plan.exp_avg, plan.exp_avg_sq,
              plan.exp_avg_sq if bucket.amsgrad else None]
    launch = _Launch(columns, dtypes, written=(0, 2, 3, 4, 5))
    table = launch.table([p.numel() for p in bucket.params], chunks)
    kernel = adam_module.adam_kernel(has_master, bucket.amsgrad, bucket.maximize, bucket.l2)
    f = np.float32
    kernel(table, *(_format(d) for d in dtypes),
           f(s.beta1), f(s.beta2), f(s.one_minus_beta1), f(s.one_minus_beta2), f(s.step_size),
           f(s.inv_sqrt_bias_correction2), f(s.eps), f(s.weight_decay), f(s.decay))
    launch.finish([t for b in (0, 2, 3, 4, 5) for t in columns[b] if t is not None])


def lion(bucket: Bucket, s: LionScalars) -> None:
    if not bucket.params:
        return
    if _needs_reference(bucket):
        reference.lion(bucket, s)
        return
    _, lion_module, chunks = _kernels()
    plan = bucket.plan
    n = len(bucket.params)
    has_master = plan.master is not None
    columns = [bucket.params, bucket.grads,
               list(bucket.masters) if has_master else [None] * n, bucket.exp_avgs]
    dtypes = [plan.param, plan.param, plan.master, plan.exp_avg]
    launch = _Launch(columns, dtypes, written=(0, 2, 3))
    table = launch.table([p.numel() for p in bucket.params], chunks)
    kernel = lion_module.lion_kernel(has_master, bucket.maximize)
    f = np.float32
    kernel(table, *(_format(d) for d in dtypes),
           f(s.beta1), f(s.beta2), f(s.one_minus_beta1), f(s.one_minus_beta2), f(s.lr),
           f(s.decay))
    launch.finish([t for b in (0, 2, 3) for t in columns[b] if t is not None])
