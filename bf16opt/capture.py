"""``capturable=True``: a step that a CUDA graph can record and replay (``torch.cuda.graph``).

A replayed graph runs no host code, so whatever changes from one step to the next is read on
the device when the kernels run (cuda_src/multi_tensor.cuh, ``LiveStep``):

* each param's step counter: ``state['step']``, a float64 tensor on the param's device,
  advanced by a captured add before the kernels;
* the learning rate: a tensor on the device (which an LR scheduler fills in place), or a
  number fixed at capture, as in torch;
* Adam's bias corrections, from a table the host fills once per (device, betas) with the
  eager step's own float64 math (a device ``pow`` is not the host's).

The kernels compute each scalar as ``adam_scalars`` & co. do, one IEEE rounding per float64
operation and one rounding to float32, so a live step has the bits of the eager step.

While a graph is captured nothing may read the device from the host or copy to it
synchronously.  What would is refused with a clear error before anything changes: a group
without ``capturable=True``, a param's first step or a state conversion (they make tensors:
run warm-up steps eagerly first, as torch's CUDA-graph recipe does).  GradScaler's scale and
inf flag are read by the kernels too (bf16opt/amp.py ``captured_amp``): a flagged step skips
its updates and leaves its counters, as an eager one does.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import torch

from .backends.base import LiveInputs, f32
from .tensors import capturing

#: what capturable=True cannot be combined with (key, why)
UNSUPPORTED = (
    ("offload", "offloaded state is updated on the host"),
    ("update_in_backward", "updates run from autograd hooks"),
    ("track_precision", "telemetry counts are read on the host"),
    ("max_grad_norm_per_param", "per-param clipping is not captured"),
)

#: the most rows a bias-correction table may have (16 bytes each)
MAX_BIAS_ROWS = 1 << 21


def check_group(group: dict) -> None:
    """A capturable group's settings that can never work (ValueError naming both)."""
    if not group.get("capturable"):
        return
    for key, why in UNSUPPORTED:
        value = group.get(key)
        if value not in (None, False):
            raise ValueError(f"capturable=True cannot be combined with {key}={value!r}: {why}")


def check_backend(backend, number: int) -> None:
    """Only the CuPy kernels read a live step."""
    if not getattr(backend, "live", False):
        raise ValueError(f"param group {number}: capturable=True needs the CuPy kernels (params on a CUDA "
                         f"device, CuPy installed, backend 'cupy' or 'auto'); here it would run on "
                         f"backend {backend.name!r}")


def refuse_while_capturing(number: int, what: str) -> None:
    raise RuntimeError(f"param group {number}: {what} cannot be captured in a CUDA graph; run warm-up "
                       f"steps eagerly before capturing (as torch's CUDA-graph recipe does)")


def check_optimizer(optimizer) -> None:
    """The checks of a step while a graph is captured (RuntimeError; nothing changed yet)."""
    for number, group in enumerate(optimizer.param_groups):
        if not group.get("capturable"):
            raise RuntimeError(f"Attempting CUDA graph capture of step() for an instance of "
                               f"{type(optimizer).__name__} but param group {number} has capturable=False")


def advance_counters(counters: list, found_inf: Optional[torch.Tensor] = None) -> None:
    """Add one to every step counter; with GradScaler's inf flag of a captured step (on the
    counters' device), one where the flag is zero and none where it is not."""
    if found_inf is None:
        torch._foreach_add_(counters, 1)
    else:
        torch._foreach_add_(counters, torch.eq(found_inf.reshape(()), 0).to(torch.float64))


def placeholder_lr(group: dict) -> dict:
    """``group`` for the host scalars of a live step: a tensor lr (read by the kernels, not here)
    replaced by 1.0, so the host reads nothing from the device."""
    return {**group, "lr": 1.0} if isinstance(group["lr"], torch.Tensor) else group


def live_inputs(optimizer, group: dict, number: int, device: torch.device, amp=None) -> LiveInputs:
    """What the kernels of ``group``'s live steps on ``device`` read (ValueError on betas or a
    weight decay it cannot read on the host; the backend checks what it reads itself, a tensor
    lr's form included: ``cupy.check_live``); ``amp``: GradScaler's tensors of a captured step
    (``amp.captured_amp``), or None."""
    lr = group["lr"]
    lr_tensor, lr_value = (lr, 0.0) if isinstance(lr, torch.Tensor) else (None, float(lr))
    for name, value in (("weight_decay", group.get("weight_decay")), *(
            (f"betas[{i}]", beta) for i, beta in enumerate(group.get("betas", ())))):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(f"param group {number}: with capturable=True, {name} is read on the host (Adam's "
                             f"bias corrections are a host table): give a number or a CPU tensor, got a tensor "
                             f"on {value.device}")
    decay_rate, betas = optimizer._live_rates(group)
    bias = None if betas is None else bias_table(betas, device, number)
    if amp is None:
        return LiveInputs(lr_tensor, lr_value, decay_rate, bias)
    return LiveInputs(lr_tensor, lr_value, decay_rate, bias, amp.grad_scale, amp.found_inf)


_device_tables: dict = {}  # (device, beta1, beta2) -> float64 (rows, 2) tensor


def bias_table(betas: tuple, device: torch.device, number: int) -> torch.Tensor:
    """Adam's bias corrections by step on ``device``: row k is (1 - beta1**k,
    float32(1 / sqrt(1 - beta2**k))); the last row holds for every later step."""
    key = (device, float(betas[0]), float(betas[1]))
    table = _device_tables.get(key)
    if table is None:
        if capturing():
            refuse_while_capturing(number, "a step with new betas")
        table = _device_tables[key] = torch.from_numpy(bias_rows(key[1], key[2])).to(device)
    return table


@functools.lru_cache(maxsize=16)
def bias_rows(beta1: float, beta2: float) -> np.ndarray:
    """The host rows of :func:`bias_table`, by adam_scalars' own float64 expressions, until
    beta**k is below 2**-60 for both betas: from there on 1 - beta**k is 1.0 for every k
    (pow's error is far below the margin to 2**-54)."""
    rows = [(1.0, 1.0)]  # (no step 0 is ever run)
    k = 1
    while True:
        rows.append((1.0 - beta1 ** k, f32(1.0 / math.sqrt(1.0 - beta2 ** k))))
        if beta1 ** k < 2.0 ** -60 and beta2 ** k < 2.0 ** -60:
            break
        k += 1
        if k >= MAX_BIAS_ROWS:
            raise ValueError(f"capturable=True with betas ({beta1}, {beta2}): the bias corrections keep "
                             f"changing past step {MAX_BIAS_ROWS}, more than a device table holds; "
                             f"use capturable=False")
    return np.array(rows, dtype=np.float64)

