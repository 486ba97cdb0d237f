"""Type hints of the public API (checked with mypy) and the package's metadata: py.typed,
LICENSE, and the extras (the CUDA extras resolve; the test extra needs no GPU).

``python -m mypy`` (configured in pyproject.toml) checks bf16opt/__init__.py, the command line,
bf16opt/memory.py and this file, whose ``public_api_in_use`` is ordinary user code and whose
``misuses`` must each be an error: the ``# type: ignore[...]`` comments there would be unused
(an error under ``warn_unused_ignores``) if the hints did not catch them.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.resources
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import bf16opt

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- user code, type-checked by mypy
def public_api_in_use() -> str:
    """What a user writes; mypy checks it against the hints, and test_public_api_in_use runs it."""
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    adamw = bf16opt.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, precision="bf16",
                          backend="reference")
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=10)  # a torch.optim.Optimizer
    bf16opt.Adam(model.parameters(), lr=torch.tensor(1e-3), betas=(0.9, 0.95), amsgrad=True, seed=3,
                 offload="cpu", offload_threads=1)
    bf16opt.Lion([{"params": list(model.parameters()), "precision": bf16opt.PRESETS["fp32"]}], lr=1e-4)
    sgd = bf16opt.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, backend="reference",
                      precision=bf16opt.Precision(master="fp32", exp_avg="bf16"), track_precision=True)
    model(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    sgd.step()
    adamw.step()
    schedule.step()
    swallowed: float = sgd.precision_stats()["total"]["swallowed"]
    report: bf16opt.MemoryReport = bf16opt.memory_report(sgd)
    per_param: float = report.optimizer_bytes_per_param
    components: dict[str, float] = report.bytes_per_param
    on_device: int = report.device_bytes
    precision: bf16opt.Precision = bf16opt.PRESETS["bf16-sr"]
    version: str = bf16opt.__version__
    return f"{swallowed} {per_param} {components} {on_device} {precision.label} {version} {report}"


def misuses() -> None:
    """Never run: each line is an error the hints must catch."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    bf16opt.AdamW(params, lr="fast")  # type: ignore[arg-type]
    bf16opt.Adam(params, amsgrad="yes")  # type: ignore[arg-type]
    bf16opt.Lion(params, betas=0.9)  # type: ignore[arg-type]
    bf16opt.SGD(params, precision=16)  # type: ignore[arg-type]
    bf16opt.SGD(params, seed="0")  # type: ignore[arg-type]
    bf16opt.Precision(master=16)  # type: ignore[arg-type]
    bf16opt.memory_report("adam")  # type: ignore[arg-type]
    size: str = bf16opt.memory_report(bf16opt.SGD(params)).total_per_param  # type: ignore[assignment]
    del size


def test_public_api_in_use() -> None:
    assert "Memory breakdown" in public_api_in_use()


def test_mypy_passes() -> None:
    pytest.importorskip("mypy", reason="mypy (in bf16opt[test]) type-checks the public API")
    # the cache (.mypy_cache, with its own .gitignore) makes runs after the first take seconds
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


PUBLIC_MODULES = ("bf16opt", "bf16opt.adam", "bf16opt.lion", "bf16opt.sgd", "bf16opt.memory",
                  "bf16opt.precision")


