"""Optional comparisons with peers from PyPI (never dependencies of bf16opt; each test runs
where its peer is installed: ``pip install torch-optimi lion-pytorch``).

* Same math, same storage: bf16opt's fp32 Lion is lion-pytorch's and torch-optimi's bit for
  bit (both backends); its fp32 AdamW and SGD agree with torch-optimi's to float32 rounding
  (the operations' order differs by a few ulps).
* Same storage, other rounding code: over a run of small updates on bfloat16 params, bf16opt's
  ``bf16-kahan`` stays as close to the float32 run as torch-optimi's Kahan summation, and its
  plain ``bf16`` loses as much as optimi's plain bfloat16 step.
"""

from __future__ import annotations

import pytest
import torch

import bf16opt

LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SGD = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)


def optimi():
    return pytest.importorskip("optimi", reason="torch-optimi (a peer from PyPI) is not installed")


def run(make, dtype: torch.dtype, steps: int, n: int = 4096, grad_shift: float = 0.0,
        seed: int = 0) -> torch.Tensor:
    """The float32 value of one param of ``n`` elements, from bfloat16 starting values, after
    ``steps`` steps of ``make([param])`` on seeded grads (``grad_shift``: a bias, so updates
    keep a direction and rounding losses accumulate)."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=generator).mul(0.1).to(torch.bfloat16)
    param = start.to(dtype).clone().requires_grad_()
    opt = make([param])
    for _ in range(steps):
        param.grad = (torch.randn(n, generator=generator) * 0.01 + grad_shift).to(dtype)
        opt.step()
    return param.detach().float()


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_fp32_lion_is_lion_pytorch_bit_for_bit(backend):
    lion_pytorch = pytest.importorskip("lion_pytorch",
                                       reason="lion-pytorch (a peer from PyPI) is not installed")
    theirs = run(lambda ps: lion_pytorch.Lion(ps, **LION), torch.float32, 20)
    ours = run(lambda ps: bf16opt.Lion(ps, precision="fp32", backend=backend, **LION), torch.float32, 20)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_fp32_lion_is_optimis_bit_for_bit(backend):
    peer = optimi()
    theirs = run(lambda ps: peer.Lion(ps, kahan_sum=False, **LION), torch.float32, 20)
    ours = run(lambda ps: bf16opt.Lion(ps, precision="fp32", backend=backend, **LION), torch.float32, 20)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_fp32_adamw_and_sgd_agree_with_optimi_to_float32_rounding(name):
    peer = optimi()
    hyper, extra = (ADAMW, {}) if name == "AdamW" else (SGD, dict(torch_init=True))  # (torch's first buffer)
    theirs = run(lambda ps: getattr(peer, name)(ps, kahan_sum=False, **hyper, **extra), torch.float32, 20)
    ours = run(lambda ps: getattr(bf16opt, name)(ps, precision="fp32", **hyper), torch.float32, 20)
    # a few float32 ulps (a step moves a param by ~1e-3: far outside this)
    torch.testing.assert_close(ours, theirs, rtol=4 * 2.0 ** -24, atol=1e-7)


@pytest.mark.parametrize("name, hyper, extra", [
    ("AdamW", dict(ADAMW, lr=1e-4), {}),
    ("Lion", dict(LION, lr=1e-5), {}),
    ("SGD", dict(SGD, lr=1e-3), dict(torch_init=True)),
])
def test_kahan_summation_is_as_accurate_as_optimis(name, hyper, extra):
    """Mean error against the float32 run, relative to the params' mean magnitude, after 300
    steps whose updates are a fraction of a bfloat16 ulp: Kahan's within 10% of optimi's (both
    ~1.5e-3 here), plain bfloat16's the same as optimi's (3-9e-2: updates lost)."""
    peer = optimi()
    ours, theirs = getattr(bf16opt, name), getattr(peer, name)
    truth = run(lambda ps: ours(ps, precision="fp32", **hyper), torch.float32, 300, grad_shift=0.003)

    def error(make) -> float:
        final = run(make, torch.bfloat16, 300, grad_shift=0.003)
        return float((final - truth).abs().mean() / truth.abs().mean())

    kahan = error(lambda ps: ours(ps, precision="bf16-kahan", **hyper))
    peer_kahan = error(lambda ps: theirs(ps, kahan_sum=True, **hyper, **extra))
    plain = error(lambda ps: ours(ps, precision="bf16", **hyper))
    peer_plain = error(lambda ps: theirs(ps, kahan_sum=False, **hyper, **extra))
    assert kahan <= 1.1 * peer_kahan, (kahan, peer_kahan)
    assert plain <= 1.1 * peer_plain, (plain, peer_plain)
    assert kahan < 0.1 * plain, (kahan, plain)  # (the run loses updates without compensation)
