"""q8 moments in the Numba kernels: the maps, a block's decoding and its quantization.

The same functions as ``bf16opt/storage.py``'s "q8" section, element by element, with the
same bits: a q8 moment is a uint8 array of rows of 260 bytes per block of 256 elements (256
codes, then the block's float32 scale).  The row driver (``rows.py``) decodes a block's codes
into float32, runs the update over the block, and quantizes the new values back.

The maps are rebuilt here from the same float64 formulas (each value rounded once to
float32), as ``cuda_src/q8_maps.cuh`` holds them as literals; ``tests/test_q8_kernels.py``
checks all three agree.  Code bytes: a signed map stores ``index - 127`` as an int8 (0x80:
NaN), an unsigned map the index (0xFF: NaN), so ``(code + 127) & 0xFF`` and ``code`` index
a 256-entry table whose last entry is NaN.
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
    """(values, boundaries): float32 arrays of 256 entries each -- the 255 map values and NaN,
    the 254 round-to-nearest boundaries and +inf (and a pad)."""
    if signed:
        positive = _dynamic(7, 1)
        values = [-v for v in reversed(positive)] + [0.0] + positive
    else:
        values = [0.0] + _dynamic(7, 2)
    table = np.array(values, dtype=np.float64).astype(np.float32)
    middles = ((table[:-1].astype(np.float64) + table[1:].astype(np.float64)) / 2).astype(np.float32)
    values_out = np.append(table, np.float32(np.nan)).astype(np.float32)
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


@njit(inline="always")
def _count_below(table, y, strict):
    """#{k < 255: table[k] < y} (``strict``) or <= y, by an 8-step binary search."""
    index = 0
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        probe = table[index + step - 1]
        index += step if (probe < y if strict else probe <= y) else 0
    return index


@njit(inline="always")
def decode_block(codes, count, kind, out):
    """``out[j] = value(codes[j]) * scale`` for the block's ``count`` elements (one float32
    multiplication each; NaN for the NaN code); ``codes``: a uint8 pointer to the block's row."""
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
    table = SIGNED_VALUES if kind == SIGNED else UNSIGNED_VALUES
    bounds = SIGNED_BOUNDS if kind == SIGNED else UNSIGNED_BOUNDS
    scale = np.float32(0.0)
    for j in range(count):
        magnitude = abs(values[j])
        finite = magnitude < np.float32(np.inf)  # (False for NaN)
        scale = magnitude if finite and magnitude > scale else scale
    bits = f32_to_bits(scale)
    codes[256] = np.uint8(bits & np.uint32(0xFF))
    codes[257] = np.uint8((bits >> np.uint32(8)) & np.uint32(0xFF))
    codes[258] = np.uint8((bits >> np.uint32(16)) & np.uint32(0xFF))
    codes[259] = np.uint8(bits >> np.uint32(24))
    underflows = 0
    nan_code = 0x80 if kind == SIGNED else 0xFF
    for j in range(count):
        x = values[j]
        y = x / scale if scale > np.float32(0.0) else np.float32(0.0)
        if stochastic:
            lo = _count_below(table, y, False) - 1
            lo = lo if lo > 0 else 0
            top = lo >= 254
            low = lo - 1 if top else lo
            fraction = (y - table[low]) / (table[low + 1] - table[low])
            word = _random_word(key, first_element + j, buffer_odd)
            up = np.float32(word >> np.uint32(16)) < fraction * np.float32(65536.0)
            index = lo if top else lo + (1 if up else 0)
        else:
            index = _count_below(bounds, y, True)
        code = (index - 127) & 255 if kind == SIGNED else index
        finite = abs(x) < np.float32(np.inf)
        code = code if finite else nan_code
        codes[j] = np.uint8(code)
        underflows += (x != np.float32(0.0)) & finite & (table[index] * scale == np.float32(0.0))
    return underflows


@njit(inline="always")
def _random_word(key, element, buffer_odd):
    """The buffer's random word (``storage.buffer_bits``) of element ``element`` (its index in
    the whole param) in the stream of ``key``: the hash's upper 16 bits for an even buffer,
    its lower 16 for an odd one, as the upper half of a word."""
    r = np.uint32(random_bits(np.uint32(key), np.uint32(element & 0xFFFFFFFF)))
    return np.uint32(r << np.uint32(16)) if buffer_odd else r & np.uint32(0xFFFF0000)
