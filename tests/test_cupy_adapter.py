"""The CuPy adapter's host side: launch plans, sources, availability errors, and the
optimizer driving the (CPU-emulated) kernels end to end.  No GPU, no CuPy needed
(except where noted)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt import backends
from bf16opt.adam import adam_scalars
from bf16opt.algorithms import ADAM, ALGORITHMS, kernel_config
from bf16opt.backends import Bucket, cuda_compile, resolve_backend
from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import PRESETS, Precision, StoragePlan, all_plans, plan_for
from cuda_emulation import emulator

ADAM_GROUP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True)


# ---------------------------------------------------------------- launch plan
def test_launch_plan_layout():
    pointers = [(100, 200), (300, 400), (500, 600), (700, 800)]
    sizes = [10, 0, 33, 16]
    plan = cuda_backend.build_launch_plan(pointers, sizes, chunk_size=16, block=4)
    n = 3  # the empty tensor is left out
    assert plan.n_tensors == n and plan.chunk_size == 16 and plan.block == 4
    table = plan.table
    assert table.dtype == np.int64 and table.size == (2 + 4) * n + 1
    assert list(table[0:n]) == [100, 500, 700]          # role 0 pointers
    assert list(table[n:2 * n]) == [200, 600, 800]      # role 1 pointers
    assert list(table[2 * n:3 * n]) == [10, 33, 16]     # sizes
    assert list(table[3 * n:4 * n]) == [0, 2, 3]        # optimizer indices (default: position)
    assert list(table[4 * n:5 * n + 1]) == [0, 1, 4, 5]  # first chunk per tensor, then total
    assert list(table[5 * n + 1:]) == [0, 0, 0]         # first element's global index (default 0)
    assert plan.n_chunks == 5 and plan.grid == 5 and plan.columns == (0, 2, 3)
    plan = cuda_backend.build_launch_plan(pointers, sizes, indices=[7, 8, 2 ** 40, 9], chunk_size=16)
    assert list(plan.table[3 * n:4 * n]) == [7, 2 ** 40, 9]
    plan = cuda_backend.build_launch_plan(pointers, sizes, offsets=[5, 6, 2 ** 33, 0], chunk_size=16)
    assert list(plan.table[5 * n + 1:]) == [5, 2 ** 33, 0]  # a shard's offset in its param


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
    directory = cuda_compile.source_dir()
    assert set(cuda_compile.KINDS) == set(ALGORITHMS)
    for kind in cuda_compile.KINDS:
        source = cuda_compile.kernel_source(kind)
        assert '#include "' not in source
        assert f'#line 1 "{(directory / "storage.cuh").resolve().as_posix()}"' in source
        assert f'#line 1 "{(directory / "multi_tensor.cuh").resolve().as_posix()}"' in source
        assert source.count("struct Fp16 {") == 1  # each header once
        assert f"{kind}_kernel" in source


def config_of(kind, preset, dtype, track=False, **flags):
    precision = preset if isinstance(preset, Precision) else PRESETS[preset]
    return kernel_config(ALGORITHMS[kind], plan_for(precision, dtype), tuple(flags.items()), track)


def test_kernel_name_follows_plan_and_flags():
    name = cuda_backend.kernel_name
    assert name(config_of("adam", "bf16-states", torch.bfloat16, amsgrad=True)) == (
        "bf16opt::adam_kernel<bf16opt::Bf16, bf16opt::Master<bf16opt::Fp32>, bf16opt::Bf16, "
        "bf16opt::Bf16, true, false>")
    assert name(config_of("lion", "bf16", torch.float32, track=True)) == (
        "bf16opt::lion_kernel<bf16opt::Fp32, bf16opt::NoMaster, bf16opt::Bf16, true>")
    # stochastic rounding: the param only when it is the master, 16-bit moments always
    assert name(config_of("adam", "bf16-sr", torch.bfloat16)) == (
        "bf16opt::adam_kernel<bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::NoMaster, "
        "bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::Stochastic<bf16opt::Bf16>, false, false>")
    sr_states = Precision("fp32", "bf16", "fp32", rounding="stochastic")
    assert name(config_of("adam", sr_states, torch.float16)) == (
        "bf16opt::adam_kernel<bf16opt::Fp16, bf16opt::Master<bf16opt::Fp32>, "
        "bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::Fp32, false, false>")
    assert name(config_of("lion", "bf16-kahan", torch.float16)) == (
        "bf16opt::lion_kernel<bf16opt::Fp16, bf16opt::Kahan<bf16opt::Bf16>, bf16opt::Bf16, false>")
    assert name(config_of("adam", "fp32-remainder", torch.bfloat16, track=True)) == (
        "bf16opt::adam_kernel<bf16opt::Bf16, bf16opt::Remainder, bf16opt::Fp32, bf16opt::Fp32, "
        "false, true>")
    # SGD: the momentum buffer's storage (Fp32 when there is no buffer), momentum, telemetry
    assert name(config_of("sgd", "bf16", torch.bfloat16, momentum=True)) == (
        "bf16opt::sgd_kernel<bf16opt::Bf16, bf16opt::NoMaster, bf16opt::Bf16, true, false>")
    assert name(config_of("sgd", "bf16-sr", torch.bfloat16, track=True)) == (
        "bf16opt::sgd_kernel<bf16opt::Stochastic<bf16opt::Bf16>, bf16opt::NoMaster, bf16opt::Fp32, "
        "false, true>")
    # run-time flags are bits of the kernels' flags argument, not part of the name
    assert name(config_of("sgd", "bf16", torch.bfloat16, momentum=True, maximize=True, nesterov=True,
                          first=True)) == name(config_of("sgd", "bf16", torch.bfloat16, momentum=True))
    assert config_of("adam", "bf16", torch.bfloat16, maximize=True, l2=True).flag_bits == 3
    assert config_of("lion", "bf16", torch.bfloat16, maximize=True).flag_bits == 1
    assert config_of("sgd", "bf16", torch.bfloat16, maximize=True, l2=True, nesterov=True,
                     first=True).flag_bits == 15
    assert config_of("sgd", "bf16", torch.bfloat16, momentum=True, nesterov=True).flag_bits == 4
    with pytest.raises(ValueError):
        config_of("lion", "bf16", torch.float32, amsgrad=True)
    with pytest.raises(ValueError):
        config_of("lion", "bf16", torch.float32, l2=True)


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


def test_missing_cupy_names_the_packages_and_the_extras(monkeypatch):
    """The message names what pip can install (bf16opt itself is not published) and the extras."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    with pytest.raises(ValueError, match=r"cupy-cuda12x.*cupy-cuda13x.*'\.\[cuda12\]'.*'\.\[cuda13\]'"):
        resolve_backend("cupy", torch.device("cuda", 0))
    if not torch.cuda.is_available():
        monkeypatch.setattr(backends, "_warned", set())  # (the fallback warns once per process)
        with pytest.warns(UserWarning, match="cupy-cuda12x"):
            assert resolve_backend("auto", torch.device("cuda", 0)).name == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_message():
    with pytest.raises(ValueError, match="unavailable"):
        resolve_backend("cupy", torch.device("cuda"))


