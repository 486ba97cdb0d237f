"""Per-update grad clipping: ``max_grad_norm_per_param`` per param group.

Each param's grad is scaled to at most this L2 norm, on its own, as its update reads it:

    coef = min(1, max_norm / (float32 L2 norm of the grad + 1e-6));  grad = grad * coef

(one multiplication rounded to the grad's dtype, on the grad's device, as
``torch.nn.utils.clip_grad_norm_`` scales; in place, so a step leaves the clipped grad in
``.grad``, as that function does; an offloaded step scales its host copy and the device
grad).  It needs nothing but the param's own grad, so an update in backward (``release.py``)
clips exactly as a normal step does: the one clipping that update in backward supports
(``clip_grad_norm_`` over the whole model after backward finds no grads there).  Why per
update and not a speculative global clip: docs/performance.md, "Update in backward".
"""

from __future__ import annotations

import torch

from .checks import check_number
from .distributed import is_dtensor

__all__ = ["KEY", "check_max_norm", "check_whole_params", "coefficient", "refuse_dtensor"]

KEY = "max_grad_norm_per_param"
_EPS = 1e-6  # (torch.nn.utils.clip_grad_norm_'s)


def check_max_norm(value) -> None:
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{KEY} must be None or a float, got a tensor")
    if check_number(value, KEY, KEY) <= 0.0:
        raise ValueError(f"{KEY} must be None or a finite number > 0, got {value!r}")


def refuse_dtensor(param_name: str) -> ValueError:
    return ValueError(f"{KEY} clips each param by its own norm; {param_name} is a DTensor, whose shard's "
                      f"norm is not the param's (clip with torch.nn.utils.clip_grad_norm_ before step())")


def check_whole_params(value, params: list) -> None:
    """Refuse ``max_grad_norm_per_param`` for a group with a DTensor param when the group is
    made: in backward (``update_in_backward``) other params may already be updated when its
    hook would find out."""
    if value is not None and any(map(is_dtensor, params)):
        raise refuse_dtensor("a param of this group")


def coefficient(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The clip factor of ``grad`` (a float32 tensor on its device; no host sync)."""
    norm = torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32)
    return torch.clamp(max_norm / (norm + _EPS), max=1.0)
