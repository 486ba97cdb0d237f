"""Adam, Lion and SGD over whole q8 blocks, hand-vectorised: ``rows.py``'s q8 loop (decode a
block's codes, the element update, quantize the new values: ``q8.py``) for a block of 256
elements in ``VECTORS`` 512-bit vectors, where ``vector_blocks.form`` covers the rest of the
configuration (its master, grad and param formats; no amsgrad, no telemetry) and every
moment is q8.

Why: the element loop spends most of a q8 step in the scalar update and the per-element
search of the quantization (``benchmarks/q8_step.py``; docs/performance.md); here each of
them is a few vector instructions per 16 elements.

Bits: the update is ``vector_blocks``' (the algorithm's operations in the reference's order,
each rounded on its own); decode, the block's scale and the codes are ``q8.py``'s
(``bf16opt/storage.py``'s "q8" spec):

- decode: ``value(code) * scale``, the value looked up in a 256-entry table by code (NaN or
  +inf for the non-finite code): by byte permutes where the CPU has AVX512-VBMI (:meth:`_Q8.values_by_bytes`),
  else by gathers;
- scale: the largest finite magnitude, as the largest of the magnitudes' bit patterns (an
  integer maximum, NaN and inf taken as the least float32, bits 1); ``y = x / scale``, one
  IEEE division (x / 1 where the scale is 0: every finite x is then +-0, as is the spec's y,
  and -0 and +0 count alike);
- round to nearest: the index is ``#{boundaries < y}``; stochastic: ``lo = #{values <= y} - 1``
  (at least 0), then up with the buffer's random bits as ``q8.quantize_block``;
- the counts without a search: floats are ordered as the integers ``key(y)`` (the bits, the
  lower 31 flipped for a negative float; for an unsigned map a negative float counts as +0,
  below every entry but 0; where values are counted -0 is taken as +0 first, the map holds
  +0), and ``key >> KEY_SHIFT`` names a bucket of keys holding at most one table entry
  (checked when the tables are built).  A bucket's 32-bit word holds the count of entries
  below it (low 8 bits; for round to nearest the code byte of that count) and, above them,
  the entry's low key bits (+1 for a strict count; ``1 << KEY_SHIFT``, never reached, for no
  entry): the count is ``first + (threshold <= low bits of key(y))``, one gather per 16
  elements.  A finite x has ``|y| <= 1``, inside the table; the lanes of a non-finite x are
  not looked up (masked gathers) and get the non-finite code.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import q8, vector_blocks
from .roles import state_role
from .storage import EXP_AVG
from .vector_blocks import LANES, PREFETCH, _Block, _intrinsic

__all__ = ["BLOCK", "Q8_STOCHASTIC", "adam_q8_block", "count_vector", "decode_row", "form", "lion_q8_block",
           "sgd_q8_block"]

BLOCK = q8.BLOCK
VECTORS = BLOCK // LANES  # vectors of a block
Q8_STOCHASTIC = 1 << 20      # a form's bit (beside vector_blocks'): the q8 moments round stochastically
KEY_SHIFT = 16


def form(weights: str, param_format, grad_format, companion_format, moment_formats: tuple,
         moment_rounding: str, track: bool, unit: bool, l2: bool = False, stochastic: bool = False):
    """The q8 blocks' form for a chunk function's configuration, or None where they do not
    apply: every moment q8 (np.uint8) and ``vector_blocks.form`` covering the rest (the
    moments as float32)."""
    if not moment_formats or any(f is not np.uint8 for f in moment_formats):
        return None
    flags = vector_blocks.form(weights, param_format, grad_format, companion_format,
                               (np.float32,) * len(moment_formats), moment_rounding, track, unit, l2)
    return None if flags is None else flags | Q8_STOCHASTIC * bool(stochastic)


# ---------------------------------------------------------------- tables
def _keys(values: np.ndarray) -> np.ndarray:
    """The order-preserving integer keys (int64) of float32 values (no NaN)."""
    bits = np.asarray(values, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_range(signed: bool) -> tuple:
    """(smallest, largest) key a normalized value is clamped to."""
    return int(_keys(np.float32(-1.0 if signed else 0.0))), int(_keys(np.float32(1.0)))


def _bucket_words(entries: np.ndarray, strict: bool, signed: bool, code_offset: int = 0) -> np.ndarray:
    """uint32 per bucket of the key range of -1 (0 unsigned) to 1: the count of entries below
    the bucket (less ``code_offset``, modulo 256) | its threshold << 8."""
    keys = _keys(entries)
    assert np.all(np.diff(keys) > 0)
    low, high = (k >> KEY_SHIFT for k in _key_range(signed))
    buckets = np.arange(low, high + 1, dtype=np.int64)
    first = np.searchsorted(keys, buckets << KEY_SHIFT, side="left")
    inside = np.searchsorted(keys, (buckets + 1) << KEY_SHIFT, side="left") - first
    assert inside.max() <= 1, "a bucket holds more than one table entry"
    mask = (1 << KEY_SHIFT) - 1
    entry = keys[np.minimum(first, keys.size - 1)]
    threshold = np.where(inside == 1, (entry & mask) + int(strict), 1 << KEY_SHIFT)
    return (((first - code_offset) & 0xFF) | (threshold << 8)).astype(np.uint32)


def _tables(signed: bool) -> dict:
    values = q8.SIGNED_VALUES if signed else q8.UNSIGNED_VALUES
    bounds = q8.SIGNED_BOUNDS if signed else q8.UNSIGNED_BOUNDS
    codes = np.arange(256)
    return {"values": values.astype(np.float32),                               # by map index
            "by_code": values[(codes + 127) & 255 if signed else codes].astype(np.float32),
            # round to nearest: the code byte of #{boundaries < y} (a signed map's index - 127)
            "nearest": _bucket_words(bounds[:254], True, signed, 127 if signed else 0),
            "at_most": _bucket_words(values[:255], False, signed)}              # #{values <= y}


TABLES = {True: _tables(True), False: _tables(False)}


def _byte_permutes() -> bool:
    """Whether Numba's target CPU permutes bytes across a 512-bit register (AVX512-VBMI)."""
    return "+avx512vbmi" in vector_blocks._target_features()


