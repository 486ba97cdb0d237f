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

The update of one element (``update``, from stored elements to the elements to store) is
all this file holds; ``rows.py`` runs it over a chunk-table row: in the element loop, the
paired loop (every array 16-bit), or, where ``vector_blocks.py`` covers the configuration
(no amsgrad, no telemetry, stochastic rounding only where the blocks prefetch:
``vector_blocks.form``) on a CPU with AVX-512, whole blocks of ``ADAM_BLOCK`` elements through
its hand-vectorised update (the same operations, the same bits).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from . import q8_blocks, rows, vector_blocks
from .chunks import inline_jit, update_jit
from .storage import (WEIGHTS, buffer_bits, decode, encode_master, encode_moment, master_value, random_words,
                      stream_keys)

__all__ = ["chunk_function"]


@njit
def _adam_moments(g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2):
    """The new first and second moments (the reference's operation order, each op rounded)."""
    m = m * beta1
    t = g * one_minus_beta1
    m = m + t
    v = v * beta2
    t = g * one_minus_beta2  # before the square, as torch: g * g overflows for |g| > 1.8e19
    t = t * g
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


def _chunk(row, scalars, keys, counts):
    """The chunk function of a configuration: ``rows.py``'s loops (``drive``, a global set by
    ``chunks.chunk_compiler``), defined here so that Numba's cache names it after this file."""
    drive(row, scalars, keys, counts)  # noqa: F821


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moment_rounding: str, track: bool, amsgrad: bool = False,
                   l2: bool = False, unit: bool = False, q8_rounding: str = "nearest"):
    """The compiled Adam chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of the roles, in the order of
    ``bf16opt.algorithms.ADAM.roles`` (param, grad, companion, exp_avg, exp_avg_sq,
    max_exp_avg_sq; absent roles any class), which is also the row's address order; the
    grad's class is the param's or np.float32;
    ``weights``: a key of ``storage.WEIGHT_POLICIES`` (how the master is held);
    ``moment_rounding``: a key of ``storage.MOMENT_ROUNDINGS``;
    ``track``: count telemetry into the row's counters; ``unit``: the step's unscaling
    factor (``inv_grad_scale * sign``) is exactly 1 and its multiplication per element is left
    out -- the same bits (``x * 1`` is exact; the grad only enters arithmetic, which quiets a
    signalling NaN as the multiplication would, and a NaN is made canonical when stored),
    chosen per call by the backend from the scalars (a run-time branch per element would cost
    what it saves; the multiplication's vector constant adds register pressure in the loop).
    The scalars are ``AdamScalars`` (``inv_grad_scale`` last) followed by ``sign`` (-1 to
    maximize).  q8 moments (np.uint8) are float32 to ``update``; ``q8_rounding`` rounds them.
    """
    param_format, grad_format, companion_format, stored_exp_avg, stored_exp_avg_sq, _ = formats
    exp_avg_format, exp_avg_sq_format = rows.element_class(stored_exp_avg), rows.element_class(stored_exp_avg_sq)
    quantized = np.uint8 in (stored_exp_avg, stored_exp_avg_sq)
    q8_stochastic = rows.checked_q8_rounding(q8_rounding)
    weights, moment_rounding = rows.checked_policies(weights, moment_rounding)
    amsgrad, l2, track, unit = bool(amsgrad), bool(l2), bool(track), bool(unit)
    # whole blocks hand-vectorised where vector_blocks.py covers the configuration, with
    # stochastic rounding only where they prefetch (without, AdamW's blocks were slower than
    # the paired loop: docs/performance.md)
    stochastic = weights == "param-stochastic" or moment_rounding == "stochastic"
    if amsgrad or (stochastic and not vector_blocks.prefetching()):
        form = None
    elif quantized:  # whole q8 blocks where both moments are q8 (q8_blocks.py)
        form = q8_blocks.form(weights, param_format, grad_format, companion_format,
                              (stored_exp_avg, stored_exp_avg_sq), moment_rounding, track, unit, l2,
                              q8_stochastic)
    else:
        form = vector_blocks.form(weights, param_format, grad_format, companion_format,
                                  (exp_avg_format, exp_avg_sq_format), moment_rounding, track, unit, l2)
    states = (rows.state("exp_avg", stored_exp_avg), rows.state("exp_avg_sq", stored_exp_avg_sq),
              rows.state("max_exp_avg_sq", stored_exp_avg_sq, amsgrad, amsgrad))
    m_buffer, v_buffer, x_buffer = (state.buffer for state in states)  # (constants of update)

    @inline_jit
    def begin(row, scalars, keys):
        """The row's arrays (ADAM.roles), length and first element; the update's scalars."""
        scale = scalars[9] * scalars[10]  # inv_grad_scale * sign (see the module docstring)
        # beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps,
        # weight_decay, decay, scale, and the streams' keys
        now = (scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5], scalars[6], scalars[7],
               scalars[8], scale, stream_keys(keys))
        return row[0], row[1], row[2], (row[3], row[4], row[5]), row[6], row[7], now, scale

    @update_jit
    def update(g, p, c, states, element, now):
        """Stored elements of grad, param, companion, (exp_avg, exp_avg_sq, max_exp_avg_sq) in;
        the elements to store and the telemetry flags (swallowed, exp_avg / exp_avg_sq
        underflow) out."""
        beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps, \
            weight_decay, decay, scale, keys = now
        m, v, x = states
        randoms = random_words(keys, element)  # stochastic rounding's streams (dead code without it)
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
            x = encode_moment(moment_rounding, exp_avg_sq_format, v_hat, buffer_bits(randoms, x_buffer))[0]
        else:
            v_hat = v
        u = _adam_update(m, v_hat, step_size, inv_sqrt_bias_correction2, eps)
        w = w - u
        m_stored, m_value = encode_moment(moment_rounding, exp_avg_format, m, buffer_bits(randoms, m_buffer))
        v_stored, v_value = encode_moment(moment_rounding, exp_avg_sq_format, v,
                                          buffer_bits(randoms, v_buffer))
        p, c, same = encode_master(weights, param_format, companion_format, p, c, w0, w,
                                   buffer_bits(randoms, WEIGHTS))
        return (p, c, (m_stored, v_stored, x),
                ((u != np.float32(0.0)) & same, (m != np.float32(0.0)) & (m_value == np.float32(0.0)),
                 (v != np.float32(0.0)) & (v_value == np.float32(0.0))))

    @inline_jit
    def block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        vector_blocks.adam_block(form, param, grad, companion, states[0], states[1], scalars, scale, keys,
                                 element, ahead)

    @inline_jit
    def q8_block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        q8_blocks.adam_q8_block(form, param, grad, companion, states[0], states[1], scalars, scale, keys,
                                element, ahead)

    math = rows.block_math(begin, update, form, quantized, q8_stochastic, block, vector_blocks.ADAM_BLOCK,
                           q8_block)
    return rows.chunk_function((formats, weights, moment_rounding, track, amsgrad, l2, unit, form,
                                q8_stochastic),
                               (param_format, grad_format, companion_format), weights, states, 3, track, math,
                               _chunk)
