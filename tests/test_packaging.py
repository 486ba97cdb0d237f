"""cpu_src/ and cuda_src/ ship inside the package, for regular and editable installs alike."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import os
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
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
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