def _unpack(low: bool, width: int) -> list:
    """``punpckl*`` / ``punpckh*`` of two vectors of 512 bits as a shuffle of ``width``-bit
    elements: within each 128-bit lane, the lower (or upper) half of the first's interleaved
    with the second's."""
    per_lane = 128 // width
    order = []
    for lane in range(4):
        base = lane * per_lane + (0 if low else per_lane // 2)
        for i in range(per_lane // 2):
            order += [base + i, 4 * per_lane + base + i]
    return order


_LOW_BYTES, _HIGH_BYTES = _unpack(True, 8), _unpack(False, 8)
_LOW_WORDS, _HIGH_WORDS = _unpack(True, 16), _unpack(False, 16)
# the interleaving puts element 16k + 4l + q of 64 (vector k, its lane l) at 16l + 4k + q: the codes
# are reordered to match (a transpose of 4x4 groups of 4 bytes)
_CODE_ORDER = [16 * (p % 16 // 4) + 4 * (p // 16) + p % 4 for p in range(64)]


@functools.lru_cache(maxsize=None)
def _byte_planes(signed: bool) -> tuple:
    """The decode table's bytes (by code): plane b holds byte b of each entry, in four groups
    of 64 entries (Python ints, for IR constants)."""
    table = TABLES[signed]["by_code"].view(np.uint8).reshape(256, 4)
    return tuple(tuple([int(x) for x in table[64 * g:64 * (g + 1), b]] for g in range(4)) for b in range(4))


def _global_table(builder, name: str, array: np.ndarray, first: int = 0):
    """A pointer (i8*) to ``array`` as a constant of the module being built (one per module),
    moved to where its element ``first`` would be (``array[0]`` is then at index ``-first``)."""
    module = builder.module
    element = ir.FloatType() if array.dtype == np.float32 else ir.IntType(32)
    kind = ir.ArrayType(element, array.size)
    try:
        table = module.get_global(name)
    except KeyError:
        table = ir.GlobalVariable(module, kind, name)
        table.linkage = "internal"
        table.global_constant = True
        table.initializer = ir.Constant(kind, [float(x) for x in array] if array.dtype == np.float32
                                        else [int(x) for x in array])
    i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
    return builder.gep(builder.bitcast(table, i8p), [ir.Constant(i64, -4 * first)])


# ---------------------------------------------------------------- a q8 moment of a block
class _Q8:
    """The IR of one q8 moment of a block: its row's codes decoded, and the new values
    quantized into it."""

    def __init__(self, block: _Block, row_at, signed: bool, buffer: int, stochastic: bool):
        self.block, self.builder, self.signed, self.buffer, self.stochastic = \
            block, block.builder, signed, buffer, stochastic
        self.row_at = row_at
        prefix = f"bf16opt_q8_{'signed' if signed else 'unsigned'}_"
        tables = TABLES[signed]
        self.values = _global_table(self.builder, prefix + "values", tables["values"])
        self.by_code = _global_table(self.builder, prefix + "by_code", tables["by_code"])
        name = "at_most" if stochastic else "nearest"
        # (indexed by key >> KEY_SHIFT: the first word is the bucket of the smallest key's)
        self.buckets = _global_table(self.builder, prefix + name, tables[name], _key_range(signed)[0] >> KEY_SHIFT)
        self.bytes = ir.VectorType(ir.IntType(8), LANES)
        self.all_lanes = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [1] * LANES)

    def address(self, offset: int, kind):
        return self.builder.inttoptr(self.builder.add(self.row_at, ir.Constant(self.block.i64, offset)),
                                     kind.as_pointer())

    def gather(self, table, index, floats: bool, lanes=None):
        """``table[index]`` in the ``lanes`` (an i1 vector; default all), undefined in the others
        (vpgatherdps / vpgatherdd: the others are not read)."""
        block = self.block
        kind = block.vector if floats else block.words
        name = "llvm.x86.avx512.mask.gather.dps.512" if floats else "llvm.x86.avx512.mask.gather.dpi.512"
        mask = ir.VectorType(ir.IntType(1), LANES)
        gather = _intrinsic(self.builder, name, kind,
                            [kind, ir.IntType(8).as_pointer(), block.words, mask, block.i32])
        return self.builder.call(gather, [ir.Constant(kind, ir.Undefined), table, index,
                                          self.all_lanes if lanes is None else lanes, ir.Constant(block.i32, 4)])

    def decode(self, by_bytes: bool) -> list:
        """The block's values: ``value(code) * scale`` per vector; the values looked up by byte
        permutes (:meth:`values_by_bytes`) or gathered."""
        builder, block = self.builder, self.block
        scale = builder.bitcast(builder.load(self.address(q8.BLOCK, block.i32), align=1), ir.FloatType())
        scale = block.splat(scale)
        values = self.values_by_bytes() if by_bytes else [
            self.gather(self.by_code, builder.zext(builder.load(self.address(LANES * k, self.bytes), align=1),
                                                   block.words), True) for k in range(VECTORS)]
        return [builder.fmul(value, scale) for value in values]

    def values_by_bytes(self) -> list:
        """The codes' map values, 64 codes at a time without a gather (AVX512-VBMI): each byte of
        the values looked up by byte permutes (``vpermi2b`` over the table's 128 lower and 128
        upper entries, picked by the code's top bit), the four bytes then interleaved into
        floats.  The codes are first reordered (one ``vpermb``) so that the interleaving, which
        works within 128-bit lanes, leaves the floats in element order."""
        builder, block = self.builder, self.block
        i8, i32 = ir.IntType(8), block.i32
        wide = ir.VectorType(i8, 64)
        permute = _intrinsic(builder, "llvm.x86.avx512.vpermi2var.qi.512", wide, [wide, wide, wide])
        planes = _byte_planes(self.signed)
        out = []
        for group in range(VECTORS // 4):
            codes = builder.load(self.address(64 * group, wide), align=1)
            codes = builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(i32, 64), _CODE_ORDER))
            top = builder.icmp_signed("<", codes, ir.Constant(wide, [0] * 64))
            bytes_ = []
            for plane in planes:  # (the table's byte b of entries 0-63, 64-127, 128-191, 192-255)
                low = builder.call(permute, [ir.Constant(wide, plane[0]), codes, ir.Constant(wide, plane[1])])
                high = builder.call(permute, [ir.Constant(wide, plane[2]), codes, ir.Constant(wide, plane[3])])
                bytes_.append(builder.select(top, high, low))
            halves = [builder.bitcast(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 64), order)),
                                      ir.VectorType(ir.IntType(16), 32))
                      for a, b in (bytes_[:2], bytes_[2:]) for order in (_LOW_BYTES, _HIGH_BYTES)]
            # halves: bytes 0-1 of the lanes' elements 0-7, then 8-15; bytes 2-3 likewise
            for first, second in ((0, 2), (1, 3)):
                for order in (_LOW_WORDS, _HIGH_WORDS):
                    pairs = builder.shuffle_vector(halves[first], halves[second],
                                                   ir.Constant(ir.VectorType(i32, 32), order))
                    out.append(builder.bitcast(pairs, block.vector))
        return out

    def quantize(self, xs: list) -> None:
        """The block's row from its new values ``xs`` (q8.quantize_block's bits).  Where the
        scale is 0 every finite x is +-0 and is divided by 1: y = +-0 for the spec's +0, the
        same codes (no boundary is 0; -0 is counted as +0)."""
        builder, block = self.builder, self.block
        magnitudes = [builder.and_(builder.bitcast(x, block.words), block.word(0x7FFFFFFF)) for x in xs]
        finites = [builder.icmp_unsigned("<", magnitude, block.word(0x7F800000)) for magnitude in magnitudes]
        largest = None
        for magnitude, finite in zip(magnitudes, finites):  # the largest finite magnitude's bits
            magnitude = builder.select(finite, magnitude, block.word(1))  # (the least float32)
            largest = magnitude if largest is None else builder.select(
                builder.icmp_unsigned(">", magnitude, largest), magnitude, largest)
        reduce = _intrinsic(builder, f"llvm.vector.reduce.umax.v{LANES}i32", block.i32, [block.words])
        largest = builder.call(reduce, [largest])
        builder.store(largest, self.address(q8.BLOCK, block.i32), align=1)
        nonzero = builder.icmp_unsigned("!=", largest, ir.Constant(block.i32, 0))
        divisor = builder.select(nonzero, builder.bitcast(largest, ir.FloatType()),
                                 ir.Constant(ir.FloatType(), 1.0))
        divisor = block.splat(divisor)
        nan_code = block.word(0x80 if self.signed else 0xFF)
        for k, (x, finite) in enumerate(zip(xs, finites)):
            y = builder.fdiv(x, divisor)  # (|y| <= 1 where x is finite)
            if self.stochastic:
                index = self.stochastic_index(y, k, finite)
                code = builder.sub(index, block.word(127)) if self.signed else index
            else:  # the bucket word's low byte is the code of the entries below
                code = self.counted(builder.bitcast(y, block.words), finite, nearest=True)
            code = builder.trunc(builder.select(finite, code, nan_code), self.bytes)
            builder.store(code, self.address(LANES * k, self.bytes), align=1)

    def counted(self, bits, finite, nearest: bool):
        """The count of entries below (round to nearest: boundaries < y; its low byte the code) or
        at most (stochastic: values <= y) y, from its bits (the module docstring); the lanes
        where x is not ``finite`` (y NaN or infinite) are not looked up and hold any count."""
        builder, block = self.builder, self.block
        if self.signed:  # the key: the lower 31 bits flipped for a negative float
            key = builder.xor(bits, builder.lshr(builder.ashr(bits, block.word(31)), block.word(1)))
        else:  # no boundary or value below +0: a negative float counts as +0
            key = builder.select(builder.icmp_signed("<", bits, block.word(0)), block.word(0), bits)
        word = self.gather(self.buckets, builder.ashr(key, block.word(KEY_SHIFT)), False, finite)
        inside = builder.icmp_unsigned("<=", builder.lshr(word, block.word(8)),
                                       builder.and_(key, block.word((1 << KEY_SHIFT) - 1)))
        first = word if nearest else builder.and_(word, block.word(0xFF))
        return builder.add(first, builder.zext(inside, block.words))

    def plus_zero(self, bits):
        """``bits`` with -0 made +0 (counted at most: the map holds +0)."""
        block = self.block
        return self.builder.select(self.builder.icmp_unsigned("==", bits, block.word(0x80000000)), block.word(0),
                                   bits)

    def stochastic_index(self, y, k: int, finite):
        """q8.quantize_block's stochastic index of ``y`` (vector ``k`` of the block)."""
        builder, block = self.builder, self.block
        lo = builder.sub(self.counted(self.plus_zero(builder.bitcast(y, block.words)), finite, nearest=False),
                         block.word(1))
        lo = builder.select(builder.icmp_signed(">", lo, block.word(0)), lo, block.word(0))
        top = builder.icmp_signed(">=", lo, block.word(254))
        low = builder.select(top, builder.sub(lo, block.word(1)), lo)
        below = self.gather(self.values, low, True, finite)
        above = self.gather(self.values, builder.add(low, block.word(1)), True, finite)
        fraction = builder.fdiv(builder.fsub(y, below), builder.fsub(above, below))
        word = block.buffer_bits(self.buffer, k)
        up = builder.fcmp_ordered("<", builder.uitofp(builder.lshr(word, block.word(16)), block.vector),
                                  builder.fmul(fraction, block.constant(65536.0)))
        return builder.select(top, lo, builder.add(lo, builder.zext(up, block.words)))


