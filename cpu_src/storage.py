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

``load(array, index)`` and ``store(array, index, value)``, and their forms on one element,
``decode(element)`` and ``encode_for(fmt, value)``, pick their codec from the element type
at compile time (``numba.extending.overload``), so a kernel is written once and every
combination of storage types is a separate compiled specialisation without a run-time
branch.  A new format is an addition here: a new view type (or a new rounding function)
plus one line in ``_DECODERS`` / ``_ENCODERS``.

Also here, as additions the kernels pick at compile time (section "storage policies"):

* stochastic rounding: ``random_bits(key, element)`` (the counter-based hash, 32-bit
  lanes), ``random_words(keys, element)`` (every stream's: a buffer's stream follows from its
  number), ``buffer_bits(random, buffer)`` (a buffer's half of its stream's bits) and
  ``encode_stochastic_for`` per format (``_STOCHASTIC_ENCODERS``);
* the exact float32 master as bfloat16 param + int16 remainder (``split_param``,
  ``split_remainder``, ``join_remainder``);
* how the master is held (``WEIGHT_POLICIES``: float32 copy, the param itself with
  nearest or stochastic rounding, Kahan, remainder) and how moments are rounded
  (``MOMENT_ROUNDINGS``), on stored elements, so one update serves the loop over array
  elements and the paired loop over the 32-bit words of 16-bit arrays (``low_half``,
  ``high_half``, ``pair_word``); the encode functions also return what telemetry needs.

Everything is written without data-dependent branches (selects only), so LLVM can
vectorise the conversions.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .roles import EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, STREAMS, WEIGHTS

__all__ = [
    "CANONICAL_NAN_F32", "CANONICAL_NAN_BF16", "CANONICAL_NAN_F16",
    "f32_to_bits", "bits_to_f32",
    "decode_bf16", "decode_f16", "encode_f32", "bf16_rounding_bits", "encode_bf16", "encode_f16",
    "load", "store", "pointer_to", "encode_for", "encode_like", "decode", "round_for", "same_bits",
    "low_half", "high_half", "pair_word",
    "element_index", "random_bits", "stream_keys", "random_words", "buffer_bits",
    "WEIGHTS", "EXP_AVG", "EXP_AVG_SQ", "MAX_EXP_AVG_SQ",
    "encode_bf16_stochastic", "encode_f16_stochastic", "encode_stochastic_for",
    "join_remainder", "split_param", "split_remainder",
    "WEIGHT_POLICIES", "MOMENT_ROUNDINGS", "WEIGHT_ARRAYS", "master_value", "encode_master", "encode_moment",
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
def bf16_rounding_bits(x):
    """float32 bits of ``x`` (NaN: the canonical one) plus the round-to-nearest-even bias: the
    upper half is ``encode_bf16(x)``; with the lower half cleared, the bits of its decoding.

    NaN is replaced before rounding, on the 32-bit lanes of the float (the canonical NaN
    rounds to the canonical bfloat16 NaN); the sum never carries out of 32 bits."""
    bits = f32_to_bits(x if x == x else bits_to_f32(CANONICAL_NAN_F32))
    return np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))


@njit
def encode_bf16(x):
    """bfloat16 bits (int16) of float32 ``x``: round to nearest even, canonical NaN."""
    return np.int16(np.uint16(bf16_rounding_bits(x) >> np.uint32(16)))


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
    """The element type naming the format: of an array or pointer, or a format class (np.int16...)."""
    if isinstance(array, (types.CPointer, types.Array)):
        return array.dtype
    if isinstance(array, (types.NumberClass, types.TypeRef)):
        return array.instance_type
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


