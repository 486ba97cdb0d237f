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

Also here, as additions the kernels pick at compile time (section "storage policies"):

* stochastic rounding: ``random_bits(key, element)`` (the counter-based hash, 32-bit
  lanes) and ``encode_stochastic_for`` per format (``_STOCHASTIC_ENCODERS``);
* the exact float32 master as bfloat16 param + int16 remainder (``split_param``,
  ``split_remainder``, ``join_remainder``);
* how the master is held (``WEIGHT_POLICIES``: float32 copy, the param itself with
  nearest or stochastic rounding, Kahan, remainder) and how moments are rounded
  (``MOMENT_ROUNDINGS``); the store functions also return what telemetry needs.

Everything is written without data-dependent branches (selects only), so LLVM can
vectorise the conversions.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = [
    "CANONICAL_NAN_F32", "CANONICAL_NAN_BF16", "CANONICAL_NAN_F16",
    "f32_to_bits", "bits_to_f32",
    "decode_bf16", "decode_f16", "encode_f32", "encode_bf16", "encode_f16",
    "load", "store", "pointer_to", "encode_for", "decode_for", "same_bits",
    "random_bits", "encode_bf16_stochastic", "encode_f16_stochastic", "encode_stochastic_for",
    "join_remainder", "split_param", "split_remainder",
    "WEIGHT_POLICIES", "MOMENT_ROUNDINGS", "load_weights", "store_weights", "store_moment",
]

CANONICAL_NAN_F32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
CANONICAL_NAN_F16 = 0x7E00


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


# ---------------------------------------------------------------- typed pointers from element classes
@intrinsic
def pointer_to(typingctx, address, element):
    """Typed pointer to byte ``address``; ``element`` is the element class (``np.int16``...).

    The chunk functions (``adam.py``, ``lion.py``) hold their storage formats as closure
    constants (numpy scalar classes), so each combination is a compile-time specialisation.
    """
    if not isinstance(address, types.Integer):
        return None
    if isinstance(element, (types.NumberClass, types.TypeRef)):
        pointer = types.CPointer(element.instance_type)
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, element), codegen


# ---------------------------------------------------------------- encode / decode by format
# Value-level forms of load/store: ``encode_for(array, x)`` is the element ``store`` would
# write, ``decode_for(array, bits)`` the float32 ``load`` would read.  Used where a kernel
# needs the stored bits themselves (Kahan, telemetry).
def encode_for(array, value):
    """Element of ``array``'s format encoding float32 ``value`` (round to nearest even)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def decode_for(array, element):
    """float32 value of one stored element of ``array``'s format."""
    raise NotImplementedError("only callable from Numba-compiled code")


