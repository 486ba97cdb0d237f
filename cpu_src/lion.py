"""Numba chunk functions for Lion (Chen et al. 2023), same conventions as ``adam.py``."""

from __future__ import annotations

import functools

import numpy as np
from numba import cfunc

from .chunks import CHUNK_SIGNATURE
from .storage import (MOMENT_ROUNDINGS, WEIGHT_POLICIES, load, load_weights, pointer_to,
                      store_moment, store_weights)

__all__ = ["chunk_function"]


@functools.lru_cache(maxsize=None)
def chunk_function(formats: tuple, weights: str, moments: str, track: bool):
    """The compiled Lion chunk function of one configuration (memoised; on-disk cached).

    ``formats``: numpy element classes of ``bf16opt.algorithms.LION.roles`` (param, grad,
    companion, exp_avg); the other arguments as for :func:`adam.chunk_function`.  The
    scalars are ``LionScalars`` (``inv_grad_scale`` last) followed by ``sign``.
    """
    param_format, grad_format, companion_format, exp_avg_format = formats
    if weights not in WEIGHT_POLICIES or moments not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moments!r}")
    weights, moments, track = str(weights), str(moments), bool(track)

    @cfunc(CHUNK_SIGNATURE, cache=True, error_model="numpy")
    def chunk(row, scalars, keys, counts):
        param = pointer_to(row[0], param_format)
        grad = pointer_to(row[1], grad_format)
        companion = pointer_to(row[2], companion_format)
        exp_avg = pointer_to(row[3], exp_avg_format)
        n, start = row[4], row[5]
        beta1, beta2 = scalars[0], scalars[1]
        one_minus_beta1, one_minus_beta2 = scalars[2], scalars[3]
        lr, decay, inv_grad_scale, sign = scalars[4], scalars[5], scalars[6], scalars[7]
        key_w, key_m = keys[0], keys[1]
        swallowed, m_underflow = 0, 0
        for i in range(n):
            element = start + i
            g = load(grad, i) * inv_grad_scale
            g = g * sign
            w0 = load_weights(weights, param, companion, i)
            w = w0 * decay
            m_old = load(exp_avg, i)
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
            stored_m = store_moment(moments, exp_avg, i, m, key_m, element)
            same = store_weights(weights, param, companion, i, w0, w, key_w, element)
            if track:
                swallowed += (u != np.float32(0.0)) & same
                m_underflow += (m != np.float32(0.0)) & (stored_m == np.float32(0.0))
        if track:
            counts[0] = swallowed
            counts[1] = m_underflow

    return chunk
