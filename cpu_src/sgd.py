"""Numba chunk functions for SGD with momentum (torch.optim.SGD's math), same conventions
as ``adam.py``; the operation order is ``bf16opt/backends/reference.py``'s ``sgd``."""

from __future__ import annotations

import functools

import numpy as np
from numba import cfunc

from .chunks import CHUNK_SIGNATURE
from .storage import (MOMENT_ROUNDINGS, WEIGHT_POLICIES, load, load_weights, pointer_to,
                      store_moment, store_weights)

__all__ = ["chunk_function"]


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moments: str, track: bool, momentum: bool = False,
                   l2: bool = False, nesterov: bool = False, first: bool = False):
    """The compiled SGD chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of ``bf16opt.algorithms.SGD.roles`` (param, grad,
    companion, momentum_buffer); ``momentum``: the buffer exists; ``first``: its first
    step (the buffer becomes the gradient, as torch clones it); the other arguments as for
    :func:`adam.chunk_function`.  The scalars are ``SGDScalars`` (``inv_grad_scale`` last) followed by ``sign``.
    """
    param_format, grad_format, companion_format, buffer_format = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments, track = str(weights), str(moments), bool(track)
    momentum, l2, nesterov, first = bool(momentum), bool(l2), bool(nesterov), bool(first)

    @cfunc(CHUNK_SIGNATURE, cache=True, error_model="numpy")
    def chunk(row, scalars, keys, counts):
        param = pointer_to(row[0], param_format)
        grad = pointer_to(row[1], grad_format)
        companion = pointer_to(row[2], companion_format)
        momentum_buffer = pointer_to(row[3], buffer_format)
        n, start = row[4], row[5]
        momentum_factor, one_minus_dampening = scalars[0], scalars[1]
        lr, weight_decay = scalars[2], scalars[3]
        inv_grad_scale, sign = scalars[4], scalars[5]
        key_w, key_b = keys[0], keys[1]
        swallowed, b_underflow = 0, 0
        for i in range(n):
            element = start + i
            g = load(grad, i) * inv_grad_scale
            g = g * sign
            w0 = load_weights(weights, param, companion, i)
            w = w0
            if l2:
                t = w * weight_decay
                g = g + t
            if momentum:
                if first:
                    b = g
                else:
                    b = load(momentum_buffer, i) * momentum_factor
                    t = g * one_minus_dampening
                    b = b + t
                if nesterov:
                    t = b * momentum_factor
                    g = g + t
                else:
                    g = b
                stored_b = store_moment(moments, momentum_buffer, i, b, key_b, element)
                if track:
                    b_underflow += (b != np.float32(0.0)) & (stored_b == np.float32(0.0))
            u = g * lr
            w = w - u
            same = store_weights(weights, param, companion, i, w0, w, key_w, element)
            if track:
                swallowed += (u != np.float32(0.0)) & same
        if track:
            counts[0] = swallowed
            counts[1] = b_underflow

    return chunk
