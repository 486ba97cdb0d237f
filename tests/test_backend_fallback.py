"""backend="auto" on CUDA params without a usable CuPy: the reference runs, and says so once.

No GPU needed: ``torch.device("cuda")`` can be named without one, CuPy's absence is faked at
the adapter's import check, and the optimizer's params stay on the CPU while its backend lookup is
asked about a CUDA device (the reference backend runs on either).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import bf16opt
import bf16opt.optimizer as optimizer_module
from bf16opt import backends
from bf16opt.backends import backend_name, resolve_backend
from bf16opt.backends import cupy as cupy_backend

CUDA = torch.device("cuda", 0)


@pytest.fixture
def no_cupy(monkeypatch):
    """CuPy cannot be imported (the adapter's import check says so: hiding the module from
    sys.modules would also break torch's lazy imports, which scan it), and no fallback has
    been warned about in this process yet."""
    monkeypatch.setattr(cupy_backend, "_import_problem",
                        lambda: f"CuPy is not installed (No module named 'cupy'); {cupy_backend.INSTALL_HINT}")
    monkeypatch.setattr(backends, "_warned", set())


def test_auto_on_cuda_without_cupy_warns_once_naming_the_package_and_its_install(no_cupy):
    with pytest.warns(UserWarning) as record:
        for _ in range(3):
            assert resolve_backend("auto", CUDA) is backends.reference
        assert resolve_backend("auto", torch.device("cuda", 1)) is backends.reference
    assert len(record) == 1
    message = str(record[0].message)
    assert "CuPy is not installed" in message and "reference backend" in message
    assert cupy_backend.INSTALL_HINT in message and "backend='reference'" in message
    assert record[0].filename == __file__  # points at the caller, not into bf16opt


def test_the_optimizer_warns_once_over_construction_and_steps(no_cupy, monkeypatch):
    """The optimizer resolves its groups' backends when built and at every full step: one
    warning in all, at the user's line."""
    import bf16opt.step_plan as step_plan
    real = optimizer_module.resolve_backend
    for module in (optimizer_module, step_plan):  # (construction's checks, and each full step)
        monkeypatch.setattr(module, "resolve_backend", lambda name, device: real(name, CUDA))
    param = torch.nn.Parameter(torch.ones(5))
    with pytest.warns(UserWarning, match="cupy-cuda12x") as record:
        opt = bf16opt.AdamW([param], lr=0.1)
        for _ in range(3):
            param.grad = torch.ones(5)
            opt.step()
        bf16opt.AdamW([torch.nn.Parameter(torch.ones(2))])  # another optimizer: still once per process
    assert len(record) == 1 and record[0].filename == __file__
    assert opt.state[param]["step"] == 3 and not torch.equal(param.detach(), torch.ones(5))


def test_backend_name_resolves_without_warning(no_cupy, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend_name("auto", CUDA) == "reference"
        assert backend_name("auto", "cpu") == "numba"
        assert backend_name("reference", CUDA) == "reference"
        assert backend_name("numba", torch.device("cpu")) == "numba"
    assert backends._warned == set()  # the warning is still to come
    with pytest.raises(ValueError, match="CuPy is not installed"):
        backend_name("cupy", CUDA)
    with pytest.raises(ValueError, match="CPU tensors only"):
        backend_name("numba", CUDA)
    with pytest.raises(ValueError, match="backend must be one of"):
        backend_name("gpu", CUDA)


def test_auto_with_a_working_cupy_picks_it_silently(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(cupy_backend, "check_available", lambda device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", CUDA) is cupy_backend
    assert backend_name("auto", CUDA) == "cupy"


def test_explicit_reference_on_cuda_does_not_warn(no_cupy):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("reference", CUDA) is backends.reference


def test_float64_params_show_the_reference_they_run_on():
    wide, narrow = torch.nn.Parameter(torch.ones(3, dtype=torch.float64)), torch.nn.Parameter(torch.ones(2))
    complex_wide = torch.nn.Parameter(torch.ones(2, dtype=torch.complex128))
    opt = bf16opt.AdamW([{"params": [wide]}, {"params": [narrow, complex_wide]}])
    assert opt.group_backends() == ["reference", "numba (float64 params: reference)"]


def test_each_group_shows_the_backend_it_runs_on(no_cupy, monkeypatch):
    """repr(opt) and group_backends() name the backend each group runs on, "auto" resolved:
    numba for CPU params, the reference where CUDA params lack CuPy, the host's for offload."""
    cpu, offloaded, empty = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)), []
    opt = bf16opt.AdamW([{"params": [cpu]}, {"params": [offloaded], "offload": "cpu"},
                         {"params": [torch.nn.Parameter(torch.ones(2))], "backend": "reference"}])
    opt.param_groups.append({**opt.param_groups[0], "params": empty})
    assert opt.group_backends() == ["numba", "numba", "reference", "none"]
    assert repr(opt).count("    runs on: ") == 4 and "    runs on: reference" in repr(opt)
    monkeypatch.setattr(backends, "_resolve", lambda name, device, real=backends._resolve: real(name, CUDA))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asking does not warn
        assert opt.group_backends()[0] == "reference"
