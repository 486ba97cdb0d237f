"""q8 moments in the Numba kernels: the maps, a block's decoding and its quantization.

The same functions as ``bf16opt/storage.py``'s "q8" section, element by element, with the
same bits: a q8 moment is a uint8 array of rows of 260 bytes per block of 256 elements (256
codes, then the block's float32 scale).  The row driver (``rows.py``) decodes a block's codes
into float32, runs the update over the block, and quantizes the new values back.

The maps are rebuilt here from the same float64 formulas (each value rounded once to
float32), as ``cuda_src/q8_maps.cuh`` holds them as literals; ``tests/test_q8_kernels.py``
checks all three agree.  Code bytes: a signed map stores ``index - 127`` as an int8 (0x80:
NaN), an unsigned map the index (0xFF: +inf), so ``(code + 127) & 0xFF`` and ``code`` index
a 256-entry table whose last entry is the non-finite value.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .storage import bits_to_f32, f32_to_bits, random_bits

__all__ = ["BLOCK", "ROW", "SIGNED", "UNSIGNED", "maps", "decode_block", "quantize_block", "scratch_block"]

BLOCK = 256
ROW = 260
SIGNED, UNSIGNED = 1, 2  # a state's map (0: not q8)


def _dynamic(decades: int, base: int) -> list:
    values = []
    for i in range(decades):
        count = base << i
        power = 10 ** (decades - 1 - i)
        values += [(0.1 + 0.9 * j / count) / power for j in range(1, count + 1)]
    return sorted(values)


def maps(signed: bool) -> tuple:
    """(values, boundaries): float32 arrays of 256 entries each -- the 255 map values and the
    non-finite code's value (NaN signed, +inf unsigned), the 254 round-to-nearest boundaries
    and +inf (and a pad)."""
    if signed:
        positive = _dynamic(7, 1)
        values = [-v for v in reversed(positive)] + [0.0] + positive
    else:
        values = [0.0] + _dynamic(7, 2)
    table = np.array(values, dtype=np.float64).astype(np.float32)
    middles = ((table[:-1].astype(np.float64) + table[1:].astype(np.float64)) / 2).astype(np.float32)
    values_out = np.append(table, np.float32(np.nan if signed else np.inf)).astype(np.float32)
    bounds = np.concatenate((middles, np.array([np.inf, np.inf], dtype=np.float32))).astype(np.float32)
    return values_out, bounds


@intrinsic
def scratch_block(typingctx):
    """A float32 pointer to BLOCK elements on the stack of the calling function (its entry
    block: one allocation per call, not per loop trip; no heap in a chunk function)."""
    def codegen(context, builder, signature, args):
        array = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), BLOCK))
        return builder.bitcast(array, ir.PointerType(ir.FloatType()))

    return types.CPointer(types.float32)(), codegen


SIGNED_VALUES, SIGNED_BOUNDS = maps(True)
UNSIGNED_VALUES, UNSIGNED_BOUNDS = maps(False)


# The binary search over a map's 255 entries, as the spec states it, costs eight dependent
# loads and branches per element; the kernels count in two comparisons instead: the upper 15
# bits of y's float32 pattern name a bucket of floats, and ``*_FROM[bucket]`` is the number of
# entries below the bucket's smallest float.  No bucket holds more than two entries (checked
# below), so the count is FROM + (entry FROM < y) + (entry FROM + 1 < y): the same number.
KEY_SHIFT = 17


def _bucket_starts(table: np.ndarray, strict: bool) -> np.ndarray:
    """uint8 per bucket: #{table < bucket's smallest float} (strict) or #{table < it} for <=
    counting (the same number: entries equal to the smallest float are counted by the
    comparisons)."""
    keys = np.arange(1 << (32 - KEY_SHIFT), dtype=np.uint64)
    first = (keys << np.uint64(KEY_SHIFT)).astype(np.uint32).view(np.float32)
    last = (((keys + np.uint64(1)) << np.uint64(KEY_SHIFT)) - np.uint64(1)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        low, high = np.fmin(first, last), np.fmax(first, last)
    finite = np.isfinite(low) & np.isfinite(high)
    entries = table[:255].astype(np.float32)
    starts = np.zeros(keys.size, dtype=np.int64)
    starts[finite] = np.searchsorted(entries, low[finite], side="left")
    inside = np.searchsorted(entries, high[finite], side="right") - starts[finite]
    assert inside.max() <= 2, "a bucket holds more than two map entries"
    return starts.astype(np.uint8)


def _padded(table: np.ndarray) -> np.ndarray:
    """The 255 entries then +inf: the two comparisons never read past it."""
    return np.concatenate((table[:255], np.full(2, np.inf))).astype(np.float32)


SIGNED_BOUNDS_PADDED = _padded(SIGNED_BOUNDS)
UNSIGNED_BOUNDS_PADDED = _padded(UNSIGNED_BOUNDS)
SIGNED_VALUES_PADDED = _padded(SIGNED_VALUES)
UNSIGNED_VALUES_PADDED = _padded(UNSIGNED_VALUES)
SIGNED_BOUNDS_FROM = _bucket_starts(SIGNED_BOUNDS_PADDED, True)
UNSIGNED_BOUNDS_FROM = _bucket_starts(UNSIGNED_BOUNDS_PADDED, True)
SIGNED_VALUES_FROM = _bucket_starts(SIGNED_VALUES_PADDED, False)
UNSIGNED_VALUES_FROM = _bucket_starts(UNSIGNED_VALUES_PADDED, False)


@njit(inline="always")
def _count_below(table, starts, y):
    """#{k < 255: table[k] < y}."""
    first = np.int64(starts[f32_to_bits(y) >> np.uint32(KEY_SHIFT)])
    return first + np.int64(table[first] < y) + np.int64(table[first + 1] < y)


