"""The CuPy adapter's host side: launch plans, sources, availability errors, and the
optimizer driving the (CPU-emulated) kernels end to end.  No GPU, no CuPy needed
(except where noted)."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt.backends import cupy as cuda_backend
from bf16opt.backends import resolve_backend
from cuda_emulation import emulator


# ---------------------------------------------------------------- launch plan
def test_launch_plan_layout():
    pointers = [(100, 200), (300, 400), (500, 600), (700, 800)]
    sizes = [10, 0, 33, 16]
    plan = cuda_backend.build_launch_plan(pointers, sizes, chunk_size=16, block=4)
    n = 3  # the empty tensor is left out
    assert plan.n_tensors == n and plan.chunk_size == 16 and plan.block == 4
    table = plan.table
    assert table.dtype == np.int64 and table.size == (2 + 3) * n + 1
    assert list(table[0:n]) == [100, 500, 700]          # role 0 pointers
    assert list(table[n:2 * n]) == [200, 600, 800]      # role 1 pointers
    assert list(table[2 * n:3 * n]) == [10, 33, 16]     # sizes
    assert list(table[3 * n:4 * n]) == [0, 2, 3]        # optimizer indices (default: position)
    assert list(table[4 * n:]) == [0, 1, 4, 5]          # first chunk per tensor, then total
    assert plan.n_chunks == 5 and plan.grid == 5 and plan.columns == (0, 2, 3)
    plan = cuda_backend.build_launch_plan(pointers, sizes, indices=[7, 8, 2 ** 40, 9], chunk_size=16)
    assert list(plan.table[3 * n:4 * n]) == [7, 2 ** 40, 9]


def test_launch_plan_grid_cap_and_edge_cases():
    plan = cuda_backend.build_launch_plan([(1,)], [10 ** 6], chunk_size=64, max_grid=7)
    assert plan.n_chunks == -(-10 ** 6 // 64) and plan.grid == 7
    assert cuda_backend.build_launch_plan([(1,), (2,)], [0, 0]) is None
    big = cuda_backend.build_launch_plan([(2 ** 63 + 16,)], [1])  # pointers above 2**63 survive
    assert np.uint64(big.table[0].astype(np.uint64)) == np.uint64(2 ** 63 + 16)
    with pytest.raises(ValueError, match="indices"):
        cuda_backend.build_launch_plan([(1,)], [1], indices=[0, 1])
    for chunk_size in (0, 12, 2 ** 31):
        with pytest.raises(ValueError, match="chunk_size"):
            cuda_backend.build_launch_plan([(1,)], [1], chunk_size=chunk_size)
    with pytest.raises(ValueError, match="block"):
        cuda_backend.build_launch_plan([(1,)], [1], block=2048)


def test_default_launch_plan_chunks_keep_vector_alignment():
    # every chunk start of a 16-byte aligned tensor stays 16-byte aligned for 2-byte types
    assert cuda_backend.DEFAULT_CHUNK_SIZE % 8 == 0


# ---------------------------------------------------------------- sources and names
def test_kernel_source_inlines_headers_with_line_markers():
    directory = cuda_backend.source_dir()
    for kind in cuda_backend.KINDS:
        source = cuda_backend.kernel_source(kind)
        assert '#include "' not in source
        assert f'#line 1 "{(directory / "storage.cuh").resolve().as_posix()}"' in source
        assert f'#line 1 "{(directory / "multi_tensor.cuh").resolve().as_posix()}"' in source
        assert source.count("struct Fp16 {") == 1  # each header once
        assert f"{kind}_kernel" in source


def test_kernel_name_follows_plan_and_flags():
    def plan(preset, dtype):
        return bf16opt.precision.plan_for(bf16opt.PRESETS[preset], dtype)
    assert cuda_backend.kernel_name("adam", plan("bf16-states", torch.bfloat16), amsgrad=True) == (
        "bf16opt::adam_kernel<bf16opt::Bf16, bf16opt::Master<bf16opt::Fp32>, bf16opt::Bf16, "
        "bf16opt::Bf16, true, false>")
    assert cuda_backend.kernel_name("lion", plan("bf16", torch.float32), track=True) == (
        "bf16opt::lion_kernel<bf16opt::Fp32, bf16opt::NoMaster, bf16opt::Bf16, true>")
    # stochastic rounding: the param only when it is the master, 16-bit moments always
    assert cuda_backend.kernel_name("adam", plan("bf16-sr", torch.bfloat16)) == (
        "bf16opt::adam_kernel<bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::NoMaster, "
        "bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::Stochastic<bf16opt::Bf16>, false, false>")
    sr_states = bf16opt.Precision("fp32", "bf16", "fp32", rounding="stochastic")
    assert cuda_backend.kernel_name("adam", bf16opt.precision.plan_for(sr_states, torch.float16)) == (
        "bf16opt::adam_kernel<bf16opt::Fp16, bf16opt::Master<bf16opt::Fp32>, "
        "bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::Fp32, false, false>")
    assert cuda_backend.kernel_name("lion", plan("bf16-kahan", torch.float16)) == (
        "bf16opt::lion_kernel<bf16opt::Fp16, bf16opt::Kahan<bf16opt::Bf16>, bf16opt::Bf16, false>")
    assert cuda_backend.kernel_name("adam", plan("fp32-remainder", torch.bfloat16), track=True) == (
        "bf16opt::adam_kernel<bf16opt::Bf16, bf16opt::Remainder, bf16opt::Fp32, bf16opt::Fp32, "
        "false, true>")
    assert cuda_backend.kernel_flags("adam", maximize=True, l2=True) == 3
    assert cuda_backend.kernel_flags("lion", maximize=True) == 1
    with pytest.raises(ValueError):
        cuda_backend.kernel_name("lion", plan("bf16", torch.float32), amsgrad=True)
    with pytest.raises(ValueError):
        cuda_backend.kernel_flags("lion", l2=True)


# ---------------------------------------------------------------- availability
def test_import_bf16opt_does_not_import_cupy():
    code = "import sys, bf16opt, bf16opt.backends.cupy; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cupy_backend_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs params on a CUDA device"):
        resolve_backend("cupy", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        bf16opt.AdamW([torch.nn.Parameter(torch.zeros(3))], backend="cupy")


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    with pytest.raises(ValueError, match=r"bf16opt\[cuda12\].*bf16opt\[cuda13\]"):
        resolve_backend("cupy", torch.device("cuda", 0))
    if not torch.cuda.is_available():
        assert resolve_backend("auto", torch.device("cuda", 0)).name == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_message():
    with pytest.raises(ValueError, match="unavailable"):
        resolve_backend("cupy", torch.device("cuda"))


# ---------------------------------------------------------------- optimizer end to end
def emulated_backend():
    """The cupy adapter with the launch swapped for the CPU emulation."""
    return types.SimpleNamespace(
        name="cupy-emulated", supports=cuda_backend.supports,
        adam=lambda bucket, s: cuda_backend.run_bucket("adam", bucket, s, execute=emulator.execute),
        lion=lambda bucket, s: cuda_backend.run_bucket("lion", bucket, s, execute=emulator.execute))


def make_params(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (5,), (129,), (4, 4, 3), (1,), (6, 5, 3, 3)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float16, torch.bfloat16]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]
    # a channels_last conv weight: in place in memory order, or staged under stochastic rounding
    params[-1] = torch.nn.Parameter(params[-1].detach().to(memory_format=torch.channels_last))
    return params


@pytest.mark.parametrize("optimizer, options", [
    (bf16opt.AdamW, dict(precision="bf16", weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="bf16-states", amsgrad=True)),
    (bf16opt.Adam, dict(precision="fp32", weight_decay=0.01, maximize=True)),
    (bf16opt.Adam, dict(precision="bf16-master", amsgrad=True)),
    (bf16opt.Lion, dict(precision="bf16", weight_decay=0.1)),
    (bf16opt.Lion, dict(precision="fp32", maximize=True)),
    # quality presets, with precision telemetry
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1, seed=2 ** 63 + 5, track_precision=True)),
    (bf16opt.AdamW, dict(precision="bf16-kahan", amsgrad=True, track_precision=True)),
    (bf16opt.Adam, dict(precision="fp32-remainder", weight_decay=0.01, track_precision=True)),
    (bf16opt.AdamW, dict(precision="fp32-remainder-bf16-states", maximize=True)),
    (bf16opt.Lion, dict(precision="bf16-sr", seed=3, track_precision=True)),
    (bf16opt.Lion, dict(precision="bf16-kahan", weight_decay=0.1)),
    (bf16opt.Lion, dict(precision="fp32-remainder", track_precision=True)),
])
def test_optimizer_with_emulated_kernels_matches_reference(monkeypatch, optimizer, options):
    expected_params, actual_params = make_params(0), make_params(0)
    expected = optimizer(expected_params, lr=1e-2, backend="reference", **options)
    actual = optimizer(actual_params, lr=1e-2, backend="reference", **options)
    emulated = emulated_backend()
    import bf16opt.optimizer as optimizer_module
    real_resolve = optimizer_module.resolve_backend
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for e, a in zip(expected_params, actual_params):
            grad = torch.empty_like(e).copy_(torch.randn(e.shape, generator=g))  # e's layout
            e.grad, a.grad = grad.clone(), grad.clone()
        expected.step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", lambda name, device: emulated)
        actual.step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", real_resolve)
        if options.get("track_precision"):
            assert actual.precision_stats() == expected.precision_stats()
    for e, a in zip(expected_params, actual_params):
        assert torch.equal(e.view(torch.int16 if e.element_size() == 2 else torch.int32),
                           a.view(torch.int16 if a.element_size() == 2 else torch.int32))
        assert expected.state[e].keys() == actual.state[a].keys()
        for key, value in expected.state[e].items():
            other = actual.state[a][key]
            if value.dtype == torch.float32 and value.dim() > 0:
                assert torch.equal(value.view(torch.int32), other.view(torch.int32)), key
            elif value.dim() > 0:
                assert torch.equal(value.view(torch.int16), other.view(torch.int16)), key


def test_supports_every_plan():
    plans = bf16opt.precision.all_plans(quality=True)
    assert len(plans) == 57
    assert all(cuda_backend.supports(p) for p in plans)
    # plans the policy never makes are refused, not mis-run
    odd = bf16opt.precision.StoragePlan(torch.float16, None, torch.float32, torch.float32,
                                        compensation="remainder")
    assert not cuda_backend.supports(odd)
    with pytest.raises(NotImplementedError, match="backend='cupy' does not implement"):
        cuda_backend.run_bucket("adam", bucket_of(odd), None, execute=emulator.execute)


def test_telemetry_counts_come_from_the_kernel(monkeypatch):
    """bucket.counts is filled by the TRACK kernel (the reference is never called), with
    rows for empty params and the tensors' own positions."""
    from bf16opt.backends import reference
    plan = bf16opt.precision.plan_for(bf16opt.PRESETS["bf16"], torch.bfloat16)
    bucket = bucket_of(plan)
    bucket.params.insert(0, torch.zeros(0, dtype=torch.bfloat16))
    bucket.grads.insert(0, torch.zeros(0, dtype=torch.bfloat16))
    for field in ("masters", "exp_avgs", "exp_avg_sqs"):
        first = getattr(bucket, field)[0]
        getattr(bucket, field).insert(0, None if first is None else first[:0].clone())
    bucket.params[1].copy_(torch.full((5,), 256.0))      # lr 1e-3 updates vanish in bf16 at 256
    bucket.grads[1].copy_(torch.tensor([1.0, -1.0, 0.0, 1e-20, 2.0]))
    bucket.counts = torch.full((2, 3), -1, dtype=torch.int64)
    monkeypatch.setattr(reference, "adam", None)
    scalars = bf16opt.adam.adam_scalars(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                             decoupled_weight_decay=True), 1)
    cuda_backend.run_bucket("adam", bucket, scalars, execute=emulator.execute)
    # swallowed: the four non-zero updates; exp_avg_sq 1e-43 (a float32 subnormal) is
    # below half the smallest bfloat16 subnormal (2**-133): one underflow
    assert bucket.counts.tolist() == [[0, 0, 0], [4, 0, 1]]


