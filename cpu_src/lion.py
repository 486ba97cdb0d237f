"""Numba chunk functions for Lion (Chen et al. 2023), same conventions as ``adam.py`` (the
update of one element, run by the element loop, the paired loop or
``vector_blocks.py``'s blocks)."""

from __future__ import annotations

import functools

import numpy as np

from . import vector_blocks
from .adam import SIXTEEN_BITS
from .chunks import chunk_compiler, update_jit
from .storage import (EXP_AVG, MOMENT_ROUNDINGS, WEIGHT_ARRAYS, WEIGHT_POLICIES, WEIGHTS, buffer_bits, decode,
                      element_index, encode_master, encode_moment, high_half, low_half, master_value,
                      pair_word, pointer_to, random_bits)

__all__ = ["chunk_function"]


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moments: str, track: bool, unit: bool = False):
    """The compiled Lion chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of ``bf16opt.algorithms.LION.roles`` (param, grad,
    companion, exp_avg); the other arguments (``unit``: no multiplication by an unscaling
    factor of exactly 1) as for :func:`adam.chunk_function`.  The scalars are
    ``LionScalars`` (``inv_grad_scale`` last) followed by ``sign``.
    """
    param_format, grad_format, companion_format, exp_avg_format = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments, track, unit = str(weights), str(moments), bool(track), bool(unit)
    reads_param, has_companion = WEIGHT_ARRAYS[weights]
    present = (param_format, grad_format, exp_avg_format) + ((companion_format,) if has_companion else ())
    # whole blocks hand-vectorised where vector_blocks.py covers the configuration (adam.py)
    form = vector_blocks.form(weights, param_format, grad_format, companion_format, (exp_avg_format,), moments,
                              track, unit)
    vector = form is not None
    # all arrays 16-bit: words of two elements, unless the blocks take them
    paired = not vector and all(f in SIXTEEN_BITS for f in present)
    block = vector_blocks.LION_BLOCK if vector else 0
    param_size, grad_size, companion_size, moment_size = (np.dtype(f).itemsize  # bytes per element
                                                          for f in (param_format, grad_format, companion_format,
                                                                    exp_avg_format))

    @update_jit
    def element_update(g, p, comp, m_old, element, now):
        """Stored elements of grad, param, companion, exp_avg in; the elements to store
        and the telemetry flags (swallowed, exp_avg underflow) out."""
        beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay, scale, key = now
        random = random_bits(key, element)  # stochastic rounding's stream: weights, exp_avg (or dead code)
        g = decode(g) if unit else decode(g) * scale
        w0 = master_value(weights, p, comp)
        w = w0 * decay
        m_old = decode(m_old)
        c = m_old * beta1
        t = g * one_minus_beta1
        c = c + t
        # sign(c) with +0 for +-0 and NaN for NaN (c + 0 is +0 for zeros, NaN for NaN)
        s = c + np.float32(0.0)
        s = np.float32(1.0) if c > np.float32(0.0) else s
        s = np.float32(-1.0) if c < np.float32(0.0) else s
        u = s * lr
        w = w - u
        m = m_old * beta2
        t = g * one_minus_beta2
        m = m + t
        m_stored, m_value = encode_moment(moments, exp_avg_format, m, buffer_bits(random, EXP_AVG))
        p, comp, same = encode_master(weights, param_format, companion_format, p, comp, w0, w,
                                      buffer_bits(random, WEIGHTS))
        return (p, comp, m_stored, (u != np.float32(0.0)) & same,
                (m != np.float32(0.0)) & (m_value == np.float32(0.0)))

    # (the chunk function calls element_update as its global ``update``: see chunks.chunk_compiler)
    @chunk_compiler((formats, weights, moments, track, unit) + ((("vector", block, form),) if vector else ()),
                    update=element_update)
    def chunk(row, scalars, keys, counts):
        param = pointer_to(row[0], param_format)
        grad = pointer_to(row[1], grad_format)
        companion = pointer_to(row[2], companion_format)
        exp_avg = pointer_to(row[3], exp_avg_format)
        n, start = row[4], row[5]
        beta1, beta2 = scalars[0], scalars[1]
        one_minus_beta1, one_minus_beta2 = scalars[2], scalars[3]
        lr, decay = scalars[4], scalars[5]
        scale = scalars[6] * scalars[7]  # inv_grad_scale * sign (see adam.py's module docstring)
        now = (beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay, scale, keys[0])  # (update's)
        swallowed, m_underflow = 0, 0
        first = 0
        # (uint32 words need 4-byte aligned addresses; absent arrays have address 0)
        if paired and ((row[0] | row[1] | row[2] | row[3]) & 3) == 0:
            param_words = pointer_to(row[0], np.uint32)
            grad_words = pointer_to(row[1], np.uint32)
            companion_words = pointer_to(row[2], np.uint32)
            exp_avg_words = pointer_to(row[3], np.uint32)
            for j in range(n >> 1):
                g = grad_words[j]
                p = param_words[j] if reads_param else np.uint32(0)
                c = companion_words[j] if has_companion else np.uint32(0)
                m = exp_avg_words[j]
                low = update(low_half(g, grad_format), low_half(p, param_format), low_half(c, companion_format),
                             low_half(m, exp_avg_format), element_index(start, 2 * j), now)
                high = update(high_half(g, grad_format), high_half(p, param_format),
                              high_half(c, companion_format), high_half(m, exp_avg_format),
                              element_index(start, 2 * j + 1), now)
                param_words[j] = pair_word(low[0], high[0])
                if has_companion:
                    companion_words[j] = pair_word(low[1], high[1])
                exp_avg_words[j] = pair_word(low[2], high[2])
                if track:
                    swallowed += low[3] + high[3]
                    m_underflow += low[4] + high[4]
            first = n - (n & 1)
        if vector:
            first = n - n % block
            for j in range(0, first, block):
                vector_blocks.lion_block(form, row[0] + param_size * j, row[1] + grad_size * j,
                                         row[2] + companion_size * j, row[3] + moment_size * j, scalars,
                                         scale, keys, element_index(start, j),
                                         vector_blocks.prefetch_ahead(j, n, block))
        for i in range(first, n):
            out = update(grad[i], param[i] if reads_param else param_format(0),
                         companion[i] if has_companion else companion_format(0), exp_avg[i],
                         element_index(start, i), now)
            param[i] = out[0]
            if has_companion:
                companion[i] = out[1]
            exp_avg[i] = out[2]
            if track:
                swallowed += out[3]
                m_underflow += out[4]
        if track:
            counts[0] = swallowed
            counts[1] = m_underflow

    chunk.vectorised = vector  # (the tests check which loop a configuration got)
    return chunk
