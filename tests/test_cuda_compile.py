"""Every CUDA kernel instantiation the CuPy adapter can request compiles with NVRTC.

No GPU needed: NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel and is driven through
``cupy_backends``.  The source, options and compiler (``bf16opt.backends.cuda_compile``)
and the name expressions (``bf16opt.backends.cupy.all_kernel_names``) are what the
adapter's loader uses at run time; only the target differs (PTX for compute_80 and
compute_90 here, a cubin for the device's sm_XX there; ``test_cubin_sample`` covers that
path for sm_90).

The instantiations are all plans of ``all_plans(quality=True)`` x each algorithm's
template flags (Adam's amsgrad, SGD's momentum) x telemetry on/off
(``all_kernel_names``; maximize, L2, nesterov, ... are run-time flags), a part of them compiled for compute_80 on each run (the part chosen by the run's
seed: ``tests/sweeps.py``, so consecutive days' runs take every name in turn;
``$BF16OPT_SWEEP=all`` compiles all), and one program of each kind and telemetry
setting for compute_90 (``SAMPLE`` names spread over the plans).  NVRTC's time grows faster
than linearly with the number of name expressions in one program (docs/performance.md), so
they are compiled in programs of ``BATCH`` names, two worker processes at a time.

The PTX is also checked for the numerics contract (docs/numerics.md): no fused
multiply-add, no flush-to-zero, IEEE-rounded division and square root; and for the
telemetry contract: kernels without tracking contain no atomics.

Select alone with ``pytest -m nvrtc``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re
import sys
from pathlib import Path

import pytest

from bf16opt.algorithms import ALGORITHMS, LION, SGD, kernel_config
from bf16opt.backends import cuda_compile
from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import all_plans, q8_plans

sys.path.insert(0, str(Path(__file__).parent))  # (sweeps.py: the run's part of the sweep)
import sweeps  # noqa: E402

pytestmark = pytest.mark.nvrtc

ARCHS = ("compute_80", "compute_90")


def _nvrtc_problem():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:
        return f"cupy is not installed ({exc}): pip install cupy-cuda13x nvidia-cuda-nvrtc"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # the NVRTC shared library is missing
        return f"NVRTC is not loadable ({exc}): pip install nvidia-cuda-nvrtc"
    return None


PROBLEM = _nvrtc_problem()
if PROBLEM is not None:
    pytestmark = [pytest.mark.nvrtc, pytest.mark.skip(reason=PROBLEM)]


BATCH = 16
SAMPLE = 6  # names compiled for each arch after the first, per (kind, telemetry)
#: parts of the first arch's sweep: more than the Numba sweeps' (tests/sweeps.py), as it has
#: no names every run must keep and its set-up is the suite's longest item
PARTS = 2 * sweeps.PARTS


def compile_all(kind: str, arch: str, names=None):
    """What the loader would compile for every (or the given) instantiation of ``kind``."""
    names = cuda_backend.all_kernel_names(kind) if names is None else names
    compiled = cuda_compile.nvrtc_compile(cuda_compile.kernel_source(kind), names,
                                          cuda_compile.compile_options(arch), filename=f"{kind}.cu")
    return names, compiled


def ptx_facts(kind: str, arch: str, names: list) -> dict:
    """Compile ``names`` into one program (in a worker) and report what the PTX shows."""
    _, compiled = compile_all(kind, arch, names)
    ptx = compiled.binary.decode()
    return dict(
        names=names,
        target=f".target sm_{arch.split('_')[1]}" in ptx,
        missing=[n for n in names if f".entry {compiled.lowered[n]}(" not in ptx],
        ftz=".ftz" in ptx,
        fma=bool(re.search(r"\bfma\.\w*\.?f32", ptx)),
        approx=bool(re.search(r"\b(div|sqrt|rcp|rsqrt)\.approx", ptx) or re.search(r"\bdiv\.full", ptx)),
        ieee_div_sqrt=bool(re.search(r"\bdiv\.rn\.f32", ptx) and re.search(r"\bsqrt\.rn\.f32", ptx)),
        v4=bool(re.search(r"\bld(\.global)?\.v4\.", ptx) and re.search(r"\bst(\.global)?\.v4\.", ptx)),
        atomics=bool(re.search(r"\b(atom|red)\.", ptx)),  # (NVRTC 12.4 reduces without a result: red)
        atomic_add_u64=bool(re.search(r"\b(atom|red)(\.global)?\.add\.u64", ptx)),
        internal=[line for line in ptx.splitlines() if "_INTERNAL_" in line],
        log=compiled.log,
    )


def first_arch_names(names: list, environ=os.environ) -> list:
    """The names of one (kind, telemetry) compiled for the first arch on this run: this run's
    part (``tests/sweeps.py``), or all with ``$BF16OPT_SWEEP=all``."""
    return sweeps.todays_part(names, environ=environ, parts=PARTS)


def jobs() -> list:
    """(kind, arch, names): programs of BATCH names with one telemetry setting each; every
    name for the first arch (sm_80, the oldest with native bf16), one program of each (kind,
    telemetry) for the others, of SAMPLE names spread over the plans (so over the storage
    policies): the source is the same, only code generation differs, and a full second
    sweep would double the suite's longest setup."""
    work = []
    for kind in ALGORITHMS:
        configs = cuda_backend.kernel_configs(kind)
        for track in (False, True):
            names = [n for n, config in configs.items() if config.track == track]
            swept = first_arch_names(names)
            for start in range(0, len(swept), BATCH):
                work.append((kind, ARCHS[0], swept[start:start + BATCH]))
            for arch in ARCHS[1:]:
                work.append((kind, arch, names[::-(-len(names) // SAMPLE)]))
    return work


@pytest.fixture(scope="module")
def compiled_ptx():
    """Facts of every program, compiled two at a time in worker processes."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        futures = [(job, pool.submit(ptx_facts, *job)) for job in jobs()]
        return [(job, future.result()) for job, future in futures]


def template_arguments(name: str) -> list:
    """``bf16opt::x_kernel<A, B<C>, ...>`` -> ["A", "B<C>", ...]."""
    return [a.strip() for a in re.findall(r"(?:[^,<>]|<[^<>]*>)+", name[name.index("<") + 1:-1])]


def test_instantiation_count():
    plans = all_plans(quality=True)
    assert len(plans) == 57
    # q8 plans: the 12 with float32 moments, both moments q8, rounded to nearest or stochastically
    assert len(q8_plans()) == 24
    plans = plans + q8_plans()
    # every plan x amsgrad x telemetry for Adam
    assert len(cuda_backend.all_kernel_names("adam")) == (57 + 24) * 4
    # Lion ignores exp_avg_sq: one kernel per distinct (param, master policy, exp_avg)
    lion_plans = {cuda_backend.kernel_name(kernel_config(LION, p)) for p in plans}
    assert len(cuda_backend.all_kernel_names("lion")) == len(lion_plans) * 2 == 54 + 48
    # SGD: with momentum one kernel per distinct (param, master policy, momentum buffer)
    # -- Lion's set --, without one per (param, master policy); x telemetry
    sgd_momentum = {cuda_backend.kernel_name(kernel_config(SGD, p, (("momentum", True),))) for p in plans}
    sgd_plain = {cuda_backend.kernel_name(kernel_config(SGD, p)) for p in plans}
    assert len(sgd_momentum) == len(lion_plans)
    assert len(cuda_backend.all_kernel_names("sgd")) == (len(sgd_momentum) + len(sgd_plain)) * 2 == 78 + 48
    for kind, algorithm in ALGORITHMS.items():
        names = cuda_backend.all_kernel_names(kind)
        assert len(set(names)) == len(names)
        # <param, master policy, storage parameters..., template flags..., track>
        arity = 2 + len(algorithm.storage_parameters) + len(algorithm.template_flags) + 1
        for name in names:
            assert name.startswith(f"bf16opt::{kind}_kernel<") and name.endswith(">")
            assert len(template_arguments(name)) == arity, name


def test_sgd_without_momentum_names_an_fp32_buffer():
    """The unused momentum buffer's storage is Fp32, so such configurations share kernels."""
    plain = [template_arguments(n) for n in cuda_backend.all_kernel_names("sgd")]
    plain = [arguments for arguments in plain if arguments[3] == "false"]  # MOMENTUM
    assert plain and all(arguments[2] == "bf16opt::Fp32" for arguments in plain)


def test_every_instantiation_compiles(compiled_ptx):
    compiled = {}
    for (kind, arch, names), facts in compiled_ptx:
        context = f"{kind} {arch} {names[0]} ... ({len(names)} names)"
        assert facts["target"] and not facts["missing"], context
        assert not facts["ftz"], f"flush-to-zero arithmetic in the PTX: {context}"
        assert not facts["fma"], f"fused multiply-add in the PTX: {context}"
        assert not facts["approx"], f"approximate div/sqrt in the PTX: {context}"
        # internal-linkage globals get a per-compile hash in their names (see test_reproducible)
        assert not facts["internal"], f"{facts['internal'][:3]}: {context}"
        if kind == "adam":
            assert facts["ieee_div_sqrt"], context
        # 16-byte vector accesses are there (the aligned path; q8 kernels' lanes too)
        assert facts["v4"], context
        tracked = names[0].endswith("true>")  # the last template argument is TRACK
        assert all(n.endswith("true>") == tracked for n in names)
        # telemetry is compiled in only when tracked: no atomics otherwise
        assert facts["atomics"] == tracked and facts["atomic_add_u64"] == tracked, context
        for name in names:
            compiled.setdefault(name, set()).add(arch)
    expected = {name for kind in ALGORITHMS for track in (False, True)
                for name in first_arch_names([n for n, config in cuda_backend.kernel_configs(kind).items()
                                              if config.track == track])}
    assert {name for name, found in compiled.items() if ARCHS[0] in found} == expected
    assert all(sum(arch in found for found in compiled.values()) >= len(ALGORITHMS) * 2 * SAMPLE
               for arch in ARCHS[1:])


def test_live_kernels_compile_apart_from_the_others():
    """capturable=True's instantiations (``kernel_name(config, live=True)``) compile with the same
    IEEE rules; the float64 math of their per-chunk scalars is in them and not in the kernel of
    the same config without LIVE (a kernel has the registers of its widest path)."""
    for kind in ALGORITHMS:
        names = cuda_backend.all_kernel_names(kind)[:2]
        live = [cuda_backend.kernel_name(cuda_backend.kernel_configs(kind)[name], live=True) for name in names]
        assert all(name.endswith(", true>") for name in live)
        facts = ptx_facts(kind, "compute_90", names + live)
        assert not facts["missing"] and not facts["ftz"] and not facts["fma"] and not facts["approx"], kind
        _, compiled = compile_all(kind, "compute_90", names)
        ptx = compiled.binary.decode()
        assert not re.search(r"\b(div|mul|sub)\.rn\.f64", ptx), f"float64 math in {kind}'s kernels without LIVE"
        _, compiled = compile_all(kind, "compute_90", live)
        ptx = compiled.binary.decode()
        assert re.search(r"\bcvt\.rn\.f32\.f64", ptx), kind
        if kind != "sgd":  # (Adam's and Lion's decay = 1 - lr * rate; Adam's lr / bias correction)
            assert re.search(r"\bmul\.rn\.f64", ptx) and re.search(r"\bsub\.rn\.f64", ptx), kind
        if kind == "adam":
            assert re.search(r"\bdiv\.rn\.f64", ptx), kind


def test_consecutive_runs_sweep_every_name():
    """The first arch's part-sweeps of consecutive days are disjoint and cover every name."""
    names = cuda_backend.all_kernel_names("sgd")
    days = [first_arch_names(names, {"BF16OPT_GPU_SAMPLE_SEED": str(20261128 + k)})
            for k in range(PARTS)]
    assert sorted(name for day in days for name in day) == sorted(names)
    assert first_arch_names(names, {sweeps.SWEEP_VARIABLE: "all"}) == names


def test_cubin_sample():
    """sm_90 cubins (what load_kernel builds on an H100): a plain kernel, and one per
    stochastic, Kahan and remainder policy with telemetry."""
    for kind in ALGORITHMS:
        all_names = cuda_backend.all_kernel_names(kind)
        names = [all_names[0]] + [next(n for n in all_names if word in n and n.endswith("true>"))
                                  for word in ("Stochastic<bf16opt::Fp16>", "Kahan", "Remainder")]
        _, compiled = compile_all(kind, "sm_90", names)
        assert compiled.binary[:4] == b"\x7fELF"
        assert set(compiled.lowered) == set(names)


def compiled_bytes(kind: str, names: list) -> bytes:
    return compile_all(kind, "compute_90", names)[1].binary


def test_reproducible():
    """Two processes compiling the same program get the same bytes (what the on-disk
    NVRTC cache and its tests expect): the sources declare no internal-linkage globals,
    whose PTX names NVRTC salts with the process id."""
    context = multiprocessing.get_context("spawn")
    results = []
    for _ in range(2):
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            results.append([pool.submit(compiled_bytes, kind, cuda_backend.all_kernel_names(kind)[:2])
                            for kind in ALGORITHMS])
    for kind, first, second in zip(ALGORITHMS, *results):
        assert first.result() == second.result(), kind


def test_compile_errors_point_at_the_real_file(tmp_path, monkeypatch):
    """#line markers: a broken header is reported at its own path and line."""
    for source in cuda_compile.source_dir().iterdir():
        if source.suffix in (".cu", ".cuh"):
            (tmp_path / source.name).write_text(source.read_text(encoding="utf-8"))
    broken = (tmp_path / "multi_tensor.cuh").read_text(encoding="utf-8").splitlines()
    line = next(i for i, text in enumerate(broken) if "struct ChunkTable" in text)
    broken.insert(line, "this is not C++;")
    (tmp_path / "multi_tensor.cuh").write_text("\n".join(broken) + "\n")
    monkeypatch.setattr(cuda_compile, "source_dir", lambda: tmp_path)
    cuda_compile.kernel_source.cache_clear()
    try:
        with pytest.raises(cuda_compile.CompileError) as error:
            compile_all("lion", "compute_90", cuda_backend.all_kernel_names("lion")[:1])
    finally:
        cuda_compile.kernel_source.cache_clear()
    assert f'{(tmp_path / "multi_tensor.cuh").as_posix()}({line + 1})' in str(error.value)
