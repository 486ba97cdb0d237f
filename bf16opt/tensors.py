"""Where a param's tensors live and how the kernels see them: real views of complex
params, local shards of DTensors, and state moved between devices.

A leaf module: it imports nothing from bf16opt but ``distributed`` and ``storage`` (leaves
themselves), so the optimizer, the step planner and the state-dict code can all use it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .distributed import is_dtensor, local, wrap_like
from .storage import Q8

__all__ = ["HOST", "layout_name", "read_view", "real_view", "shards", "state_is_on", "state_moved", "wrapped"]

HOST = torch.device("cpu")


def real_view(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A complex tensor as the real tensor of its (re, im) pairs (torch.optim's treatment of
    complex params: the update acts on each part); other tensors as they are.  A conjugate
    view (``is_conj()``) has none: its memory holds the conjugates (see :func:`read_view`)."""
    return torch.view_as_real(tensor) if tensor is not None and tensor.is_complex() else tensor


def read_view(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """:func:`real_view` of a tensor that is only read (a grad): a conjugate view, as autograd
    makes for some complex grads, first resolved into a copy."""
    if tensor is not None and tensor.is_conj():
        tensor = tensor.resolve_conj()
    return real_view(tensor)


def shards(state: Optional[dict]) -> Optional[dict]:
    """A param's state with every DTensor buffer as its local shard (what the backends update)."""
    if not state or not any(is_dtensor(value) for value in state.values()):
        return state
    return {key: local(value) for key, value in state.items()}


def wrapped(state: dict, param) -> dict:
    """Local state buffers of ``param`` as DTensors sharded like it (``step`` stays a plain
    tensor, as in torch.optim); unchanged for plain params."""
    if not is_dtensor(param):
        return state
    # a q8 moment stays the rank's own tensor: its blocks are blocks of the local shard
    # (docs/numerics.md, "Distributed: q8"), not a shard of a tensor shaped like the param
    return {key: value if key == "step" or not isinstance(value, torch.Tensor) or value.dtype == Q8
            else wrap_like(value, param) for key, value in state.items()}


def state_is_on(state: dict, device: torch.device, contiguous: bool) -> bool:
    """True when every state buffer is on ``device`` (the step counter lives on the CPU), and
    contiguous where asked (offloaded state is walked in flat pieces)."""
    return all(value.device == device and (not contiguous or value.is_contiguous())
               for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor))


def state_moved(state: dict, move: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """``state`` with every buffer but the step counter passed through ``move``."""
    return {key: value if key == "step" or not isinstance(value, torch.Tensor) else move(value)
            for key, value in state.items()}


def layout_name(tensor) -> str:
    """How a tensor is laid out across ranks, for messages."""
    return f"a DTensor placed {tuple(tensor.placements)} on {tensor.device_mesh}" if is_dtensor(tensor) \
        else "a plain tensor"


def check_writable(tensor: torch.Tensor, name: str, inference_ok: bool = False) -> None:
    """What makes a dense tensor impossible to write in place, refused before anything changes
    (at construction for params, at each full step for params, grads to clip and state, which a
    ``.data`` assignment or a hand edit may have replaced since).  ``inference_ok``: a param
    whose ``.data`` is an inference tensor, which torch lets the param itself write (not its views)."""
    if tensor.is_inference() and not inference_ok:
        raise ValueError(f"{name} was created under torch.inference_mode() and cannot be updated "
                         f"in place outside it; create it (or clone it) outside inference mode")
    check_not_conjugate(tensor, name)
    if tensor.numel() > 1 and not tensor.is_contiguous() and torch._debug_has_internal_overlap(tensor) == 1:
        raise ValueError(f"{name} has elements that share memory (an expanded, stride-0 view?); "
                         f"an in-place update would write each location several times; pass a "
                         f"materialised tensor (.clone())")


def check_not_negative(param, name: str) -> None:
    """A negative view (``is_neg()``, e.g. ``x.conj().imag``) holds its values negated in
    memory, which the offload pipeline's copies move as they are."""
    if param.is_neg():
        raise ValueError(f"{name} is a negative view (is_neg(): its memory holds its values negated), "
                         f"which bf16opt cannot update there; pass a resolved tensor "
                         f"(param.resolve_neg())")


def check_not_conjugate(param, name: str) -> None:
    """A complex param that is a conjugate view (``is_conj()``) is updated as no real view of
    its memory, which holds the conjugates of its values."""
    if param.is_conj():
        raise ValueError(f"{name} is a conjugate view (is_conj(): its memory holds the conjugates of "
                         f"its values), which bf16opt cannot update in place as (re, im) pairs; pass "
                         f"a resolved tensor (param.resolve_conj())")


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (no CUDA: never)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
