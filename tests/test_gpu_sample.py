"""The GPU run's sample of kernel instantiations (tests/gpu_sample.py), checked without a GPU:
every algorithm and preset in each sample, another sample for another seed, the same for the
same seed, every case a kernel the adapter lists, clear errors for bad settings."""

from __future__ import annotations

import sys

import pytest

import gpu_sample
from bf16opt.algorithms import ALGORITHMS
from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import PRESETS

SEEDS = [0, 1, 20260101, 2 ** 40 + 7]


def ids(configs) -> list:
    return [gpu_sample.config_id(c) for c in configs]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", list(ALGORITHMS))
def test_each_sample_has_every_preset_and_valid_kernels(kind, seed):
    configs = gpu_sample.sample(kind, seed)
    assert len(set(ids(configs))) == len(configs) <= len(PRESETS) + gpu_sample.DEFAULT_EXTRA
    assert len(configs) > gpu_sample.DEFAULT_EXTRA
    for config in configs:
        assert config.algorithm is ALGORITHMS[kind]
        assert cuda_backend.kernel_name(config) in cuda_backend.kernel_configs(kind)
    plans = {config.plan for config in configs}
    for name in PRESETS:  # on a param dtype where it keeps its compensation and rounding
        assert plans & set(gpu_sample._distinctive_plans(name)), name
    assert any(plan.compensation == "remainder" for plan in plans)
    tracked = [config.track for config in configs[:len(PRESETS)]]
    assert any(tracked) and not all(tracked)  # telemetry on for about half of the preset cases


@pytest.mark.parametrize("kind", list(ALGORITHMS))
def test_the_seed_decides_the_sample(kind):
    assert ids(gpu_sample.sample(kind, 5)) == ids(gpu_sample.sample(kind, 5))
    samples = {tuple(ids(gpu_sample.sample(kind, seed))) for seed in range(6)}
    assert len(samples) == 6


def test_over_many_runs_every_instantiation_comes_up():
    """The extra cases reach what no preset names: over 400 runs' samples, every kernel of
    Lion (the fewest cases per kernel) is drawn."""
    seen = {cuda_backend.kernel_name(c) for seed in range(400) for c in gpu_sample.sample("lion", seed)}
    assert seen == set(cuda_backend.all_kernel_names("lion"))


def test_all_and_sizes():
    assert ids(gpu_sample.sample("lion", 3, extra=None)) == ids(gpu_sample.instantiations("lion"))
    assert len(gpu_sample.sample("adam", 3, extra=0)) <= len(PRESETS)
    assert len(gpu_sample.sample("adam", 3, extra=40)) > len(gpu_sample.sample("adam", 3, extra=0)) + 30


def test_sgd_cases_without_momentum_have_no_nesterov_or_first_step():
    for config in gpu_sample.instantiations("sgd") + gpu_sample.sample("sgd", 11, extra=200):
        if not config.flag("momentum"):
            assert not config.flag("nesterov") and not config.flag("first")


def test_settings_from_the_environment():
    assert gpu_sample.sample_seed({"BF16OPT_GPU_SAMPLE_SEED": "42"}) == 42
    assert gpu_sample.sample_seed({"BF16OPT_GPU_SAMPLE_SEED": "0x10"}) == 16
    assert 20240101 <= gpu_sample.sample_seed({}) < 30000000  # today, YYYYMMDD
    with pytest.raises(ValueError, match="BF16OPT_GPU_SAMPLE_SEED must be an integer"):
        gpu_sample.sample_seed({"BF16OPT_GPU_SAMPLE_SEED": "today"})
    assert gpu_sample.sample_size({}) == gpu_sample.DEFAULT_EXTRA
    assert gpu_sample.sample_size({"BF16OPT_GPU_SAMPLE": "ALL"}) is None
    assert gpu_sample.sample_size({"BF16OPT_GPU_SAMPLE": "3"}) == 3
    with pytest.raises(ValueError, match="BF16OPT_GPU_SAMPLE must be 'all' or a non-negative integer"):
        gpu_sample.sample_size({"BF16OPT_GPU_SAMPLE": "-1"})
    line = gpu_sample.describe(7, 6, {"adam": (14, 912)})
    assert "seed 7" in line and "BF16OPT_GPU_SAMPLE_SEED=7" in line and "adam 14 of 912" in line


def test_compiling_ahead_fills_the_cache_the_loader_reads(tmp_path, monkeypatch):
    """What the GPU module compiles in worker processes is the entry cupy.load_kernel reads
    (same source, name, options, file name), so a test then loads instead of compiling."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                        reason="NVRTC comes with CuPy: pip install cupy-cuda13x nvidia-cuda-nvrtc")
    from bf16opt.backends import cuda_compile

    monkeypatch.setenv("BF16OPT_CACHE_DIR", str(tmp_path))
    expression = cuda_backend.all_kernel_names("lion")[0]
    assert gpu_sample.compile_for_the_loader("lion", expression, "sm_90")
    hits = cuda_compile.cache_stats().get("hits", 0)
    # the real loader on a fake sm_90 device: it must find the entry, not compile
    monkeypatch.setattr(cuda_compile, "nvrtc_compile", lambda *a, **k: pytest.fail("the loader compiled"))
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    module, function = cuda_backend._load_module.__wrapped__(0, "lion", expression)
    assert cuda_compile.cache_stats().get("hits", 0) == hits + 1
    assert module.binary[:4] == b"\x7fELF" and function.startswith("_Z")


class FakeCupy:
    """What cupy._load_module touches of CuPy, on an sm_90 device."""

    class _Device:
        compute_capability = "90"

        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class _Module:
        def load(self, binary):
            self.binary = binary

        def get_function(self, name):
            return name

    def __init__(self):
        import types

        function = types.SimpleNamespace(Module=self._Module)
        self.cuda = types.SimpleNamespace(Device=self._Device, function=function)
