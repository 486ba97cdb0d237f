"""cpu_src/ and cuda_src/ ship inside the package, for regular and editable installs alike."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build a wheel from a copy of the project (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.nbi", "*.nbc")
    for name in ("bf16opt", "cpu_src", "cuda_src"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
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
    probe = (
        "import json, importlib.resources, bf16opt, bf16opt._cpu, bf16opt._cuda\n"
        "cuda = importlib.resources.files('bf16opt._cuda')\n"
        "print(json.dumps({'package': bf16opt.__file__, 'cpu': bf16opt._cpu.__file__,\n"
        "  'cuda': sorted(p.name for p in cuda.iterdir() if p.name.endswith(('.cu', '.cuh')))}))\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    found = json.loads(out)
    assert Path(found["package"]).is_relative_to(site)
    assert Path(found["cpu"]).is_relative_to(site / "bf16opt" / "_cpu")
    assert set(found["cuda"]) == {n for n in source_files("cuda_src") if n.endswith((".cu", ".cuh"))}


def test_this_install_finds_kernel_sources():
    """The environment the suite runs in (editable under `make test`) maps both directories."""
    direct_url = importlib.metadata.distribution("bf16opt").read_text("direct_url.json")
    editable = bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))
    cpu_dir = Path(bf16opt._cpu.__file__).parent
    cuda_dir = Path(str(importlib.resources.files("bf16opt._cuda")))
    if editable:
        assert cpu_dir == ROOT / "cpu_src" and cuda_dir == ROOT / "cuda_src"
    else:
        package_dir = Path(bf16opt.__file__).parent
        assert cpu_dir == package_dir / "_cpu" and cuda_dir == package_dir / "_cuda"
    assert {p.name for p in cuda_dir.iterdir()} >= {n for n in source_files("cuda_src") if "/" not in n}
