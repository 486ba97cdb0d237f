"""Every CUDA kernel instantiation the CuPy adapter can request compiles with NVRTC.

No GPU needed: NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel and is driven through
``cupy_backends``.  The source, name expressions and options are produced by the same
functions the adapter's loader (``bf16opt.backends.cupy.load_kernel``) uses at run time;
only the target differs (PTX for compute_80 and compute_90 here, a cubin for the
device's sm_XX there; ``test_cubin_sample`` covers that path for sm_90).

The instantiations are all plans of ``all_plans(quality=True)`` x amsgrad (Adam) x
telemetry on/off (``all_kernel_names``: 228 Adam + 54 Lion; maximize and L2 are
run-time flags), each compiled for both archs.  NVRTC takes ~0.1 s per instantiation
and grows faster than linearly with the number of name expressions in one program
(160 names: 16.6 s in one program, 8.8 s in programs of 16), so they are compiled in
programs of ``BATCH`` names, two worker processes at a time.

The PTX is also checked for the numerics contract (DESIGN.md section 3): no fused
multiply-add, no flush-to-zero, IEEE-rounded division and square root; and for the
telemetry contract: kernels without tracking contain no atomics.

Select alone with ``pytest -m nvrtc``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import re

import pytest

from bf16opt.backends import cupy as cuda_backend
from bf16opt.precision import all_plans

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


def compile_all(kind: str, arch: str, names=None):
    """What the loader would compile for every (or the given) instantiation of ``kind``."""
    names = cuda_backend.all_kernel_names(kind) if names is None else names
    compiled = cuda_backend.nvrtc_compile(cuda_backend.kernel_source(kind), names,
                                          cuda_backend.compile_options(arch), filename=f"{kind}.cu")
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
        atomics=bool(re.search(r"\batom\.", ptx)),
        atomic_add_u64=bool(re.search(r"\b(atom|red)(\.global)?\.add\.u64", ptx)),
        log=compiled.log,
    )


def jobs() -> list:
    """(kind, arch, names): programs of BATCH names with one telemetry setting each."""
    work = []
    for kind in cuda_backend.KINDS:
        configs = cuda_backend.kernel_configs(kind)
        for track in (False, True):
            names = [n for n, (_, flags) in configs.items() if flags["track"] == track]
            for arch in ARCHS:
                for start in range(0, len(names), BATCH):
                    work.append((kind, arch, names[start:start + BATCH]))
    return work


@pytest.fixture(scope="module")
def compiled_ptx():
    """Facts of every program, compiled two at a time in worker processes."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        futures = [(job, pool.submit(ptx_facts, *job)) for job in jobs()]
        return [(job, future.result()) for job, future in futures]


def test_instantiation_count():
    plans = all_plans(quality=True)
    assert len(plans) == 57
    # every plan x amsgrad x telemetry for Adam
    assert len(cuda_backend.all_kernel_names("adam")) == 57 * 4
    # Lion ignores exp_avg_sq: one kernel per distinct (param, master policy, exp_avg)
    lion_plans = {cuda_backend.kernel_name("lion", p) for p in plans}
    assert len(cuda_backend.all_kernel_names("lion")) == len(lion_plans) * 2 == 54
    for kind in cuda_backend.KINDS:
        assert all(cuda_backend.supports(p) for p in plans)
        names = cuda_backend.all_kernel_names(kind)
        assert len(set(names)) == len(names)


def test_every_instantiation_compiles(compiled_ptx):
    compiled = {}
    for (kind, arch, names), facts in compiled_ptx:
        context = f"{kind} {arch} {names[0]} ... ({len(names)} names)"
        assert facts["target"] and not facts["missing"], context
        assert not facts["ftz"], f"flush-to-zero arithmetic in the PTX: {context}"
        assert not facts["fma"], f"fused multiply-add in the PTX: {context}"
        assert not facts["approx"], f"approximate div/sqrt in the PTX: {context}"
        if kind == "adam":
            assert facts["ieee_div_sqrt"], context
        # 16-byte vector accesses are there (the aligned path)
        assert facts["v4"], context
        tracked = names[0].endswith("true>")  # the last template argument is TRACK
        assert all(n.endswith("true>") == tracked for n in names)
        # telemetry is compiled in only when tracked: no atomics otherwise
        assert facts["atomics"] == tracked and facts["atomic_add_u64"] == tracked, context
        for name in names:
            compiled.setdefault(name, set()).add(arch)
    expected = set(cuda_backend.all_kernel_names("adam")) | set(cuda_backend.all_kernel_names("lion"))
    assert set(compiled) == expected
    assert all(found == set(ARCHS) for found in compiled.values())


def test_cubin_sample():
    """sm_90 cubins (what load_kernel builds on an H100): a plain kernel, and one per
    stochastic, Kahan and remainder policy with telemetry."""
    for kind in cuda_backend.KINDS:
        all_names = cuda_backend.all_kernel_names(kind)
        names = [all_names[0]] + [next(n for n in all_names if word in n and n.endswith("true>"))
                                  for word in ("Stochastic<bf16opt::Fp16>", "Kahan", "Remainder")]
        _, compiled = compile_all(kind, "sm_90", names)
        assert compiled.binary[:4] == b"\x7fELF"
        assert set(compiled.lowered) == set(names)


def test_compile_errors_point_at_the_real_file(tmp_path, monkeypatch):
    """#line markers: a broken header is reported at its own path and line."""
    for source in cuda_backend.source_dir().iterdir():
        if source.suffix in (".cu", ".cuh"):
            (tmp_path / source.name).write_text(source.read_text())
    broken = (tmp_path / "multi_tensor.cuh").read_text().splitlines()
    line = next(i for i, text in enumerate(broken) if "struct ChunkTable" in text)
    broken.insert(line, "this is not C++;")
    (tmp_path / "multi_tensor.cuh").write_text("\n".join(broken) + "\n")
    monkeypatch.setattr(cuda_backend, "source_dir", lambda: tmp_path)
    cuda_backend.kernel_source.cache_clear()
    try:
        with pytest.raises(cuda_backend.CompileError) as error:
            compile_all("lion", "compute_90", cuda_backend.all_kernel_names("lion")[:1])
    finally:
        cuda_backend.kernel_source.cache_clear()
    assert f'{(tmp_path / "multi_tensor.cuh").as_posix()}({line + 1})' in str(error.value)