# ---------------------------------------------------------------- optimizer end to end
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
    (bf16opt.SGD, dict(precision="bf16", momentum=0.9, dampening=0.1, weight_decay=0.1)),
    (bf16opt.SGD, dict(precision="fp32", momentum=0.9, nesterov=True, maximize=True)),
    # quality presets, with precision telemetry
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1, seed=2 ** 63 + 5, track_precision=True)),
    (bf16opt.AdamW, dict(precision="bf16-kahan", amsgrad=True, track_precision=True)),
    (bf16opt.Adam, dict(precision="fp32-remainder", weight_decay=0.01, track_precision=True)),
    (bf16opt.AdamW, dict(precision="fp32-remainder-bf16-states", maximize=True)),
    (bf16opt.Lion, dict(precision="bf16-sr", seed=3, track_precision=True)),
    (bf16opt.Lion, dict(precision="bf16-kahan", weight_decay=0.1)),
    (bf16opt.Lion, dict(precision="fp32-remainder", track_precision=True)),
    (bf16opt.SGD, dict(precision="bf16-sr", momentum=0.9, seed=5, track_precision=True)),
    (bf16opt.SGD, dict(precision="bf16-kahan", momentum=0.9, nesterov=True, weight_decay=0.1,
                       track_precision=True)),
    (bf16opt.SGD, dict(precision="fp32-remainder-bf16-states", weight_decay=0.01, track_precision=True)),
])
def test_optimizer_with_emulated_kernels_matches_reference(monkeypatch, optimizer, options):
    expected_params, actual_params = make_params(0), make_params(0)
    expected = optimizer(expected_params, lr=1e-2, backend="reference", **options)
    actual = optimizer(actual_params, lr=1e-2, backend="reference", **options)
    emulated = emulator.backend()
    import bf16opt.step_plan as optimizer_module
    real_resolve = optimizer_module.resolve_backend
    g = torch.Generator().manual_seed(1)
    relaunched = []
    real_run = cuda_backend.Relaunch.run
    monkeypatch.setattr(cuda_backend.Relaunch, "run", lambda self, *args: relaunched.append(self)
                        or real_run(self, *args))
    for _ in range(5):  # the third step on reuses the launch kept from the second (when it qualifies)
        for e, a in zip(expected_params, actual_params):
            grad = torch.empty_like(e).copy_(torch.randn(e.shape, generator=g))  # e's layout
            e.grad, a.grad = grad.clone(), grad.clone()
        expected.step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", lambda name, device: emulated)
        actual.step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", real_resolve)
        if options.get("track_precision"):
            assert actual.precision_stats() == expected.precision_stats()
    # kept unless telemetry counts every step or stochastic rounding stages the channels_last param
    kept = not options.get("track_precision") and options["precision"] != "bf16-sr"
    assert bool(relaunched) == kept
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