def same_bits(a, b):
    """True when two stored elements have the same bit pattern (float32 compared as bits)."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(encode_for)
def _encode_for_impl(array, value):
    element = _element_type(array)
    if element not in _ENCODERS or value != types.float32:
        return None
    encoder = _ENCODERS[element]
    return lambda array, value: encoder(value)


@overload(decode_for)
def _decode_for_impl(array, element):
    kind = _element_type(array)
    if kind not in _DECODERS:
        return None
    decoder = _DECODERS[kind]
    if decoder is None:
        return lambda array, element: element
    return lambda array, element: decoder(element)


@overload(same_bits)
def _same_bits_impl(a, b):
    if a == types.float32 and b == types.float32:
        return lambda a, b: f32_to_bits(a) == f32_to_bits(b)
    if isinstance(a, types.Integer) and a == b:
        return lambda a, b: a == b
    return None


# ---------------------------------------------------------------- stochastic rounding
GOLDEN = 0x9E3779B9


@intrinsic
def _random_bits_i32(typingctx, key, element):
    """fmix32(key ^ (element * GOLDEN)), all in 32-bit integer arithmetic.

    Written as LLVM IR on i32 so the vectorised loop uses 32-bit lanes (Numba's typing
    widens uint32 arithmetic to 64 bits, which halves the vector width of the hash)."""
    if not isinstance(key, types.Integer) or not isinstance(element, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)

        def as_i32(value):
            width = value.type.width
            if width > 32:
                return builder.trunc(value, i32)
            return builder.zext(value, i32) if width < 32 else value

        h = builder.xor(as_i32(args[0]), builder.mul(as_i32(args[1]), ir.Constant(i32, GOLDEN)))
        h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))
        h = builder.mul(h, ir.Constant(i32, 0x85EBCA6B))
        h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 13)))
        h = builder.mul(h, ir.Constant(i32, 0xC2B2AE35))
        return builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))

    return types.uint32(key, element), codegen


@njit
def random_bits(key, element):
    """32 random bits of element ``element`` (row-major index in its tensor) of stream ``key``:
    ``fmix32(key ^ (element * 0x9E3779B9 mod 2**32))``."""
    return _random_bits_i32(key, element)


@njit
def encode_bf16_stochastic(x, r):
    """bfloat16 bits (int16) of ``x`` rounded up in magnitude with probability equal to
    the dropped fraction (``r``: 32 random bits); inf kept, NaN canonical."""
    bits = f32_to_bits(x)
    rounded = np.uint32(bits + (np.uint32(r) >> np.uint32(16))) >> np.uint32(16)
    finite = (bits & np.uint32(0x7FFFFFFF)) != np.uint32(0x7F800000)
    result = rounded if finite else bits >> np.uint32(16)
    result = result if x == x else np.uint32(CANONICAL_NAN_BF16)
    return np.int16(np.uint16(result))


@njit
def encode_f16_stochastic(x, r):
    """float16 bits (uint16) of ``x`` stochastically rounded (``bf16opt/storage.py``)."""
    bits = f32_to_bits(x)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    r = np.uint32(r)
    # float16 normal range: add random bits below the kept 10 mantissa bits, truncate
    normal = bits_to_f32(np.uint32(magnitude + (r >> np.uint32(19))) & np.uint32(0xFFFFE000))
    # float16 subnormal grid (step 2^-24): round up when 24 random bits < dropped fraction
    scaled = np.abs(x) * np.float32(16777216.0)
    floor = np.floor(scaled)
    fraction = (scaled - floor) * np.float32(16777216.0)
    up = np.float32(r >> np.uint32(8)) < fraction
    subnormal = (floor + np.float32(1.0 if up else 0.0)) * np.float32(5.960464477539063e-08)
    value = normal if magnitude >= np.uint32(0x38800000) else subnormal
    value = np.abs(x) if magnitude == np.uint32(0x7F800000) else value
    value = -value if bits >= np.uint32(0x80000000) else value
    # exact: value is on float16's grid or beyond its range; NaN (whose bits the addition
    # may have wrapped) becomes the canonical NaN
    return encode_f16(value) if x == x else np.uint16(CANONICAL_NAN_F16)


@njit
def encode_f32_stochastic(x, r):
    """float32 storage is exact: stochastic rounding changes nothing."""
    return encode_f32(x)


# element type of the view -> stochastic encoder.  Add a format by adding a line.
_STOCHASTIC_ENCODERS = {types.float32: encode_f32_stochastic, types.int16: encode_bf16_stochastic,
                        types.uint16: encode_f16_stochastic}


def encode_stochastic_for(array, value, random):
    """Element of ``array``'s format encoding float32 ``value`` with stochastic rounding."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(encode_stochastic_for)
def _encode_stochastic_for_impl(array, value, random):
    element = _element_type(array)
    if element not in _STOCHASTIC_ENCODERS or value != types.float32:
        return None
    encoder = _STOCHASTIC_ENCODERS[element]
    return lambda array, value, random: encoder(value, random)


# ---------------------------------------------------------------- exact float32 master: bf16 + int16
@njit
def join_remainder(param_bits, remainder):
    """float32 master held by bfloat16 bits ``param_bits`` and int16 ``remainder``."""
    low = np.uint32(np.uint16(remainder))
    upper = (np.uint32(np.uint16(param_bits)) - (low >> np.uint32(15))) & np.uint32(0xFFFF)
    return bits_to_f32((upper << np.uint32(16)) | low)


@njit
def split_param(master):
    """bfloat16 bits (int16) of the float32 ``master``: nearest, ties away from zero."""
    bits = f32_to_bits(encode_f32(master))
    return np.int16(np.uint16(np.uint32(bits + np.uint32(0x8000)) >> np.uint32(16)))


@njit
def split_remainder(master):
    """int16 remainder: the low 16 bits of the float32 ``master`` (NaN canonical)."""
    return np.int16(np.uint16(f32_to_bits(encode_f32(master)) & np.uint32(0xFFFF)))


# ---------------------------------------------------------------- storage policies of the kernels
# A kernel is written once against two small interfaces, and each configuration picks its
# implementations at compile time (closure constants of the chunk-function factories):
#
# * moments: ``store_moment(array, i, value, key, element) -> float32`` writes the encoding
#   of ``value`` and returns the stored value decoded (telemetry's underflow test);
#   ``key``/``element`` name the random stream and the element for stochastic rounding.
# * weights: ``load_weights(param, companion, i) -> w0`` reads the master value;
#   ``store_weights(param, companion, i, w0, w, key, element) -> bool`` stores the
#   updated master ``w`` and returns True when the bits that hold the master did not
#   change (telemetry's swallowed-update test).  ``companion`` is the master policy's
#   array: the float32 copy, the Kahan compensation or the int16 remainder (unused by
#   "param").  Policy names are ``KernelConfig.weights`` (bf16opt/algorithms.py).
#
# Results that a configuration does not use (random bits, the returned flags when
# telemetry is off) are dead code that LLVM removes.
@njit
def store_moment_nearest(array, i, value, key, element):
    encoded = encode_for(array, value)
    array[i] = encoded
    return decode_for(array, encoded)


