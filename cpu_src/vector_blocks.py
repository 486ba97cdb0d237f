"""Adam, Lion and SGD, hand-vectorised: the blocks of ``adam.py``'s, ``lion.py``'s and
``sgd.py``'s element loops for the configurations of :func:`form` -- float32 or bfloat16
params that are their own master (rounded to nearest, or stochastically),
bfloat16 params with a float32 master copy, an int16 remainder (the exact float32 master) or
a Kahan compensation; float32 or bfloat16 grads; float32 or bfloat16 moments; no amsgrad, no
telemetry -- where the target CPU has AVX-512.

Why: from the element loops LLVM builds one vector per array per iteration, which runs no
faster than any plain exact loop; a loop that loads eight 512-bit vectors of each array
before computing any (DeepSpeedCPUAdam's form) is faster, with the same arithmetic
(``benchmarks/cpu_step.py --same-arrays``; figures in docs/performance.md).  LLVM does not build that form
from Numba source (512-bit vectors, forced interleaving, blocked loops: measured, none
faster), so it is written here as LLVM vector IR, from an ``@intrinsic`` per algorithm.
On Intel CPUs each block also first asks for its arrays' lines ``PREFETCH_DISTANCE`` bytes on
(:meth:`_Block.prefetch`): streamed steps take less time with them (docs/performance.md).

Bits: each operation is the element loop's (so ``reference.py``'s), in its order, on
``LANES`` lanes at once -- IEEE multiplication, addition, square root and division, each
rounded on its own (no fused multiply-add: LLVM only fuses operations marked ``contract``)
-- bfloat16 decoded and encoded as ``storage.decode_bf16`` / ``storage.encode_bf16`` do (a
shift; round to nearest even on the integer lanes, or the same bits from the CPU's
conversion where it has AVX512-BF16: :meth:`_Block.encode_bf16_native`, the conversion alone
for the vectors without a NaN or subnormal lane, faster in cache than the integer rounding;
or stochastically,
with ``storage.random_bits``' bits of each element), and every stored NaN made canonical.
The tests that compare the kernels with the reference element for element run this path
wherever it is on.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .chunks import CHUNK
from .roles import WEIGHTS, buffer_of
from .storage import CANONICAL_NAN_F32, GOLDEN

__all__ = ["ADAM_BLOCK", "COMPANION16", "COPY", "GRAD16", "KAHAN", "L2", "LION_BLOCK", "MOMENT16", "NATIVE16",
           "NESTEROV", "PARAM16", "PREFETCH", "REMAINDER", "SGD_BLOCK", "SR_MOMENTS", "SR_WEIGHTS", "UNIT",
           "adam_block", "available", "form", "lion_block", "native_bf16", "prefetch_ahead", "prefetch_span",
           "prefetching", "sgd_block"]

LANES = 16  # float32 lanes of one vector: a 512-bit register
# vectors of each array loaded before any is computed: Adam eight (DeepSpeed's form); Lion and
# SGD four, as they do less work per byte (chosen by benchmarks/cpu_step.py; docs/performance.md)
ADAM_SPAN, LION_SPAN, SGD_SPAN = 8, 4, 4
ADAM_BLOCK, LION_BLOCK, SGD_BLOCK = (LANES * span for span in (ADAM_SPAN, LION_SPAN, SGD_SPAN))  # elements

# the bits of a block's form (a compile-time constant of the chunk function)
L2 = 1       # the weight decay is added to the grad (Adam)
UNIT = 2     # no multiplication by the unscaling factor (it is exactly 1)
PARAM16 = 4  # the param is bfloat16
GRAD16 = 8   # the grad is bfloat16
COPY = 16    # the master is a float32 copy (the companion), the param its rounding (PARAM16)
NATIVE16 = 32  # bfloat16 values rounded to nearest by the CPU's conversion (AVX512-BF16)
REMAINDER = 64  # the master is the bfloat16 param and an int16 remainder (the companion): PARAM16
NESTEROV = 128  # SGD's Nesterov momentum
MOMENT16 = 256  # the moments are bfloat16 (rounded to nearest even), not float32
KAHAN = 512  # the master is the bfloat16 param with a Kahan compensation (the companion): PARAM16
COMPANION16 = 1024  # the Kahan compensation is bfloat16, not float32
SR_WEIGHTS = 2048  # the bfloat16 param, its own master, rounded stochastically (buffer WEIGHTS): PARAM16
SR_MOMENTS = 4096  # the bfloat16 moments rounded stochastically (buffers EXP_AVG, EXP_AVG_SQ): MOMENT16
PREFETCH = 8192  # each array's lines PREFETCH_DISTANCE ahead asked for as the block starts (_Block.prefetch)

# bytes ahead of a block's start in each array that its prefetches ask for: the fastest distance
# of those measured (cpu_step.py --prefetch-ab; the figures in docs/performance.md)
PREFETCH_DISTANCE = 2048
#: whether :func:`form` asks for PREFETCH: None = by the target CPU (:func:`prefetching`); the
#: benchmarks' A/B sets it
PREFETCH_ON = None


def _target_features() -> list:
    """Numba's target CPU's features (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, or the host's)."""
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return features.split(",")


def available() -> bool:
    """Whether Numba's target CPU has AVX-512: without 512-bit registers the blocks would be
    split and spilled."""
    return "+avx512f" in _target_features()


def prefetching() -> bool:
    """Whether the blocks prefetch (:data:`PREFETCH_ON`, else the target CPU): measured on Intel
    CPUs; not on AMD's (``znver*``), where an earlier prefetch, in the element loop, made the
    streamed limit kernel slower (Zen 4) -- off there until measured."""
    if PREFETCH_ON is not None:
        return bool(PREFETCH_ON)
    name = config.CPU_NAME
    if not name or name == "host":
        name = llvm.get_host_cpu_name()
    return not name.startswith("znver")


@njit
def prefetch_ahead(j, n, block):
    """The ``ahead`` of the block at element ``j`` of a chunk-table row of ``n`` elements
    (``block`` per block): :data:`PREFETCH_DISTANCE`; but 0 (the block's own lines) in a row
    shorter than a chunk -- its tensor's last -- where a prefetch of a 2-byte array would reach
    past the tensor's end, into memory another thread may be writing (its last
    ``PREFETCH_DISTANCE / 2 + block`` elements).  A full row's prefetches run on into the next
    row (the tensor's, or past a tensor of whole chunks): prefetching past every row slowed the
    in-cache benchmark, where each thread steps its own short tensor, and stopping short of every
    row's end slowed streamed steps (docs/performance.md, "Prefetching in the blocks")."""
    return PREFETCH_DISTANCE if n >= CHUNK or j + PREFETCH_DISTANCE // 2 + block <= n else 0


def native_bf16() -> bool:
    """Whether Numba's target CPU converts float32 to bfloat16 itself (AVX512-BF16), and
    classifies floats (AVX512DQ's ``vfpclassps``: :meth:`_Block.encode_bf16_native`; every CPU
    with the first has the second so far)."""
    features = _target_features()
    return "+avx512bf16" in features and "+avx512dq" in features


def form(weights: str, param_format, grad_format, companion_format, moment_formats: tuple,
         moment_rounding: str, track: bool, unit: bool, l2: bool = False):
    """The blocks' form (the flags above) for a chunk function's configuration, or None where
    they do not apply: moments all float32 or all bfloat16, nothing counted, a float32 or
    bfloat16 grad, a float32 or bfloat16 param as its own master (rounded to nearest or
    stochastically) or a bfloat16 param with a float32 copy, an int16 remainder or a Kahan
    compensation (bfloat16 or float32), and a target CPU with AVX-512.  (``formats``: the numpy
    element classes of ``storage.py``, ``np.int16`` for bfloat16 and the remainder; a float32
    value rounded stochastically is stored as it is.)"""
    master = (weights in ("param", "param-stochastic") and param_format in (np.float32, np.int16)) \
        or (weights == "copy" and param_format is np.int16 and companion_format is np.float32) \
        or (weights == "remainder" and param_format is np.int16 and companion_format is np.int16) \
        or (weights == "kahan" and param_format is np.int16 and companion_format in (np.float32, np.int16))
    moment16 = all(f is np.int16 for f in moment_formats)
    if not master or track or not (moment16 or all(f is np.float32 for f in moment_formats)) \
            or grad_format not in (np.float32, np.int16) or not available():
        return None
    param16, remainder, kahan = param_format is np.int16, weights == "remainder", weights == "kahan"
    sr_weights = weights == "param-stochastic" and param16
    sr_moments = moment_rounding == "stochastic" and moment16
    # some value is rounded to nearest bfloat16
    nearest16 = (param16 and not remainder and not sr_weights) or (moment16 and not sr_moments)
    return (L2 * bool(l2) | UNIT * bool(unit) | PARAM16 * param16 | GRAD16 * (grad_format is np.int16)
            | COPY * (weights == "copy") | REMAINDER * remainder | MOMENT16 * moment16 | KAHAN * kahan
            | COMPANION16 * (kahan and companion_format is np.int16) | SR_WEIGHTS * sr_weights
            | SR_MOMENTS * sr_moments | NATIVE16 * (nearest16 and native_bf16())
            | PREFETCH * prefetching())


class _Block:
    """The IR of one block: splatted scalars, and the loads and stores of its ``span``
    vectors per array, for a chunk function's form (the flags above)."""

    def __init__(self, builder, span: int, flags: int, scalars_at, param_at, grad_at, companion_at, keys_at,
                 element):
        self.builder, self.span, self.keys_at, self.element = builder, span, keys_at, element
        self.hashes = {}  # (stream, vector k) -> its random bits: the stream's two buffers share them
        self.unit, self.param16, self.grad16, self.copy, self.native16, self.remainder, self.moment16, \
            self.kahan, self.companion16, self.sr_weights, self.sr_moments = (bool(flags & bit) for bit in (
                UNIT, PARAM16, GRAD16, COPY, NATIVE16, REMAINDER, MOMENT16, KAHAN, COMPANION16, SR_WEIGHTS,
                SR_MOMENTS))
        f32, self.i32, self.i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        self.vector, self.words = ir.VectorType(f32, LANES), ir.VectorType(self.i32, LANES)
        self.halves = ir.VectorType(ir.IntType(16), LANES)
        self.pairs = ir.VectorType(ir.IntType(16), 2 * LANES)  # a vector's words as their 16-bit halves
        self.scalars_at = scalars_at
        self.canonical_nan = builder.bitcast(self.word(int(CANONICAL_NAN_F32)), self.vector)
        self.param_pointers = self.pointers(param_at, self.param16)
        self.grad_pointers = self.pointers(grad_at, self.grad16)
        self.master_pointers = self.pointers(companion_at, False) if self.copy else \
            self.pointers(companion_at, True) if self.remainder else self.param_pointers
        self.compensation_pointers = self.pointers(companion_at, self.companion16) if self.kahan else []
        self.compensations = []  # the Kahan compensations' vectors, loaded with the masters

    def prefetch(self, param_at, grad_at, companion_at, moments_at: list, ahead,
                 moment_bytes: int = 0) -> None:
        """Ask for each array's lines ``ahead`` bytes on (:func:`prefetch_ahead`), as many as the
        block spans (``prefetcht0``, a cache line each), before the block's first load.  Why:
        LLVM schedules each load next to its arithmetic, behind the divisions of the vectors
        before it, and the hardware prefetchers alone kept fewer lines in flight (the exact C
        loop, which GCC schedules with its loads first, ran ahead of the blocks).  A compiler-only
        fence keeps the prefetches first: without it LLVM sank them among the arithmetic, where
        they gained nothing.  A prefetch past an array's end is dropped by the CPU, never a
        fault.  ``moment_bytes``: a moment's bytes in the block where they are not its elements'
        (q8 rows)."""
        companion = 4 if self.copy or (self.kahan and not self.companion16) else \
            2 if self.remainder or self.kahan else 0  # (bytes per element; 0: none)
        arrays = [(param_at, 2 if self.param16 else 4), (grad_at, 2 if self.grad16 else 4)] \
            + ([(companion_at, companion)] if companion else [])
        moment_bytes = moment_bytes or (2 if self.moment16 else 4) * LANES * self.span
        _prefetch_lines(self.builder, [(address, size * LANES * self.span) for address, size in arrays]
                        + [(at, moment_bytes) for at in moments_at], ahead)

    def splat(self, x, kind=None):
        undefined = ir.Constant(kind or self.vector, ir.Undefined)
        one = self.builder.insert_element(undefined, x, ir.Constant(self.i32, 0))
        return self.builder.shuffle_vector(one, undefined, ir.Constant(self.words, [0] * LANES))

    def splat_word(self, x):
        return self.splat(x, self.words)

    def scalar(self, k: int):
        return self.splat(self.builder.load(self.builder.gep(self.scalars_at, [ir.Constant(self.i64, k)])))

    def word(self, value: int):
        return ir.Constant(self.words, [value] * LANES)

    def constant(self, value: float):
        return ir.Constant(self.vector, [value] * LANES)

    def pointers(self, address, sixteen: bool) -> list:
        """The block's ``span`` vector pointers into one array."""
        kind = self.halves if sixteen else self.vector
        step = (2 if sixteen else 4) * LANES
        return [self.builder.inttoptr(self.builder.add(address, ir.Constant(self.i64, step * k)),
                                      kind.as_pointer()) for k in range(self.span)]

    def load(self, pointer, sixteen: bool):
        """storage.decode: bfloat16 is the upper half of a float32."""
        x = self.builder.load(pointer, align=2 if sixteen else 4)
        return self.widen(x) if sixteen else x

    def widen(self, halves):
        """storage.decode_bf16 of a vector of bfloat16 bits: the upper half of a float32."""
        return self.builder.bitcast(self.builder.shl(self.builder.zext(halves, self.words), self.word(16)),
                                    self.vector)

    def canonical(self, x):
        """``x`` with every NaN made the canonical NaN (the storage spec's)."""
        return self.builder.select(self.builder.fcmp_unordered("uno", x, x), self.canonical_nan, x)

    def encode(self, x, sixteen: bool):
        """storage.encode_f32 / encode_bf16: the canonical NaN; round to nearest even."""
        if sixteen and self.native16:
            return self.encode_bf16_native(x)
        x = self.canonical(x)
        if sixteen:
            x = self.round_bf16(x)
        return x

    def encode_bf16_native(self, x):
        """storage.encode_bf16 by AVX512-BF16's conversion alone where no lane of ``x`` is a NaN
        or subnormal (``vfpclassps``; nearly always), else with the canonical NaN and
        :meth:`round_bf16_native`'s subnormal correction: the same bits either way."""
        builder = self.builder
        classify = _intrinsic(builder, "llvm.x86.avx512.fpclass.ps.512", ir.VectorType(ir.IntType(1), LANES),
                              [self.vector, ir.IntType(32)])
        special = builder.call(classify, [x, ir.Constant(ir.IntType(32), _NAN_OR_SUBNORMAL)])
        any_special = builder.icmp_unsigned("!=", builder.bitcast(special, ir.IntType(LANES)),
                                            ir.Constant(ir.IntType(LANES), 0))
        with builder.if_else(any_special, likely=False) as (rare, plain):
            with rare:
                corrected = self.round_bf16_native(self.canonical(x))
                rare_end = builder.block
            with plain:
                converted = builder.call(_bf16_conversion(builder, self), [x])
                plain_end = builder.block
        bits = builder.phi(self.halves)
        bits.add_incoming(corrected, rare_end)
        bits.add_incoming(converted, plain_end)
        return bits

    def store(self, x, pointer, sixteen: bool, buffer=None, k: int = 0):
        """:meth:`encode` and store; or, with a ``buffer`` number (storage.WEIGHTS...; a bfloat16
        value), rounded stochastically with that buffer's random bits for the block's vector ``k``."""
        if buffer is None:
            x = self.encode(x, sixteen)
        else:
            x = self.round_bf16_stochastic(x, self.buffer_bits(buffer, k))
        self.builder.store(x, pointer, align=2 if sixteen else 4)

    def buffer_bits(self, buffer: int, k: int):
        """storage.buffer_bits: the buffer's half of its stream's bits (the upper, or the lower
        moved up) as the words' upper 16 bits."""
        random = self.random(buffer >> 1, k)
        return self.builder.shl(random, self.word(16)) if buffer % 2 else \
            self.builder.and_(random, self.word(0xFFFF0000))

    def random(self, stream: int, k: int):
        """storage.random_bits of the vector ``k``'s elements in stream ``keys[stream]``:
        ``fmix32(key ^ (element * GOLDEN))``, the elements' products as the block's first
        times GOLDEN plus constants (the same modulo 2^32); hashed once per block and vector."""
        if (stream, k) not in self.hashes:
            self.hashes[stream, k] = self.hash(stream, k)
        return self.hashes[stream, k]

    def hash(self, stream: int, k: int):
        """The IR of :meth:`random`'s hash (built once per stream and vector)."""
        builder = self.builder
        key = builder.load(builder.gep(self.keys_at, [ir.Constant(self.i64, stream)]))
        first = builder.mul(self.element, ir.Constant(self.i32, GOLDEN))
        offsets = ir.Constant(self.words, [(LANES * k + lane) * GOLDEN % 2 ** 32 for lane in range(LANES)])
        h = builder.xor(self.splat_word(key), builder.add(self.splat_word(first), offsets))
        h = builder.xor(h, builder.lshr(h, self.word(16)))
        h = builder.mul(h, self.word(0x85EBCA6B))
        h = builder.xor(h, builder.lshr(h, self.word(13)))
        h = builder.mul(h, self.word(0xC2B2AE35))
        return builder.xor(h, builder.lshr(h, self.word(16)))

    def round_bf16_stochastic(self, x, random):
        """storage.encode_bf16_stochastic: the canonical NaN, then ``(bits + (u >> 16)) >> 16``."""
        builder = self.builder
        bits = builder.bitcast(self.canonical(x), self.words)
        bits = builder.add(bits, builder.lshr(random, self.word(16)))
        return builder.trunc(builder.lshr(bits, self.word(16)), self.halves)

    def round_bf16(self, x):
        """bfloat16 bits of ``x`` (no NaN), rounded to nearest even on the integer lanes:
        ``(bits + 0x7FFF + bit 16) >> 16``."""
        bits = self.builder.bitcast(x, self.words)
        odd = self.builder.and_(self.builder.lshr(bits, self.word(16)), self.word(1))
        rounded = self.builder.add(self.builder.add(bits, self.word(0x7FFF)), odd)
        return self.builder.trunc(self.builder.lshr(rounded, self.word(16)), self.halves)

    def round_bf16_native(self, x):
        """:meth:`round_bf16`'s bits from AVX512-BF16's ``vcvtneps2bf16`` (5 instructions for
        its 7, a faster kernel: docs/performance.md).  The
        conversion rounds to nearest even whatever MXCSR says, but reads a subnormal as zero:
        a float whose exponent field is 0 (zero or subnormal) gets it set to 1 first -- the
        same sign and 23 low bits, 2^-126 more: a normal float, rounded on the same grid
        (2^-133) with the same parity of its last kept bit -- and 0x0080 (the field's 1) is
        taken off its result again (a carry out of the mantissa lands on the smallest
        normal, 0x0080, as the integer rounding's does).  ``x`` holds no NaN (the
        conversion would keep a NaN's payload)."""
        builder = self.builder
        bits = builder.bitcast(x, self.words)
        low = builder.icmp_unsigned("==", builder.and_(bits, self.word(0x7F800000)), self.word(0))
        normal = builder.select(low, builder.or_(bits, self.word(0x00800000)), bits)
        normal = builder.bitcast(normal, self.vector)
        rounded = builder.call(_bf16_conversion(builder, self), [normal])
        return builder.select(low, builder.sub(rounded, ir.Constant(self.halves, [0x0080] * LANES)), rounded)

    def masters(self) -> list:
        """The masters' vectors: the param's, the float32 copy's (the param's where the param is
        not the copy's round to nearest even: edited since, storage.join_copy), or the param's
        joined with its remainder (storage.join_remainder: ``(param << 16) + remainder``, the
        remainder sign-extended, modulo 2^32, is the float32's bits); a Kahan compensation's
        vectors are loaded with them (``compensations``)."""
        self.compensations = [self.load(pointer, self.companion16) for pointer in self.compensation_pointers]
        if self.copy:
            builder, masters = self.builder, []
            for param, copy in zip(self.param_pointers, self.master_pointers):
                master = builder.load(copy, align=4)
                bits = builder.load(param, align=2)
                # (the integer rounding, not the native conversion: no branch on NaN lanes)
                written = builder.icmp_unsigned("==", self.round_bf16(self.canonical(master)), bits)
                masters.append(builder.select(written, master, self.widen(bits)))
            return masters
        if self.remainder:
            builder, masters = self.builder, []
            for param, remainder in zip(self.param_pointers, self.master_pointers):
                upper = builder.shl(builder.zext(builder.load(param, align=2), self.words), self.word(16))
                bits = builder.add(upper, builder.sext(builder.load(remainder, align=2), self.words))
                masters.append(builder.bitcast(self._param_where_stray(upper, bits), self.vector))
            return masters
        return [self.load(pointer, self.param16 and not self.copy) for pointer in self.master_pointers]

    def _param_where_stray(self, upper, bits):
        """``bits``, or the param's ``upper`` where ``bits`` is NaN and the param is not (an
        edited param beside its old remainder: storage.join_remainder)."""
        builder = self.builder
        magnitude = self.word(0x7FFFFFFF)
        joined_nan = builder.icmp_unsigned(">", builder.and_(bits, magnitude), self.word(0x7F800000))
        param_number = builder.icmp_unsigned("<=", builder.and_(upper, magnitude), self.word(0x7F800000))
        return builder.select(builder.and_(joined_nan, param_number), upper, bits)

    def grads(self, scale) -> list:
        """The grads' vectors, unscaled (times ``inv_grad_scale * sign``) unless ``UNIT``."""
        gs = [self.load(pointer, self.grad16) for pointer in self.grad_pointers]
        return gs if self.unit else [self.builder.fmul(g, self.splat(scale)) for g in gs]

    def store_master(self, k: int, w0, w) -> None:
        """storage.encode_master with rounding to nearest (``w0`` the master read, ``w`` the
        updated one): the param, and the copy's float32; or the exact master split
        (storage.split_remainder: the canonical NaN; the param ``(bits + 0x8000) >> 16``, the
        remainder the low 16 bits); or the param with its Kahan compensation
        (storage.encode_master_kahan: ``y = (w - w0) + c``, the param ``round(w0 + y)``, the
        compensation ``y - (param - w0)``)."""
        builder = self.builder
        if self.kahan:
            y = builder.fadd(builder.fsub(w, w0), self.compensations[k])
            rounded = self.encode(builder.fadd(w0, y), True)
            builder.store(rounded, self.param_pointers[k], align=2)
            self.store(builder.fsub(y, builder.fsub(self.widen(rounded), w0)), self.compensation_pointers[k],
                       self.companion16)
            return
        if self.remainder:
            bits = builder.bitcast(self.canonical(w), self.words)
            # the params (the adjusted words' upper halves) and the remainders (the words' lower
            # halves) gathered into one vector by one word shuffle, stored as its two halves (two
            # truncating stores, vpmovdw, streamed slower: docs/performance.md)
            adjusted = builder.bitcast(builder.add(bits, self.word(0x8000)), self.pairs)
            both = builder.shuffle_vector(adjusted, builder.bitcast(bits, self.pairs), ir.Constant(
                ir.VectorType(self.i32, 2 * LANES), [2 * i + 1 for i in range(LANES)]
                + [2 * LANES + 2 * i for i in range(LANES)]))
            for half, pointer in enumerate((self.param_pointers[k], self.master_pointers[k])):
                builder.store(builder.shuffle_vector(both, both, ir.Constant(
                    self.words, list(range(half * LANES, (half + 1) * LANES)))), pointer, align=2)
            return
        self.store(w, self.param_pointers[k], self.param16, WEIGHTS if self.sr_weights else None, k)
        if self.copy:
            self.store(w, self.master_pointers[k], False)


def _prefetch_lines(builder, spans: list, ahead) -> None:
    """``prefetcht0`` of every cache line of each (address, bytes) span moved ``ahead`` bytes on,
    then a compiler-only fence that keeps them before what follows (:meth:`_Block.prefetch`)."""
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
    prefetch = _intrinsic(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, i32, i32, i32])
    read, all_levels, data = (ir.Constant(i32, k) for k in (0, 3, 1))
    for address, size in spans:
        for line in range(0, size, 64):
            at = builder.add(builder.add(address, ahead), ir.Constant(i64, line))
            builder.call(prefetch, [builder.inttoptr(at, i8p), read, all_levels, data])
    builder.fence("acq_rel", "singlethread")