def bucket_of(plan, n=5):
    from bf16opt.backends import Bucket
    p = torch.randn(n).to(plan.param)
    return Bucket(plan=plan, params=[p], grads=[torch.randn(n).to(plan.param)],
                  masters=[None if plan.master is None else p.to(plan.master)],
                  exp_avgs=[torch.zeros(n, dtype=plan.exp_avg)],
                  exp_avg_sqs=[torch.zeros(n, dtype=plan.exp_avg_sq)],
                  compensations=[None], remainders=[None], indices=[0])


def test_kernel_writes_bump_autograd_versions():
    plan = bf16opt.precision.plan_for(bf16opt.PRESETS["bf16-states"], torch.bfloat16)
    bucket = bucket_of(plan)
    versions = [t._version for t in (bucket.params[0], bucket.masters[0], bucket.exp_avgs[0])]
    scalars = bf16opt.adam.adam_scalars(dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                             decoupled_weight_decay=True), 1)
    cuda_backend.run_bucket("adam", bucket, scalars, execute=emulator.execute)
    after = [t._version for t in (bucket.params[0], bucket.masters[0], bucket.exp_avgs[0])]
    assert all(b > a for a, b in zip(versions, after))


@pytest.mark.parametrize("rounding, staged", [("nearest", False), ("stochastic", True)])
def test_channels_last_buffers_in_place_unless_stochastic(rounding, staged):
    """Same-layout dense buffers are launched in place (no copies), except under stochastic
    rounding, whose random bits hash the row-major index."""
    from bf16opt.adam import adam_scalars
    from bf16opt.backends import Bucket
    from bf16opt.precision import Precision, plan_for
    plan = plan_for(Precision(master="bf16", exp_avg="bf16", exp_avg_sq="bf16", rounding=rounding),
                    torch.bfloat16)
    like = torch.zeros(4, 3, 2, 2, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    bucket = Bucket(plan, params=[like], grads=[torch.zeros_like(like)], masters=[None],
                    exp_avgs=[torch.zeros_like(like)], exp_avg_sqs=[torch.zeros_like(like)],
                    compensations=[None], remainders=[None], indices=[0], seed=1, step=1)
    scalars = adam_scalars(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                decoupled_weight_decay=True), step=1)
    prepared = cuda_backend.prepare_launch("adam", bucket, scalars)
    assert bool(prepared.write_back) == staged
    assert (prepared.plan.table[0] == like.data_ptr()) != staged  # role 0: the param
    # every pointer into a staged copy, the read-only grad's included, is kept alive
    n = prepared.plan.n_tensors
    pointers = set(prepared.plan.table[:len(cuda_backend.ROLES["adam"]) * n].tolist()) - {0}
    alive = {t.data_ptr() for t in (like, *bucket.grads, *bucket.exp_avgs, *bucket.exp_avg_sqs,
                                    *prepared.staged)}
    assert pointers <= alive and len(prepared.staged) == (4 if staged else 0)
