"""Numba kernels for Lion (Chen et al. 2023), same conventions as ``adam.py``."""

from __future__ import annotations

import functools

import numpy as np

from numba import njit, prange

from .storage import address_as_pointer, load, store

__all__ = ["LION_BUFFERS", "lion_kernel"]

#: buffer order in the chunk table columns (see chunks.py)
LION_BUFFERS = ("param", "grad", "master", "exp_avg")


@functools.lru_cache(maxsize=None)
def lion_kernel(has_master: bool, maximize: bool):
    """The compiled-on-first-call Lion kernel for one set of flags (memoised).

    Call signature: ``kernel(table, param_format, grad_format, master_format,
    exp_avg_format, beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay)``.
    """
    has_master, maximize = bool(has_master), bool(maximize)

    @njit(parallel=True, nogil=True, cache=True, error_model="numpy")
    def kernel(table, param_format, grad_format, master_format, exp_avg_format,
               beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay):
        for row in prange(table.shape[0]):
            param = address_as_pointer(table[row, 0], param_format)
            grad = address_as_pointer(table[row, 1], grad_format)
            master = address_as_pointer(table[row, 2], master_format)
            exp_avg = address_as_pointer(table[row, 3], exp_avg_format)
            for i in range(table[row, 4]):
                g = load(grad, i)
                if maximize:
                    g = -g
                if has_master:
                    w = load(master, i)
                else:
                    w = load(param, i)
                w = w * decay
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
                store(exp_avg, i, m)
                if has_master:
                    store(master, i, w)
                store(param, i, w)

    return kernel
