"""Independent oracles for the update math, written in numpy from the papers' formulas.

* ``*_f32``: the operation order of the spec, in numpy float32 (one rounding per op);
  encoding with numpy's own conversions.  Agreement bit for bit with the reference
  backend shows the reference does what its docstring says.
* ``*_f64``: the same formulas in float64, for the rounding-error bounds.
"""

from __future__ import annotations

import numpy as np
import torch

U = 2.0 ** -24  # unit roundoff of float32

CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def to_numpy_f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float32, copy=True)


def bits(t: torch.Tensor) -> np.ndarray:
    """Raw storage bits of a tensor as an unsigned numpy array."""
    view = {torch.float32: (torch.int32, np.uint32), torch.bfloat16: (torch.int16, np.uint16),
            torch.float16: (torch.int16, np.uint16)}[t.dtype]
    return t.detach().contiguous().view(view[0]).numpy().view(view[1]).reshape(-1).copy()


def encode_bits(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Bits of round-to-nearest-even(x) in ``dtype`` with canonical NaN (numpy only), flattened."""
    x = np.array(x, dtype=np.float32, ndmin=1).reshape(-1)
    if dtype == torch.float32:
        out = x.view(np.uint32).copy()
    elif dtype == torch.float16:
        with np.errstate(over="ignore"):  # overflow to inf is the IEEE result we want
            out = x.astype(np.float16).view(np.uint16).copy()
    elif dtype == torch.bfloat16:
        b = x.view(np.uint32).astype(np.uint64)
        out = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)
    else:
        raise TypeError(dtype)
    out[np.isnan(x)] = CANONICAL_NAN[dtype]
    return out


def half_ulp(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """An upper bound of half a unit in the last place of ``dtype`` at |x|."""
    ax = np.abs(np.asarray(x, dtype=np.float64))
    if dtype == torch.float32:
        return ax * 2.0 ** -24 + 2.0 ** -150
    if dtype == torch.bfloat16:
        return ax * 2.0 ** -8 + 2.0 ** -134
    return ax * 2.0 ** -11 + 2.0 ** -25  # float16


@np.errstate(all="ignore")  # inf/NaN inputs are part of the tests
def adam_f32(w, g, m, v, vmax, s, *, maximize, l2, amsgrad):
    """One Adam step in numpy float32, in the spec's operation order."""
    f = np.float32
    g = -g if maximize else g
    if l2:
        g = g + w * f(s.weight_decay)
    w = w * f(s.decay)
    m = m * f(s.beta1) + g * f(s.one_minus_beta1)
    v = v * f(s.beta2) + (g * f(s.one_minus_beta2)) * g
    v_hat = np.where((vmax > v) | np.isnan(vmax), vmax, v) if amsgrad else v
    d = np.sqrt(v_hat) * f(s.inv_sqrt_bias_correction2) + f(s.eps)
    w = w - (m / d) * f(s.step_size)
    return w, m, v, v_hat


def adam_f64(w, g, m, v, vmax, s, *, maximize, l2, amsgrad):
    """The same step in float64 (same float32-valued scalars), plus an error bound for w."""
    w, g, m, v, vmax = (np.asarray(a, dtype=np.float64) for a in (w, g, m, v, vmax))
    g = -g if maximize else g
    g_mag = np.abs(g) + (s.weight_decay * np.abs(w) if l2 else 0.0)
    if l2:
        g = g + s.weight_decay * w
    w_decayed = w * s.decay
    m_mag = s.beta1 * np.abs(m) + s.one_minus_beta1 * g_mag
    m_new = s.beta1 * m + s.one_minus_beta1 * g
    v_mag = s.beta2 * v + s.one_minus_beta2 * g_mag * g_mag
    v_new = s.beta2 * v + s.one_minus_beta2 * g * g
    v_hat = np.maximum(vmax, v_new) if amsgrad else v_new
    d = np.sqrt(v_hat) * s.inv_sqrt_bias_correction2 + s.eps
    update = m_new / d * s.step_size
    w_new = w_decayed - update
    # each float32 op adds at most U relative error; sums of these terms bound the total
    bounds = {
        "w": 16 * U * (np.abs(w_new) + np.abs(w_decayed) + np.abs(update)
                       + s.step_size * m_mag / d),
        "m": 4 * U * m_mag,
        "v": 6 * U * v_mag,
    }
    return (w_new, m_new, v_new, v_hat), bounds


@np.errstate(all="ignore")
def lion_f32(w, g, m, s, *, maximize):
    f = np.float32
    g = -g if maximize else g
    w = w * f(s.decay)
    c = m * f(s.beta1) + g * f(s.one_minus_beta1)
    sign = np.sign(c) + f(0.0)  # NaN stays NaN, -0 becomes +0
    w = w - sign * f(s.lr)
    m = m * f(s.beta2) + g * f(s.one_minus_beta2)
    return w, m


def lion_f64(w, g, m, lr, beta1, beta2, weight_decay, *, maximize):
    """Lion from the paper's formula, in float64 with the user's (unrounded) hyper-parameters."""
    w, g, m = (np.asarray(a, dtype=np.float64) for a in (w, g, m))
    g = -g if maximize else g
    c = beta1 * m + (1 - beta1) * g
    w = w * (1 - lr * weight_decay) - lr * np.sign(c)
    m = beta2 * m + (1 - beta2) * g
    return w, m
