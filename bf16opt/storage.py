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

Stochastic rounding (``encode_stochastic``) takes 16 random bits per element and buffer from
a counter-based hash, never from a stateful generator, so every backend, thread count and
launch shape draws the same bits.  One hash gives two buffers their bits: half the hashing
of one per buffer (figures: docs/performance.md):

* ``fmix32`` is MurmurHash3's 32-bit finaliser; all arithmetic is modulo 2**32.
* buffers pair up into streams: buffer ``b`` (``WEIGHTS``, ``EXP_AVG``, ``EXP_AVG_SQ``,
  ``MAX_EXP_AVG_SQ``: 0-3) draws from stream ``s = b >> 1``.
* ``stream_key(seed, step, tensor_index, s)`` (host, once per tensor, stream and step)::

      k = 0
      for word in (seed & M, (seed >> 32 ^ step >> 32) & M, step & M, tensor_index & M, s):
          k = fmix32((k ^ word) + 0x9E3779B9)

  ``tensor_index`` is the param's identity (``stream_id``): the 32-bit hash of its name
  when the optimizer was given named params, else its position in the optimizer.
* per element ``i`` (the row-major index in the whole, unsharded param: a shard of a
  DTensor or a piece of an offloaded param adds its first element's global index):
  ``r = fmix32(k ^ (i * 0x9E3779B9 mod 2**32))``; the even buffer of the stream takes its
  upper 16 bits, the odd buffer its lower 16 bits, each as the upper half of a 32-bit word
  ``u`` (``buffer_bits``): ``u = r & 0xFFFF0000`` or ``u = (r << 16) mod 2**32``.
* bfloat16: ``bits(x) + (u >> 16)``, then keep the upper 16 bits (rounds the magnitude
  up with probability equal to the dropped fraction).
* float16, ``|x| >= 2**-14``: ``(bits(|x|) + (u >> 19))`` with the low 13 bits cleared,
  then converted exactly; ``|x| < 2**-14`` (float16's subnormal grid of step 2**-24):
  ``y = |x| * 2**24, n = floor(y)``, round up when ``float(u >> 8) < (y - n) * 2**24``
  (16 random bits: the probability is the dropped fraction to within 2**-16).
* inf stays inf and NaN becomes the canonical NaN, as with round to nearest.

Exact float32 master in 16 extra bits (``split_remainder`` / ``join_remainder``): with
M the float32 bits, ``param = (M + 0x8000) >> 16`` (nearest, ties away from zero) and
``remainder = M & 0xFFFF`` read as int16; ``M = ((param - (remainder < 0)) << 16) |
(remainder & 0xFFFF)``.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def decode(x: torch.Tensor) -> torch.Tensor:
    """float32 value of a stored tensor (a new tensor unless ``x`` is float32)."""
    return x if x.dtype == torch.float32 else x.float()


def _bits_as(value_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value_bits.to(_INT_VIEW[dtype]).view(dtype)


def _signed16(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values (int64) as the int16 two's complement values with those bits."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits)


def _with_canonical_nan(x: torch.Tensor, encoded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``encoded`` with every element where ``x`` is NaN replaced by the canonical NaN."""
    nan = torch.isnan(x)
    if bool(nan.any()):
        canonical = torch.tensor(CANONICAL_NAN_BITS[dtype], dtype=torch.int64)
        encoded = torch.where(nan, _bits_as(canonical, dtype), encoded)
    return encoded


def _bf16_round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1
    return _bits_as(_signed16(((bits + 0x7FFF + lsb) >> 16) & 0xFFFF), torch.bfloat16)


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
    return _with_canonical_nan(x, encoded, dtype)


# ---------------------------------------------------------------- stochastic rounding
MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
# Buffer numbers: buffer b rounds with one half of stream b >> 1's bits (see the module doc).
WEIGHTS, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ = 0, 1, 2, 3
STREAMS = 2  # random streams per tensor and step


def stream_of(buffer: int) -> int:
    """The random stream whose hash gives ``buffer`` its bits."""
    return buffer >> 1


def fmix32_int(h: int) -> int:
    """MurmurHash3 fmix32 on a Python int (host side)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=1 << 16)  # asked for every named param at every step
def name_id(name: str) -> int:
    """A param name's 32-bit stream identity: the first 4 bytes of its UTF-8 BLAKE2b-32
    digest, little-endian (deterministic across processes, unlike Python's salted hash)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest(), "little")


def stream_id(position: int, name=None) -> int:
    """What names a param's random streams (``stream_key``'s ``tensor_index``): its name's
    hash when it has one, else its position in the optimizer."""
    return position if name is None else name_id(name)


def stream_key(seed: int, step: int, tensor_index: int, stream: int) -> int:
    """32-bit key of one (seed, step, tensor, stream) random stream."""
    key = 0
    # the step's high word shares a slot with the seed's: for steps below 2**32 (every
    # practical run) the key is as it always was, and no two steps of one run share a key
    for word in (seed & MASK32, ((seed >> 32) ^ (step >> 32)) & MASK32, step & MASK32, tensor_index & MASK32,
                 stream):
        key = fmix32_int(((key ^ word) + GOLDEN) & MASK32)
    return key


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    return ((a & 0xFFFF) * c + ((((a >> 16) * c) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(key: int, shape, device=None, offset: int = 0) -> torch.Tensor:
    """uint32 values (in int64) of the stream ``key`` for a tensor of ``shape``, row-major;
    ``offset``: the row-major index of its first element in the whole tensor."""
    index = torch.arange(offset, offset + math.prod(shape), dtype=torch.int64, device=device).reshape(shape)
    return _fmix32(_mul32(index, GOLDEN) ^ key)


def buffer_bits(random: torch.Tensor, buffer: int) -> torch.Tensor:
    """The random word (uint32 values in int64) ``buffer`` rounds with, from its stream's
    ``random_bits``: the even buffer's half of the bits (the upper) or the odd buffer's (the
    lower), as the upper 16 bits of the word, the lower 16 zero."""
    return random & 0xFFFF0000 if buffer % 2 == 0 else (random << 16) & MASK32


def _as_uint32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & MASK32


def _from_uint32(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 0x80000000, bits - 0x100000000, bits)
    return signed.to(torch.int32).view(torch.float32)


def encode_stochastic(x: torch.Tensor, dtype: torch.dtype, random: torch.Tensor) -> torch.Tensor:
    """Stochastically rounded encoding of float32 ``x`` with the random words ``random`` (uint32
    values in int64, ``buffer_bits``' or any 32 random bits; see the module doc); float32 is
    exact."""
    if dtype == torch.float32:
        return encode(x, dtype)
    bits = _as_uint32(x)
    if dtype == torch.bfloat16:
        encoded = _bits_as(_signed16(((bits + (random >> 16)) >> 16) & 0xFFFF), torch.bfloat16)
        finite = ~torch.isinf(x)  # inf + random bits would turn into NaN patterns
        encoded = torch.where(finite, encoded, x.to(torch.bfloat16))
    elif dtype == torch.float16:
        magnitude = bits & 0x7FFFFFFF
        normal = _from_uint32((magnitude + (random >> 19)) & ~0x1FFF & MASK32)
        scaled = torch.abs(x) * 2.0 ** 24
        floor = torch.floor(scaled)
        up = (random >> 8).to(torch.float32) < (scaled - floor) * 2.0 ** 24
        subnormal = (floor + up.to(torch.float32)) * 2.0 ** -24
        value = torch.where(magnitude >= 0x38800000, normal, subnormal)
        value = torch.where(torch.isinf(x), torch.abs(x), value)
        encoded = torch.where(bits >= 0x80000000, -value, value).to(torch.float16)
    else:
        raise TypeError(f"cannot encode into {dtype}")
    return _with_canonical_nan(x, encoded, dtype)


# ---------------------------------------------------------------- exact fp32 master in bf16 + int16
def split_remainder(master: torch.Tensor) -> tuple:
    """(bfloat16 param, int16 remainder) holding the float32 ``master`` exactly (NaN canonical)."""
    bits = _as_uint32(encode(master, torch.float32))
    upper = ((bits + 0x8000) >> 16) & 0xFFFF
    lower = bits & 0xFFFF
    param = _bits_as(_signed16(upper), torch.bfloat16)
    remainder = _signed16(lower).to(torch.int16)
    return param, remainder


def join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master held by a bfloat16 param and its int16 remainder."""
    upper = (param.view(torch.int16).to(torch.int64) & 0xFFFF) - (remainder < 0).to(torch.int64)
    bits = ((upper & 0xFFFF) << 16) | (remainder.to(torch.int64) & 0xFFFF)
    return _from_uint32(bits)