def test_kernels_launch_on_the_torch_stream_without_a_deprecation_warning():
    """cupy_stream hands CuPy the torch stream through the CUDA stream protocol where the stream
    has it (ExternalStream, the fallback, warns in CuPy 14); no device is needed to make one."""
    import warnings  # noqa: PLC0415

    cupy = pytest.importorskip("cupy", reason="CuPy (the cuda13 extra) is not installed")

    class ProtocolStream:  # (torch.cuda.Stream's protocol, on the legacy default stream)
        cuda_stream = 0

        def __cuda_stream__(self):
            return (0, 0)

    class OlderStream:
        cuda_stream = 0

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert cuda_backend.cupy_stream(cupy, ProtocolStream()).ptr == 0
    if hasattr(cupy.cuda, "ExternalStream"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert cuda_backend.cupy_stream(cupy, OlderStream()).ptr == 0


def test_a_kept_launch_holds_no_grad(monkeypatch):
    """Grads are new tensors every step: the CuPy adapter's kept launch must not keep the ones of
    the step that built it alive (a set of grads in GPU memory), as the Numba one does not."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    import bf16opt.step_plan as step_plan  # noqa: PLC0415
    monkeypatch.setattr(step_plan, "resolve_backend", lambda name, device: emulator.backend(lambda prepared: None))
    params = [torch.nn.Parameter(torch.randn(8 + k, dtype=torch.bfloat16)) for k in range(3)]
    opt = bf16opt.AdamW(params, precision="bf16", backend="reference")
    built = []
    for step in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        built.append([weakref.ref(param.grad) for param in params])
        opt.step()
    assert isinstance(opt._group_launches[0].relaunches[0][0], cuda_backend.Relaunch)
    opt.zero_grad()
    gc.collect()
    assert [grad() for grads in built for grad in grads] == [None] * 12


def test_every_plan_has_a_kernel_instantiation():
    """Every configuration of every allowed plan (template flags, telemetry) names a kernel
    the adapter lists, so the loader (and the emulation, and the NVRTC test) has it."""
    plans = all_plans(quality=True)
    assert len(plans) == 57
    for algorithm in ALGORITHMS.values():
        names = cuda_backend.kernel_configs(algorithm.name)
        for plan in plans:
            for values in itertools.product((False, True), repeat=len(algorithm.flags) + 1):
                config = kernel_config(algorithm, plan, tuple(zip(algorithm.flags, values)), values[-1])
                assert cuda_backend.kernel_name(config) in names, (algorithm.name, plan, values)


def test_plans_the_policy_never_makes_are_refused():
    """A hand-made StoragePlan no precision produces (an int16 remainder completing a
    float16 param: ``Remainder`` reads the param's bits as bfloat16) is refused, not
    mis-run: no kernel is launched for it."""
    odd = StoragePlan(torch.float16, None, torch.float32, torch.float32, compensation="remainder")
    assert odd not in all_plans(quality=True)
    config = kernel_config(ADAM, odd)
    assert cuda_backend.kernel_name(config) not in cuda_backend.kernel_configs("adam")
    bucket = Bucket.of(config, {
        "param": [torch.ones(5, dtype=torch.float16)], "grad": [torch.ones(5, dtype=torch.float16)],
        "companion": [torch.zeros(5, dtype=torch.int16)], "exp_avg": [torch.zeros(5)],
        "exp_avg_sq": [torch.zeros(5)]}, indices=[0])
    launched = []
    with pytest.raises((ValueError, NotImplementedError)):
        cuda_backend.run(bucket, adam_scalars(ADAM_GROUP, 1), execute=launched.append)
    assert launched == []


def test_telemetry_counts_come_from_the_kernel(monkeypatch):
    """bucket.counts is filled by the TRACK kernel (the reference is never called), with
    rows for empty params and the tensors' own positions."""
    from bf16opt.backends import reference
    plan = plan_for(PRESETS["bf16"], torch.bfloat16)
    bf16 = dict(dtype=torch.bfloat16)
    bucket = Bucket.of(kernel_config(ADAM, plan, track=True), {
        "param": [torch.zeros(0, **bf16), torch.full((5,), 256.0, **bf16)],  # lr 1e-3 updates vanish at 256
        "grad": [torch.zeros(0, **bf16), torch.tensor([1.0, -1.0, 0.0, 1e-20, 2.0], **bf16)],
        "exp_avg": [torch.zeros(0, **bf16), torch.zeros(5, **bf16)],
        "exp_avg_sq": [torch.zeros(0, **bf16), torch.zeros(5, **bf16)]}, indices=[0, 1])
    bucket.counts = torch.full((2, 3), -1, dtype=torch.int64)
    for kind in reference.UPDATES:
        monkeypatch.setitem(reference.UPDATES, kind, None)
    cuda_backend.run(bucket, adam_scalars(ADAM_GROUP, 1), execute=emulator.execute)
    # swallowed: the four non-zero updates; exp_avg_sq 1e-43 (a float32 subnormal) is
    # below half the smallest bfloat16 subnormal (2**-133): one underflow
    assert bucket.counts.tolist() == [[0, 0, 0], [4, 0, 1]]


def bucket_of(plan, n=5):
    p = torch.randn(n).to(plan.param)
    return Bucket.of(kernel_config(ADAM, plan), {
        "param": [p], "grad": [torch.randn(n).to(plan.param)],
        "companion": [None if plan.master is None else p.to(plan.master)],
        "exp_avg": [torch.zeros(n, dtype=plan.exp_avg)],
        "exp_avg_sq": [torch.zeros(n, dtype=plan.exp_avg_sq)]}, indices=[0])


def test_kernel_writes_bump_autograd_versions():
    plan = plan_for(PRESETS["bf16-states"], torch.bfloat16)
    bucket = bucket_of(plan)
    written = (bucket.params[0], bucket["companion"][0], bucket["exp_avg"][0])
    versions = [t._version for t in written]
    scalars = adam_scalars(dict(ADAM_GROUP, lr=0.1), 1)
    cuda_backend.run(bucket, scalars, execute=emulator.execute)
    after = [t._version for t in written]
    assert all(b > a for a, b in zip(versions, after))


@pytest.mark.parametrize("rounding, staged", [("nearest", False), ("stochastic", True)])
def test_channels_last_buffers_in_place_unless_stochastic(rounding, staged):
    """Same-layout dense buffers are launched in place (no copies), except under stochastic
    rounding, whose random bits hash the row-major index."""
    plan = plan_for(Precision(master="bf16", exp_avg="bf16", exp_avg_sq="bf16", rounding=rounding),
                    torch.bfloat16)
    like = torch.zeros(4, 3, 2, 2, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    bucket = Bucket.of(kernel_config(ADAM, plan), {
        "param": [like], "grad": [torch.zeros_like(like)], "exp_avg": [torch.zeros_like(like)],
        "exp_avg_sq": [torch.zeros_like(like)]}, indices=[0], seed=1, step=1)
    prepared = cuda_backend.prepare_launch(bucket, adam_scalars(ADAM_GROUP, step=1))
    assert bool(prepared.staged.write_back) == staged
    assert (prepared.plan.table[0] == like.data_ptr()) != staged  # role 0: the param
    # every pointer into a staged copy, the read-only grad's included, is kept alive
    copies = [t for staged_column, column in zip(prepared.staged.tensors, bucket.tensors)
              for t, original in zip(staged_column, column) if t is not original]
    n = prepared.plan.n_tensors
    pointers = set(prepared.plan.table[:len(ADAM.roles) * n].tolist()) - {0}
    alive = {t.data_ptr() for t in (like, *bucket["grad"], *bucket["exp_avg"], *bucket["exp_avg_sq"],
                                    *copies)}
    assert pointers <= alive and len(copies) == (4 if staged else 0)


def test_kernel_arguments_follow_the_kernels_signature():
    """What a GPU launch passes (eager, kept and captured alike): the table's address, the
    plan's sizes, seed, step, counts' address and flags, then the live step's seven (zero for
    an eager step), then every scalar, each as the kernel's C type."""
    plan = plan_for(PRESETS["bf16-sr"], torch.bfloat16)
    param = torch.zeros(300, dtype=torch.bfloat16)
    bucket = Bucket.of(kernel_config(ADAM, plan), {
        "param": [param], "grad": [torch.zeros_like(param)], "exp_avg": [torch.zeros_like(param)],
        "exp_avg_sq": [torch.zeros_like(param)]}, indices=[0], seed=5, step=3)
    prepared = cuda_backend.prepare_launch(bucket, adam_scalars(ADAM_GROUP, step=3))
    arguments = cuda_backend.kernel_arguments(prepared, 0x1234, counts=0x50)
    head, live, scalars = arguments[:8], arguments[8:15], arguments[15:]
    assert [type(a) for a in head] == [np.uint64, np.int32, np.int64, np.int32, np.uint64, np.int64, np.uint64,
                                       np.int32]
    assert [int(a) for a in head] == [0x1234, prepared.plan.n_tensors, prepared.plan.n_chunks,
                                      prepared.plan.chunk_size, 5, 3, 0x50, prepared.flags]
    assert [type(a) for a in live] == [np.uint64, np.float64, np.float64, np.uint64, np.int64, np.uint64, np.uint64]
    assert all(a == 0 for a in live)
    assert scalars == prepared.scalars and len(scalars) == emulator.scalar_count("adam")
    assert all(type(s) is np.float32 for s in scalars)


def test_negative_views_match_the_reference(monkeypatch):
    """A negative view (``is_neg()``: its memory holds the values negated), as grad and as
    param, is staged through a copy: the emulated kernels give the reference's bits."""
    import bf16opt.step_plan as optimizer_module
    emulated = emulator.backend()
    values = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in range(3)]
    params = {backend: [torch.nn.Parameter(v.clone()) for v in values] for backend in ("reference", "cupy")}
    for backend in params:  # (a param that is a negative view, as a .data assignment makes one)
        params[backend][2].data = params[backend][2].data.neg()._neg_view()
    opts = {backend: bf16opt.AdamW(ps, lr=1e-2, precision="bf16", backend="reference")
            for backend, ps in params.items()}
    real_resolve = optimizer_module.resolve_backend
    for step in range(4):
        grads = [torch.randn(v.shape, generator=torch.Generator().manual_seed(10 + step)).to(v.dtype) for v in values]
        for backend, ps in params.items():
            for k, (p, g) in enumerate(zip(ps, grads)):
                p.grad = g.neg()._neg_view() if (k + step) % 2 else g.clone()
        opts["reference"].step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", lambda name, device: emulated)
        opts["cupy"].step()
        monkeypatch.setattr(optimizer_module, "resolve_backend", real_resolve)
        for e, a in zip(params["reference"], params["cupy"]):
            assert torch.equal(e.detach().resolve_neg().view(torch.int16), a.detach().resolve_neg().view(torch.int16))
    assert params["cupy"][2].is_neg()