@intrinsic(prefer_literal=True)
def prefetch_span(typingctx, address, size, ahead):
    """``prefetch_span(address, size, ahead)``: the blocks' prefetch (:meth:`_Block.prefetch`)
    of the ``size`` bytes (a constant) at ``address`` (int64) moved ``ahead`` bytes on, for a
    plain loop over groups of elements (the benchmarks' streamed limit kernel)."""
    if not isinstance(size, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        _prefetch_lines(builder, [(args[0], size.literal_value)], args[2])
        return context.get_dummy_value()

    return types.void(address, size, ahead), codegen


def _intrinsic(builder, name: str, result, arguments: list):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)


#: ``vfpclassps``'s classes: quiet NaN (0x01), subnormal (0x20), signalling NaN (0x80)
_NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80


def _bf16_conversion(builder, block):
    """AVX512-BF16's ``vcvtneps2bf16`` of a block's vectors (declared with 16-bit integer lanes,
    as before LLVM's bfloat type: LLVM upgrades it)."""
    return _intrinsic(builder, "llvm.x86.avx512bf16.cvtneps2bf16.512", block.halves, [block.vector])


def _sqrt(builder, vector):
    return _intrinsic(builder, f"llvm.sqrt.v{LANES}f32", vector, [vector])


def _block_codegen(flags: int, span: int, scalar_count: int, update, roles: tuple):
    """The codegen of a block intrinsic with the arguments (form, param, grad, companion, the
    moments' addresses..., scalars, scale, keys, element): the block's masters, grads and moments loaded,
    ``update(block, values, w, g, moments) -> (w, moments)`` on each vector (``values``: the
    first ``scalar_count`` scalars, splatted), then every result stored (``roles``: the moments',
    whose buffers, ``roles.buffer_of``, round them with ``SR_MOMENTS``)."""
    buffers = [buffer_of(role) if flags & SR_MOMENTS else None for role in roles]

    def codegen(context, builder, sig, args):
        param_at, grad_at, companion_at, *moments_at, scalars_at, scale, keys_at, element, ahead = args[1:]
        element = builder.trunc(element, ir.IntType(32)) if element.type.width > 32 else element
        block = _Block(builder, span, flags, scalars_at, param_at, grad_at, companion_at, keys_at, element)
        if flags & PREFETCH:
            block.prefetch(param_at, grad_at, companion_at, moments_at, ahead)
        values = [block.scalar(k) for k in range(scalar_count)]
        pointers = [block.pointers(at, block.moment16) for at in moments_at]
        ws, gs = block.masters(), block.grads(scale)
        loaded = [[block.load(pointer, block.moment16) for pointer in moment] for moment in pointers]
        results = [update(block, values, w, g, moments) for w, g, *moments in zip(ws, gs, *loaded)]
        for k, (w, moments) in enumerate(results):
            block.store_master(k, ws[k], w)
            for x, moment, buffer in zip(moments, pointers, buffers):
                block.store(x, moment[k], block.moment16, buffer, k)
        return context.get_dummy_value()

    return codegen