@njit(inline="always")
def _count_at_most(table, starts, y):
    """#{k < 255: table[k] <= y}."""
    first = np.int64(starts[f32_to_bits(y) >> np.uint32(KEY_SHIFT)])
    return first + np.int64(table[first] <= y) + np.int64(table[first + 1] <= y)


@njit(inline="always")
def decode_block(codes, count, kind, out):
    """``out[j] = value(codes[j]) * scale`` for the block's ``count`` elements (one float32
    multiplication each; the non-finite code's value is NaN or +inf); ``codes``: a uint8
    pointer to the block's row."""
    scale = bits_to_f32(np.uint32(codes[256]) | (np.uint32(codes[257]) << np.uint32(8))
                        | (np.uint32(codes[258]) << np.uint32(16)) | (np.uint32(codes[259]) << np.uint32(24)))
    table = SIGNED_VALUES if kind == SIGNED else UNSIGNED_VALUES
    for j in range(count):
        code = np.int64(codes[j])
        index = (code + 127) & 255 if kind == SIGNED else code
        out[j] = table[index] * scale


@njit(inline="always")
def quantize_block(values, count, kind, stochastic, key, buffer_odd, first_element, codes):
    """Quantize ``values[:count]`` into the block's row at ``codes`` (codes and scale);
    returns the number of non-zero values stored as zero (telemetry's underflows)."""
    table = SIGNED_VALUES_PADDED if kind == SIGNED else UNSIGNED_VALUES_PADDED
    table_from = SIGNED_VALUES_FROM if kind == SIGNED else UNSIGNED_VALUES_FROM
    bounds = SIGNED_BOUNDS_PADDED if kind == SIGNED else UNSIGNED_BOUNDS_PADDED
    bounds_from = SIGNED_BOUNDS_FROM if kind == SIGNED else UNSIGNED_BOUNDS_FROM
    # the largest finite magnitude, as the largest of the magnitudes' bit patterns (the same
    # order for non-negative floats; NaN and inf count as the least float32, bits 1): an
    # integer maximum, which vectorises
    largest = np.uint32(0)
    for j in range(count):
        magnitude = f32_to_bits(values[j]) & np.uint32(0x7FFFFFFF)
        magnitude = magnitude if magnitude < np.uint32(0x7F800000) else np.uint32(1)
        largest = magnitude if magnitude > largest else largest
    codes[256] = np.uint8(largest & np.uint32(0xFF))
    codes[257] = np.uint8((largest >> np.uint32(8)) & np.uint32(0xFF))
    codes[258] = np.uint8((largest >> np.uint32(16)) & np.uint32(0xFF))
    codes[259] = np.uint8(largest >> np.uint32(24))
    scale = bits_to_f32(largest)
    divisor = scale if largest != np.uint32(0) else np.float32(1.0)
    ys = scratch_block()
    for j in range(count):  # y = x / scale (0 where the scale is 0: x is then 0 or not finite)
        ys[j] = values[j] / divisor if largest != np.uint32(0) else np.float32(0.0)
    underflows = 0
    nan_code = 0x80 if kind == SIGNED else 0xFF
    for j in range(count):
        x, y = values[j], ys[j]
        if stochastic:
            lo = _count_at_most(table, table_from, y) - 1
            lo = lo if lo > 0 else 0
            top = lo >= 254
            low = lo - 1 if top else lo
            fraction = (y - table[low]) / (table[low + 1] - table[low])
            word = _random_word(key, first_element + j, buffer_odd)
            up = np.float32(word >> np.uint32(16)) < fraction * np.float32(65536.0)
            index = lo if top else lo + (1 if up else 0)
        else:
            index = _count_below(bounds, bounds_from, y)
        code = (index - 127) & 255 if kind == SIGNED else index
        finite = (f32_to_bits(x) & np.uint32(0x7FFFFFFF)) < np.uint32(0x7F800000)
        codes[j] = np.uint8(code if finite else nan_code)
        underflows += (x != np.float32(0.0)) & finite & (table[index] * scale == np.float32(0.0))
    return underflows


@njit(inline="always")
def _random_word(key, element, buffer_odd):
    """The buffer's random word (``storage.buffer_bits``) of element ``element`` (its index in
    the whole param) in the stream of ``key``: the hash's upper 16 bits for an even buffer,
    its lower 16 for an odd one, as the upper half of a word."""
    r = np.uint32(random_bits(np.uint32(key), np.uint32(element & 0xFFFFFFFF)))
    return np.uint32(r << np.uint32(16)) if buffer_odd else r & np.uint32(0xFFFF0000)