def _q8_block_codegen(flags: int, scalar_count: int, update, roles: tuple):
    """The codegen of a q8 block intrinsic with the arguments (form, param, grad, companion, the
    moments' row addresses..., scalars, scale, keys, element, ahead): every moment's codes
    decoded, the masters and grads loaded, ``update`` on each vector (as
    ``vector_blocks._block_codegen``), the masters stored, then each moment quantized.
    ``roles``: the moments', whose rows of ``roles.STATE_ROLES`` give their maps and buffers."""
    entries = [state_role(role) for role in roles]

    def codegen(context, builder, sig, args):
        param_at, grad_at, companion_at, *rows_at, scalars_at, scale, keys_at, element, ahead = args[1:]
        element = builder.trunc(element, ir.IntType(32)) if element.type.width > 32 else element
        block = _Block(builder, VECTORS, flags, scalars_at, param_at, grad_at, companion_at, keys_at, element)
        if flags & PREFETCH:
            block.prefetch(param_at, grad_at, companion_at, rows_at, ahead, moment_bytes=q8.ROW)
        values = [block.scalar(k) for k in range(scalar_count)]
        moments = [_Q8(block, at, entry.q8_signed, entry.buffer, bool(flags & Q8_STOCHASTIC))
                   for at, entry in zip(rows_at, entries)]
        decoded = [moment.decode(_byte_permutes()) for moment in moments]
        ws, gs = block.masters(), block.grads(scale)
        results = [update(block, values, w, g, old) for w, g, *old in zip(ws, gs, *decoded)]
        for k, (w, _) in enumerate(results):
            block.store_master(k, ws[k], w)
        for j, moment in enumerate(moments):
            moment.quantize([new[j] for _, new in results])
        return context.get_dummy_value()

    return codegen


