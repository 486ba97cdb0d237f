"""On a real GPU: backend="cupy" equals the reference backend bit for bit.

Runs automatically when torch sees a CUDA device and CuPy imports; skipped with the
reason otherwise.  The oracle is the reference backend on CPU copies, the same oracle
the CPU emulation tests use; kernel instantiations (quality plans and telemetry
included) of every algorithm with run-time flags, over consecutive steps, on buckets
from ``tests/buckets.py`` (NaN/inf/subnormal gradients, transposed, strided and
channels_last tensors, views at odd offsets so chunks take the vector path, its tail or
the misaligned path) copied to the GPU with their strides and offsets.

All of them (over 1,500 cases) would take hours; each run checks a sample drawn from a
seed that changes daily (``tests/gpu_sample.py``: every preset of every algorithm, plus
random instantiations; ``BF16OPT_GPU_SAMPLE_SEED`` repeats a run, ``BF16OPT_GPU_SAMPLE=all``
checks everything).  The seed is printed, and named in every failure.  The sample's
kernels are compiled first, side by side in worker processes, into the on-disk NVRTC
cache that the adapter's loader then reads.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing
import os
import zlib

import pytest
import torch

import bf16opt
from bf16opt.algorithms import ALGORITHMS, kernel_config
from bf16opt.backends import cuda_compile
from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import as_precision, plan_for

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install cupy-cuda12x or cupy-cuda13x",
                allow_module_level=True)

import gpu_sample  # noqa: E402
from buckets import bucket_to, make_bucket, run_both, sgd_group  # noqa: E402
from gpu_sample import config_id  # noqa: E402

SEED = gpu_sample.sample_seed()
EXTRA = gpu_sample.sample_size()
CONFIGS = {kind: gpu_sample.sample(kind, SEED, EXTRA) for kind in ALGORITHMS}
OPTIMIZER_DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]  # of the optimizer cases


# shapes and layouts of a bucket: 1-d of odd sizes, a transposed matrix, a strided view,
# a channels_last conv weight
SHAPES = [(1,), (7,), (2, 11), (64,), (129,), (10, 100), (3,), (513,), (2, 3, 4, 5)]
LAYOUTS = ["contiguous", "transposed", "transposed", "contiguous", "contiguous", "contiguous",
           "contiguous", "contiguous", "channels_last"]
LARGE = [(100_003,), (5,), (70_000,)]


def group_for(config) -> dict:
    """Hyper-parameters matching the configuration's flags (L2 needs a weight decay)."""
    kind, l2 = config.algorithm.name, dict(config.flags).get("l2", False)
    if kind == "adam":
        return dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.3 if l2 else 0.01,
                    decoupled_weight_decay=not l2)
    if kind == "lion":
        return dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    if kind != "sgd":
        raise KeyError(f"no test group for algorithm {kind!r}")
    nesterov = config.flag("nesterov")
    return sgd_group(lr=0.1, momentum=0.9, dampening=0.0 if nesterov else 0.1,
                     weight_decay=0.3 if l2 else 0.0, nesterov=nesterov)


def run_on_gpu(config, seed, shapes, layouts=None, steps=3, **plan_options):
    """``steps`` steps of the reference on a random bucket and of the kernel on its GPU copy."""
    expected = make_bucket(config.algorithm, config.plan, shapes, flags=config.flags, track=config.track,
                           seed=seed, layouts=layouts, misalign=0.5)
    actual = bucket_to(expected, "cuda")

    def fetch(bucket):
        torch.cuda.synchronize()
        return bucket_to(bucket, "cpu")

    run_both(expected, group_for(config), steps, f"{config_id(config)} (sample seed {SEED})", other=actual,
             fetch=fetch, name="cupy",
             run=lambda bucket, scalars: cuda_backend.run(bucket, scalars, **plan_options))


