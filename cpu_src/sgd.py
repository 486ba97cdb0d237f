"""Numba chunk functions for SGD with momentum (torch.optim.SGD's math), same conventions
as ``adam.py`` (the update of one element, run by the element loop or the paired loop, or
whole blocks by ``vector_blocks.py`` where it covers the configuration: a momentum buffer
after its first step); the operation order is ``bf16opt/backends/reference.py``'s
``sgd``."""

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
def chunk_function(formats: tuple, weights: str, moments: str, track: bool, momentum: bool = False,
                   l2: bool = False, nesterov: bool = False, first: bool = False, unit: bool = False):
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
    param_format, grad_format, companion_format, buffer_format = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments, track = str(weights), str(moments), bool(track)
    momentum, l2, nesterov, first, unit = bool(momentum), bool(l2), bool(nesterov), bool(first), bool(unit)
    reads_buffer = momentum and not first
    reads_param, has_companion = WEIGHT_ARRAYS[weights]
    present = (param_format, grad_format) + ((companion_format,) if has_companion else ()) + \
        ((buffer_format,) if momentum else ())
    # whole blocks hand-vectorised where vector_blocks.py covers the configuration (adam.py)
    form = None if not reads_buffer else vector_blocks.form(
        weights, param_format, grad_format, companion_format, (buffer_format,), moments, track, unit, l2)
    vector = form is not None
    # all arrays 16-bit: words of two elements, unless the blocks take them
    paired = not vector and all(f in SIXTEEN_BITS for f in present)
    if vector and nesterov:
        form |= vector_blocks.NESTEROV
    block = vector_blocks.SGD_BLOCK if vector else 0
    param_size, grad_size, companion_size, moment_size = (np.dtype(f).itemsize  # bytes per element
                                                          for f in (param_format, grad_format, companion_format,
                                                                    buffer_format))

    @update_jit
    def element_update(g, p, comp, b, element, now):
        """Stored elements of grad, param, companion, momentum buffer in; the elements to
        store and the telemetry flags (swallowed, buffer underflow) out."""
        momentum_factor, one_minus_dampening, lr, weight_decay, scale, key = now
        random = random_bits(key, element)  # stochastic rounding's stream: weights, buffer (or dead code)
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
            b, b_value = encode_moment(moments, buffer_format, b_new, buffer_bits(random, EXP_AVG))
            b_underflow = (b_new != np.float32(0.0)) & (b_value == np.float32(0.0))
        u = g * lr
        w = w - u
        p, comp, same = encode_master(weights, param_format, companion_format, p, comp, w0, w,
                                      buffer_bits(random, WEIGHTS))
        return p, comp, b, (u != np.float32(0.0)) & same, b_underflow

    # (the chunk function calls element_update as its global ``update``: see chunks.chunk_compiler)
    @chunk_compiler((formats, weights, moments, track, momentum, l2, nesterov, first, unit)
                    + ((("vector", block, form),) if vector else ()), update=element_update)
    def chunk(row, scalars, keys, counts):
        param = pointer_to(row[0], param_format)
        grad = pointer_to(row[1], grad_format)
        companion = pointer_to(row[2], companion_format)
        momentum_buffer = pointer_to(row[3], buffer_format)
        n, start = row[4], row[5]
        momentum_factor, one_minus_dampening = scalars[0], scalars[1]
        lr, weight_decay = scalars[2], scalars[3]
        scale = scalars[4] * scalars[5]  # inv_grad_scale * sign (see adam.py's module docstring)
        now = (momentum_factor, one_minus_dampening, lr, weight_decay, scale, keys[0])  # (update's)
        swallowed, b_underflow = 0, 0
        first_element = 0
        # (uint32 words need 4-byte aligned addresses; absent arrays have address 0)
        if paired and ((row[0] | row[1] | row[2] | row[3]) & 3) == 0:
            param_words = pointer_to(row[0], np.uint32)
            grad_words = pointer_to(row[1], np.uint32)
            companion_words = pointer_to(row[2], np.uint32)
            buffer_words = pointer_to(row[3], np.uint32)
            for j in range(n >> 1):
                g = grad_words[j]
                p = param_words[j] if reads_param else np.uint32(0)
                c = companion_words[j] if has_companion else np.uint32(0)
                b = buffer_words[j] if reads_buffer else np.uint32(0)
                low = update(low_half(g, grad_format), low_half(p, param_format), low_half(c, companion_format),
                             low_half(b, buffer_format), element_index(start, 2 * j), now)
                high = update(high_half(g, grad_format), high_half(p, param_format),
                              high_half(c, companion_format), high_half(b, buffer_format),
                              element_index(start, 2 * j + 1), now)
                param_words[j] = pair_word(low[0], high[0])
                if has_companion:
                    companion_words[j] = pair_word(low[1], high[1])
                if momentum:
                    buffer_words[j] = pair_word(low[2], high[2])
                if track:
                    swallowed += low[3] + high[3]
                    b_underflow += low[4] + high[4]
            first_element = n - (n & 1)
        if vector:
            first_element = n - n % block
            for j in range(0, first_element, block):
                vector_blocks.sgd_block(form, row[0] + param_size * j, row[1] + grad_size * j,
                                        row[2] + companion_size * j, row[3] + moment_size * j, scalars, scale,
                                        keys, element_index(start, j),
                                        vector_blocks.prefetch_ahead(j, n, block))
        for i in range(first_element, n):
            out = update(grad[i], param[i] if reads_param else param_format(0),
                         companion[i] if has_companion else companion_format(0),
                         momentum_buffer[i] if reads_buffer else buffer_format(0), element_index(start, i),
                         now)
            param[i] = out[0]
            if has_companion:
                companion[i] = out[1]
            if momentum:
                momentum_buffer[i] = out[2]
            if track:
                swallowed += out[3]
                b_underflow += out[4]
        if track:
            counts[0] = swallowed
            counts[1] = b_underflow

    chunk.vectorised = vector  # (the tests check which loop a configuration got)
    return chunk
