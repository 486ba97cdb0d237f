"""Numba chunk functions for Adam / AdamW (amsgrad, maximize, L2 or decoupled weight decay).

The per-element math, operation by operation, is ``bf16opt/backends/reference.py``'s;
each line below is one float32 operation rounded on its own (no fastmath, so LLVM does
not contract ``a * b + c`` into a fused multiply-add or reassociate).

Specialisation: :func:`chunk_function` makes one serial chunk function (a ``cfunc``, see
``chunks.py``) per configuration.  The storage formats (numpy element classes of the
views, see ``storage.py``), the flags (amsgrad, L2, telemetry) and the storage policies
(how the master is read and encoded, nearest or stochastic rounding of the moments) are
closure constants, so LLVM folds them away: no run-time branch in the loop.  ``maximize``
is the run-time scalar ``sign`` (+1 or -1), folded into the unscaling factor once per
chunk: ``scale = inv_grad_scale * sign`` is exact, and ``g * scale`` has the bits of the
reference's ``g * inv_grad_scale`` negated (rounding to nearest is symmetric in sign; a
NaN's sign does not survive its canonical encoding): one multiplication per element, no
branch.  The grad is read in its own format (the param's, or float32 for float32-accumulated
grads of 16-bit params) and multiplied by ``scale`` first (``inv_grad_scale`` is 1.0
without a GradScaler).

Loops: the update of one element (``update``, from stored elements to the elements to
store) runs in the loop over the row's elements, or, when every array of the
configuration is 16-bit and 4-byte aligned, in the paired loop: one uint32 word of each
array holds two elements, so decoding is one shift or mask and encoding one merge per pair
(cheaper than widening and narrowing 16-bit lanes); an odd last element goes through the
element loop.  Where ``vector_blocks.py`` covers the configuration (no amsgrad, no telemetry,
stochastic rounding only where the blocks prefetch: ``vector_blocks.form``) on a CPU with
AVX-512, whole blocks of ``ADAM_BLOCK`` (128) elements go through its hand-vectorised update
(the same operations, the same bits) instead, the rest through the element loop.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from . import vector_blocks
from .chunks import chunk_compiler, update_jit
from .storage import (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, MOMENT_ROUNDINGS, WEIGHT_ARRAYS, WEIGHT_POLICIES,
                      WEIGHTS, buffer_bits, decode, element_index, encode_master, encode_moment, high_half,
                      low_half, master_value, pair_word, pointer_to, random_bits)

__all__ = ["chunk_function"]

SIXTEEN_BITS = (np.int16, np.uint16)


@njit
def _adam_moments(g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2):
    """The new first and second moments (the reference's operation order, each op rounded)."""
    m = m * beta1
    t = g * one_minus_beta1
    m = m + t
    v = v * beta2
    t = g * g
    t = t * one_minus_beta2
    v = v + t
    return m, v


@njit
def _adam_update(m, v_hat, step_size, inv_sqrt_bias_correction2, eps):
    """The Adam step ``u`` subtracted from the (already decayed) weight."""
    d = np.sqrt(v_hat)
    d = d * inv_sqrt_bias_correction2
    d = d + eps
    u = m / d
    return u * step_size


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moments: str, track: bool, amsgrad: bool = False,
                   l2: bool = False, unit: bool = False):
    """The compiled Adam chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of the roles, in the order of
    ``bf16opt.algorithms.ADAM.roles`` (param, grad, companion, exp_avg, exp_avg_sq,
    max_exp_avg_sq; absent roles any class), which is also the row's address order; the
    grad's class is the param's or np.float32;
    ``weights``: a key of ``storage.WEIGHT_POLICIES`` (how the master is held);
    ``moments``: a key of ``storage.MOMENT_ROUNDINGS``;
    ``track``: count telemetry into the row's counters; ``unit``: the step's unscaling
    factor (``inv_grad_scale * sign``) is exactly 1 and its multiplication per element is left
    out -- the same bits (``x * 1`` is exact; the grad only enters arithmetic, which quiets a
    signalling NaN as the multiplication would, and a NaN is made canonical when stored),
    chosen per call by the backend from the scalars (a run-time branch per element would cost
    what it saves; the multiplication costs AdamW ``bf16`` ~7% of its time on AVX-512: one more
    live vector constant, spilled in its loop).  The scalars are ``AdamScalars``
    (``inv_grad_scale`` last) followed by ``sign`` (-1 to maximize).
    """
    param_format, grad_format, companion_format, exp_avg_format, exp_avg_sq_format, _ = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments = str(weights), str(moments)
    amsgrad, l2, track, unit = bool(amsgrad), bool(l2), bool(track), bool(unit)
    reads_param, has_companion = WEIGHT_ARRAYS[weights]
    present = (param_format, grad_format, exp_avg_format, exp_avg_sq_format) + \
        ((companion_format,) if has_companion else ())
    # whole blocks hand-vectorised where vector_blocks.py covers the configuration, the rest
    # in the element loop below
    # (with stochastic rounding only where they prefetch: without, AdamW bf16-sr's blocks ran
    # 1.03-1.18x the paired loop's time in cache and out of it on an AVX-512 Xeon (Lion's and
    # SGD's 0.86-0.93x); prefetching, 0.98x in cache and 0.87x streamed on another)
    stochastic = weights == "param-stochastic" or moments == "stochastic"
    form = None if amsgrad or (stochastic and not vector_blocks.prefetching()) else vector_blocks.form(
        weights, param_format, grad_format, companion_format, (exp_avg_format, exp_avg_sq_format), moments,
        track, unit, l2)
    vector = form is not None
    # all arrays 16-bit: words of two elements, unless the blocks take them
    paired = not vector and all(f in SIXTEEN_BITS for f in present)
    block = vector_blocks.ADAM_BLOCK if vector else 0
    param_size, grad_size, companion_size, moment_size = (np.dtype(f).itemsize  # bytes per element
                                                          for f in (param_format, grad_format, companion_format,
                                                                    exp_avg_format))

    @update_jit
    def element_update(g, p, c, m, v, x, element, now):
        """Stored elements of grad, param, companion, moments, max in; the elements to
        store and the telemetry flags (swallowed, exp_avg / exp_avg_sq underflow) out."""
        beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps, \
            weight_decay, decay, scale, key_0, key_1 = now
        # stochastic rounding's streams (dead code without it): weights and exp_avg; exp_avg_sq and max
        random_0, random_1 = random_bits(key_0, element), random_bits(key_1, element)
        g = decode(g) if unit else decode(g) * scale
        w0 = master_value(weights, p, c)
        w = w0
        if l2:
            t = w * weight_decay
            g = g + t
        w = w * decay
        m, v = _adam_moments(g, decode(m), decode(v), beta1, beta2, one_minus_beta1, one_minus_beta2)
        if amsgrad:
            v_max = decode(x)
            # a if (a > b or a is NaN) else b, a = the stored maximum
            v_hat = v_max if (v_max > v or v_max != v_max) else v
            x = encode_moment(moments, exp_avg_sq_format, v_hat, buffer_bits(random_1, MAX_EXP_AVG_SQ))[0]
        else:
            v_hat = v
        u = _adam_update(m, v_hat, step_size, inv_sqrt_bias_correction2, eps)
        w = w - u
        m_stored, m_value = encode_moment(moments, exp_avg_format, m, buffer_bits(random_0, EXP_AVG))
        v_stored, v_value = encode_moment(moments, exp_avg_sq_format, v, buffer_bits(random_1, EXP_AVG_SQ))
        p, c, same = encode_master(weights, param_format, companion_format, p, c, w0, w,
                                   buffer_bits(random_0, WEIGHTS))
        return (p, c, m_stored, v_stored, x, (u != np.float32(0.0)) & same,
                (m != np.float32(0.0)) & (m_value == np.float32(0.0)),
                (v != np.float32(0.0)) & (v_value == np.float32(0.0)))

    # (the chunk function calls element_update as its global ``update``: see chunks.chunk_compiler)
    @chunk_compiler((formats, weights, moments, track, amsgrad, l2, unit)
                    + ((("vector", block, form),) if vector else ()), update=element_update)
    def chunk(row, scalars, keys, counts):
        param = pointer_to(row[0], param_format)
        grad = pointer_to(row[1], grad_format)
        companion = pointer_to(row[2], companion_format)
        exp_avg = pointer_to(row[3], exp_avg_format)
        exp_avg_sq = pointer_to(row[4], exp_avg_sq_format)
        max_exp_avg_sq = pointer_to(row[5], exp_avg_sq_format)
        n, start = row[6], row[7]
        beta1, beta2 = scalars[0], scalars[1]
        one_minus_beta1, one_minus_beta2 = scalars[2], scalars[3]
        step_size, inv_sqrt_bias_correction2, eps = scalars[4], scalars[5], scalars[6]
        weight_decay, decay = scalars[7], scalars[8]
        scale = scalars[9] * scalars[10]  # inv_grad_scale * sign (see the module docstring)
        now = (beta1, beta2, one_minus_beta1, one_minus_beta2, step_size,  # (update's)
               inv_sqrt_bias_correction2, eps, weight_decay, decay, scale, keys[0], keys[1])
        swallowed, m_underflow, v_underflow = 0, 0, 0
        first = 0
        # (uint32 words need 4-byte aligned addresses; absent arrays have address 0)
        if paired and ((row[0] | row[1] | row[2] | row[3] | row[4] | row[5]) & 3) == 0:
            param_words = pointer_to(row[0], np.uint32)
            grad_words = pointer_to(row[1], np.uint32)
            companion_words = pointer_to(row[2], np.uint32)
            exp_avg_words = pointer_to(row[3], np.uint32)
            exp_avg_sq_words = pointer_to(row[4], np.uint32)
            max_words = pointer_to(row[5], np.uint32)
            for j in range(n >> 1):
                g = grad_words[j]
                p = param_words[j] if reads_param else np.uint32(0)
                c = companion_words[j] if has_companion else np.uint32(0)
                m = exp_avg_words[j]
                v = exp_avg_sq_words[j]
                x = max_words[j] if amsgrad else np.uint32(0)
                low = update(low_half(g, grad_format), low_half(p, param_format), low_half(c, companion_format),
                             low_half(m, exp_avg_format), low_half(v, exp_avg_sq_format),
                             low_half(x, exp_avg_sq_format), element_index(start, 2 * j), now)
                high = update(high_half(g, grad_format), high_half(p, param_format),
                              high_half(c, companion_format), high_half(m, exp_avg_format),
                              high_half(v, exp_avg_sq_format), high_half(x, exp_avg_sq_format),
                              element_index(start, 2 * j + 1), now)
                param_words[j] = pair_word(low[0], high[0])
                if has_companion:
                    companion_words[j] = pair_word(low[1], high[1])
                exp_avg_words[j] = pair_word(low[2], high[2])
                exp_avg_sq_words[j] = pair_word(low[3], high[3])
                if amsgrad:
                    max_words[j] = pair_word(low[4], high[4])
                if track:
                    swallowed += low[5] + high[5]
                    m_underflow += low[6] + high[6]
                    v_underflow += low[7] + high[7]
            first = n - (n & 1)
        if vector:
            first = n - n % block
            for j in range(0, first, block):
                vector_blocks.adam_block(form, row[0] + param_size * j, row[1] + grad_size * j,
                                         row[2] + companion_size * j, row[3] + moment_size * j,
                                         row[4] + moment_size * j, scalars, scale, keys,
                                         element_index(start, j),
                                         vector_blocks.prefetch_ahead(j, n, block))
        for i in range(first, n):
            out = update(grad[i], param[i] if reads_param else param_format(0),
                         companion[i] if has_companion else companion_format(0), exp_avg[i], exp_avg_sq[i],
                         max_exp_avg_sq[i] if amsgrad else exp_avg_sq_format(0), element_index(start, i),
                         now)
            param[i] = out[0]
            if has_companion:
                companion[i] = out[1]
            exp_avg[i] = out[2]
            exp_avg_sq[i] = out[3]
            if amsgrad:
                max_exp_avg_sq[i] = out[4]
            if track:
                swallowed += out[5]
                m_underflow += out[6]
                v_underflow += out[7]
        if track:
            counts[0] = swallowed
            counts[1] = m_underflow
            counts[2] = v_underflow

    chunk.vectorised = vector  # (the tests check which loop a configuration got)
    return chunk
