"""What every backend receives: buckets of tensors and per-step float32 scalars.

The optimizer groups the params of one param group by (device, StoragePlan, step);
one bucket is one call into a backend, so a kernel backend can update all tensors of a
bucket in a single launch.  Scalars are computed once on the host in float64 and
rounded to float32 once (``f32``); every backend gets the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol

import numpy as np
import torch

from ..precision import StoragePlan


def f32(value: float) -> float:
    """Round a host scalar to float32 once (returned as an exactly representable float)."""
    return float(np.float32(value))


def same_dense_layout(buffers: list[torch.Tensor]) -> bool:
    """True when the tensors each fill one gap-free block of memory and map every index to
    the same position in it (equal strides over the dims longer than 1).

    The buffers of one param (param, grad, master, moments...) laid out like this can be
    updated in memory order in place -- e.g. ``channels_last`` conv weights, whose states
    ``preserve_format`` keeps in the same layout -- as long as the update does not depend on
    the element's logical index (stochastic rounding does)."""
    layout = [(size, stride) for size, stride in zip(buffers[0].shape, buffers[0].stride()) if size > 1]
    expected = 1
    for size, stride in sorted(layout, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return all([(n, st) for n, st in zip(b.shape, b.stride()) if n > 1] == layout for b in buffers[1:])


class AdamScalars(NamedTuple):
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    step_size: float                  # lr / (1 - beta1**step)
    inv_sqrt_bias_correction2: float  # 1 / sqrt(1 - beta2**step)
    eps: float
    weight_decay: float               # L2 coefficient (Adam); 0.0 when decay is decoupled
    decay: float                      # 1 - lr * weight_decay (AdamW); 1.0 for Adam


class LionScalars(NamedTuple):
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    lr: float
    decay: float                      # 1 - lr * weight_decay


@dataclass
class Bucket:
    """Tensors of one (device, plan, step) set; list entries line up by param."""

    plan: StoragePlan
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    masters: list[Optional[torch.Tensor]] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)       # Adam only
    max_exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)   # amsgrad only
    compensations: list[Optional[torch.Tensor]] = field(default_factory=list)  # Kahan buffers
    remainders: list[Optional[torch.Tensor]] = field(default_factory=list)     # int16 remainders
    indices: list[int] = field(default_factory=list)  # each param's index in the optimizer
    maximize: bool = False
    amsgrad: bool = False
    l2: bool = False  # Adam: add weight_decay * param to the gradient
    seed: int = 0     # stochastic rounding: stream_key(seed, step, index, buffer)
    step: int = 0
    # Telemetry: when set, the backend writes per param [swallowed updates,
    # exp_avg underflows, exp_avg_sq underflows] into this int64 (len(params), 3) tensor.
    counts: Optional[torch.Tensor] = None


class Backend(Protocol):
    name: str

    def supports(self, plan: StoragePlan) -> bool: ...

    def adam(self, bucket: Bucket, scalars: AdamScalars) -> None: ...

    def lion(self, bucket: Bucket, scalars: LionScalars) -> None: ...
