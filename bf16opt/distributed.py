"""DTensor params (FSDP2's ``fully_shard``, tensor parallel): the update runs on each rank's shard.

A DTensor has no memory of its own (``data_ptr()`` is 0) and bit operations on a whole
DTensor go through its sharding propagation, so neither the kernels nor the reference
backend may see one.  The optimizer therefore:

* updates ``param.to_local()`` with ``grad.to_local()`` (a view: the kernels write the
  rank's shard in place);
* keeps every state buffer a DTensor sharded like its param (``zeros_like(param)``, as
  torch.optim does), so ``state_dict()`` and ``torch.distributed.checkpoint`` see what
  they see with torch.optim; the backends get the buffers' local tensors;
* names an element's stochastic-rounding stream by its **global** row-major index: the
  shard's first element's index in the whole param is the bucket offset
  (:func:`global_offset`).  So N ranks draw the bits one process draws.  This needs the
  shard to be one contiguous range of the param's elements (``Shard(0)``, as FSDP2 shards,
  or ``Replicate``); other placements are refused for stochastic rounding only.

Anything else the kernels cannot address -- a tensor subclass bf16opt does not know (it
may override every op, or hold no memory) -- is refused with a TypeError by name.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch

__all__ = ["check_known_tensor", "dtensor_type", "global_offset", "is_dtensor", "local", "local_box", "shard_of", "wrap_like"]


_DTENSOR: Optional[type] = None


def dtensor_type() -> Optional[type]:
    """DTensor's class once torch.distributed.tensor is imported, else None: no DTensor exists
    before that, so bf16opt never imports it itself, and a step without DTensors can skip
    every per-param DTensor test."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None)
    return _DTENSOR


# torch.Tensor's own protocol slots: a subclass that keeps both changes no op
_PLAIN_FUNCTION = (torch.Tensor.__torch_function__, torch._C._disabled_torch_function_impl)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def is_dtensor(tensor) -> bool:
    kind = dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def local(tensor):
    """A DTensor's local shard (the same memory, not a copy); anything else as it is."""
    if not is_dtensor(tensor):
        return tensor
    if not torch.is_grad_enabled():  # (a step) to_local is then the local tensor itself
        return tensor.to_local()
    with torch.no_grad():  # to_local is differentiable
        return tensor.to_local()


def check_known_tensor(tensor, what: str) -> None:
    """TypeError unless ``tensor`` is a plain tensor, a Parameter or a DTensor (or a subclass
    that overrides no op): any other subclass may hold no memory or change what ops do."""
    kind = type(tensor)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common case first
        return
    if is_dtensor(tensor):
        inner = local(tensor)
        if type(inner) is not torch.Tensor and not _plain_subclass(type(inner)):
            raise TypeError(f"{what} is a DTensor whose local tensor is a {type(inner).__name__}; "
                            f"the kernels address plain dense local tensors")
        if any(placement.is_partial() for placement in tensor.placements):
            raise TypeError(f"{what} is a DTensor with a Partial placement {tensor.placements}: its "
                            f"local tensor is not the value to update (reduce it first)")
        if tensor.is_complex():
            raise TypeError(f"{what} is a complex DTensor; bf16opt updates complex params as real "
                            f"views of plain tensors only")
        return
    if kind is torch.Tensor or kind is torch.nn.Parameter or _plain_subclass(kind):
        return
    raise TypeError(f"{what} is a {kind.__name__}, a tensor subclass bf16opt does not know (it "
                    f"overrides torch's ops, and may hold no memory the kernels could address); "
                    f"pass plain tensors, Parameters or DTensors")


def _plain_subclass(kind: type) -> bool:
    return kind.__torch_function__ in _PLAIN_FUNCTION and kind.__torch_dispatch__ is _PLAIN_DISPATCH


def wrap_like(tensor: torch.Tensor, param) -> torch.Tensor:
    """``tensor`` (a local shard shaped like ``param``'s) as a DTensor sharded like ``param``;
    ``tensor`` itself when ``param`` is no DTensor."""
    if not is_dtensor(param) or is_dtensor(tensor):
        return tensor
    return dtensor_type().from_local(tensor, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def local_box(param) -> tuple:
    """(local shape, global offset per dim) of this rank's shard of ``param``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local(param).shape):  # a placement the helper does not describe
        raise ValueError(f"cannot locate the local shard {tuple(local(param).shape)} of a DTensor of "
                         f"shape {tuple(param.shape)} placed {param.placements}")
    return tuple(shape), tuple(offset)


def global_offset(param, what: str) -> int:
    """Row-major index, in the whole param, of the first element of this rank's shard (0 for
    plain tensors).  Stochastic rounding hashes global indices, so the shard must be one
    contiguous range of the param's elements; ValueError naming ``what`` otherwise."""
    if not is_dtensor(param):
        return 0
    shape, offset = local_box(param)
    full = tuple(param.shape)
    if math.prod(shape) == 0:
        return 0
    # contiguous in row-major order: after the first dim that is cut, every dim is whole,
    # and before it every dim has length 1
    cut = [d for d in range(len(full)) if shape[d] != full[d]]
    if cut and any(shape[d] != 1 for d in range(cut[0])) or any(shape[d] != full[d] for d in cut[1:]):
        raise ValueError(f"{what} is a DTensor placed {param.placements} whose local shard {shape} is "
                         f"not one contiguous range of the param's {full} elements; stochastic "
                         f"rounding numbers elements globally and needs Shard(0)-style shards "
                         f"(as FSDP2 makes) or Replicate; use rounding='nearest' for this param")
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    return sum(o * s for o, s in zip(offset, strides))


def shard_of(value: torch.Tensor, param, what: str) -> torch.Tensor:
    """A saved state tensor as this rank's shard of DTensor ``param``: a DTensor placed like
    it gives its local tensor; a plain tensor of the param's whole shape (a full, unsharded
    state dict) gives the slice this rank holds."""
    if is_dtensor(value):
        if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
            raise ValueError(f"{what} is a DTensor placed {value.placements} on {value.device_mesh}; the "
                             f"param is placed {param.placements} on {param.device_mesh}")
        return local(value)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
        return value  # convert_state names what is wrong with it
    shape, offset = local_box(param)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
