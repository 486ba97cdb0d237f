"""Numba chunk functions for SGD with momentum (torch.optim.SGD's math): the update of one
element, same conventions as ``adam.py``; ``rows.py`` runs it over a row (the blocks of
``vector_blocks.py`` where they cover the configuration: a momentum buffer after its first
step).  The operation order is ``bf16opt/backends/reference.py``'s ``sgd``."""

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
def chunk_function(formats: tuple, weights: str, moment_rounding: str, track: bool, momentum: bool = False,
                   l2: bool = False, nesterov: bool = False, first: bool = False, unit: bool = False,
                   q8_rounding: str = "nearest"):
    """The compiled SGD chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of ``bf16opt.algorithms.SGD.roles`` (param, grad,
    companion, momentum_buffer); ``momentum``: the buffer exists; ``first``: its first
    step (the buffer becomes the gradient, as torch clones it); ``unit``: the step's
    unscaling factor (``inv_grad_scale * sign``) and ``1 - dampening`` are both exactly 1, and
    their two multiplications per element are left out -- the same bits (``x * 1`` is exact,
    and a NaN is made canonical when stored either way), chosen per call by the backend from
    the scalars (a run-time branch per element would cost what it saves); the other arguments as for
    :func:`adam.chunk_function`.  The scalars are ``SGDScalars`` (``inv_grad_scale`` last) followed by ``sign``.
    """
    param_format, grad_format, companion_format, stored_buffer = formats
    buffer_format = rows.element_class(stored_buffer)  # (q8: float32 to update, see adam.py)
    q8_stochastic = rows.checked_q8_rounding(q8_rounding)
    weights, moment_rounding = rows.checked_policies(weights, moment_rounding)
    track = bool(track)
    momentum, l2, nesterov, first, unit = bool(momentum), bool(l2), bool(nesterov), bool(first), bool(unit)
    reads_buffer = momentum and not first
    quantized = stored_buffer is np.uint8
    if not reads_buffer:
        form = None
    elif quantized:
        form = q8_blocks.form(weights, param_format, grad_format, companion_format, (stored_buffer,),
                              moment_rounding, track, unit, l2, q8_stochastic)
    else:
        form = vector_blocks.form(weights, param_format, grad_format, companion_format, (buffer_format,),
                                  moment_rounding, track, unit, l2)
    if form is not None and nesterov:
        form |= vector_blocks.NESTEROV
    states = (rows.state("momentum_buffer", stored_buffer, reads_buffer, momentum),)
    b_buffer = states[0].buffer  # (a constant of update)

    @inline_jit
    def begin(row, scalars, keys):
        """The row's arrays (SGD.roles), length and first element; the update's scalars."""
        scale = scalars[4] * scalars[5]  # inv_grad_scale * sign (see adam.py's module docstring)
        # momentum_factor, one_minus_dampening, lr, weight_decay, scale, the streams' keys
        now = (scalars[0], scalars[1], scalars[2], scalars[3], scale, stream_keys(keys))
        return row[0], row[1], row[2], (row[3],), row[4], row[5], now, scale

    @update_jit
    def update(g, p, comp, states, element, now):
        """Stored elements of grad, param, companion, (momentum buffer,) in; the elements to
        store and the telemetry flags (swallowed, buffer underflow) out."""
        momentum_factor, one_minus_dampening, lr, weight_decay, scale, keys = now
        (b,) = states
        randoms = random_words(keys, element)  # stochastic rounding's streams (dead code without it)
        g = decode(g) if unit else decode(g) * scale
        w0 = master_value(weights, p, comp)
        w = w0
        if l2:
            t = w * weight_decay
            g = g + t
        b_underflow = False
        if momentum:
            if first:
                b_new = g
            else:
                b_new = decode(b) * momentum_factor
                t = g if unit else g * one_minus_dampening
                b_new = b_new + t
            if nesterov:
                t = b_new * momentum_factor
                g = g + t
            else:
                g = b_new
            b, b_value = encode_moment(moment_rounding, buffer_format, b_new, buffer_bits(randoms, b_buffer))
            b_underflow = (b_new != np.float32(0.0)) & (b_value == np.float32(0.0))
        u = g * lr
        w = w - u
        p, comp, same = encode_master(weights, param_format, companion_format, p, comp, w0, w,
                                      buffer_bits(randoms, WEIGHTS))
        return p, comp, (b,), ((u != np.float32(0.0)) & same, b_underflow)

    @inline_jit
    def block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        vector_blocks.sgd_block(form, param, grad, companion, states[0], scalars, scale, keys, element,
                                ahead)

    @inline_jit
    def q8_block(param, grad, companion, states, scalars, scale, keys, element, ahead):
        q8_blocks.sgd_q8_block(form, param, grad, companion, states[0], scalars, scale, keys, element, ahead)

    math = rows.block_math(begin, update, form, quantized, q8_stochastic, block, vector_blocks.SGD_BLOCK,
                           q8_block)
    return rows.chunk_function((formats, weights, moment_rounding, track, momentum, l2, nesterov, first, unit,
                                form, q8_stochastic),
                               (param_format, grad_format, companion_format), weights, states, 2, track, math,
                               _chunk)
