"""cpu_src/ and cuda_src/ ship inside the package, for regular and editable installs alike; the
wheel has py.typed and LICENSE; the README installs what exists; the extras resolve and the test
extra needs no GPU."""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

import bf16opt
import bf16opt._cpu
import bf16opt._cuda

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DIRS = {"cpu_src": "bf16opt/_cpu", "cuda_src": "bf16opt/_cuda"}
SOURCE_SUFFIXES = {".py", ".cu", ".cuh", ".h"}


def source_files(directory: str) -> set:
    """Files of a source directory that must ship, relative to it."""
    base = ROOT / directory
    return {str(path.relative_to(base)).replace(os.sep, "/") for path in base.rglob("*")
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts
            and "emulation" not in path.parts}


# what a probe subprocess reports about the bf16opt it imports
PROBE = (
    "import json, importlib.resources, bf16opt, bf16opt._cpu, bf16opt._cuda\n"
    "cuda = importlib.resources.files('bf16opt._cuda')\n"
    "print(json.dumps({'package': bf16opt.__file__, 'cpu': bf16opt._cpu.__file__, 'cuda_dir': str(cuda),\n"
    "  'cuda': sorted(p.name for p in cuda.iterdir() if p.name.endswith(('.cu', '.cuh')))}))\n")


def copy_project(source: Path) -> Path:
    """The files a build needs, copied to ``source`` (the checkout stays clean)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.nbi", "*.nbc")
    for name in ("bf16opt", "cpu_src", "cuda_src"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    return source


def installed_distribution() -> importlib.metadata.Distribution:
    """bf16opt's installed metadata.  The checkout's own ``bf16opt.egg-info`` (left by setuptools
    builds, no direct_url.json) shadows it when the checkout root is on sys.path (``python -m
    pytest`` from the root), so that entry is skipped."""
    path = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != ROOT]
    found = list(importlib.metadata.distributions(name="bf16opt", path=path))
    assert found, "bf16opt is not installed"
    return found[0]


def editable_source(distribution):
    """The project directory of an editable install (from PEP 610 direct_url.json), else None."""
    direct_url = distribution.read_text("direct_url.json")
    info = json.loads(direct_url) if direct_url else {}
    if not info.get("dir_info", {}).get("editable"):
        return None
    return Path(url2pathname(urlparse(info["url"]).path))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build a wheel from a copy of the project (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    source = copy_project(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist"), str(source)], check=True)
    (path,) = (work / "dist").glob("bf16opt-*.whl")
    return path


@pytest.mark.packaging
def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for directory, package in SHIPPED_DIRS.items():
        expected = source_files(directory)
        assert expected, f"{directory} has no sources"
        missing = {f"{package}/{name}" for name in expected} - names
        assert not missing, f"wheel lacks {sorted(missing)}"


# the SHA-256 of https://www.apache.org/licenses/LICENSE-2.0.txt (LICENSE: tests/test_typing.py)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


@pytest.mark.packaging
def test_wheel_ships_py_typed_and_license(wheel):
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "bf16opt/py.typed" in names
    licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, names
    assert hashlib.sha256(archive.read(licenses[0])).hexdigest() == APACHE_2_SHA256


@pytest.mark.packaging
def test_readme_installs_from_a_checkout_or_the_wheel_it_names(wheel):
    """bf16opt is not on PyPI: every `pip install` the README shows installs the checkout (".",
    ".[extra]") or the wheel that `pip wheel` builds from it, by the file name it gets."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    warning = "`pip install bf16opt` does not install it"
    assert warning in readme
    targets = re.findall(r"pip install (?:-e )?(\S+)", readme.replace(warning, ""))
    assert targets
    for target in targets:
        target = target.strip("`'\"")
        assert target.startswith((".", "dist/", "torch")), f"README installs {target!r}: not published"
    assert f"dist/{wheel.name}" in readme, f"README does not name the wheel {wheel.name}"
    assert "pip wheel --no-deps -w dist ." in readme


@pytest.mark.packaging
def test_regular_install_finds_kernel_sources(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    found = json.loads(out)
    assert Path(found["package"]).is_relative_to(site)
    assert Path(found["cpu"]).is_relative_to(site / "bf16opt" / "_cpu")
    assert set(found["cuda"]) == {n for n in source_files("cuda_src") if n.endswith((".cu", ".cuh"))}


@pytest.mark.packaging
def test_editable_install_finds_kernel_sources(tmp_path):
    """`pip install -e` of a copy into a scratch venv (dependencies from this environment through a
    .pth line): bf16opt._cpu and bf16opt._cuda resolve to the copy's cpu_src/ and cuda_src/."""
    source = copy_project(tmp_path / "src")
    scratch = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(scratch)], check=True)
    python = scratch / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    scratch_site = Path(subprocess.run([str(python), "-c", purelib], check=True, capture_output=True,
                                       text=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (scratch_site / "_bf16opt_test_deps.pth").write_text("\n".join(ours) + "\n")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONPATH="")
    # --ignore-installed: this environment's bf16opt is visible through the .pth; leave it alone
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--ignore-installed", "-q", "-e", str(source)], cwd=tmp_path, env=env, check=True)
    out = subprocess.run([str(python), "-c", PROBE], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    found = json.loads(out)
    assert Path(found["package"]) == source / "bf16opt" / "__init__.py"
    assert Path(found["cpu"]).parent == source / "cpu_src"
    assert Path(found["cuda_dir"]) == source / "cuda_src"
    assert set(found["cuda"]) == {n for n in source_files("cuda_src") if n.endswith((".cu", ".cuh"))}
    assert not (scratch_site / "bf16opt").exists(), "not an editable install: the package was copied"


def test_this_install_finds_kernel_sources():
    """The environment the suite runs in (editable under `make test`) maps both directories."""
    source = editable_source(installed_distribution())
    cpu_dir = Path(bf16opt._cpu.__file__).parent
    cuda_dir = Path(str(importlib.resources.files("bf16opt._cuda")))
    if source is not None:
        assert Path(bf16opt.__file__).parent == source / "bf16opt"
        assert cpu_dir == source / "cpu_src" and cuda_dir == source / "cuda_src"
    else:
        package_dir = Path(bf16opt.__file__).parent
        assert cpu_dir == package_dir / "_cpu" and cuda_dir == package_dir / "_cuda"
    assert {p.name for p in cuda_dir.iterdir()} >= {n for n in source_files("cuda_src") if "/" not in n}


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
    import torch
    from cupy.cuda import nvrtc

    # NVRTC works here, GPU or not (a CUDA 12 build of torch loads its own NVRTC 12 first)
    assert nvrtc.getVersion() >= ((12, 0) if (torch.version.cuda or "").startswith("12") else (13, 0))
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
    installs = json.loads(report.read_text(encoding="utf-8"))["install"]
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