def optimizer_kernels(optimizer, options, dtypes=OPTIMIZER_DTYPES, live=False) -> set:
    """(kind, kernel name) an optimizer case launches: one kernel per param dtype (only the
    template flags and telemetry name a kernel; run-time flags are arguments); ``live``: and
    the capturable step's kernel of each."""
    algorithm = optimizer.algorithm
    template = {"amsgrad": options.get("amsgrad", False), "momentum": options.get("momentum", 0.0) != 0.0}
    flags = tuple((name, template[name]) for name in algorithm.template_flags)
    precision = as_precision(options.get("precision", "fp32"))
    configs = [kernel_config(algorithm, plan_for(precision, dtype), flags, options.get("track_precision", False))
               for dtype in set(dtypes)]
    return {(algorithm.name, cuda_backend.kernel_name(config, is_live))
            for config in configs for is_live in ((False, True) if live else (False,))}


def kernels_of(item) -> set:
    """The kernels a collected test of this module launches (empty when not known ahead)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "config" in params:
        config = params["config"]
        return {(config.algorithm.name, cuda_backend.kernel_name(config))}
    if "optimizer" in params:
        return optimizer_kernels(params["optimizer"], params["options"],
                                 live=item.name.startswith("test_cuda_graph"))
    if item.name == "test_runs_on_the_current_stream":
        return optimizer_kernels(bf16opt.AdamW, {}, [torch.float32])
    return set()


@pytest.fixture(scope="module", autouse=True)
def sample_compiled(request):
    """Print the sample's seed; compile the selected tests' kernels side by side into the on-disk
    NVRTC cache (an xdist worker does not know its share ahead, and compiles as it goes)."""
    counts = {kind: (len(CONFIGS[kind]), len(gpu_sample.instantiations(kind))) for kind in ALGORITHMS}
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(gpu_sample.describe(SEED, EXTRA, counts))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import cupy  # noqa: PLC0415

    device = torch.cuda.current_device()
    arch = cuda_compile.device_arch(int(cupy.cuda.Device(device).compute_capability))
    jobs = sorted({kernel for item in request.session.items if item.module is request.module
                   for kernel in kernels_of(item)})
    if not jobs:
        return
    context = multiprocessing.get_context("spawn")
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 12))
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        stored = list(pool.map(gpu_sample.compile_for_the_loader, *zip(*[(k, e, arch) for k, e in jobs])))
    if reporter is not None and not all(stored):
        reporter.write_line(f"NVRTC cache not writable ({cuda_compile.cache_dir()}): "
                            f"each test compiles its kernel")


@pytest.mark.parametrize("config", CONFIGS["adam"], ids=config_id)
def test_adam_kernels_on_gpu(config):
    seed = zlib.crc32(f"{SEED}:{config_id(config)}".encode())  # new data with each sample
    run_on_gpu(config, seed, SHAPES, LAYOUTS)
    run_on_gpu(config, seed, LARGE, chunk_size=4096, max_grid=7)


@pytest.mark.parametrize("config", CONFIGS["lion"], ids=config_id)
def test_lion_kernels_on_gpu(config):
    seed = zlib.crc32(f"{SEED}:{config_id(config)}".encode())  # new data with each sample
    run_on_gpu(config, seed, SHAPES, LAYOUTS)
    run_on_gpu(config, seed, LARGE, chunk_size=4096, max_grid=7)


@pytest.mark.parametrize("config", CONFIGS["sgd"], ids=config_id)
def test_sgd_kernels_on_gpu(config):
    """With ``first``, step 1 is the momentum buffer's first step, later steps are not."""
    seed = zlib.crc32(f"{SEED}:{config_id(config)}".encode())  # new data with each sample
    run_on_gpu(config, seed, SHAPES, LAYOUTS)
    run_on_gpu(config, seed, LARGE, chunk_size=4096, max_grid=7)


OPTIMIZER_CASES = [
    (bf16opt.AdamW, dict(precision="bf16", weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="bf16-states", amsgrad=True)),
    (bf16opt.Adam, dict(precision="fp32", weight_decay=0.01, maximize=True)),
    (bf16opt.Lion, dict(precision="bf16-master", weight_decay=0.1)),
    (bf16opt.SGD, dict(precision="bf16", momentum=0.9, nesterov=True, weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1, track_precision=True)),
    (bf16opt.AdamW, dict(precision="bf16-kahan", amsgrad=True)),
    (bf16opt.Adam, dict(precision="fp32-remainder", track_precision=True)),
    (bf16opt.Lion, dict(precision="bf16-sr", seed=7)),
    (bf16opt.SGD, dict(precision="bf16-sr", momentum=0.9, dampening=0.1, seed=7, track_precision=True)),
]