# One intrinsic per algorithm, the form a literal argument (as vector_blocks': an on-disk cache key
# free of per-process ids).  ``exp_avg``...: the addresses of the block's q8 rows.
@intrinsic(prefer_literal=True)
def adam_q8_block(typingctx, form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale, keys, element,
                  ahead):
    """``vector_blocks.adam_block`` over one q8 block (256 elements) with q8 exp_avg and
    exp_avg_sq; ``form``: :func:`form`'s."""
    if not isinstance(form, types.IntegerLiteral):
        return None
    flags = form.literal_value
    return (types.void(form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale, keys, element, ahead),
            _q8_block_codegen(flags, vector_blocks.ADAM_SCALARS, vector_blocks.adam_math(flags),
                              ("exp_avg", "exp_avg_sq")))


@intrinsic(prefer_literal=True)
def lion_q8_block(typingctx, form, param, grad, companion, exp_avg, scalars, scale, keys, element, ahead):
    """``vector_blocks.lion_block`` over one q8 block with a q8 exp_avg."""
    if not isinstance(form, types.IntegerLiteral) or form.literal_value & vector_blocks.L2:
        return None
    flags = form.literal_value
    return (types.void(form, param, grad, companion, exp_avg, scalars, scale, keys, element, ahead),
            _q8_block_codegen(flags, vector_blocks.LION_SCALARS, vector_blocks.lion_math(flags),
                              ("exp_avg",)))


