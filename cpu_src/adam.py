"""Numba chunk functions for Adam / AdamW (amsgrad, maximize, L2 or decoupled weight decay).

The per-element math, operation by operation, is ``bf16opt/backends/reference.py``'s;
each line below is one float32 operation rounded on its own (no fastmath, so LLVM does
not contract ``a * b + c`` into a fused multiply-add or reassociate).

Specialisation: :func:`adam_chunk` makes one serial chunk function (a ``cfunc``, see
``chunks.py``) per configuration.  The storage formats (numpy element classes of the
views, see ``storage.py``), the flags (amsgrad, L2, telemetry) and the storage policies
(how the master is loaded and stored, nearest or stochastic rounding of the moments) are
closure constants, so LLVM folds them away: no run-time branch in the loop.  ``maximize``
is the run-time scalar ``sign`` (+1 or -1): ``g * -1`` is ``-g`` exactly, a
loop-invariant multiplication rather than a branch or another compiled kernel.  The grad
is read in its own format (the param's, or float32 for float32-accumulated grads of 16-bit
params) and multiplied by ``inv_grad_scale`` first (1.0 without a GradScaler).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cfunc, njit

from .chunks import CHUNK_SIGNATURE
from .storage import (MOMENT_ROUNDINGS, WEIGHT_POLICIES, bits_to_f32, f32_to_bits, load,
                      load_weights, pointer_to, store_moment, store_weights)

__all__ = ["chunk_function"]

@njit
def _bf16_pair_bits(word):
    """float32 values of the two bfloat16 held in a uint32 (low half: the lower address)."""
    return (bits_to_f32(np.uint32(word << np.uint32(16))),
            bits_to_f32(np.uint32(word & np.uint32(0xFFFF0000))))


@njit
def _rounding_bits(x):
    """float32 bits of ``x`` (NaN: the canonical one) plus the round-to-nearest-even bias:
    its upper 16 bits are ``storage.encode_bf16(x)``."""
    x = x if x == x else bits_to_f32(np.uint32(0x7FC00000))
    bits = f32_to_bits(x)
    # np.uint32(): wrap to 32 bits so LLVM keeps the lanes 32-bit (never carries out here)
    return np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))


@njit
def _bf16_pair_word(low, high):
    """uint32 holding the bfloat16 encodings (RNE, canonical NaN) of ``low`` and ``high``."""
    return np.uint32((_rounding_bits(high) & np.uint32(0xFFFF0000))
                     | (_rounding_bits(low) >> np.uint32(16)))


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


@njit
def _adamw_pair_element(g, w, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size,
                        inv_sqrt_bias_correction2, eps, decay, inv_grad_scale, sign):
    """AdamW (decoupled decay, no amsgrad) on one element of the paired bf16 loop."""
    g = g * inv_grad_scale
    g = g * sign
    w = w * decay
    m, v = _adam_moments(g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2)
    w = w - _adam_update(m, v, step_size, inv_sqrt_bias_correction2, eps)
    return w, m, v


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moments: str, track: bool, amsgrad: bool = False,
                   l2: bool = False):
    """The compiled Adam chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of the roles, in the order of
    ``bf16opt.algorithms.ADAM.roles`` (param, grad, companion, exp_avg, exp_avg_sq,
    max_exp_avg_sq; absent roles any class), which is also the row's address order; the
    grad's class is the param's or np.float32;
    ``weights``: a key of ``storage.WEIGHT_POLICIES`` (how the master is held);
    ``moments``: a key of ``storage.MOMENT_ROUNDINGS``;
    ``track``: count telemetry into the row's counters.  The scalars are
    ``AdamScalars`` (``inv_grad_scale`` last) followed by ``sign`` (-1 to maximize).
    """
    param_format, grad_format, companion_format, exp_avg_format, exp_avg_sq_format, _ = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments = str(weights), str(moments)
    amsgrad, l2, track = bool(amsgrad), bool(l2), bool(track)
    # all-bf16 AdamW: two elements per uint32 word (one load, shift/mask decode, one
    # shift/merge encode per pair); odd last element by the general loop
    paired = (param_format is np.int16 and grad_format is np.int16 and exp_avg_format is np.int16
              and exp_avg_sq_format is np.int16 and weights == "param"
              and moments == "nearest" and not amsgrad and not l2 and not track)

    @cfunc(CHUNK_SIGNATURE, cache=True, error_model="numpy")
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
        inv_grad_scale, sign = scalars[9], scalars[10]
        key_w, key_m, key_v, key_max = keys[0], keys[1], keys[2], keys[3]
        swallowed, m_underflow, v_underflow = 0, 0, 0
        first = 0
        # (uint32 words need 4-byte aligned addresses; otherwise the general loop)
        if paired and ((row[0] | row[1] | row[3] | row[4]) & 3) == 0:
            param_words = pointer_to(row[0], np.uint32)
            grad_words = pointer_to(row[1], np.uint32)
            exp_avg_words = pointer_to(row[3], np.uint32)
            exp_avg_sq_words = pointer_to(row[4], np.uint32)
            for j in range(n >> 1):
                g0, g1 = _bf16_pair_bits(grad_words[j])
                w0, w1 = _bf16_pair_bits(param_words[j])
                m0, m1 = _bf16_pair_bits(exp_avg_words[j])
                v0, v1 = _bf16_pair_bits(exp_avg_sq_words[j])
                w0, m0, v0 = _adamw_pair_element(g0, w0, m0, v0, beta1, beta2, one_minus_beta1,
                                           one_minus_beta2, step_size, inv_sqrt_bias_correction2,
                                           eps, decay, inv_grad_scale, sign)
                w1, m1, v1 = _adamw_pair_element(g1, w1, m1, v1, beta1, beta2, one_minus_beta1,
                                           one_minus_beta2, step_size, inv_sqrt_bias_correction2,
                                           eps, decay, inv_grad_scale, sign)
                exp_avg_words[j] = _bf16_pair_word(m0, m1)
                exp_avg_sq_words[j] = _bf16_pair_word(v0, v1)
                param_words[j] = _bf16_pair_word(w0, w1)
            first = n - (n & 1)
        for i in range(first, n):
            element = start + i
            g = load(grad, i) * inv_grad_scale
            g = g * sign
            w0 = load_weights(weights, param, companion, i)
            w = w0
            if l2:
                t = w * weight_decay
                g = g + t
            w = w * decay
            m, v = _adam_moments(g, load(exp_avg, i), load(exp_avg_sq, i), beta1, beta2,
                                 one_minus_beta1, one_minus_beta2)
            if amsgrad:
                v_max = load(max_exp_avg_sq, i)
                # a if (a > b or a is NaN) else b, a = the stored maximum
                v_hat = v_max if (v_max > v or v_max != v_max) else v
            else:
                v_hat = v
            u = _adam_update(m, v_hat, step_size, inv_sqrt_bias_correction2, eps)
            w = w - u
            stored_m = store_moment(moments, exp_avg, i, m, key_m, element)
            stored_v = store_moment(moments, exp_avg_sq, i, v, key_v, element)
            if amsgrad:
                store_moment(moments, max_exp_avg_sq, i, v_hat, key_max, element)
            same = store_weights(weights, param, companion, i, w0, w, key_w, element)
            if track:
                swallowed += (u != np.float32(0.0)) & same
                m_underflow += (m != np.float32(0.0)) & (stored_m == np.float32(0.0))
                v_underflow += (v != np.float32(0.0)) & (stored_v == np.float32(0.0))
        if track:
            counts[0] = swallowed
            counts[1] = m_underflow
            counts[2] = v_underflow

    return chunk
