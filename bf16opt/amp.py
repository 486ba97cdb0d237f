"""torch.amp.GradScaler's protocol for optimizers that unscale inside their kernels.

``MixedPrecisionOptimizer._step_supports_amp_scaling`` tells GradScaler to hand the step the
loss scale and the inf check (attributes ``grad_scale`` and ``found_inf``) rather than
unscaling the grads itself: the kernels fold the unscale into their one pass, and a step
with infs changes nothing.  A step called by hand may pass the same as keywords.

A step captured in a CUDA graph (capturable=True) cannot read them on the host: its kernels
read them on the device when the graph runs (:func:`captured_amp`, bf16opt/capture.py).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from .backends import f32
from .checks import check_amp_tensor

__all__ = ["CapturedAmp", "amp_arguments", "captured_amp"]


def _given(optimizer, grad_scale, found_inf) -> dict:
    """name -> tensor of GradScaler's arguments: from the step's keywords or the attributes
    torch.amp.GradScaler.step sets, each checked (not read)."""
    devices = None
    given = {}
    for name, keyword in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        attribute = getattr(optimizer, name, None)
        if keyword is not None and attribute is not None:
            raise ValueError(f"{name} was given to step() and set as an attribute (by "
                             f"torch.amp.GradScaler.step); give it one way")
        value = keyword if keyword is not None else attribute
        if value is None:
            continue
        if name == "found_inf" and isinstance(value, numbers.Real) and not isinstance(value, bool):
            # GradScaler's sum over the devices of no grads (no param has one): the int 0
            value = torch.tensor(float(value))
        if devices is None:
            devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        check_amp_tensor(value, name, devices)
        given[name] = value
    return given


def amp_arguments(optimizer, grad_scale, found_inf) -> tuple:
    """(inv_grad_scale, skip) of a step: from its keywords, or from the attributes
    torch.amp.GradScaler.step sets (``grad_scale``: the loss scale, None once the user
    called ``unscale_``; ``found_inf``: non-zero when a grad had an inf or NaN).  Both are
    checked before anything changes; reading them is a host sync."""
    values = {name: float(value.item()) for name, value in _given(optimizer, grad_scale, found_inf).items()}
    inv_grad_scale = 1.0
    if "grad_scale" in values:
        scale = values["grad_scale"]
        # float32 of the float64 reciprocal: GradScaler.unscale_'s inv_scale, so folding the
        # unscale gives the bits of unscale_ followed by a step, whatever the scale
        # (reciprocals from 2**128 - 2**103 on round to float32 infinity)
        if not (math.isfinite(scale) and scale > 0 and 1.0 / scale < 2.0 ** 128 - 2.0 ** 103):
            raise ValueError(f"grad_scale is {scale!r}; it must be a positive float32 whose "
                             f"reciprocal is a finite float32 (about 2**-128 or more)")
        inv_grad_scale = f32(1.0 / scale)
    return inv_grad_scale, values.get("found_inf", 0.0) != 0.0


class CapturedAmp(NamedTuple):
    """GradScaler's tensors of a step captured in a CUDA graph, read by its kernels."""

    grad_scale: Optional[torch.Tensor]  # the loss scale (None once unscale_ was called)
    found_inf: Optional[torch.Tensor]   # non-zero: the step changes nothing


def captured_amp(optimizer, grad_scale, found_inf) -> Optional[CapturedAmp]:
    """GradScaler's tensors for a captured step (None without GradScaler), checked but not
    read: they must be on the device of every param (RuntimeError), where the kernels read them.
    Their values are not checked: GradScaler keeps the scale a positive float32."""
    given = _given(optimizer, grad_scale, found_inf)
    if not given:
        return None
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    for name, value in given.items():
        if devices != {value.device}:
            raise RuntimeError(f"a captured step reads {name} on the device of its params; it is on "
                               f"{value.device}, the params on {', '.join(sorted(map(str, devices)))}")
    return CapturedAmp(given.get("grad_scale"), given.get("found_inf"))
