"""Storage formats, reference version: decode to float32, encode from float32.

This is the specification of how values are stored.  The Numba helpers
(``cpu_src/storage.py``) and the CUDA helpers (``cuda_src/storage.cuh``) implement the
same functions and must produce the same bits.

* decode: bfloat16/float16 -> float32 is exact; float32 is taken as is.
* encode to bfloat16: round to nearest, ties to even, done on the integer bits so it
  does not depend on torch's conversion path (torch's vectorised cast turns NaN into
  0xFFFF, its scalar cast into 0x7FC0, and AVX512-BF16 flushes subnormals).
  Overflow rounds to +-inf like IEEE.
* encode to float16: IEEE round to nearest, ties to even (subnormals kept).
* NaN is stored as the canonical quiet NaN of each format (float32 0x7FC00000,
  bfloat16 0x7FC0, float16 0x7E00) whatever its sign or payload, so NaN propagation
  differences between CPUs and GPUs never show in stored bits.
"""

from __future__ import annotations

import torch

CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def decode(x: torch.Tensor) -> torch.Tensor:
    """float32 value of a stored tensor (a new tensor unless ``x`` is float32)."""
    return x if x.dtype == torch.float32 else x.float()


def _bits_as(value_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value_bits.to(_INT_VIEW[dtype]).view(dtype)


def _bf16_round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1
    upper = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
    upper = torch.where(upper >= 0x8000, upper - 0x10000, upper)  # two's complement int16
    return _bits_as(upper, torch.bfloat16)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Encode a float32 tensor into ``dtype`` storage (see module doc); returns a new tensor."""
    if x.dtype != torch.float32:
        raise TypeError(f"encode expects float32 input, got {x.dtype}")
    if dtype == torch.float32:
        encoded = x.clone()
    elif dtype == torch.bfloat16:
        encoded = _bf16_round_nearest_even(x)
    elif dtype == torch.float16:
        encoded = x.to(torch.float16)  # IEEE RNE on every torch CPU path
    else:
        raise TypeError(f"cannot encode into {dtype}")
    nan = torch.isnan(x)
    if bool(nan.any()):
        canonical = torch.tensor(CANONICAL_NAN_BITS[dtype], dtype=torch.int64)
        encoded = torch.where(nan, _bits_as(canonical, dtype), encoded)
    return encoded


def store(target: torch.Tensor, value_f32: torch.Tensor) -> None:
    """Write ``encode(value_f32, target.dtype)`` into ``target`` in place."""
    target.copy_(encode(value_f32, target.dtype))
