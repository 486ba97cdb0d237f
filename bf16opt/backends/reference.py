"""Reference backend: the executable specification of every update, in plain torch.

The Numba kernels (``cpu_src/``) and CUDA kernels (``cuda_src/``) must produce the same
bits.  Rules that make that possible (``docs/numerics.md``):

* every stored value is decoded to float32 (``storage.decode``), the update is
  computed in float32, and results are encoded back (``storage.encode``);
* each line below is ONE float32 operation, rounded on its own, in exactly this
  order: no fused multiply-add, no reassociation; never ``addcmul_``, ``addcdiv_``
  or ``lerp_`` (their kernels may fuse);
* the scalars come from the host already rounded to float32 (``base.f32``);
* sqrt is the correctly rounded IEEE square root.  torch's own float32 sqrt is not on
  every CPU (its AVX-512 path is 1 ulp off on ~17% of inputs), so the reference rounds
  the float64 root to a float32 candidate and then checks it exactly against the
  midpoints to its neighbours (squares of 26-bit numbers are exact in float64);
* ``max(a, b)`` is ``a if (a > b or a is NaN) else b`` and ``sign(c)`` is NaN for NaN,
  +0 for +-0: written out, since torch's maximum picks either zero on a +-0 tie and
  torch.sign(NaN) is 0 on CPU.

Every update starts by reading the gradient the same way::

    g  = decode(grad) * inv_grad_scale;  if maximize: g = -g

``grad`` is stored like the param, or in float32 for a bfloat16/float16 param whose grads
are accumulated in float32 (decode of float32 is the value itself: no rounding to the
param's format).  ``inv_grad_scale`` is the float32 reciprocal of GradScaler's loss scale,
exactly 1.0 without one (``g * 1.0`` is ``g``).  Below, "g = gradient" stands for this line.

Adam / AdamW, per element (``w`` is the master value, ``g`` the gradient)::

    g  = gradient
    w  = decode(master or param)
    if l2:  t = w * weight_decay;  g = g + t            # Adam's L2 decay, only if wd != 0
    w  = w * decay                                      # AdamW: 1 - lr*wd; Adam: 1.0
    m  = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  m = m + t
    v  = decode(exp_avg_sq) * beta2;  t = g * one_minus_beta2;  t = t * g;  v = v + t   # torch's order
    if amsgrad: v_hat = max(decode(max_exp_avg_sq), v)  else: v_hat = v
    d  = sqrt(v_hat);  d = d * inv_sqrt_bias_correction2;  d = d + eps
    u  = m / d;  u = u * step_size
    w  = w - u
    store m, v (and v_hat into max_exp_avg_sq); store_weights(w0, w) (below).

Lion (Chen et al. 2023), per element::

    g  = gradient
    w  = decode(master or param);  w = w * decay           # decay = 1 - lr*wd
    c  = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  c = c + t
    s  = sign(c), with +0 for c == +-0 and NaN for NaN
    u  = s * lr;  w = w - u
    m  = decode(exp_avg) * beta2;  t = g * one_minus_beta2;  m = m + t
    store m; store_weights(w0, w).

SGD (torch.optim.SGD's order), per element::

    g  = gradient
    w  = decode(master or param)
    if l2:  t = w * weight_decay;  g = g + t           # only if wd != 0
    if momentum:                                       # momentum != 0: a momentum buffer
        if first: b = g                                # the buffer's first step (torch clones g)
        else:     b = decode(momentum_buffer) * momentum;  t = g * one_minus_dampening;  b = b + t
        if nesterov: t = b * momentum;  g = g + t
        else:        g = b
    u  = g * lr;  w = w - u
    store b; store_weights(w0, w).

float64 params run the same listings in float64 math with unrounded float64 scalars (torch
keeps float64 params in float64 too); their float32 or bfloat16 moments are encoded from the
float64 result rounded to float32.

``w0`` is the master value before the step: join_copy(param, master copy), decode(param), or
join_remainder(param, remainder).  join_copy is the copy, or decode(param) where the param's
bits are not encode(copy): a param edited between steps (docs/numerics.md).  The moments used
in an update are the float32 results before encoding; what is stored is their encoding: round
to nearest even, or stochastic rounding (plan.rounding) for 16-bit moments, each with its
own buffer's bits.  A q8 moment is decoded with ``storage.q8_decode`` and stored with
``storage.q8_encode`` (per block of 256 elements; stochastic when plan.q8_rounding says so, on
the same buffer's bits) in its own map.  A moment's buffer and map are its row of
``bf16opt._cpu.roles.STATE_ROLES`` (first moments: a signed map, second moments: unsigned).

store_weights(w0, w), by plan:

* float32 master copy: master = encode(w); param = encode(w) (round to nearest even);
* the param is the master: param = encode(w), stochastic (stream WEIGHTS) when
  plan.rounding says so;
* Kahan (16-bit master, buffer c)::

      y = w - w0;  y = y + decode(c);  s = w0 + y;  param = encode(s)
      t = decode(param) - w0;  c = encode(y - t)          # round to nearest even

* remainder: (param, remainder) = split_remainder(w).

Telemetry (``bucket.counts``), per param: elements whose update ``u`` is non-zero but
whose stored master (param, copy, or param + remainder) kept its bits — swallowed
updates (a copy's "kept": the new copy is the encoding of ``w0``, which for an edited param
is the param's value, not the stale copy); and elements of exp_avg / exp_avg_sq whose
float32 value is non-zero but whose stored value is zero — underflows.
"""

