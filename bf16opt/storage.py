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
  ``MAX_EXP_AVG_SQ``: 0-3) draws from stream ``s = b >> 1``; the param's buffer is ``WEIGHTS``,
  a state's is its row of ``bf16opt._cpu.roles.STATE_ROLES`` (as is its q8 map, ``q8_signed``).
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

A float32 master copy (``join_copy``): the param is written as the copy's ``encode`` (round to
nearest even), so a param whose bits are not that encoding was edited between steps, and its
own value is the master: ``w0 = decode(param) if bits(param) != bits(encode(master)) else
master``.

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

# each state's buffer and q8 map: the one table every backend reads (bf16opt._cpu.roles, no numba)
from ._cpu.roles import (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, STREAMS, WEIGHTS,  # noqa: F401
                         q8_signed, stream_of)

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
# The buffer numbers (WEIGHTS, EXP_AVG, ...), STREAMS and stream_of: imported above from
# bf16opt._cpu.roles (buffer b rounds with one half of stream b >> 1's bits, see the module doc).


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


# ---------------------------------------------------------------- float32 master copy
def join_copy(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The float32 master of a 16-bit ``param`` written from the float32 copy ``master``: the
    copy, or the param's own value where the param's bits are not the copy's round to nearest
    even (canonical NaN), i.e. where the param was edited since the last step.  Bits are
    compared, so -0 and +0 differ, and a NaN copy and the canonical NaN param it wrote agree."""
    return torch.where(written_from(param, master), master, decode(param))


def written_from(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Where a 16-bit ``param`` holds the bits a step writes from the float32 copy ``master``
    (its round to nearest even, canonical NaN): the elements not edited since."""
    view = _INT_VIEW[param.dtype]
    return encode(master, param.dtype).view(view) == param.view(view)


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
    """The float32 master held by a bfloat16 param and its int16 remainder; the param alone
    where the two would join into NaN but the param is no NaN (a param edited between steps
    to +-0 or +-inf beside a remainder no split of a master gives)."""
    param_bits = param.view(torch.int16).to(torch.int64) & 0xFFFF
    upper = param_bits - (remainder < 0).to(torch.int64)
    bits = ((upper & 0xFFFF) << 16) | (remainder.to(torch.int64) & 0xFFFF)
    stray = ((bits & 0x7FFFFFFF) > 0x7F800000) & ((param_bits & 0x7FFF) <= 0x7F80)
    return _from_uint32(torch.where(stray, param_bits << 16, bits))


# ---------------------------------------------------------------- q8: 8-bit block-quantized moments
# A q8 moment of a param of n elements is one uint8 tensor of shape (ceil(n / 256), 260): row b
# holds block b (elements 256*b .. 256*b + 255 of the flattened param) as 256 code bytes, then
# the block's float32 scale as 4 little-endian bytes.  Padding codes of the last block stay 0.
Q8 = torch.uint8           # the dtype a StoragePlan names for a q8 moment
Q8_BLOCK = 256             # elements per block
Q8_SCALE_BYTES = 4         # one float32 scale per block
Q8_ROW = Q8_BLOCK + Q8_SCALE_BYTES
Q8_LEVELS = 255            # codes with a map value; the 256th code is non-finite


def q8_shape(numel: int) -> tuple:
    """Shape of the q8 tensor holding ``numel`` elements."""
    return (-(-numel // Q8_BLOCK), Q8_ROW)


def q8_piece(q: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The q8 tensor of elements ``start .. start + count`` of ``q`` (a view; ``start`` on a block)."""
    if start % Q8_BLOCK:
        raise ValueError(f"a piece of a q8 tensor starts on a block of {Q8_BLOCK}, got element {start}")
    return q[start // Q8_BLOCK:(start + count + Q8_BLOCK - 1) // Q8_BLOCK]


def _round_f32(values) -> list:
    """float64 values rounded once to float32 (round to nearest even), as Python floats."""
    import numpy as np  # noqa: PLC0415  (the only numpy use of the spec)
    return [float(v) for v in np.asarray(values, dtype=np.float64).astype(np.float32)]


def _dynamic_magnitudes(decades: int, per_decade_base: int) -> list:
    """Dynamic-tree magnitudes in (0, 1]: decade i (0 <= i < decades) holds
    ``per_decade_base * 2**i`` values ``(0.1 + 0.9 * j / count) / 10**(decades - 1 - i)``,
    j = 1..count (float64, each an exact-rounded quotient)."""
    values = []
    for i in range(decades):
        count = per_decade_base << i
        power = 10 ** (decades - 1 - i)
        values += [(0.1 + 0.9 * j / count) / power for j in range(1, count + 1)]
    return sorted(values)


@functools.lru_cache(maxsize=None)
def q8_map(signed: bool, kind: str = "dynamic") -> tuple:
    """The 255 values (float32, ascending) of the codes with a value, the spec of the map.

    ``signed``: -1..1, symmetric around an exact 0 (the first moments); else 0..1 (second
    moments).  ``kind``: ``"dynamic"`` (dynamic tree: seven decades, finer at the top) or
    ``"companded"`` (uniform steps of a companded value: ``z / (2 - |z|)`` of z = q/127
    for signed maps, ``z**2`` of z = k/254 for unsigned ones).
    """
    if kind == "dynamic":
        if signed:
            positive = _dynamic_magnitudes(7, 1)        # 1 + 2 + ... + 64 = 127 values
            values = [-v for v in reversed(positive)] + [0.0] + positive
        else:
            values = [0.0] + _dynamic_magnitudes(7, 2)  # 254 values and 0
    elif kind == "companded":
        if signed:
            values = [(q / 127) / (2 - abs(q / 127)) for q in range(-127, 128)]
        else:
            values = [(k / 254) * (k / 254) for k in range(255)]
    else:
        raise ValueError(f"q8 map kind must be 'dynamic' or 'companded', got {kind!r}")
    values = _round_f32(values)
    assert len(values) == Q8_LEVELS and values == sorted(values) and values[-1] == 1.0
    return tuple(values)


@functools.lru_cache(maxsize=None)
def q8_boundaries(signed: bool, kind: str = "dynamic") -> tuple:
    """The 255 decision boundaries of round to nearest: ``B[k]`` (k < 254) is the float32
    rounding of the midpoint of the map's values k and k + 1 (exact in float64); ``B[254]``
    is +inf.  The nearest index of ``y`` is the number of boundaries below it: ``#{k: B[k] < y}``."""
    values = q8_map(signed, kind)
    return tuple(_round_f32([(a + b) / 2 for a, b in zip(values, values[1:])])) + (math.inf,)


#: the maps the kernels use (see docs/numerics.md, "q8 moments", for why this one)
Q8_MAP_KIND = "dynamic"


def q8_index_to_code(index: torch.Tensor, signed: bool) -> torch.Tensor:
    """Code byte of map index ``index`` (int64 in 0..254): signed maps store ``index - 127``
    as an int8 (so a zero byte is the value 0), unsigned ones the index itself."""
    return (index - 127) & 0xFF if signed else index


def q8_code_to_index(code: torch.Tensor, signed: bool) -> torch.Tensor:
    """Map index (int64) of code bytes (int64 in 0..255); the non-finite code gives 255."""
    if not signed:
        return code
    return torch.where(code == 0x80, torch.full_like(code, 255), (code + 127) & 0xFF)


def q8_nan_code(signed: bool) -> int:
    """The code byte of a non-finite value: -128 as an int8 in signed maps (it decodes to NaN),
    255 in unsigned ones (+inf: an unsigned moment's non-finite values are +inf, or NaN that
    comes with a NaN first moment)."""
    return 0x80 if signed else 0xFF


def q8_non_finite_value(signed: bool) -> float:
    """What the non-finite code decodes to (:func:`q8_nan_code`)."""
    return math.nan if signed else math.inf


def _q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened into (blocks, 256) rows, the last padded with zeros."""
    flat = x.reshape(-1)
    blocks = q8_shape(flat.numel())[0]
    padded = torch.zeros(blocks * Q8_BLOCK, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    return padded.view(blocks, Q8_BLOCK)


#: the magnitude a non-finite element counts as in its block's scale: the least float32, so a
#: block of zeros and infs gets a scale above 0 and its infs decode as inf, not inf * 0 = NaN
Q8_NON_FINITE_MAGNITUDE = 2.0 ** -149


def q8_scales(x: torch.Tensor) -> torch.Tensor:
    """Each block's scale: the largest magnitude of its finite elements, a non-finite one
    counted as ``Q8_NON_FINITE_MAGNITUDE`` (0 for a block of zeros)."""
    blocks = _q8_blocks(x)
    finite = torch.where(torch.isfinite(blocks), torch.abs(blocks),
                         torch.full_like(blocks, Q8_NON_FINITE_MAGNITUDE))
    return finite.amax(dim=1)


def q8_normalized(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``y = x / scale`` per element ((blocks, 256), float32 division); 0 where the scale is 0."""
    blocks = _q8_blocks(x)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    return torch.where(scales[:, None] > 0, torch.div(blocks, divisor), torch.zeros_like(blocks))


def q8_nearest_index(y: torch.Tensor, signed: bool, kind: str = None) -> torch.Tensor:
    """Round-to-nearest map index of normalized values: ``#{k: B[k] < y}`` (a tie goes down)."""
    bounds = torch.tensor(q8_boundaries(signed, kind or Q8_MAP_KIND), dtype=torch.float32, device=y.device)
    return torch.searchsorted(bounds, y.contiguous(), right=False)  # (the count of bounds < y)


def q8_stochastic_index(y: torch.Tensor, random: torch.Tensor, signed: bool,
                        kind: str = None) -> torch.Tensor:
    """Stochastically rounded map index: ``lo`` the largest index whose value is <= y, then
    ``lo + 1`` when ``float(u >> 16) < f * 65536`` with ``f = (y - T[lo]) / (T[lo+1] - T[lo])``
    (float32 operations); the top index stays."""
    table = torch.tensor(q8_map(signed, kind or Q8_MAP_KIND), dtype=torch.float32, device=y.device)
    lo = torch.searchsorted(table, y.contiguous(), right=True) - 1  # (the count of values <= y, less 1)
    lo = torch.clamp(lo, min=0)
    top = lo >= Q8_LEVELS - 1
    lo_safe = torch.where(top, lo - 1, lo)
    below, above = table[lo_safe], table[lo_safe + 1]
    fraction = torch.div(torch.sub(y, below), torch.sub(above, below))
    up = (random >> 16).to(torch.float32) < torch.mul(fraction, 65536.0)
    return torch.where(top, lo, lo + (up & ~top).to(torch.int64))


def q8_encode(x: torch.Tensor, signed: bool, random: torch.Tensor = None,
              kind: str = None) -> torch.Tensor:
    """The q8 tensor (``q8_shape(x.numel())``, uint8) holding float32 ``x``.

    Per block: scale = largest finite magnitude (:func:`q8_scales`); y = x / scale (0 when
    the scale is 0); code of the nearest map value (``random``: the buffer's words,
    ``buffer_bits``, for stochastic rounding); a non-finite element gets the non-finite code
    and leaves the other elements of its block alone.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"q8_encode expects float32 input, got {x.dtype}")
    n = x.numel()
    scales = q8_scales(x)
    y = q8_normalized(x, scales)
    if random is None:
        index = q8_nearest_index(y, signed, kind)
    else:
        index = q8_stochastic_index(y, _q8_blocks(random.reshape(-1)), signed, kind)
    codes = q8_index_to_code(index, signed)
    codes = torch.where(torch.isfinite(_q8_blocks(x)), codes, torch.full_like(codes, q8_nan_code(signed)))
    codes = codes.reshape(-1)
    codes[n:] = 0  # padding
    out = torch.empty(q8_shape(n), dtype=torch.uint8, device=x.device)
    out[:, :Q8_BLOCK] = codes.view(-1, Q8_BLOCK).to(torch.uint8)
    out[:, Q8_BLOCK:] = scales.contiguous().view(torch.uint8).view(-1, Q8_SCALE_BYTES)
    return out


def q8_scale_values(q: torch.Tensor) -> torch.Tensor:
    """The float32 scales of a q8 tensor."""
    return q[:, Q8_BLOCK:].contiguous().view(torch.float32).reshape(-1)


def q8_decode(q: torch.Tensor, shape, signed: bool, kind: str = None) -> torch.Tensor:
    """float32 values of a q8 tensor, of ``shape``: ``T[index] * scale`` (one float32
    multiplication); the non-finite code's ``T[255]`` is NaN (signed) or +inf (unsigned)."""
    n = math.prod(shape)
    if q.dtype != torch.uint8 or tuple(q.shape) != q8_shape(n):
        raise ValueError(f"a q8 tensor of {n} elements is uint8 of shape {q8_shape(n)}, "
                         f"got {q.dtype} of shape {tuple(q.shape)}")
    entries = q8_map(signed, kind or Q8_MAP_KIND) + (q8_non_finite_value(signed),)
    table = torch.tensor(entries, dtype=torch.float32, device=q.device)
    index = q8_code_to_index(q[:, :Q8_BLOCK].to(torch.int64), signed)
    values = torch.mul(table[index], q8_scale_values(q)[:, None])
    return values.reshape(-1)[:n].reshape(shape)