# The algorithms' updates of one vector (``update(block, values, w, g, moments) -> (w, moments)``,
# ``values`` the first ``*_SCALARS`` scalars, splatted), shared by these blocks and q8_blocks.py's.
ADAM_SCALARS, LION_SCALARS, SGD_SCALARS = 9, 6, 4


def adam_math(flags: int):
    """adam.py's update, operation by operation (``L2`` of ``flags``)."""
    def update(block, values, w, g, moments):
        builder, (m, v) = block.builder, moments
        beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps, \
            weight_decay, decay = values
        if flags & L2:
            g = builder.fadd(g, builder.fmul(w, weight_decay))
        w = builder.fmul(w, decay)
        m = builder.fadd(builder.fmul(m, beta1), builder.fmul(g, one_minus_beta1))
        v = builder.fadd(builder.fmul(v, beta2), builder.fmul(builder.fmul(g, one_minus_beta2), g))
        d = builder.call(_sqrt(builder, block.vector), [v])
        d = builder.fadd(builder.fmul(d, inv_sqrt_bias_correction2), eps)
        w = builder.fsub(w, builder.fmul(builder.fdiv(m, d), step_size))
        return w, (m, v)

    return update


def lion_math(flags: int):
    """lion.py's update, operation by operation."""
    def update(block, values, w, g, moments):
        builder, (m,) = block.builder, moments
        beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay = values
        zero, one, minus_one = block.constant(0.0), block.constant(1.0), block.constant(-1.0)
        w = builder.fmul(w, decay)
        c = builder.fadd(builder.fmul(m, beta1), builder.fmul(g, one_minus_beta1))
        s = builder.fadd(c, zero)  # sign(c): +0 for +-0, NaN for NaN
        s = builder.select(builder.fcmp_ordered(">", c, zero), one, s)
        s = builder.select(builder.fcmp_ordered("<", c, zero), minus_one, s)
        w = builder.fsub(w, builder.fmul(s, lr))
        m = builder.fadd(builder.fmul(m, beta2), builder.fmul(g, one_minus_beta2))
        return w, (m,)

    return update