from __future__ import annotations

import functools

import torch

from .._cpu.roles import buffer_of
from ..storage import (Q8, Q8_BLOCK, WEIGHTS, buffer_bits, decode, encode, encode_stochastic, join_copy,
                       join_remainder, q8_decode, q8_encode, q8_signed, random_bits, split_remainder,
                       stream_key, stream_of)
from .base import Bucket, check_scalars
from .staging import check

name = "reference"


def _value(bucket: Bucket, x: torch.Tensor) -> torch.Tensor:
    """A stored tensor's value in the bucket's compute dtype: float32 (``decode``), or
    float64 for float64 params, whose update is the same listing in float64 math."""
    return x.double() if bucket.plan.param == torch.float64 else decode(x)


def _master_value(bucket: Bucket, i: int) -> torch.Tensor:
    weights = bucket.config.weights
    param = bucket.params[i]
    if weights == "remainder":
        return join_remainder(param, bucket["companion"][i])
    if weights == "copy":  # the copy, unless the param was edited since it was written from it
        return join_copy(param, bucket["companion"][i])
    return _value(bucket, param)


def _moment(bucket: Bucket, i: int, role: str) -> torch.Tensor:
    """A moment's value: ``_value``, or the q8 decoding (float32) of a q8 moment."""
    stored = bucket[role][i]
    if stored.dtype == Q8:
        value = q8_decode(stored, bucket.params[i].shape, q8_signed(role))
        return value.double() if bucket.plan.param == torch.float64 else value
    return _value(bucket, stored)


def _random_word(bucket: Bucket, i: int, shape, device, buffer: int) -> torch.Tensor:
    key = stream_key(bucket.seed, bucket.step, bucket.stream_id(i), stream_of(buffer))
    return buffer_bits(random_bits(key, shape, device, bucket.offset(i)), buffer)


def _encode(bucket: Bucket, i: int, x: torch.Tensor, dtype: torch.dtype, buffer: int) -> torch.Tensor:
    """Encode with the plan's rounding; ``buffer`` names the random bits
    (``storage.buffer_bits``).  float64 results are stored as they are (NaN canonical) or
    rounded to float32 first, then encoded."""
    if dtype == torch.float64:
        return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)
    x = x.float()  # a no-op for float32 math
    if bucket.plan.rounding == "stochastic" and dtype != torch.float32:
        return encode_stochastic(x, dtype, _random_word(bucket, i, x.shape, x.device, buffer))
    return encode(x, dtype)


def _store_moment(bucket: Bucket, i: int, role: str, value: torch.Tensor):
    """Store a moment's new value (rounding with ``role``'s buffer, ``roles.buffer_of``);
    returns what telemetry compares (the stored value's encoding, or for a q8 moment its
    decoding)."""
    target, buffer = bucket[role][i], buffer_of(role)
    if target.dtype == Q8:
        value = value.float()
        random = _random_word(bucket, i, value.shape, value.device, buffer) \
            if bucket.plan.q8_rounding == "stochastic" else None
        signed = q8_signed(role)
        encoded = q8_encode(value, signed, random)
        used = value.numel() - Q8_BLOCK * (encoded.shape[0] - 1)
        if encoded.shape[0] and used < Q8_BLOCK:  # the padding codes are never written (numerics.md)
            encoded[-1, used:Q8_BLOCK] = target[-1, used:Q8_BLOCK]
        target.copy_(encoded)
        return q8_decode(encoded, value.shape, signed)
    encoded = _encode(bucket, i, value, target.dtype, buffer)
    target.copy_(encoded)
    return encoded