# ---------------------------------------------------------------- encode / decode of one element
# Value-level forms of load/store, for the storage policies below: ``encode_for(fmt, x)`` is
# the element ``store`` would write into an array of format ``fmt`` (an array, or the
# format's element class, np.int16...), ``decode(element)`` the float32 ``load`` would read
# (the element's type names its format).
def encode_for(array, value):
    """Element of ``array``'s format encoding float32 ``value`` (round to nearest even)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def decode(element):
    """float32 value of one stored element (its type names the format)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def encode_like(element, value):
    """Element of the format of the stored element ``element`` encoding float32 ``value``
    (round to nearest even)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def round_for(array, value):
    """``(encode_for(array, value), decode(that))``: the stored element and its value."""
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


@overload(encode_like)
def _encode_like_impl(element, value):
    if element not in _ENCODERS or value != types.float32:
        return None
    encoder = _ENCODERS[element]
    return lambda element, value: encoder(value)


@overload(decode)
def _decode_impl(element):
    if element not in _DECODERS:
        return None
    decoder = _DECODERS[element]
    if decoder is None:
        return lambda element: element
    return lambda element: decoder(element)


@overload(round_for)
def _round_for_impl(array, value):
    element = _element_type(array)
    if element not in _ENCODERS or value != types.float32:
        return None
    if element == types.int16:  # bfloat16: both from the rounding bits, no decode of the 16 bits
        def impl(array, value):
            rounded = bf16_rounding_bits(value)
            return np.int16(np.uint16(rounded >> np.uint32(16))), bits_to_f32(rounded & np.uint32(0xFFFF0000))

        return impl
    encoder = _ENCODERS[element]

    def impl(array, value):
        encoded = encoder(value)
        return encoded, decode(encoded)

    return impl


@overload(same_bits)
def _same_bits_impl(a, b):
    if a == types.float32 and b == types.float32:
        return lambda a, b: f32_to_bits(a) == f32_to_bits(b)
    if isinstance(a, types.Integer) and a == b:
        return lambda a, b: a == b
    return None


# ---------------------------------------------------------------- two 16-bit elements in a 32-bit word
# The paired loops of the kernels read two elements of a 16-bit array as one uint32 word
# (element 2j in the low half: little-endian) and write them back the same way.  On the word,
# LLVM turns decoding into one shift or mask and encoding into one merge per pair.
@njit
def low_half(word, element):
    """The element (class ``element``: np.int16, np.uint16) in the low half of ``word``."""
    return element(np.uint16(word & np.uint32(0xFFFF)))


@njit
def high_half(word, element):
    """The element (class ``element``) in the high half of ``word``."""
    return element(np.uint16(word >> np.uint32(16)))


@njit
def pair_word(low, high):
    """uint32 word holding the 16-bit elements ``low`` (low half) and ``high``."""
    return np.uint32(np.uint32(np.uint16(low)) | (np.uint32(np.uint16(high)) << np.uint32(16)))


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


@intrinsic
def element_index(typingctx, start, i):
    """``start + i`` modulo 2**32 (the hash's element counter), added in 32 bits so the
    vectorised loop counts elements in 32-bit lanes rather than 64-bit ones."""
    if not isinstance(start, types.Integer) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.add(builder.trunc(args[0], i32), builder.trunc(args[1], i32))

    return types.uint32(start, i), codegen


@njit
def random_bits(key, element):
    """32 random bits of element ``element`` (row-major index in its tensor) of stream ``key``:
    ``fmix32(key ^ (element * 0x9E3779B9 mod 2**32))``."""
    return _random_bits_i32(key, element)


# Buffer numbers: roles.py's (a state's buffer is its row of roles.STATE_ROLES); buffer b rounds
# with one half of stream b >> 1's bits.
assert STREAMS == 2  # (stream_keys and random_words name the streams)


# (inlined by Numba: the caller's code is what it was with the keys and hashes written out there)
@njit(inline="always")
def stream_keys(keys):
    """The keys of every stream of a row's tensor (``keys``: its ``chunks.KEYS`` keys), read once
    per row, for :func:`random_words`."""
    return keys[0], keys[1]


@njit(inline="always")
def random_words(keys, element):
    """``random_bits`` of element ``element`` in every stream (``keys``: :func:`stream_keys`'),
    a tuple from which :func:`buffer_bits` takes a buffer's stream; a stream no buffer of the
    configuration rounds with is dead code."""
    return random_bits(keys[0], element), random_bits(keys[1], element)


@intrinsic(prefer_literal=True)
def buffer_bits(typingctx, random, buffer):
    """The random word buffer ``buffer`` (a constant: WEIGHTS, a state's ``State.buffer``...)
    rounds with, from its stream's ``random_bits`` (``random``: those, or every stream's,
    :func:`random_words`, of which the buffer's stream ``buffer >> 1`` is taken): its half of the
    bits as the word's upper 16 (``bf16opt/storage.py``): ``random & 0xFFFF0000`` for an even
    buffer, ``random << 16`` for an odd one, on i32 lanes."""
    if not isinstance(buffer, types.IntegerLiteral):
        return None
    stream = buffer.literal_value >> 1
    of_streams = isinstance(random, types.UniTuple) and isinstance(random.dtype, types.Integer)
    if not (of_streams and 0 <= stream < random.count) and not isinstance(random, types.Integer):
        return None
    odd = buffer.literal_value % 2 == 1

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        r = builder.extract_value(args[0], stream) if of_streams else args[0]
        r = r if r.type.width == 32 else builder.trunc(r, i32)
        return builder.shl(r, ir.Constant(i32, 16)) if odd else builder.and_(r, ir.Constant(i32, 0xFFFF0000))

    return types.uint32(random, buffer), codegen


@njit
def encode_bf16_stochastic(x, r):
    """bfloat16 bits (int16) of ``x`` rounded up in magnitude with probability equal to
    the dropped fraction (``r``: 32 random bits); inf kept, NaN canonical."""
    # inf stays inf: its low 16 bits are 0, so adding fewer than 2**16 never carries out;
    # NaN first becomes the canonical NaN, which keeps its upper half the same way
    bits = f32_to_bits(x if x == x else bits_to_f32(CANONICAL_NAN_F32))
    return np.int16(np.uint16(np.uint32(bits + (np.uint32(r) >> np.uint32(16))) >> np.uint32(16)))


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
    """float32 master held by bfloat16 bits ``param_bits`` and int16 ``remainder``
    (``bf16opt/storage.py``'s join, the param alone where that would be a stray NaN)."""
    low = np.uint32(np.uint16(remainder))
    # ((param - (low >> 15)) & 0xFFFF) << 16 | low, as one 32-bit subtraction (wrapping like
    # the 16-bit one), so the paired loop's words need no narrowing to 16-bit lanes
    upper = np.uint32(np.uint16(param_bits)) << np.uint32(16)
    joined = np.uint32((upper | low) - ((low & np.uint32(0x8000)) << np.uint32(1)))
    # the param alone where the join is NaN but the param is not (an edited param: see the spec)
    stray = ((joined & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)) \
        & ((upper & np.uint32(0x7FFFFFFF)) <= np.uint32(0x7F800000))
    return bits_to_f32(upper if stray else joined)


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
# A kernel is written once, as the update of one element from its stored elements to the
# elements to store, against two small interfaces; each configuration picks the
# implementations at compile time (closure constants of the chunk-function factories).  The
# policies take and return stored *elements* (a float32, or the 16-bit integer of a
# bfloat16, float16 or int16 remainder), not arrays, so one update serves the loop over
# array elements and the paired loop over the 32-bit words of 16-bit arrays.  ``fmt``
# arguments are element classes (np.float32, np.int16, np.uint16): the formats to encode to.
#
# * moments: ``encode_moment(rounding, fmt, value, random) -> (encoded, stored)``:
#   the element storing ``value`` and its decoded value (telemetry's underflow test);
#   ``random``: the element's random word for stochastic rounding (``buffer_bits``).
# * weights: ``master_value(policy, param, companion) -> w0`` reads the master value from
#   the stored param and companion elements; ``encode_master(policy, param_fmt,
#   companion_fmt, param, companion, w0, w, random) -> (param, companion, same)`` gives
#   the elements storing the updated master ``w`` and True when the bits that hold the
#   master did not change (telemetry's swallowed-update test).  ``companion`` is the master
#   policy's element: of the float32 copy, the Kahan compensation or the int16 remainder.
#   ``WEIGHT_ARRAYS`` says which of the two arrays a policy reads (the elements it does not
#   read are passed as zeros of their format, and what it returns for them is not stored).
#   Policy names are ``KernelConfig.weights`` (bf16opt/algorithms.py).
#
# Results that a configuration does not use (random bits, the flags when telemetry is off)
# are dead code that LLVM removes; so is the hash of a stream no buffer rounds with, and the
# two buffers of one stream share its hash (the same operations on the same key and element).
@njit
def encode_moment_nearest(fmt, value, random):
    return round_for(fmt, value)


@njit
def encode_moment_stochastic(fmt, value, random):
    encoded = encode_stochastic_for(fmt, value, random)
    return encoded, decode(encoded)


@njit
def master_value_copy(param, companion):
    """The float32 copy, or the param's value where the param is not the copy's round to
    nearest even (edited since the step wrote it: ``bf16opt/storage.py``'s join_copy)."""
    master = decode(companion)
    return master if same_bits(param, encode_like(param, master)) else decode(param)


@njit
def master_value_param(param, companion):
    return decode(param)


@njit
def master_value_remainder(param, companion):
    return join_remainder(param, companion)


@njit
def encode_master_copy(param_fmt, companion_fmt, param, companion, w0, w, random):
    """float32 master copy, param = its round to nearest even; unchanged: the copy's encoding of
    the master the update started from (an edited param's value: join_copy) is the new one."""
    encoded = encode_for(companion_fmt, w)
    return encode_for(param_fmt, w), encoded, same_bits(encode_for(companion_fmt, w0), encoded)


@njit
def encode_master_param(param_fmt, companion_fmt, param, companion, w0, w, random):
    """The param is the master: round to nearest even."""
    encoded = encode_for(param_fmt, w)
    return encoded, companion, same_bits(param, encoded)


@njit
def encode_master_stochastic(param_fmt, companion_fmt, param, companion, w0, w, random):
    """The param is the master: stochastic rounding (``random``: buffer WEIGHTS' bits)."""
    encoded = encode_stochastic_for(param_fmt, w, random)
    return encoded, companion, same_bits(param, encoded)


@njit
def encode_master_kahan(param_fmt, companion_fmt, param, companion, w0, w, random):
    """16-bit master with Kahan compensation ``companion`` (reference.py's formula)."""
    y = w - w0
    y = y + decode(companion)
    s = w0 + y
    encoded, stored = round_for(param_fmt, s)
    t = stored - w0
    return encoded, encode_for(companion_fmt, y - t), same_bits(param, encoded)


@njit
def encode_master_remainder(param_fmt, companion_fmt, param, companion, w0, w, random):
    """Exact float32 master as bfloat16 param + int16 remainder ``companion``."""
    high = split_param(w)
    low = split_remainder(w)
    return high, low, (param == high) & (companion == low)


#: weights policy name -> (master_value, encode_master); moment rounding -> encode_moment.
#: A new way to hold the master or to round is one entry here (and one in WEIGHT_ARRAYS).
WEIGHT_POLICIES = {
    "copy": (master_value_copy, encode_master_copy),
    "param": (master_value_param, encode_master_param),
    "param-stochastic": (master_value_param, encode_master_stochastic),
    "kahan": (master_value_param, encode_master_kahan),
    "remainder": (master_value_remainder, encode_master_remainder),
}
MOMENT_ROUNDINGS = {"nearest": encode_moment_nearest, "stochastic": encode_moment_stochastic}
#: weights policy name -> (reads the param, has a companion array)
WEIGHT_ARRAYS = {"copy": (True, True), "param": (True, False), "param-stochastic": (True, False),
                 "kahan": (True, True), "remainder": (True, True)}


# The kernels name their policies with string constants (closure variables, which Numba
# types as string literals): the implementation is picked at compile time, and the
# on-disk cache key (which includes closure values) stays the same across processes.
def master_value(policy, param, companion):
    """Master value from the stored elements under ``policy`` (a key of WEIGHT_POLICIES)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def encode_master(policy, param_fmt, companion_fmt, param, companion, w0, w, random):
    """(param, companion, unchanged) elements storing the updated master ``w`` under ``policy``."""
    raise NotImplementedError("only callable from Numba-compiled code")


def encode_moment(rounding, fmt, value, random):
    """(element, its value) storing a moment with ``rounding`` (a key of MOMENT_ROUNDINGS)."""
    raise NotImplementedError("only callable from Numba-compiled code")


def _literal(policy, table):
    if isinstance(policy, types.StringLiteral) and policy.literal_value in table:
        return table[policy.literal_value]
    return None


@overload(master_value)
def _master_value_impl(policy, param, companion):
    chosen = _literal(policy, WEIGHT_POLICIES)
    if chosen is None:
        return None
    value_impl = chosen[0]
    return lambda policy, param, companion: value_impl(param, companion)


@overload(encode_master)
def _encode_master_impl(policy, param_fmt, companion_fmt, param, companion, w0, w, random):
    chosen = _literal(policy, WEIGHT_POLICIES)
    if chosen is None:
        return None
    encode_impl = chosen[1]

    def impl(policy, param_fmt, companion_fmt, param, companion, w0, w, random):
        return encode_impl(param_fmt, companion_fmt, param, companion, w0, w, random)

    return impl


@overload(encode_moment)
def _encode_moment_impl(rounding, fmt, value, random):
    encode_impl = _literal(rounding, MOMENT_ROUNDINGS)
    if encode_impl is None:
        return None
    return lambda rounding, fmt, value, random: encode_impl(fmt, value, random)