@pytest.mark.parametrize("optimizer, options", OPTIMIZER_CASES)
def test_optimizer_backend_cupy_on_gpu(optimizer, options):
    g = torch.Generator().manual_seed(0)
    shapes = [(333, 77), (5,), (1029,), (4, 4, 3)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, OPTIMIZER_DTYPES)]
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
        for key, value in expected.state[c].items():
            other = actual.state[d][key]
            if value.dim() > 0:
                view = torch.int16 if value.element_size() == 2 else torch.int32
                assert torch.equal(value.view(view), other.cpu().view(view)), key


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


def test_a_kept_launch_on_another_stream_gives_the_references_bits():
    """Steps that reuse their kept launch alternate between the default stream and a side
    stream, the grads moving every step: each launch reads a chunk table of its own stream."""
    g = torch.Generator().manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in [(1 << 16,), (3, 5), (1029,)]]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    expected = bf16opt.AdamW(cpu, lr=1e-2, backend="reference", precision="bf16-sr")
    actual = bf16opt.AdamW(gpu, lr=1e-2, backend="cupy", precision="bf16-sr")
    side = torch.cuda.Stream()
    for step in range(8):
        grads = [torch.randn(p.shape, generator=g).bfloat16() for p in cpu]
        for c, grad in zip(cpu, grads):
            c.grad = grad
        expected.step()
        stream = side if step % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for d, grad in zip(gpu, grads):
                d.grad = grad.cuda()
            actual.step()
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for c, d in zip(cpu, gpu):
        assert torch.equal(_bits(c), _bits(d))
        for key, value in expected.state[c].items():
            assert torch.equal(_bits(value), _bits(actual.state[d][key])), key