def _stored_master_bits(bucket: Bucket, i: int, before: bool = False) -> list:
    """Copies of what holds the master, for telemetry's "unchanged" test; ``before`` the update,
    a copy's is the master the update starts from (``join_copy``: an edited param's value)."""
    weights = bucket.config.weights
    if weights == "copy" and before:
        companion = bucket["companion"][i]
        return [encode(_master_value(bucket, i), companion.dtype)]
    held = [bucket["companion"][i] if weights == "copy" else bucket.params[i]]
    if weights == "remainder":
        held.append(bucket["companion"][i])
    return [t.detach().clone() for t in held]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.view(view) == b.view(view)


def _store_weights(bucket: Bucket, i: int, w0: torch.Tensor, w: torch.Tensor) -> None:
    weights, param = bucket.config.weights, bucket.params[i]
    companion = bucket["companion"][i]
    if weights == "remainder":
        new_param, remainder = split_remainder(w)
        param.copy_(new_param)
        companion.copy_(remainder)
    elif weights == "kahan":
        y = torch.add(torch.sub(w, w0), decode(companion))
        new_param = encode(torch.add(w0, y), param.dtype)
        c = torch.sub(y, torch.sub(decode(new_param), w0))
        param.copy_(new_param)
        companion.copy_(encode(c, companion.dtype))
    elif weights == "copy":
        companion.copy_(encode(w, companion.dtype))
        param.copy_(encode(w, param.dtype))
    else:
        param.copy_(_encode(bucket, i, w, param.dtype, WEIGHTS))


def _count(bucket: Bucket, i: int, before: list, u: torch.Tensor, moments: list) -> None:
    after = _stored_master_bits(bucket, i)
    unchanged = _same_bits(before[0], after[0])
    for old, new in zip(before[1:], after[1:]):
        unchanged &= _same_bits(old, new)
    bucket.counts[i, :len(bucket.config.algorithm.counters)] = 0  # a moment this config lacks counts 0
    bucket.counts[i, 0] = int(((u != 0) & unchanged).sum())
    for column, (value, encoded) in enumerate(moments, start=1):
        bucket.counts[i, column] = int(((value != 0) & (decode(encoded) == 0)).sum())


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (see module doc); float64's is IEEE already."""
    if x.dtype == torch.float64:
        return torch.sqrt(x)
    root = torch.sqrt(x.double()).float()
    below = torch.nextafter(root, torch.zeros_like(root))
    above = torch.nextafter(root, torch.full_like(root, float("inf")))
    x64, root64 = x.double(), root.double()
    low = (root64 + below.double()) * 0.5   # midpoints, exact in float64
    high = (root64 + above.double()) * 0.5
    root = torch.where(x64 < low * low, below, root)
    return torch.where(x64 > high * high, above, root)


