"""On a real GPU: backend="cupy" equals the reference backend bit for bit.

Runs automatically when torch sees a CUDA device and CuPy imports; skipped with the
reason otherwise.  The oracle is the reference backend on CPU copies, the same oracle
the CPU emulation tests use; every instantiation (quality plans and telemetry
included) with every run-time flag, over consecutive steps.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt.adam import adam_scalars
from bf16opt.backends import Bucket, reference
from bf16opt.backends import cupy as cuda_backend
from bf16opt.lion import lion_scalars

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install 'bf16opt[cuda12]' or 'bf16opt[cuda13]'",
                allow_module_level=True)

from test_cuda_emulation import (ADAM_CONFIGS, LION_CONFIGS, SIZES, adam_group,  # noqa: E402
                                 assert_same_bits, clone_bucket, lion_group, make_bucket)


def to_cuda(t):
    """Copy a CPU tensor to the GPU keeping its storage offset (alignment) and strides."""
    if t is None:
        return None
    if not t.is_contiguous():
        return t.cuda()
    base = torch.empty(t.storage_offset() + t.numel(), dtype=t.dtype, device="cuda")
    view = base[t.storage_offset():].view(t.shape)
    view.copy_(t)
    return view


BUFFERS = ("params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
           "compensations", "remainders")


def bucket_to_cuda(bucket: Bucket) -> Bucket:
    cuda = clone_bucket(bucket)
    for field in BUFFERS:
        setattr(cuda, field, [to_cuda(t) for t in getattr(bucket, field)])
    return cuda


def bucket_to_cpu(bucket: Bucket) -> Bucket:
    cpu = clone_bucket(bucket)
    for field in BUFFERS:
        setattr(cpu, field, [None if t is None else t.cpu() for t in getattr(cpu, field)])
    return cpu


def run_on_gpu(kind, plan, flags, seed, sizes, steps=3, **plan_options):
    rng = np.random.default_rng(seed)
    expected = make_bucket(kind, plan, flags, sizes, rng, 0.1, 0.5, True)
    actual = bucket_to_cuda(expected)
    group = adam_group(rng, flags.get("l2", False)) if kind == "adam" else lion_group(rng)
    for step in range(1, steps + 1):
        expected.step = actual.step = step
        scalars = adam_scalars(group, step) if kind == "adam" else lion_scalars(group)
        getattr(reference, kind)(expected, scalars)
        cuda_backend.run_bucket(kind, actual, scalars, **plan_options)
        torch.cuda.synchronize()
        assert_same_bits(expected, bucket_to_cpu(actual), f"{kind} {plan} {flags} step {step}")


@pytest.mark.parametrize("index", range(len(ADAM_CONFIGS)))
def test_adam_kernels_on_gpu(index):
    _, plan, flags = ADAM_CONFIGS[index]
    run_on_gpu("adam", plan, flags, index, SIZES)
    run_on_gpu("adam", plan, flags, index, [100_003, 5, 70_000], chunk_size=4096, max_grid=7)


@pytest.mark.parametrize("index", range(len(LION_CONFIGS)))
def test_lion_kernels_on_gpu(index):
    _, plan, flags = LION_CONFIGS[index]
    run_on_gpu("lion", plan, flags, index, SIZES)
    run_on_gpu("lion", plan, flags, index, [100_003, 5, 70_000], chunk_size=4096, max_grid=7)


@pytest.mark.parametrize("optimizer, options", [
    (bf16opt.AdamW, dict(precision="bf16", weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="bf16-states", amsgrad=True)),
    (bf16opt.Adam, dict(precision="fp32", weight_decay=0.01, maximize=True)),
    (bf16opt.Lion, dict(precision="bf16-master", weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1, track_precision=True)),
    (bf16opt.AdamW, dict(precision="bf16-kahan", amsgrad=True)),
    (bf16opt.Adam, dict(precision="fp32-remainder", track_precision=True)),
    (bf16opt.Lion, dict(precision="bf16-sr", seed=7)),
])
def test_optimizer_backend_cupy_on_gpu(optimizer, options):
    g = torch.Generator().manual_seed(0)
    shapes = [(333, 77), (5,), (1029,), (4, 4, 3)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    expected = optimizer(cpu, lr=1e-2, backend="reference", **options)
    actual = optimizer(gpu, lr=1e-2, backend="cupy", **options)
    assert type(actual.param_groups[0]["backend"]) is str
    for _ in range(3):
        for c, d in zip(cpu, gpu):
            grad = torch.randn(c.shape, generator=g).to(c.dtype)
            c.grad, d.grad = grad, grad.cuda()
        expected.step()
        actual.step()
        if options.get("track_precision"):
            assert actual.precision_stats() == expected.precision_stats()
    torch.cuda.synchronize()
    for c, d in zip(cpu, gpu):
        view = torch.int16 if c.element_size() == 2 else torch.int32
        assert torch.equal(c.detach().view(view), d.detach().cpu().view(view))


def test_runs_on_the_current_stream():
    params = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))]
    opt = bf16opt.AdamW(params, backend="cupy")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        params[0].grad = torch.ones_like(params[0])
        before = params[0].detach().clone()
        opt.step()
        after = params[0].detach().clone()  # ordered after the kernel on the same stream
    stream.synchronize()
    assert not torch.equal(before, after)
    assert torch.equal(after, params[0].detach())