RELEASE_CASES = [  # (optimizer, options, offload, update_in_backward_bucket)
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1), None, 0),
    (bf16opt.AdamW, dict(precision="fp32-remainder-q8", max_grad_norm_per_param=0.5), None, 1 << 20),
    (bf16opt.Lion, dict(precision="bf16-kahan"), "cpu", 0),
    (bf16opt.SGD, dict(precision="bf16", momentum=0.9), "cpu", 1 << 20),
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@pytest.mark.parametrize("optimizer, options, offload, bucket", RELEASE_CASES)
def test_update_in_backward_gives_the_normal_steps_bits(optimizer, options, offload, bucket):
    """Issue 39 on a GPU: the updates in backward (each param alone, or in buckets; the state on
    the GPU or offloaded, whose uploads run on a background thread) give the normal step's bits,
    with backward on a side stream that the uploads must follow."""
    def train(release: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))
        model = model.to("cuda", torch.bfloat16)
        opt = optimizer(model.parameters(), lr=1e-2, offload=offload, update_in_backward=release,
                        update_in_backward_bucket=bucket, **options)
        data = torch.Generator().manual_seed(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                x = torch.randn(16, 64, generator=data).to("cuda", torch.bfloat16)
                model(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        stream.synchronize()
        return model, opt.state_dict()

    (normal, normal_state), (released, released_state) = train(False), train(True)
    for a, b in zip(normal.parameters(), released.parameters()):
        assert torch.equal(_bits(a), _bits(b))
    assert normal_state["state"].keys() == released_state["state"].keys()
    for index, state in normal_state["state"].items():
        for key, value in state.items():
            assert torch.equal(_bits(value), _bits(released_state["state"][index][key])), (index, key)


CAPTURE_CASES = [
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1)),
    (bf16opt.Adam, dict(precision="fp32", amsgrad=True)),
    (bf16opt.AdamW, dict(precision="fp32-remainder-q8")),
    (bf16opt.Lion, dict(precision="bf16", weight_decay=0.1)),
    (bf16opt.SGD, dict(precision="bf16-kahan", momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("optimizer, options", CAPTURE_CASES)
def test_cuda_graph_replays_equal_eager_steps(optimizer, options):
    """capturable=True, captured with torch.cuda.graph after warm-up steps on a side stream (the
    graph clones static grads, so its grads are new tensors of the graph's pool), replayed with
    new grad values and an lr tensor a schedule fills: the bits of eager steps (capturable=False)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(333, 77), (5,), (4096 + 3,), (4, 4, 3)]
    start = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, OPTIMIZER_DTYPES)]
    grads = [[torch.randn(s, generator=g).to(d).cuda() for s, d in zip(shapes, OPTIMIZER_DTYPES)]
             for _ in range(8)]
    eager_params = [torch.nn.Parameter(p.cuda()) for p in start]
    graph_params = [torch.nn.Parameter(p.cuda()) for p in start]
    eager = optimizer(eager_params, lr=1e-2, backend="cupy", **options)
    lr = torch.tensor(1e-2, dtype=torch.float64, device="cuda")
    graphed = optimizer(graph_params, lr=lr, backend="cupy", capturable=True, **options)
    static = [grad.clone() for grad in grads[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):
            lr.fill_(1e-2 * 0.7 ** step)
            for param, grad in zip(graph_params, grads[step]):
                param.grad = grad.clone()
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for param, grad in zip(graph_params, static):
            param.grad = grad.clone()
        graphed.step()
    for step in range(8):
        rate = 1e-2 * 0.7 ** step
        eager.param_groups[0]["lr"] = rate
        for param, grad in zip(eager_params, grads[step]):
            param.grad = grad.clone()
        eager.step()
        if step >= 3:
            lr.fill_(rate)
            for buffer, grad in zip(static, grads[step]):
                buffer.copy_(grad)
            graph.replay()
    torch.cuda.synchronize()
    for e, a in zip(eager_params, graph_params):
        assert torch.equal(e.detach().view(torch.uint8), a.detach().view(torch.uint8))
        assert eager.state[e].keys() == graphed.state[a].keys()
        for key, value in eager.state[e].items():
            other = graphed.state[a][key]
            assert torch.equal(value.cpu().view(torch.uint8) if value.dim() else value.cpu(),
                               other.cpu().view(torch.uint8) if other.dim() else other.cpu().to(value.dtype)), key


def test_cuda_graph_step_reads_gradscaler_tensors_when_it_runs():
    """A captured step given GradScaler's loss scale and inf flag (device tensors) reads them at
    each replay: new scales unscale the grads, a flagged replay changes nothing, counters
    included, as eager steps given the same do."""
    g = torch.Generator().manual_seed(1)
    shapes = [(333, 77), (5,), (4096 + 3,)]
    start = [torch.randn(s, generator=g).half() for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 64).half().cuda() for s in shapes] for _ in range(7)]
    eager_params = [torch.nn.Parameter(p.cuda()) for p in start]
    graph_params = [torch.nn.Parameter(p.cuda()) for p in start]
    eager = bf16opt.AdamW(eager_params, lr=1e-3, precision="fp32", backend="cupy")
    graphed = bf16opt.AdamW(graph_params, lr=1e-3, precision="fp32", backend="cupy", capturable=True)
    scale = torch.full((), 2.0 ** 6, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    for param, grad in zip(graph_params, grads[0]):
        param.grad = grad.clone()
    graphed.step(grad_scale=scale, found_inf=found_inf)  # warm-up (eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(grad_scale=scale, found_inf=found_inf)
    for step in range(7):
        scale.fill_(2.0 ** (6 - step % 3))
        found_inf.fill_(1.0 if step in (3, 4) else 0.0)
        for param, grad in zip(eager_params, grads[step]):
            param.grad = grad.clone()
        eager.step(grad_scale=scale.clone(), found_inf=found_inf.clone())
        for param, grad in zip(graph_params, grads[step]):
            param.grad.copy_(grad)
        if step == 0:
            continue  # (the warm-up step was step 0)
        graph.replay()
    torch.cuda.synchronize()
    for e, a in zip(eager_params, graph_params):
        assert torch.equal(e.detach().view(torch.int16), a.detach().view(torch.int16))
        assert graphed.state[a]["step"].item() == eager.state[e]["step"].item() == 5.0
