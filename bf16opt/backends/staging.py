"""Staging a bucket for a kernel: each role's memory, its address, and how long it must live.

Both kernel backends (Numba and CuPy) address tensors by raw pointers in a chunk table,
so every array of one element must sit at the element's row-major index -- or, when the
result does not depend on the index, at the same position in one common memory layout.
:func:`stage` decides per param:

* **contiguous** buffers are used as they are;
* buffers that all share one gap-free layout (``channels_last`` conv weights, whose
  states ``preserve_format`` keeps in the same layout) are walked in memory order in
  place -- unless stochastic rounding is on, whose random bits hash the row-major index;
* anything else is staged through a contiguous copy, and so is a negative view (``is_neg()``:
  its memory holds the values negated); copies of written roles are copied back by
  :meth:`Staged.finish`.

Lifetime rule: the table points into the staged copies, read-only ones (grads) included,
so a :class:`Staged` must stay referenced until the kernel has been launched (on a CUDA
stream, work queued later on the same stream is ordered after it, so the caching
allocator may reuse the memory only then).  It is also where the checks live that make a
raw-pointer launch safe: every present role has the configuration's dtype, the param's
element count and the param's device.
"""

from __future__ import annotations

import numpy as np
import torch

from ..distributed import check_known_tensor, is_dtensor
from ..storage import Q8, q8_shape
from ..tensors import check_writable
from .base import Bucket

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the common case, checked in one C call

__all__ = ["Staged", "check", "same_dense_layout", "stage"]


def state_shape(param: torch.Tensor, dtype: torch.dtype) -> tuple:
    """The shape of a state buffer of ``dtype`` for ``param``: the param's, or a q8 tensor's."""
    return q8_shape(param.numel()) if dtype == Q8 else param.shape


def same_dense_layout(buffers: list) -> bool:
    """True when the tensors each fill one gap-free block of memory and map every index to
    the same position in it (equal strides over the dims longer than 1)."""
    layout = [(size, stride) for size, stride in zip(buffers[0].shape, buffers[0].stride()) if size > 1]
    expected = 1
    for size, stride in sorted(layout, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return all([(n, st) for n, st in zip(b.shape, b.stride()) if n > 1] == layout for b in buffers[1:])


class Staged:
    """A bucket's arrays as a kernel addresses them.

    ``pointers``: int64 (params, roles), 0 for absent roles; ``numels``: elements per
    param; ``tensors[k][i]``: what role k of param i is read from (the original or its
    staged copy), kept alive with this object.
    """

    def __init__(self, bucket: Bucket, tensors: list, pointers: np.ndarray, numels: list, write_back: list):
        self.bucket = bucket
        self.tensors = tensors
        self.pointers = pointers
        self.numels = numels
        self.write_back = write_back

    def finish(self) -> None:
        """Copy staged results back and tell autograd the written tensors changed (the
        kernels wrote through raw pointers)."""
        for original, copy in self.write_back:
            original.copy_(copy)
        written = self.bucket.written()
        if written:
            torch.autograd.graph.increment_version(written)


def _check(role, tensor, dtype, param, i: int, backend: str, name: str = None) -> None:
    """The detailed check of one tensor; ``i`` is the param's index in the optimizer and
    ``name`` the state key of the role (``master``, ``exp_avg``...)."""
    name = name or role.name
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{backend} backend: {name} of param {i} must be a tensor, got {type(tensor).__name__}")
    if tensor is not None:
        if is_dtensor(tensor):  # the optimizer passes local shards; a DTensor has no memory of its own
            raise TypeError(f"{backend} backend: {name} of param {i} is a DTensor; the kernels update "
                            f"its local shard (tensor.to_local())")
        check_known_tensor(tensor, f"{backend} backend: {name} of param {i}")
    if tensor is None:
        raise ValueError(f"{backend} backend: {name} of param {i} is missing; the "
                         f"configuration needs a {dtype} tensor")
    shape = state_shape(param, dtype) if role.storage not in ("param", "companion") else param.shape
    if tensor.dtype != dtype or tensor.shape != shape or tensor.device != param.device:
        raise ValueError(f"{backend} backend: {name} of param {i} is {tensor.dtype} of shape "
                         f"{tuple(tensor.shape)} on {tensor.device}; the configuration needs "
                         f"{dtype} of shape {tuple(shape)} on {param.device}")
    try:
        address = tensor.data_ptr()
    except RuntimeError:  # a tensor without storage
        address = 0
    if tensor.numel() and not address:
        raise TypeError(f"{backend} backend: {name} of param {i} has no data pointer "
                        f"({type(tensor).__name__}); the kernels address plain dense tensors")
    if role.written and role.storage != "param":  # (the param has its own check: step_plan._entries)
        check_writable(tensor, f"{backend} backend: {name} of param {i}")


def check(bucket: Bucket, backend: str) -> None:
    """Raise ValueError unless every present role of every param has the configuration's
    dtype and the param's shape and device, and absent roles are absent: what makes a
    raw-pointer launch safe.  Changes nothing (the step's check phase calls it)."""
    config = bucket.config
    roles = config.algorithm.roles
    for k, role in enumerate(roles):
        if config.dtypes[k] is None and any(t is not None for t in bucket.tensors[k]):
            raise ValueError(f"{backend} backend: {role.name} is not part of this configuration")
    for k, role, dtype, key in config.present():
        for i, (tensor, param) in enumerate(zip(bucket.tensors[k], bucket.tensors[0])):
            # the common case in a few C calls; anything else gets the detailed check
            if type(tensor) not in _PLAIN or tensor.dtype != dtype or (
                    tensor.shape != param.shape if dtype != Q8 else tensor.shape != q8_shape(param.numel())) \
                    or tensor.get_device() != param.get_device() or not tensor.data_ptr() \
                    or k and role.written and (tensor.is_inference() or not tensor.is_contiguous()):
                number = bucket.indices[i] if len(bucket.indices) == len(bucket.tensors[0]) else i
                _check(role, tensor, dtype, param, number, backend, key)


def stage(bucket: Bucket, backend: str, checked: bool = False) -> Staged:
    """Lay out every array of ``bucket`` for one kernel launch (see module doc); ``checked``:
    :func:`check` has passed already and nothing changed since."""
    if not checked:
        check(bucket, backend)
    config = bucket.config
    present = config.present()
    roles = config.algorithm.roles
    n = len(bucket.params)
    any_memory_order = not config.stochastic and not config.quantized  # (q8 blocks are row-major)
    tensors = [list(column) for column in bucket.tensors]
    rows, write_back, numels = [], [], []
    for i in range(n):
        param = bucket.tensors[0][i]
        row = [0] * len(roles)
        in_place = None  # decided at the first non-contiguous buffer (rare: checked lazily)
        for k, role, dtype, _ in present:
            tensor = bucket.tensors[k][i]
            # a negative view's memory holds its values negated (resolve_neg keeps the layout)
            copy = tensor.resolve_neg() if tensor.is_neg() else tensor
            if not copy.is_contiguous():
                if in_place is None:
                    in_place = any_memory_order and same_dense_layout(
                        [bucket.tensors[j][i] for j, *_ in present])
                if not in_place:
                    copy = copy.contiguous()
            if copy is not tensor:
                if role.written:
                    write_back.append((tensor, copy))
                tensor = tensors[k][i] = copy
            row[k] = tensor.data_ptr()
        rows.append(row)
        numels.append(param.numel())
    pointers = np.array(rows, dtype=np.int64).reshape(n, len(roles))
    return Staged(bucket, tensors, pointers, numels, write_back)