@njit
def store_moment_stochastic(array, i, value, key, element):
    encoded = encode_stochastic_for(array, value, random_bits(key, element))
    array[i] = encoded
    return decode_for(array, encoded)


@njit
def load_weights_copy(param, companion, i):
    return load(companion, i)


@njit
def load_weights_param(param, companion, i):
    return load(param, i)


@njit
def load_weights_remainder(param, companion, i):
    return join_remainder(param[i], companion[i])


@njit
def store_weights_copy(param, companion, i, w0, w, key, element):
    """float32 master copy, param = its round to nearest even."""
    encoded = encode_for(companion, w)
    same = same_bits(companion[i], encoded)
    companion[i] = encoded
    param[i] = encode_for(param, w)
    return same


@njit
def store_weights_param(param, companion, i, w0, w, key, element):
    """The param is the master: round to nearest even."""
    encoded = encode_for(param, w)
    same = same_bits(param[i], encoded)
    param[i] = encoded
    return same


@njit
def store_weights_stochastic(param, companion, i, w0, w, key, element):
    """The param is the master: stochastic rounding (stream WEIGHTS)."""
    encoded = encode_stochastic_for(param, w, random_bits(key, element))
    same = same_bits(param[i], encoded)
    param[i] = encoded
    return same


@njit
def store_weights_kahan(param, companion, i, w0, w, key, element):
    """16-bit master with Kahan compensation ``companion`` (reference.py's formula)."""
    y = w - w0
    y = y + load(companion, i)
    s = w0 + y
    encoded = encode_for(param, s)
    same = same_bits(param[i], encoded)
    param[i] = encoded
    t = decode_for(param, encoded) - w0
    store(companion, i, y - t)
    return same


@njit
def store_weights_remainder(param, companion, i, w0, w, key, element):
    """Exact float32 master as bfloat16 param + int16 remainder ``companion``."""
    high = split_param(w)
    low = split_remainder(w)
    same = (param[i] == high) & (companion[i] == low)
    param[i] = high
    companion[i] = low
    return same


#: weights policy name -> (load_weights, store_weights); moment rounding -> store_moment.
#: A new way to hold the master or to round is one entry here.
WEIGHT_POLICIES = {
    "copy": (load_weights_copy, store_weights_copy),
    "param": (load_weights_param, store_weights_param),
    "param-stochastic": (load_weights_param, store_weights_stochastic),
    "kahan": (load_weights_param, store_weights_kahan),
    "remainder": (load_weights_remainder, store_weights_remainder),
}
MOMENT_ROUNDINGS = {"nearest": store_moment_nearest, "stochastic": store_moment_stochastic}


# The kernels name their policies with string constants (closure variables, which Numba
# types as string literals): the implementation is picked at compile time, and the
# on-disk cache key (which includes closure values) stays the same across processes.
def load_weights(policy, param, companion, i):
    """Master value of element ``i`` under ``policy`` (a key of WEIGHT_POLICIES)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def store_weights(policy, param, companion, i, w0, w, key, element):
    """Store the updated master ``w`` under ``policy``; True when its bits did not change."""
    raise NotImplementedError("only callable from Numba-compiled code")


def store_moment(rounding, array, i, value, key, element):
    """Store a moment with ``rounding`` (a key of MOMENT_ROUNDINGS); the stored value back."""
    raise NotImplementedError("only callable from Numba-compiled code")


def _literal(policy, table):
    if isinstance(policy, types.StringLiteral) and policy.literal_value in table:
        return table[policy.literal_value]
    return None


@overload(load_weights)
def _load_weights_impl(policy, param, companion, i):
    chosen = _literal(policy, WEIGHT_POLICIES)
    if chosen is None:
        return None
    load_impl = chosen[0]
    return lambda policy, param, companion, i: load_impl(param, companion, i)


@overload(store_weights)
def _store_weights_impl(policy, param, companion, i, w0, w, key, element):
    chosen = _literal(policy, WEIGHT_POLICIES)
    if chosen is None:
        return None
    store_impl = chosen[1]

    def impl(policy, param, companion, i, w0, w, key, element):
        return store_impl(param, companion, i, w0, w, key, element)

    return impl


@overload(store_moment)
def _store_moment_impl(rounding, array, i, value, key, element):
    store_impl = _literal(rounding, MOMENT_ROUNDINGS)
    if store_impl is None:
        return None
    return lambda rounding, array, i, value, key, element: store_impl(array, i, value, key, element)
