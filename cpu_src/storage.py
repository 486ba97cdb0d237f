"""Storage helpers for the Numba kernels: bit casts, decode to float32, encode from float32.

These implement, element by element, exactly what ``bf16opt/storage.py`` specifies:

* decode: bfloat16 / float16 -> float32 is exact; float32 is taken as is;
* encode to bfloat16: round to nearest, ties to even, on the integer bits;
* encode to float16: IEEE round to nearest even, subnormals kept, overflow to +-inf,
  done on the integer bits (no dependence on the CPU's conversion instructions);
* every NaN is stored as the canonical quiet NaN of its format (float32 0x7FC00000,
  bfloat16 0x7FC0, float16 0x7E00), float32 included.

How a storage format reaches a kernel: 16-bit formats travel as integer views of the
torch tensors, and the numpy element type of the view names the format:

=========  ============  ==========================
format     view dtype    numba type of an element
=========  ============  ==========================
float32    float32       float32
bfloat16   int16         int16
float16    uint16        uint16
=========  ============  ==========================

``load(array, index)`` and ``store(array, index, value)`` pick their codec from the
array's element type at compile time (``numba.extending.overload``), so a kernel is
written once and every combination of storage types is a separate compiled
specialisation without a run-time branch.  A new format is an addition here: a new view
type (or a new rounding function) plus one line in ``_DECODERS`` / ``_ENCODERS``.

Everything is written without data-dependent branches (selects only), so LLVM can
vectorise the conversions.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = [
    "VIEW_DTYPES", "CANONICAL_NAN_F32", "CANONICAL_NAN_BF16", "CANONICAL_NAN_F16",
    "f32_to_bits", "bits_to_f32", "address_as_pointer",
    "decode_bf16", "decode_f16", "encode_f32", "encode_bf16", "encode_f16",
    "load", "store",
]

CANONICAL_NAN_F32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
CANONICAL_NAN_F16 = 0x7E00

#: numpy dtype of the view a tensor of each storage format travels as (keyed by name)
VIEW_DTYPES = {"float32": np.float32, "bfloat16": np.int16, "float16": np.uint16}


# ---------------------------------------------------------------- bit casts
@intrinsic
def _bitcast_f32_to_u32(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bitcast_u32_to_f32(typingctx, value):
    if not isinstance(value, types.Integer) or value.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(value), codegen


@njit
def f32_to_bits(x):
    """uint32 bit pattern of a float32."""
    return _bitcast_f32_to_u32(x)


@njit
def bits_to_f32(bits):
    """float32 whose bit pattern is ``bits`` (a 32-bit integer)."""
    return _bitcast_u32_to_f32(np.uint32(bits))


@intrinsic
def address_as_pointer(typingctx, address, token):
    """Typed pointer to the element at byte ``address``; the element type is ``token``'s.

    ``token`` is any array whose dtype names the storage format (an empty view serves):
    the kernels receive tensors as addresses in a chunk table and their formats as tokens,
    so each combination of formats is a compile-time specialisation.
    """
    if not isinstance(address, types.Integer) or not isinstance(token, types.Array):
        return None
    pointer = types.CPointer(token.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, token), codegen


# ---------------------------------------------------------------- decode (exact)
@njit
def decode_bf16(h):
    """float32 value of bfloat16 bits ``h`` (any 16-bit integer)."""
    return bits_to_f32((np.uint32(h) & np.uint32(0xFFFF)) << np.uint32(16))


@njit
def decode_f16(h):
    """float32 value of float16 bits ``h`` (exact; NaN payloads kept, signalling NaNs quieted)."""
    b = np.uint32(h) & np.uint32(0xFFFF)
    sign = (b & np.uint32(0x8000)) << np.uint32(16)
    exponent = (b >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = b & np.uint32(0x3FF)
    # normal numbers and inf/NaN: rebias the exponent (inf/NaN go to exponent 255)
    normal = ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))
    # inf, and NaN made quiet like the hardware conversion (F16C vcvtph2ps) does
    quiet = np.uint32(0x00400000) if mantissa != np.uint32(0) else np.uint32(0)
    special = np.uint32(0x7F800000) | (mantissa << np.uint32(13)) | quiet
    # zero and subnormals: mantissa * 2^-24, exact in float32 (one multiplication by a power of 2)
    tiny = f32_to_bits(np.float32(mantissa) * np.float32(5.960464477539063e-08))
    magnitude = normal if exponent != np.uint32(0) else tiny
    magnitude = special if exponent == np.uint32(31) else magnitude
    return bits_to_f32(sign | magnitude)


# ---------------------------------------------------------------- encode
@njit
def encode_f32(x):
    """float32 to store: ``x`` itself, or the canonical NaN."""
    return x if x == x else bits_to_f32(CANONICAL_NAN_F32)


@njit
def encode_bf16(x):
    """bfloat16 bits (int16) of float32 ``x``: round to nearest even, canonical NaN."""
    bits = f32_to_bits(x)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
    result = rounded if x == x else np.uint32(CANONICAL_NAN_BF16)
    return np.int16(np.uint16(result))


@njit
def encode_f16(x):
    """float16 bits (uint16) of float32 ``x``: IEEE round to nearest even, canonical NaN."""
    bits = f32_to_bits(x)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    a = bits & np.uint32(0x7FFFFFFF)
    # normal float16 range: drop 13 mantissa bits with RNE, rebias exponent 127 -> 15
    r = a - np.uint32(0x38000000)
    normal = (r + np.uint32(0x0FFF) + ((r >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    # float16 subnormals (and values rounding to zero): (1.m * 2^(e-127)) / 2^-24, RNE
    exponent = a >> np.uint32(23)
    mantissa = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    shift = np.uint32(126) - exponent if exponent < np.uint32(112) else np.uint32(14)
    shift = shift if shift < np.uint32(31) else np.uint32(31)
    quotient = mantissa >> shift
    remainder = mantissa & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    round_up = (remainder > half) | ((remainder == half) & ((quotient & np.uint32(1)) != np.uint32(0)))
    subnormal = quotient + np.uint32(round_up)
    magnitude = normal if a >= np.uint32(0x38800000) else subnormal
    magnitude = magnitude if a < np.uint32(0x477FF000) else np.uint32(0x7C00)  # >= 65520: inf
    result = sign | magnitude
    result = result if a <= np.uint32(0x7F800000) else np.uint32(CANONICAL_NAN_F16)
    return np.uint16(result)


# ---------------------------------------------------------------- load / store by view type
# element type of the view -> codec.  Add a format by adding a line to both tables.
_DECODERS = {types.float32: None, types.int16: decode_bf16, types.uint16: decode_f16}
_ENCODERS = {types.float32: encode_f32, types.int16: encode_bf16, types.uint16: encode_f16}


def _element_type(array):
    if isinstance(array, types.CPointer):
        return array.dtype
    if isinstance(array, types.Array):
        return array.dtype
    return None


def load(array, index):
    """float32 value of ``array[index]`` decoded from the array's storage format."""
    raise NotImplementedError("only callable from Numba-compiled code")


def store(array, index, value):
    """``array[index] = encode(value)`` in the array's storage format."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(load)
def _load_impl(array, index):
    element = _element_type(array)
    if element not in _DECODERS:
        return None
    decoder = _DECODERS[element]
    if decoder is None:
        return lambda array, index: array[index]
    return lambda array, index: decoder(array[index])


@overload(store)
def _store_impl(array, index, value):
    element = _element_type(array)
    if element not in _ENCODERS or value != types.float32:
        return None
    encoder = _ENCODERS[element]

    def impl(array, index, value):
        array[index] = encoder(value)

    return impl