@intrinsic(prefer_literal=True)
def sgd_q8_block(typingctx, form, param, grad, companion, momentum_buffer, scalars, scale, keys, element,
                 ahead):
    """``vector_blocks.sgd_block`` over one q8 block with a q8 momentum buffer."""
    if not isinstance(form, types.IntegerLiteral):
        return None
    flags = form.literal_value
    return (types.void(form, param, grad, companion, momentum_buffer, scalars, scale, keys, element, ahead),
            _q8_block_codegen(flags, vector_blocks.SGD_SCALARS, vector_blocks.sgd_math(flags),
                              ("momentum_buffer",)))


@intrinsic(prefer_literal=True)
def count_vector(typingctx, signed, stochastic, ys, out):
    """``count_vector(signed, stochastic, ys, out)``: the counts of the 16 float32 normalized
    values at address ``ys`` into the int32 at ``out``, as a q8 block looks them up (its
    encoding's word: round to nearest, the code; stochastic, ``#{values <= y}`` with -0 as +0),
    every lane taken as finite.  For the tests: the lookup against a plain search."""
    if not isinstance(signed, types.BooleanLiteral) or not isinstance(stochastic, types.BooleanLiteral):
        return None
    is_signed, is_stochastic = signed.literal_value, stochastic.literal_value

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        zero = ir.Constant(i64, 0)
        block = _Block(builder, 1, 0, builder.inttoptr(zero, ir.FloatType().as_pointer()), zero, zero, zero,
                       zero, ir.Constant(ir.IntType(32), 0))
        moment = _Q8(block, zero, is_signed, EXP_AVG, is_stochastic)
        bits = builder.load(builder.inttoptr(args[2], block.words.as_pointer()), align=4)
        if is_stochastic:
            bits = moment.plus_zero(bits)
        count = moment.counted(bits, moment.all_lanes, nearest=not is_stochastic)
        builder.store(count, builder.inttoptr(args[3], block.words.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(signed, stochastic, ys, out), codegen


@intrinsic(prefer_literal=True)
def decode_row(typingctx, signed, by_bytes, row, out):
    """``decode_row(signed, by_bytes, row, out)``: the 256 float32 values of the q8 row at
    address ``row`` into ``out``, as a q8 block decodes them (``by_bytes``: by byte permutes,
    else by gathers).  For the tests: both forms against the spec's decoding."""
    if not isinstance(signed, types.BooleanLiteral) or not isinstance(by_bytes, types.BooleanLiteral):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        zero = ir.Constant(i64, 0)
        block = _Block(builder, 1, 0, builder.inttoptr(zero, ir.FloatType().as_pointer()), zero, zero, zero,
                       zero, ir.Constant(ir.IntType(32), 0))
        moment = _Q8(block, args[2], signed.literal_value, EXP_AVG, False)
        for k, value in enumerate(moment.decode(by_bytes.literal_value)):
            at = builder.add(args[3], ir.Constant(i64, 4 * LANES * k))
            builder.store(value, builder.inttoptr(at, block.vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(signed, by_bytes, row, out), codegen
