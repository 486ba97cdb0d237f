"""Numba chunk functions for Lion (Chen et al. 2023): the update of one element, same
conventions as ``adam.py``; ``rows.py`` runs it over a row."""

from __future__ import annotations

import functools

import numpy as np

from . import q8_blocks, rows, vector_blocks
from .chunks import inline_jit, update_jit
from .storage import (WEIGHTS, buffer_bits, decode, encode_master, encode_moment, master_value, random_words,
                      stream_keys)

__all__ = ["chunk_function"]


def _chunk(row, scalars, keys, counts):
    """The chunk function of a configuration: ``rows.py``'s loops (``drive``, a global set by
    ``chunks.chunk_compiler``), defined here so that Numba's cache names it after this file."""
    drive(row, scalars, keys, counts)  # noqa: F821


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moment_rounding: str, track: bool, unit: bool = False,
                   q8_rounding: str = "nearest"):
    """The compiled Lion chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of ``bf16opt.algorithms.LION.roles`` (param, grad,
    companion, exp_avg); the other arguments (``unit``: no multiplication by an unscaling
    factor of exactly 1) as for :func:`adam.chunk_function`.  The scalars are
    ``LionScalars`` (``inv_grad_scale`` last) followed by ``sign``.
    """
    param_format, grad_format, companion_format, stored_exp_avg = formats
    exp_avg_format = rows.element_class(stored_exp_avg)  # (q8: float32 to update, see adam.py)
    q8_stochastic = rows.checked_q8_rounding(q8_rounding)
    weights, moment_rounding = rows.checked_policies(weights, moment_rounding)
    track, unit = bool(track), bool(unit)
    quantized = stored_exp_avg is np.uint8
    if quantized:
        form = q8_blocks.form(weights, param_format, grad_format, companion_format, (stored_exp_avg,),
                              moment_rounding, track, unit, stochastic=q8_stochastic)
    else:
        form = vector_blocks.form(weights, param_format, grad_format, companion_format, (exp_avg_format,),
                                  moment_rounding, track, unit)
    states = (rows.state("exp_avg", stored_exp_avg),)
    m_buffer = states[0].buffer  # (a constant of update)

    @inline_jit
    def begin(row, scalars, keys):
        """The row's arrays (LION.roles), length and first element; the update's scalars."""
        scale = scalars[6] * scalars[7]  # inv_grad_scale * sign (see adam.py's module docstring)
        # beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay, scale, the streams' keys
        now = (scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5], scale,
               stream_keys(keys))
        return row[0], row[1], row[2], (row[3],), row[4], row[5], now, scale

    @update_jit
    def update(g, p, comp, states, element, now):
        """Stored elements of grad, param, companion, (exp_avg,) in; the elements to store
        and the telemetry flags (swallowed, exp_avg underflow) out."""
        beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay, scale, keys = now
        randoms = random_words(keys, element)  # stochastic rounding's streams (dead code without it)
        g = decode(g) if unit else decode(g) * scale
        w0 = master_value(weights, p, comp)
        w = w0 * decay
        m_old = decode(states[0])
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
        m_stored, m_value = encode_moment(moment_rounding, exp_avg_format, m, buffer_bits(randoms, m_buffer))
        p, comp, same = encode_master(weights, param_format, companion_format, p, comp, w0, w,
                                      buffer_bits(randoms, WEIGHTS))
        swallowed = (u != np.float32(0.0)) & same
        return p, comp, (m_stored,), (swallowed, (m != np.float32(0.0)) & (m_value == np.float32(0.0)))

    @inline_jit
    def block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        vector_blocks.lion_block(form, param, grad, companion, states[0], scalars, scale, keys, element,
                                 ahead)

    @inline_jit
    def q8_block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        q8_blocks.lion_q8_block(form, param, grad, companion, states[0], scalars, scale, keys, element, ahead)

    math = rows.block_math(begin, update, form, quantized, q8_stochastic, block, vector_blocks.LION_BLOCK,
                           q8_block)
    return rows.chunk_function((formats, weights, moment_rounding, track, unit, form, q8_stochastic),
                               (param_format, grad_format, companion_format), weights, states, 2, track, math,
                               _chunk)
