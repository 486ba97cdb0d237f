"""Reference backend: the executable specification of every update, in plain torch.

The Numba kernels (``cpu_src/``) and CUDA kernels (``cuda_src/``) must produce the same
bits.  Rules that make that possible (DESIGN.md section 3):

* every stored value is decoded to float32 (``storage.decode``), the update is
  computed in float32, and results are encoded back (``storage.encode``);
* each line below is ONE float32 operation, rounded on its own, in exactly this
  order: no fused multiply-add, no reassociation; never ``addcmul_``, ``addcdiv_``
  or ``lerp_`` (their kernels may fuse);
* the scalars come from the host already rounded to float32 (``base.f32``).

Adam / AdamW, per element (``w`` is the master value, ``g`` the gradient)::

    g  = decode(grad);  if maximize: g = -g
    w  = decode(master or param)
    if l2:  t = w * weight_decay;  g = g + t            # Adam's L2 decay, only if wd != 0
    w  = w * decay                                      # AdamW: 1 - lr*wd; Adam: 1.0
    m  = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  m = m + t
    v  = decode(exp_avg_sq) * beta2;  t = g * g;  t = t * one_minus_beta2;  v = v + t
    if amsgrad: v_hat = max(decode(max_exp_avg_sq), v)  else: v_hat = v
    d  = sqrt(v_hat);  d = d * inv_sqrt_bias_correction2;  d = d + eps
    u  = m / d;  u = u * step_size
    w  = w - u
    store m, v (and v_hat into max_exp_avg_sq); store w into the master copy if
    there is one, and encode(w) into the param.

Lion (Chen et al. 2023), per element::

    g  = decode(grad);  if maximize: g = -g
    w  = decode(master or param);  w = w * decay           # decay = 1 - lr*wd
    c  = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  c = c + t
    s  = sign(c), with +0 for c == +-0 and NaN for NaN
    u  = s * lr;  w = w - u
    m  = decode(exp_avg) * beta2;  t = g * one_minus_beta2;  m = m + t
    store m; store w as above.

The moments used in an update are the float32 results before encoding; what is
stored is their encoding.
"""

from __future__ import annotations

import torch

from ..storage import decode, store
from .base import AdamScalars, Bucket, LionScalars

name = "reference"


def _master_value(param: torch.Tensor, master) -> torch.Tensor:
    return decode(master if master is not None else param)


def _store_weights(param: torch.Tensor, master, w: torch.Tensor) -> None:
    if master is not None:
        store(master, w)
    store(param, w)


def _gradient(grad: torch.Tensor, maximize: bool) -> torch.Tensor:
    g = decode(grad)
    return torch.neg(g) if maximize else g


def adam(bucket: Bucket, s: AdamScalars) -> None:
    for i, param in enumerate(bucket.params):
        master = bucket.masters[i]
        g = _gradient(bucket.grads[i], bucket.maximize)
        w = _master_value(param, master)
        if bucket.l2:
            g = torch.add(g, torch.mul(w, s.weight_decay))
        w = torch.mul(w, s.decay)
        m = torch.add(torch.mul(decode(bucket.exp_avgs[i]), s.beta1), torch.mul(g, s.one_minus_beta1))
        v = torch.add(torch.mul(decode(bucket.exp_avg_sqs[i]), s.beta2),
                      torch.mul(torch.mul(g, g), s.one_minus_beta2))
        v_hat = torch.maximum(decode(bucket.max_exp_avg_sqs[i]), v) if bucket.amsgrad else v
        d = torch.add(torch.mul(torch.sqrt(v_hat), s.inv_sqrt_bias_correction2), s.eps)
        u = torch.mul(torch.div(m, d), s.step_size)
        w = torch.sub(w, u)
        store(bucket.exp_avgs[i], m)
        store(bucket.exp_avg_sqs[i], v)
        if bucket.amsgrad:
            store(bucket.max_exp_avg_sqs[i], v_hat)
        _store_weights(param, master, w)


def lion(bucket: Bucket, s: LionScalars) -> None:
    for i, param in enumerate(bucket.params):
        master = bucket.masters[i]
        g = _gradient(bucket.grads[i], bucket.maximize)
        w = torch.mul(_master_value(param, master), s.decay)
        m_old = decode(bucket.exp_avgs[i])
        c = torch.add(torch.mul(m_old, s.beta1), torch.mul(g, s.one_minus_beta1))
        sign = torch.add(torch.sign(c), 0.0)  # + 0.0 turns -0 into +0, keeps NaN
        w = torch.sub(w, torch.mul(sign, s.lr))
        m = torch.add(torch.mul(m_old, s.beta2), torch.mul(g, s.one_minus_beta2))
        store(bucket.exp_avgs[i], m)
        _store_weights(param, master, w)