def unannotated(function: object) -> list[str]:
    signature = inspect.signature(function)  # type: ignore[arg-type]
    missing = [name for name, p in signature.parameters.items()
               if name != "self" and p.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_public_signatures_are_annotated() -> None:
    """Every name in bf16opt.__all__: functions, constructors, and the public methods and
    properties its classes define in the public modules."""
    problems = {}
    for name in bf16opt.__all__:
        obj = getattr(bf16opt, name)
        if inspect.isfunction(obj):
            problems[name] = unannotated(obj)
        elif inspect.isclass(obj):
            problems[f"{name}()"] = unannotated(obj)
            for attribute, value in vars(obj).items():
                if attribute.startswith("_") and attribute not in ("__init__", "_repr_html_"):
                    continue
                if isinstance(value, property) and value.fget is not None:
                    value = value.fget
                if inspect.isfunction(value) and value.__module__ in PUBLIC_MODULES:
                    problems[f"{name}.{attribute}"] = unannotated(value)
    assert not {name: missing for name, missing in problems.items() if missing}


# ---------------------------------------------------------------- py.typed and LICENSE
def test_package_is_marked_typed() -> None:
    assert importlib.resources.files("bf16opt").joinpath("py.typed").is_file()


# the SHA-256 of https://www.apache.org/licenses/LICENSE-2.0.txt
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_declared_license() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0, January 2004" in text
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "not the standard Apache License 2.0 text"


def copy_project(target: Path) -> Path:
    """The files a build needs (the checkout stays clean)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.nbi", "*.nbc")
    for name in ("bf16opt", "cpu_src", "cuda_src"):
        shutil.copytree(ROOT / name, target / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, target / name)
    return target


@pytest.mark.packaging
def test_wheel_ships_py_typed_and_license(tmp_path: Path) -> None:
    source = copy_project(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, cwd=ROOT)
    (wheel,) = (tmp_path / "dist").glob("bf16opt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bf16opt/py.typed" in names
    licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, names
    assert hashlib.sha256(zipfile.ZipFile(wheel).read(licenses[0])).hexdigest() == APACHE_2_SHA256


# ---------------------------------------------------------------- extras
def extra(name: str) -> list[str]:
    """The requirements of an extra, as setup.cfg declares them."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.extras_require"][name].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def distribution(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


# GPU packages the test extra may hold: both work on a machine without a GPU (NVRTC compiles the
# CUDA kernels in tests/test_cuda_compile.py; cupy imports and drives NVRTC without a device)
GPU_PACKAGES_WITHOUT_A_GPU = {"cupy-cuda13x", "nvidia-cuda-nvrtc"}
GPU_ONLY = re.compile(r"^(nvidia-.*|cupy-.*|triton.*|torch.*|deepspeed|jax.*cuda.*|.*-cu\d+)$")


def test_test_extra_has_expecttest_and_the_tools_the_suite_imports() -> None:
    names = {distribution(r) for r in extra("test")}
    for needed in ("expecttest", "mypy", "pytest", "hypothesis", "nbclient", "matplotlib", "tqdm"):
        assert needed in names


def test_test_extra_installs_nothing_a_cpu_only_machine_cannot_use() -> None:
    names = {distribution(r) for r in extra("test")}
    assert {n for n in names if GPU_ONLY.match(n)} == GPU_PACKAGES_WITHOUT_A_GPU
    assert not any(GPU_ONLY.match(n) for n in {distribution(r) for r in extra("plot")})
    cupy = pytest.importorskip("cupy", reason="cupy-cuda13x (bf16opt[test]) is not installed")
    from cupy.cuda import nvrtc

    assert nvrtc.getVersion() >= (13, 0)  # NVRTC works here, GPU or not
    import importlib.metadata

    for name in GPU_PACKAGES_WITHOUT_A_GPU:  # and they pull in no CUDA runtime of their own
        required = [r for r in importlib.metadata.requires(name) or [] if "extra ==" not in r]
        assert not [r for r in required if GPU_ONLY.match(distribution(r))], (name, required)
    del cupy


# pip's words for an index it cannot reach (then the resolution says nothing about the extras)
UNREACHABLE = ("NewConnectionError", "ConnectTimeout", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
               "ConnectionResetError", "ReadTimeoutError")


@pytest.mark.packaging
def test_cuda_extras_resolve(tmp_path: Path) -> None:
    """``pip install .[cuda12]`` / ``.[cuda13]`` would succeed here: pip resolves them (dry run,
    against PyPI and what is installed) to wheels only."""
    source = copy_project(tmp_path / "src")
    report = tmp_path / "report.json"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                             "--quiet", "--retries", "1", "--timeout", "20", "--report", str(report),
                             f"{source}[cuda12,cuda13]"], capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode and any(word in result.stderr for word in UNREACHABLE):
        pytest.skip("the package index is not reachable: pip cannot resolve the CUDA extras")
    assert result.returncode == 0, result.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    names = {distribution(item["metadata"]["name"]): item for item in installs}
    assert "bf16opt" in names
    import importlib.metadata

    for requirement in extra("cuda12") + extra("cuda13"):
        name = distribution(requirement)
        if name not in names:  # already installed here, and pip found that it fits
            assert importlib.metadata.version(name)
    for name, item in names.items():
        if name != "bf16opt":
            assert item["download_info"]["url"].endswith(".whl"), f"{name} would be built from source"
