"""Compute-limit kernels: the arithmetic no implementation of a configuration can avoid.

The memory-limit kernels of ``cpu_step.py`` say how fast a step can move its bytes; these
say how fast it can do its unavoidable arithmetic with the bytes in cache.  A preset's
ceiling is the slower of the two.  Per element, a compute-limit kernel does only:

* decode every stored operand (bfloat16 -> float32 is a shift; float32 as is; the
  remainder join is integer ops; a float32 copy is the master unless the param is not its
  rounding, a rounding and a compare), two elements per 32-bit word when every array is 16-bit
  (a shift or a mask per element, one merge per pair to encode: the cheapest way known,
  which bf16opt's kernels use too, and a limit slower than bf16opt is no limit);
* the algorithm's float32 operations as ``bf16opt/backends/reference.py`` lists them (each
  one IEEE-rounded on its own: the contract is bit-identity with that listing, so none can
  be skipped, fused or reordered), among them one exactly rounded square root and one
  exactly rounded division (Adam) -- except multiplications by scalars that are exactly 1
  in the benchmark, which an implementation could skip by testing the scalar once per call:
  the gradient's unscaling (no GradScaler, not maximising) and SGD's ``1 - dampening``;
* encode every stored result, NaN made canonical as the storage spec requires (one compare
  and one select per stored value): round to nearest even into bfloat16 (a few integer
  ops), or stochastic rounding with the counter-based hashes the storage spec asks for (one
  per element and stream: a stream's hash gives two buffers their 16 bits each, so AdamW
  ``bf16-sr`` hashes twice per element, Lion's and SGD's once), the Kahan compensation (the
  reference's six operations), or the remainder split;

written as plainly as Numba allows (no fastmath: exactly rounded sqrt and division are part
of the contract).  The kernels run over one cache-resident block per thread, ``passes``
times, so memory is taken out; the time for ``n`` element updates is then the compute
ceiling.  The benchmark checks the limit is not slower than bf16opt's own kernel in cache
(then it would not be a limit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cfunc, get_num_threads, njit, prange

from bf16opt._cpu import q8, vector_blocks
from bf16opt._cpu.chunks import (CHUNK_SIGNATURE, COUNTERS, KEYS, _run_row, cached_njit, chunk_compiler, run_chunks,
                                 run_chunks_serial)
from bf16opt._cpu.storage import (EXP_AVG, EXP_AVG_SQ, WEIGHTS, bits_to_f32, buffer_bits, element_index,
                                  f32_to_bits, high_half, join_remainder, low_half, pair_word, pointer_to,
                                  random_bits)


@dataclass(frozen=True)
class Storage:
    """How one configuration stores its buffers (what the kernel must decode and encode)."""

    param16: bool          # params are 16-bit (bfloat16) rather than float32
    master: str            # "param" (the param is the master), "copy" (float32 copy), "remainder"
    moments16: bool        # moments stored in bfloat16
    stochastic: bool       # 16-bit master and 16-bit (or q8) moments stochastically rounded
    kahan: bool            # bfloat16 Kahan compensation of a 16-bit master
    q8: bool = False       # moments in q8 blocks (q8_chunk_function)


# preset -> storage for bf16 params (fp32 params: every buffer float32, "param" master)
PRESET_STORAGE = {
    "fp32": Storage(True, "copy", False, False, False),
    "bf16": Storage(True, "param", True, False, False),
    "bf16-master": Storage(True, "param", False, False, False),
    "bf16-states": Storage(True, "copy", True, False, False),
    "bf16-sr": Storage(True, "param", True, True, False),
    "bf16-kahan": Storage(True, "param", True, False, True),
    "fp32-remainder": Storage(True, "remainder", False, False, False),
    "fp32-remainder-bf16-states": Storage(True, "remainder", True, False, False),
    "fp32-remainder-q8": Storage(True, "remainder", False, False, False, q8=True),
    "bf16-sr-q8": Storage(True, "param", False, True, False, q8=True),
}
FP32_PARAMS = Storage(False, "param", False, False, False)

MOMENTS = {"adam": 2, "lion": 1, "sgd": 1}


# the step's scalars, as the kernels get them (cpu_step.py's hyper-parameters at step 2);
# run-time values, as in bf16opt's kernels (not constants LLVM could fold or rematerialise)
SCALARS = {
    # beta1, beta2, 1 - beta1, 1 - beta2, step_size, 1 / sqrt(bias correction 2), eps, decay
    "adam": (0.9, 0.999, 0.1, 0.001, 1e-3 / (1 - 0.9 ** 2), 1 / np.sqrt(1 - 0.999 ** 2), 1e-8, 1 - 1e-3 * 1e-2),
    # beta1, beta2, 1 - beta1, 1 - beta2, lr, decay
    "lion": (0.9, 0.99, 0.1, 0.01, 1e-4, 1 - 1e-4 * 1e-2),
    # momentum, lr, weight_decay
    "sgd": (0.9, 1e-2, 1e-4),
}


@njit(inline="always")
def _bf16(bits16):
    return bits_to_f32(np.uint32(np.uint32(np.uint16(bits16)) << np.uint32(16)))


@njit(inline="always")
def _f32(x):
    return x if x == x else bits_to_f32(np.uint32(0x7FC00000))


@njit(inline="always")
def _rne_bits(x):
    bits = f32_to_bits(_f32(x))
    return np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))


@njit(inline="always")
def _rne(x):
    return np.int16(np.uint16(_rne_bits(x) >> np.uint32(16)))


@njit(inline="always")
def _sr(x, random):
    bits = f32_to_bits(_f32(x))
    return np.int16(np.uint16(np.uint32(bits + (random >> np.uint32(16))) >> np.uint32(16)))


GROUP = 128  # elements between the prefetching form's prefetches (an Adam block of bf16opt's)


@functools.lru_cache(maxsize=None)
def chunk_function(algorithm: str, storage: Storage, contract: bool = False, prefetch: bool = False):
    """The compute-limit work as a chunk function (``cpu_src/chunks.py``'s CHUNK_SIGNATURE),
    run by the same driver as bf16opt's: so its loop is compiled on its own, as theirs is.

    A row holds the addresses of param, grad, w, m, v (``w``: the float32 copy, the int16
    remainder or the bf16 compensation; ``v`` used by Adam only), then the length, the first
    element's index (the hash's counter) and the thread's index (its row of ``keys``).  When
    every array is 16-bit, two elements at a time from one 32-bit word of each array (one
    shift or mask to decode, one merge per pair to encode).

    ``contract``: not a limit -- the same source with LLVM free to fuse a multiplication and
    the addition of its product into one fused multiply-add (``fastmath={"contract"}``, one
    rounding instead of two: not bit-identical to the reference), as a C compiler building a
    peer's kernel may.  It measures what the fusing gains on the machine at hand.

    ``prefetch``: the same work in groups of ``GROUP`` elements, each group first asking for its
    arrays' lines as bf16opt's blocks do (``vector_blocks.prefetch_span``, the distance of
    ``prefetch_ahead``): the plain loop with the blocks' memory access, for the streamed limit
    where bf16opt's kernels prefetch (without it, bf16opt's blocks ran up to 1.34x its speed)."""
    param16, master, moments16 = storage.param16, storage.master, storage.moments16
    stochastic, kahan = storage.stochastic, storage.kahan
    moments = MOMENTS[algorithm]
    adam, lion = algorithm == "adam", algorithm == "lion"
    has_w = kahan or master != "param"
    paired = param16 and moments16 and master != "copy"
    sixteen, thirty_two = np.int16, np.float32
    param_format = sixteen if param16 else thirty_two
    w_format = thirty_two if master == "copy" else sixteen
    moment_format = sixteen if moments16 else thirty_two

    # bytes of a group in each array (prefetch_span's constant sizes)
    p_bytes, w_bytes, m_bytes = (GROUP * np.dtype(f).itemsize
                                 for f in (param_format, w_format, moment_format))
    compile_chunk = cfunc(CHUNK_SIGNATURE, error_model="numpy", fastmath={"contract"}) if contract \
        else chunk_compiler((algorithm, storage) + (("prefetch", GROUP),) * prefetch)

    @compile_chunk
    def chunk(row, scalars, keys, counts):
        p = pointer_to(row[0], param_format)
        g = pointer_to(row[1], param_format)
        w = pointer_to(row[2], w_format)
        m = pointer_to(row[3], moment_format)
        v = pointer_to(row[4], moment_format)
        n, start = row[5], row[6]
        if adam:
            beta1, beta2, one_minus_beta1, one_minus_beta2 = scalars[0], scalars[1], scalars[2], scalars[3]
            step_size, inv_sqrt_bc2, eps, decay = scalars[4], scalars[5], scalars[6], scalars[7]
        elif lion:
            beta1, beta2, one_minus_beta1, one_minus_beta2 = scalars[0], scalars[1], scalars[2], scalars[3]
            lr, decay = scalars[4], scalars[5]
        else:
            momentum, lr, weight_decay = scalars[0], scalars[1], scalars[2]
        key_0, key_1 = keys[0], keys[1]  # the streams of (param, first moment) and of the second moment

        def update(gs, ps, ws, ms, vs, element):
            """Stored elements in, stored elements (param, w, m, v) out."""
            random_0, random_1 = random_bits(key_0, element), random_bits(key_1, element)  # (or dead code)
            grad = _bf16(gs) if param16 else gs
            if master == "copy":  # the copy, or the param where it is not the copy's rounding (edited)
                w0 = (ws if _rne(ws) == ps else _bf16(ps)) if param16 else ws
            elif master == "remainder":  # (the spec's join: a 32-bit subtraction and its NaN guard)
                w0 = join_remainder(ps, ws)
            else:
                w0 = _bf16(ps) if param16 else ps
            first = _bf16(ms) if moments16 else ms
            second = _bf16(vs) if moments16 else vs
            if adam:
                new = w0 * decay
                first = first * beta1 + grad * one_minus_beta1
                second = second * beta2 + (grad * one_minus_beta2) * grad
                d = np.sqrt(second) * inv_sqrt_bc2 + eps
                new = new - (first / d) * step_size
            elif lion:
                new = w0 * decay
                c = first * beta1 + grad * one_minus_beta1
                sign = c + np.float32(0.0)
                sign = np.float32(1.0) if c > np.float32(0.0) else sign
                sign = np.float32(-1.0) if c < np.float32(0.0) else sign
                new = new - sign * lr
                first = first * beta2 + grad * one_minus_beta2
            else:
                grad = grad + w0 * weight_decay
                first = first * momentum + grad
                new = w0 - first * lr
            if kahan:  # reference.py's compensated store of a 16-bit master
                y = (new - w0) + _bf16(ws)
                rounded = _rne_bits(w0 + y)
                ps = np.int16(np.uint16(rounded >> np.uint32(16)))
                ws = _rne(y - (bits_to_f32(rounded & np.uint32(0xFFFF0000)) - w0))
            elif master == "copy":
                ws = _f32(new)
                ps = _rne(new)
            elif master == "remainder":
                bits = f32_to_bits(_f32(new))
                ps = np.int16(np.uint16(np.uint32(bits + np.uint32(0x8000)) >> np.uint32(16)))
                ws = np.int16(np.uint16(bits & np.uint32(0xFFFF)))
            elif param16:
                ps = _sr(new, buffer_bits(random_0, WEIGHTS)) if stochastic else _rne(new)
            else:
                ps = _f32(new)
            if moments16:
                ms = _sr(first, buffer_bits(random_0, EXP_AVG)) if stochastic else _rne(first)
                vs = _sr(second, buffer_bits(random_1, EXP_AVG_SQ)) if stochastic else _rne(second)
            else:
                ms = _f32(first)
                vs = _f32(second)
            return ps, ws, ms, vs

        def ask(first):  # the prefetching form's prefetches for the group at element ``first``
            ahead = vector_blocks.prefetch_ahead(first, n, GROUP)
            vector_blocks.prefetch_span(row[0] + p_bytes // GROUP * first, p_bytes, ahead)
            vector_blocks.prefetch_span(row[1] + p_bytes // GROUP * first, p_bytes, ahead)
            if has_w:
                vector_blocks.prefetch_span(row[2] + w_bytes // GROUP * first, w_bytes, ahead)
            vector_blocks.prefetch_span(row[3] + m_bytes // GROUP * first, m_bytes, ahead)
            if moments == 2:
                vector_blocks.prefetch_span(row[4] + m_bytes // GROUP * first, m_bytes, ahead)

        group = GROUP if prefetch else n + 2  # (without: one group, the plain loop)
        if paired:
            pw, gw, ww = pointer_to(row[0], np.uint32), pointer_to(row[1], np.uint32), pointer_to(row[2], np.uint32)
            mw, vw = pointer_to(row[3], np.uint32), pointer_to(row[4], np.uint32)
            for first in range(0, n, group):
                if prefetch:
                    ask(first)
                for j in range(first >> 1, min(first + group, n) >> 1):
                    x = ww[j] if has_w else np.uint32(0)
                    y = vw[j] if moments == 2 else np.uint32(0)
                    low = update(low_half(gw[j], np.int16), low_half(pw[j], np.int16),
                                 low_half(x, np.int16), low_half(mw[j], np.int16), low_half(y, np.int16),
                                 element_index(start, 2 * j))
                    high = update(high_half(gw[j], np.int16), high_half(pw[j], np.int16),
                                  high_half(x, np.int16), high_half(mw[j], np.int16), high_half(y, np.int16),
                                  element_index(start, 2 * j + 1))
                    pw[j] = pair_word(low[0], high[0])
                    if has_w:
                        ww[j] = pair_word(low[1], high[1])
                    mw[j] = pair_word(low[2], high[2])
                    if moments == 2:
                        vw[j] = pair_word(low[3], high[3])
        else:
            for first in range(0, n, group):
                if prefetch:
                    ask(first)
                for i in range(first, min(first + group, n)):
                    out = update(g[i], p[i], w[i] if has_w else w_format(0), m[i],
                                 v[i] if moments == 2 else m[i], element_index(start, i))
                    p[i] = out[0]
                    if has_w:
                        w[i] = out[1]
                    m[i] = out[2]
                    if moments == 2:
                        v[i] = out[3]

    return chunk


@dataclass(frozen=True)
class Operands:
    """Cache-resident arrays [thread, block] of one configuration (``w`` and ``v`` empty when the
    configuration has none), the step's scalars and each thread's stream keys."""

    g: np.ndarray
    p: np.ndarray
    w: np.ndarray
    m: np.ndarray
    v: np.ndarray
    scalars: np.ndarray
    keys: np.ndarray


def arrays(threads: int, block: int, algorithm: str, storage: Storage, seed: int = 0) -> Operands:
    """Operands for :func:`runner` (``block`` even: the paired loop takes two elements at a
    time): positive second moments (a real sqrt), small enough next to the squared grads
    that a step changes their bfloat16 encodings."""
    if block % 2:
        raise ValueError(f"block must be even, got {block}")
    rng = np.random.default_rng(seed)

    def values(scale, positive=False):
        x = rng.standard_normal((threads, block)).astype(np.float32) * np.float32(scale)
        return np.abs(x) + np.float32(scale) if positive else x

    def stored(x, sixteen):
        return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.int16) if sixteen else x

    g = stored(values(1e-3), storage.param16)
    p = stored(values(0.02), storage.param16)
    if storage.master == "copy":
        w = values(0.02)
    elif storage.master == "remainder" or storage.kahan:
        w = np.zeros((threads, block), dtype=np.int16)
    else:
        w = np.zeros((threads, 0), dtype=np.float32)
    if storage.q8:  # rows of random codes (none NaN) and a scale
        if block % q8.BLOCK:
            raise ValueError(f"q8 blocks need a multiple of {q8.BLOCK} elements, got {block}")
        m, v = (_q8_rows(rng, threads, block, signed, scale) for signed, scale in ((True, 1e-3), (False, 1e-6)))
        v = v if MOMENTS[algorithm] == 2 else m[:, :0]
        return Operands(g, p, w, m, v, np.array(SCALARS[algorithm], dtype=np.float32),
                        np.arange(1, threads * KEYS + 1, dtype=np.uint32).reshape(threads, KEYS))
    m = stored(values(1e-3), storage.moments16)
    v = stored(values(1e-7, positive=True), storage.moments16) if MOMENTS[algorithm] == 2 else m[:, :0]
    keys = np.arange(1, threads * KEYS + 1, dtype=np.uint32).reshape(threads, KEYS)  # run-time values
    return Operands(g, p, w, m, v, np.array(SCALARS[algorithm], dtype=np.float32), keys)


def _q8_rows(rng, threads: int, block: int, signed: bool, scale: float) -> np.ndarray:
    """[thread, q8 rows' bytes]: each block's 256 codes (random, none the non-finite code) and its scale."""
    rows = np.empty((threads, block // q8.BLOCK, q8.ROW), dtype=np.uint8)
    codes = rng.integers(0, 255, size=rows[..., :q8.BLOCK].shape)
    rows[..., :q8.BLOCK] = (codes - 127) & 0xFF if signed else codes
    rows[..., q8.BLOCK:] = np.full(rows.shape[:2], scale, dtype=np.float32)[..., None].view(np.uint8)
    return rows.reshape(threads, -1)


@functools.lru_cache(maxsize=None)
def q8_chunk_function(algorithm: str, storage: Storage, prefetch: bool = False):
    """The compute-limit work of a configuration with q8 moments (``storage.q8``; a bf16 param as
    its own master or with an int16 remainder), as a chunk function (rows as
    :func:`chunk_function`'s, ``m`` and ``v`` the addresses of q8 rows).  Per block of 256
    elements, written plainly: each q8 moment's codes decoded (a table lookup and a
    multiplication per element, ``q8.decode_block``), the algorithm's float32 operations and the
    master's encoding (as :func:`chunk_function`), then each moment quantized
    (``q8.quantize_block``: the integer maximum of the magnitudes, one division per element and
    the two comparisons of its bucketed table; stochastic rounding with ``storage.stochastic``).
    ``prefetch``: each block first asks for its arrays' lines, as bf16opt's blocks do."""
    if not storage.param16 or storage.master not in ("param", "remainder") or storage.kahan:
        raise ValueError(f"no q8 compute limit for {storage}")
    adam, lion = algorithm == "adam", algorithm == "lion"
    two = MOMENTS[algorithm] == 2
    remainder, stochastic = storage.master == "remainder", storage.stochastic
    sixteen = np.int16
    p_bytes, row_bytes = 2 * q8.BLOCK, q8.ROW

    @chunk_compiler((algorithm, storage, "q8") + (("prefetch", q8.BLOCK),) * prefetch)
    def chunk(row, scalars, keys, counts):
        p, g, w = pointer_to(row[0], sixteen), pointer_to(row[1], sixteen), pointer_to(row[2], sixteen)
        n, start = row[5], row[6]
        key_0, key_1 = keys[0], keys[1]
        ms, vs = q8.scratch_block(), q8.scratch_block()
        for first in range(0, n, q8.BLOCK):
            count = min(q8.BLOCK, n - first)
            m_row = pointer_to(row[3] + (first // q8.BLOCK) * row_bytes, np.uint8)
            v_row = pointer_to(row[4] + (first // q8.BLOCK) * row_bytes, np.uint8)
            if prefetch:
                ahead = vector_blocks.prefetch_ahead(first, n, q8.BLOCK)
                vector_blocks.prefetch_span(row[0] + 2 * first, p_bytes, ahead)
                vector_blocks.prefetch_span(row[1] + 2 * first, p_bytes, ahead)
                if remainder:
                    vector_blocks.prefetch_span(row[2] + 2 * first, p_bytes, ahead)
                vector_blocks.prefetch_span(row[3] + (first // q8.BLOCK) * row_bytes, row_bytes, ahead)
                if two:
                    vector_blocks.prefetch_span(row[4] + (first // q8.BLOCK) * row_bytes, row_bytes, ahead)
            q8.decode_block(m_row, count, q8.SIGNED, ms)
            if two:
                q8.decode_block(v_row, count, q8.UNSIGNED, vs)
            for j in range(count):
                i = first + j
                element = element_index(start, i)
                grad = _bf16(g[i])
                if remainder:  # (the spec's join: a 32-bit subtraction and its NaN guard)
                    w0 = join_remainder(p[i], w[i])
                else:
                    w0 = _bf16(p[i])
                first_moment = ms[j]
                if adam:
                    beta1, beta2, one_minus_beta1, one_minus_beta2 = scalars[0], scalars[1], scalars[2], scalars[3]
                    new = w0 * scalars[7]
                    first_moment = first_moment * beta1 + grad * one_minus_beta1
                    second = vs[j] * beta2 + (grad * one_minus_beta2) * grad
                    d = np.sqrt(second) * scalars[5] + scalars[6]
                    new = new - (first_moment / d) * scalars[4]
                    vs[j] = second
                elif lion:
                    new = w0 * scalars[5]
                    c = first_moment * scalars[0] + grad * scalars[2]
                    sign = c + np.float32(0.0)
                    sign = np.float32(1.0) if c > np.float32(0.0) else sign
                    sign = np.float32(-1.0) if c < np.float32(0.0) else sign
                    new = new - sign * scalars[4]
                    first_moment = first_moment * scalars[1] + grad * scalars[3]
                else:
                    grad = grad + w0 * scalars[2]
                    first_moment = first_moment * scalars[0] + grad
                    new = w0 - first_moment * scalars[1]
                ms[j] = first_moment
                if remainder:
                    bits = f32_to_bits(_f32(new))
                    p[i] = np.int16(np.uint16(np.uint32(bits + np.uint32(0x8000)) >> np.uint32(16)))
                    w[i] = np.int16(np.uint16(bits & np.uint32(0xFFFF)))
                else:
                    p[i] = _sr(new, buffer_bits(random_bits(key_0, element), WEIGHTS)) if stochastic else _rne(new)
            q8.quantize_block(ms, count, q8.SIGNED, stochastic, key_0, EXP_AVG & 1, start + first, m_row)
            if two:
                q8.quantize_block(vs, count, q8.UNSIGNED, stochastic, key_1, EXP_AVG_SQ & 1, start + first, v_row)

    return chunk


@cached_njit(parallel=True, nogil=True)
def run_chunks_static(address, table, scalars, keys, row_counts, bounds):
    """bf16opt's chunk driver without its work stealing: thread ``k`` runs the rows
    ``bounds[k]:bounds[k + 1]`` and no others.  For the in-cache kernels, whose rows point at
    one cache-resident block per thread: a row stolen there moves a block between cores (the
    rows of a real step each have memory of their own)."""
    for part in prange(bounds.size - 1):
        for row in range(bounds[part], bounds[part + 1]):
            _run_row(address, table, scalars, keys, row_counts, row)


def runner(algorithm: str, storage: Storage, operands: Operands, passes: int, serial: bool = False,
           contract: bool = False, static: bool = False, prefetch: bool = False):
    """A call updating each block (row) of ``operands`` ``passes`` times through bf16opt's chunk
    driver (``run_chunks``: the blocks' rows in one contiguous range per Numba thread, as a
    step's chunk table, stealing included; ``serial``: ``run_chunks_serial``; ``static``:
    :func:`run_chunks_static`; ``contract``, ``prefetch``: see :func:`chunk_function`).  In cache:
    one block per thread; over a step's tensors (``cpu_step.streamed_limit_step``): its chunks."""
    if storage.q8 and contract:
        raise ValueError("the q8 compute limit has no contracted form")
    chunk = q8_chunk_function(algorithm, storage, prefetch) if storage.q8 else \
        chunk_function(algorithm, storage, contract, prefetch)
    blocks, block = operands.p.shape
    addresses = np.array([[a[t].ctypes.data if a.shape[1] else 0 for a in
                           (operands.p, operands.g, operands.w, operands.m, operands.v)]
                          for t in range(blocks)], dtype=np.int64)
    table = np.empty((blocks * passes, addresses.shape[1] + 3), dtype=np.int64)
    table[:, :-3] = np.repeat(addresses, passes, axis=0)
    table[:, -3] = block
    table[:, -2] = np.tile(np.arange(passes, dtype=np.int64) * block, blocks)  # the counter goes on
    table[:, -1] = np.repeat(np.arange(blocks, dtype=np.int64), passes)
    parts = get_num_threads()
    bounds = np.arange(parts + 1, dtype=np.int64) * table.shape[0] // parts
    counts = np.zeros((table.shape[0], COUNTERS), dtype=np.int64)
    run = run_chunks_serial if serial else run_chunks_static if static else run_chunks

    def call():
        run(chunk.address, table, operands.scalars, operands.keys, counts, bounds)

    call.keep = operands  # the table holds their addresses
    return call