def sgd_math(flags: int):
    """sgd.py's update, operation by operation (``L2``, ``UNIT``, ``NESTEROV`` of ``flags``)."""
    def update(block, values, w, g, moments):
        builder, (b,) = block.builder, moments
        momentum, one_minus_dampening, lr, weight_decay = values
        if flags & L2:
            g = builder.fadd(g, builder.fmul(w, weight_decay))
        b = builder.fmul(b, momentum)
        b = builder.fadd(b, g if flags & UNIT else builder.fmul(g, one_minus_dampening))
        g = builder.fadd(g, builder.fmul(b, momentum)) if flags & NESTEROV else b
        w = builder.fsub(w, builder.fmul(g, lr))
        return w, (b,)

    return update


# One intrinsic per algorithm, the form a literal argument: an intrinsic made per form and held
# in a chunk function's closure would put its per-process id into Numba's on-disk cache key.
@intrinsic(prefer_literal=True)
def adam_block(typingctx, form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale, keys, element,
               ahead):
    """``adam_block(form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale, keys, element,
    ahead)``:
    ``adam.py``'s update of the ``ADAM_BLOCK`` elements at the addresses (int64; the companion's
    only with ``COPY``, ``REMAINDER`` or ``KAHAN``), in place.  ``form``: a constant of the flags above;
    ``scalars``: the chunk function's (beta1, beta2, 1 - beta1, 1 - beta2, step size, 1 / sqrt(bias
    correction 2), eps, weight decay, decay); ``scale``: ``inv_grad_scale * sign``, not read
    with ``UNIT``; ``keys``: the chunk function's random streams' keys (``chunks.KEYS``)
    and ``element`` the block's first element's counter (``storage.element_index``), read with
    ``SR_WEIGHTS`` / ``SR_MOMENTS``; ``ahead``: the bytes ahead of the block its prefetches ask
    for, read with ``PREFETCH`` (:func:`prefetch_ahead`)."""
    if not isinstance(form, types.IntegerLiteral):
        return None
    flags = form.literal_value

    return (types.void(form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale, keys, element,
                       ahead),
            _block_codegen(flags, ADAM_SPAN, ADAM_SCALARS, adam_math(flags), ("exp_avg", "exp_avg_sq")))


