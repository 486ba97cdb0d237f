"""Numba kernels for Adam / AdamW (amsgrad, maximize, L2 or decoupled weight decay).

The per-element math, operation by operation, is ``bf16opt/backends/reference.py``'s;
each line below is one float32 operation rounded on its own (no fastmath, so LLVM does
not contract ``a * b + c`` into a fused multiply-add or reassociate).

Specialisation: the optimizer flags (master copy, amsgrad, maximize, L2) are closure
constants of a kernel made by :func:`adam_kernel`, so LLVM folds them away; the storage
formats come from the element types of the ``*_format`` token arrays (see
``storage.py``), so each combination of dtypes is its own compiled specialisation.
Neither leaves a run-time branch in the loop.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from .storage import address_as_pointer, load, store

__all__ = ["ADAM_BUFFERS", "adam_kernel"]

#: buffer order in the chunk table columns (see chunks.py)
ADAM_BUFFERS = ("param", "grad", "master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@functools.lru_cache(maxsize=None)
def adam_kernel(has_master: bool, amsgrad: bool, maximize: bool, l2: bool):
    """The compiled-on-first-call Adam kernel for one set of flags (memoised).

    Call signature: ``kernel(table, param_format, grad_format, master_format,
    exp_avg_format, exp_avg_sq_format, max_exp_avg_sq_format, beta1, beta2,
    one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps,
    weight_decay, decay)``; formats are (empty) arrays of the view dtypes, scalars
    are ``np.float32``.
    """
    has_master, amsgrad, maximize, l2 = bool(has_master), bool(amsgrad), bool(maximize), bool(l2)

    @njit(parallel=True, nogil=True, cache=True, error_model="numpy")
    def kernel(table, param_format, grad_format, master_format, exp_avg_format,
               exp_avg_sq_format, max_exp_avg_sq_format, beta1, beta2, one_minus_beta1,
               one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps, weight_decay, decay):
        for row in prange(table.shape[0]):
            param = address_as_pointer(table[row, 0], param_format)
            grad = address_as_pointer(table[row, 1], grad_format)
            master = address_as_pointer(table[row, 2], master_format)
            exp_avg = address_as_pointer(table[row, 3], exp_avg_format)
            exp_avg_sq = address_as_pointer(table[row, 4], exp_avg_sq_format)
            max_exp_avg_sq = address_as_pointer(table[row, 5], max_exp_avg_sq_format)
            for i in range(table[row, 6]):
                g = load(grad, i)
                if maximize:
                    g = -g
                if has_master:
                    w = load(master, i)
                else:
                    w = load(param, i)
                if l2:
                    t = w * weight_decay
                    g = g + t
                w = w * decay
                m = load(exp_avg, i) * beta1
                t = g * one_minus_beta1
                m = m + t
                v = load(exp_avg_sq, i) * beta2
                t = g * g
                t = t * one_minus_beta2
                v = v + t
                if amsgrad:
                    v_max = load(max_exp_avg_sq, i)
                    # torch.maximum: NaN if either is NaN
                    v_hat = v_max if (v_max >= v or v_max != v_max) else v
                else:
                    v_hat = v
                d = np.sqrt(v_hat)
                d = d * inv_sqrt_bias_correction2
                d = d + eps
                u = m / d
                u = u * step_size
                w = w - u
                store(exp_avg, i, m)
                store(exp_avg_sq, i, v)
                if amsgrad:
                    store(max_exp_avg_sq, i, v_hat)
                if has_master:
                    store(master, i, w)
                store(param, i, w)

    return kernel
