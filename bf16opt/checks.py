"""Argument checks shared by the optimizers: TypeError/ValueError naming the argument,
with torch.optim's wording where torch has a message for the same input."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from .precision import PARAM_DTYPES

def check_number(value, name: str, *, low: float = 0.0, high: Optional[float] = None,
                 high_inclusive: bool = False) -> float:
    """``value`` as a float in [low, high); TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name} must be a real number or a one-element tensor, got a tensor "
                            f"of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    upper_ok = high is None or value < high or (high_inclusive and value == high)
    if math.isnan(value) or value < low or not upper_ok or math.isinf(value):
        bound = "" if high is None else (f", <= {high}" if high_inclusive else f", < {high}")
        raise ValueError(f"Invalid {name}: {value} (expected a finite value >= {low}{bound})")
    return value


def check_betas(betas, count: int = 2) -> tuple:
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise TypeError(f"betas must be a tuple of {count} numbers, got {betas!r}")
    return tuple(check_number(b, f"beta parameter at index {i} (betas[{i}])", high=1.0)
                 for i, b in enumerate(betas))


def check_flag(value, name: str, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if allow_none else ''}, got {value!r}")


def check_implementation_flags(group: dict) -> None:
    """torch's implementation switches: accepted where bf16opt can honour them."""
    check_flag(group.get("foreach"), "foreach", allow_none=True)
    check_flag(group.get("fused"), "fused", allow_none=True)
    if group.get("foreach") and group.get("fused"):
        raise ValueError("`fused` and `foreach` cannot be `True` together.")
    check_flag(group.get("capturable", False), "capturable")
    check_flag(group.get("differentiable", False), "differentiable")
    if group.get("capturable"):
        raise ValueError("capturable=True is not supported: bf16opt computes per-step scalars "
                         "on the host, which CUDA graph capture cannot record")
    if group.get("differentiable"):
        raise ValueError("differentiable=True is not supported: bf16opt's step is not "
                         "differentiable (it writes rounded results in place)")


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")


def default_seed() -> int:
    """Stochastic-rounding seed derived from torch's, so ``torch.manual_seed`` fixes it."""
    return torch.initial_seed() % 2 ** 64


def check_param(param, index: int) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"params[{index}] must be a torch.Tensor, got {type(param).__name__}")
    if param.is_sparse or param.layout != torch.strided:
        raise TypeError(f"params[{index}] has layout {param.layout}; only dense (strided) params "
                        f"are supported")
    if param.dtype not in PARAM_DTYPES:
        raise TypeError(f"params[{index}] has dtype {param.dtype}; bf16opt optimizes float32, "
                        f"bfloat16 and float16 params (complex, integer and float64 params are "
                        f"not supported)")
    if not param.is_leaf:
        raise ValueError(f"params[{index}] is not a leaf tensor; can't optimize a non-leaf Tensor")