@intrinsic(prefer_literal=True)
def lion_block(typingctx, form, param, grad, companion, exp_avg, scalars, scale, keys, element, ahead):
    """``lion_block(form, param, grad, companion, exp_avg, scalars, scale, keys, element, ahead)``:
    ``lion.py``'s
    update of the ``LION_BLOCK`` elements at the addresses, in place, as :func:`adam_block` (no
    ``L2``); ``scalars``: the chunk function's (beta1, beta2, 1 - beta1, 1 - beta2, lr,
    decay)."""
    if not isinstance(form, types.IntegerLiteral) or form.literal_value & L2:
        return None

    return (types.void(form, param, grad, companion, exp_avg, scalars, scale, keys, element, ahead),
            _block_codegen(form.literal_value, LION_SPAN, LION_SCALARS, lion_math(form.literal_value),
                           ("exp_avg",)))


@intrinsic(prefer_literal=True)
def sgd_block(typingctx, form, param, grad, companion, momentum_buffer, scalars, scale, keys, element,
              ahead):
    """``sgd_block(form, param, grad, companion, momentum_buffer, scalars, scale, keys, element, ahead)``:
    ``sgd.py``'s update with a momentum buffer (not its first step) of the ``SGD_BLOCK``
    elements at the addresses, in place, as :func:`adam_block` (``NESTEROV``; ``UNIT``: also
    no multiplication by ``1 - dampening``, as sgd.py's ``unit``); ``scalars``: the chunk
    function's (momentum, 1 - dampening, lr, weight decay)."""
    if not isinstance(form, types.IntegerLiteral):
        return None
    flags = form.literal_value

    return (types.void(form, param, grad, companion, momentum_buffer, scalars, scale, keys, element, ahead),
            _block_codegen(flags, SGD_SPAN, SGD_SCALARS, sgd_math(flags), ("momentum_buffer",)))
