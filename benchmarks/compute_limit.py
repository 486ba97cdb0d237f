"""Compute-limit kernels: the arithmetic no implementation of a configuration can avoid.

The memory-limit kernels of ``cpu_step.py`` say how fast a step can move its bytes; these
say how fast it can do its unavoidable arithmetic with the bytes in cache.  A preset's
ceiling is the slower of the two.  Per element, a compute-limit kernel does only:

* decode every stored operand (bfloat16 -> float32 is a shift; float32 as is; the
  remainder join is integer ops);
* the algorithm's irreducible float math: Adam one exactly rounded float32 square root and
  one exactly rounded float32 division (plus the adds that make the result depend on every
  operand, so nothing is dead code); Lion a sign; SGD an add;
* encode every stored result: round to nearest even into bfloat16 (a few integer ops, no
  NaN handling: an implementation that may not canonicalise NaN could skip it), or
  stochastic rounding with one counter-based hash per stochastically rounded value, the
  Kahan compensation add, or the remainder split;

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
from numba import njit, prange

from bf16opt._cpu.storage import bits_to_f32, f32_to_bits, random_bits


@dataclass(frozen=True)
class Storage:
    """How one configuration stores its buffers (what the kernel must decode and encode)."""

    param16: bool          # params are 16-bit (bfloat16) rather than float32
    master: str            # "param" (the param is the master), "copy" (float32 copy), "remainder"
    moments16: bool        # moments stored in bfloat16
    stochastic: bool       # 16-bit master and 16-bit moments stochastically rounded
    kahan: bool            # bfloat16 Kahan compensation of a 16-bit master


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
}
FP32_PARAMS = Storage(False, "param", False, False, False)

MOMENTS = {"adam": 2, "lion": 1, "sgd": 1}


@njit(inline="always")
def _bf16(bits16):
    return bits_to_f32(np.uint32(np.uint32(np.uint16(bits16)) << np.uint32(16)))


@njit(inline="always")
def _rne(x):
    bits = f32_to_bits(x)
    return np.int16(np.uint16(np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                              >> np.uint32(16)))


@njit(inline="always")
def _sr(x, key, element):
    bits = f32_to_bits(x)
    return np.int16(np.uint16(np.uint32(bits + (random_bits(key, element) >> np.uint32(16))) >> np.uint32(16)))


@functools.lru_cache(maxsize=None)
def block_kernel(algorithm: str, storage: Storage):
    """``run_block(g, p, w, m, v, passes, t)``: row ``t`` of the operands of :func:`kernel`
    updated ``passes`` times on the calling thread (one thread's share;
    ``kernel_instructions.py`` counts its instructions)."""
    param16, master, moments16 = storage.param16, storage.master, storage.moments16
    stochastic, kahan = storage.stochastic, storage.kahan
    moments = MOMENTS[algorithm]
    adam, lion = algorithm == "adam", algorithm == "lion"

    @njit(nogil=True, cache=True, error_model="numpy")
    def run_block(g, p, w, m, v, passes, t):
        block = p.shape[1]
        for k in range(passes):
            for i in range(block):
                element = np.uint32(k * block + i)
                grad = _bf16(g[t, i]) if param16 else np.float32(g[t, i])
                if master == "copy":
                    weight = np.float32(w[t, i])
                elif master == "remainder":
                    low = np.uint32(np.uint16(w[t, i]))
                    upper = (np.uint32(np.uint16(p[t, i])) - (low >> np.uint32(15))) & np.uint32(0xFFFF)
                    weight = bits_to_f32((upper << np.uint32(16)) | low)
                else:
                    weight = _bf16(p[t, i]) if param16 else np.float32(p[t, i])
                first = (_bf16(m[t, i]) if moments16 else np.float32(m[t, i])) + grad
                if adam:
                    second = (_bf16(v[t, i]) if moments16 else np.float32(v[t, i])) + grad
                    update = first / np.sqrt(second)
                elif lion:
                    update = np.float32(np.sign(first))
                else:
                    update = first
                if kahan:  # the compensation carries the rounding error of the stored weight
                    y = update + _bf16(w[t, i])
                    new = weight - y
                    stored = _bf16(_rne(new))
                    w[t, i] = _rne((new - stored))
                    p[t, i] = _rne(new)
                else:
                    new = weight - update
                    if master == "copy":
                        w[t, i] = new
                        p[t, i] = _rne(new)
                    elif master == "remainder":
                        bits = f32_to_bits(new)
                        p[t, i] = np.int16(np.uint16(np.uint32(bits + np.uint32(0x8000)) >> np.uint32(16)))
                        w[t, i] = np.int16(np.uint16(bits & np.uint32(0xFFFF)))
                    elif param16:
                        p[t, i] = _sr(new, np.uint32(1), element) if stochastic else _rne(new)
                    else:
                        p[t, i] = new
                if moments16:
                    m[t, i] = _sr(first, np.uint32(2), element) if stochastic else _rne(first)
                    if moments == 2:
                        v[t, i] = _sr(second, np.uint32(3), element) if stochastic else _rne(second)
                else:
                    m[t, i] = first
                    if moments == 2:
                        v[t, i] = second

    return run_block


@functools.lru_cache(maxsize=None)
def kernel(algorithm: str, storage: Storage):
    """``run(g, p, w, m, v, passes)``: 2-D arrays [thread, block] (``w``: the float32 copy, the
    int16 remainder or the bf16 compensation, any array when unused; ``v`` unused except by
    Adam), updated ``passes`` times per thread."""
    run_block = block_kernel(algorithm, storage)

    @njit(parallel=True, nogil=True, cache=True)
    def run(g, p, w, m, v, passes):
        for t in prange(p.shape[0]):
            run_block(g, p, w, m, v, passes, t)

    return run


def arrays(threads: int, block: int, storage: Storage, seed: int = 0):
    """Cache-resident operands for :func:`kernel` (positive second moments: a real sqrt)."""
    rng = np.random.default_rng(seed)

    def values(scale, positive=False):
        x = rng.standard_normal((threads, block)).astype(np.float32) * np.float32(scale)
        return np.abs(x) + np.float32(1e-3) if positive else x

    def stored(x, sixteen):
        return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.int16) if sixteen else x

    g = stored(values(1e-3), storage.param16)
    p = stored(values(0.02), storage.param16)
    if storage.master == "copy":
        w = values(0.02)
    elif storage.master == "remainder" or storage.kahan:
        w = np.zeros((threads, block), dtype=np.int16)
    else:
        w = np.zeros((1, 1), dtype=np.float32)
    m = stored(values(1e-3), storage.moments16)
    v = stored(values(1e-6, positive=True), storage.moments16)
    return g, p, w, m, v