def _maximum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a if (a > b or a is NaN) else b``: one answer for +-0 ties and NaN."""
    return torch.where((a > b) | torch.isnan(a), a, b)


def _sign(c: torch.Tensor) -> torch.Tensor:
    """+1, -1, +0 for +-0, NaN for NaN."""
    ones = torch.ones_like(c)
    return torch.where(c > 0, ones, torch.where(c < 0, -ones, torch.add(c, 0.0)))


def _gradient(bucket: Bucket, i: int, s) -> torch.Tensor:
    """decode(grad) * inv_grad_scale, negated to maximize (float64 math for float64 params)."""
    g = torch.mul(_value(bucket, bucket["grad"][i]), s.inv_grad_scale)
    return torch.neg(g) if bucket.config.flag("maximize") else g


def adam(bucket: Bucket, s) -> None:
    amsgrad, l2 = bucket.config.flag("amsgrad"), bucket.config.flag("l2")
    for i in range(len(bucket.params)):
        before = _stored_master_bits(bucket, i, True) if bucket.counts is not None else None
        g = _gradient(bucket, i, s)
        w0 = w = _master_value(bucket, i)
        if l2:
            g = torch.add(g, torch.mul(w, s.weight_decay))
        w = torch.mul(w, s.decay)
        m = torch.add(torch.mul(_moment(bucket, i, "exp_avg"), s.beta1), torch.mul(g, s.one_minus_beta1))
        v = torch.add(torch.mul(_moment(bucket, i, "exp_avg_sq"), s.beta2),
                      torch.mul(torch.mul(g, s.one_minus_beta2), g))
        v_hat = _maximum(_moment(bucket, i, "max_exp_avg_sq"), v) if amsgrad else v
        d = torch.add(torch.mul(_sqrt(v_hat), s.inv_sqrt_bias_correction2), s.eps)
        u = torch.mul(torch.div(m, d), s.step_size)
        w = torch.sub(w, u)
        stored_m = _store_moment(bucket, i, "exp_avg", m)
        stored_v = _store_moment(bucket, i, "exp_avg_sq", v)
        if amsgrad:
            _store_moment(bucket, i, "max_exp_avg_sq", v_hat)
        _store_weights(bucket, i, w0, w)
        if before is not None:
            _count(bucket, i, before, u, [(m, stored_m), (v, stored_v)])


def lion(bucket: Bucket, s) -> None:
    for i in range(len(bucket.params)):
        before = _stored_master_bits(bucket, i, True) if bucket.counts is not None else None
        g = _gradient(bucket, i, s)
        w0 = _master_value(bucket, i)
        w = torch.mul(w0, s.decay)
        m_old = _moment(bucket, i, "exp_avg")
        c = torch.add(torch.mul(m_old, s.beta1), torch.mul(g, s.one_minus_beta1))
        u = torch.mul(_sign(c), s.lr)
        w = torch.sub(w, u)
        m = torch.add(torch.mul(m_old, s.beta2), torch.mul(g, s.one_minus_beta2))
        stored_m = _store_moment(bucket, i, "exp_avg", m)
        _store_weights(bucket, i, w0, w)
        if before is not None:
            _count(bucket, i, before, u, [(m, stored_m)])


def sgd(bucket: Bucket, s) -> None:
    config = bucket.config
    momentum, l2 = config.flag("momentum"), config.flag("l2")
    nesterov, first = config.flag("nesterov"), config.flag("first")
    for i in range(len(bucket.params)):
        before = _stored_master_bits(bucket, i, True) if bucket.counts is not None else None
        g = _gradient(bucket, i, s)
        w0 = w = _master_value(bucket, i)
        if l2:
            g = torch.add(g, torch.mul(w, s.weight_decay))
        moments = []
        if momentum:
            if first:
                b = g
            else:
                b = torch.add(torch.mul(_moment(bucket, i, "momentum_buffer"), s.momentum),
                              torch.mul(g, s.one_minus_dampening))
            g = torch.add(g, torch.mul(b, s.momentum)) if nesterov else b
            moments.append((b, _store_moment(bucket, i, "momentum_buffer", b)))
        u = torch.mul(g, s.lr)
        w = torch.sub(w, u)
        _store_weights(bucket, i, w0, w)
        if before is not None:
            _count(bucket, i, before, u, moments)


UPDATES = {"adam": adam, "lion": lion, "sgd": sgd}


def prepare(bucket: Bucket, scalars):
    """Check the bucket (as the kernel backends do: dtypes, shapes, devices); returns the update."""
    check_scalars(bucket, scalars)
    check(bucket, "reference")
    update = UPDATES[bucket.config.algorithm.name]
    if not any(param.is_neg() for param in bucket.params):
        return lambda: update(bucket, scalars)
    return functools.partial(_update_negative_views, update, bucket, scalars)


def _update_negative_views(update, bucket: Bucket, scalars) -> None:
    """The update of a bucket with negative-view params (``is_neg()``: memory holding the values
    negated), which the spec's bit views cannot read: on resolved copies, written back."""
    params = list(bucket.params)
    bucket.tensors[0][:] = [param.resolve_neg() if param.is_neg() else param for param in params]
    try:
        update(bucket, scalars)
        for param, copy in zip(params, bucket.params):
            if copy is not param:
                param.copy_(copy)
    finally:
        bucket.tensors[0][:] = params


def run(bucket: Bucket, scalars) -> None:
    """Update every param of ``bucket`` with its algorithm's math."""
    prepare(bucket, scalars)()
