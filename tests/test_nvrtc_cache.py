"""NVRTC results are cached on disk across processes (``cuda_compile.cached_nvrtc_compile``).

A compile in one process is served from disk in the next without compiling (NVRTC's
compile is replaced by a function that fails); any change of source, options,
architecture or NVRTC version is a miss; a damaged entry is compiled again and repaired;
an unwritable cache directory only costs the compile; two processes compiling the same
program at once both succeed with identical results and leave one entry.

Select alone with ``pytest -m nvrtc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bf16opt.backends import cuda_compile

pytestmark = pytest.mark.nvrtc

ROOT = Path(__file__).resolve().parent.parent


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

KIND = "lion"
ARCH = "compute_90"

# One real compile in a fresh process: prints the cache counters and the result.
# ``refuse_compile``: NVRTC's compile raises.  ``rendezvous``: after compiling, wait until
# ``parties`` processes have compiled (so all of them missed) before storing.
SCRIPT = r"""
import hashlib, json, os, sys, time
from bf16opt.backends import cuda_compile, cupy
request = json.loads(sys.argv[1])
if request["refuse_compile"]:
    def refuse(*args, **kwargs):
        raise AssertionError("NVRTC compile called although the cache holds the program")
    cuda_compile.nvrtc_compile = refuse
if request["rendezvous"]:
    compile_for_real = cuda_compile.nvrtc_compile
    def compile_together(*args, **kwargs):
        compiled = compile_for_real(*args, **kwargs)
        os.makedirs(request["rendezvous"], exist_ok=True)
        open(os.path.join(request["rendezvous"], str(os.getpid())), "w").close()
        deadline = time.monotonic() + 300
        while len(os.listdir(request["rendezvous"])) < request["parties"]:
            if time.monotonic() > deadline:
                raise AssertionError("the other processes never compiled (cache hits?)")
            time.sleep(0.005)
        return compiled
    cuda_compile.nvrtc_compile = compile_together
name = cupy.all_kernel_names(request["kind"])[0]
compiled = cuda_compile.cached_nvrtc_compile(
    cuda_compile.kernel_source(request["kind"]), [name], cuda_compile.compile_options(request["arch"]),
    filename=request["kind"] + ".cu")
print(json.dumps({"stats": cuda_compile.cache_stats(), "lowered": compiled.lowered,
                  "sha256": hashlib.sha256(compiled.binary).hexdigest()}))
"""


def _command(refuse_compile: bool = False, rendezvous: str = "", parties: int = 0) -> list:
    request = json.dumps({"kind": KIND, "arch": ARCH, "refuse_compile": refuse_compile,
                          "rendezvous": rendezvous, "parties": parties})
    return [sys.executable, "-c", SCRIPT, request]


def _environment(cache: Path) -> dict:
    return dict(os.environ, BF16OPT_CACHE_DIR=str(cache))


def compile_in_subprocess(cache: Path, refuse_compile: bool = False) -> dict:
    done = subprocess.run(_command(refuse_compile), env=_environment(cache), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def entries(cache: Path) -> list:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """In-process: the cache in tmp_path/cache, NVRTC compiles counted."""
    calls = []
    compile_for_real = cuda_compile.nvrtc_compile

    def counting(*args, **kwargs):
        calls.append(args)
        return compile_for_real(*args, **kwargs)

    monkeypatch.setattr(cuda_compile, "nvrtc_compile", counting)
    monkeypatch.setenv("BF16OPT_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def _request(source_suffix: str = "", options_extra: tuple = (), arch: str = ARCH):
    from bf16opt.backends import cupy

    name = cupy.all_kernel_names(KIND)[0]
    return (cuda_compile.kernel_source(KIND) + source_suffix, [name],
            cuda_compile.compile_options(arch) + options_extra)


def test_second_process_is_served_from_disk(tmp_path):
    cache = tmp_path / "cache"
    first = compile_in_subprocess(cache)
    assert first["stats"] == {"misses": 1, "stores": 1}
    assert len(entries(cache)) == 1 and entries(cache)[0].endswith(".nvrtc")
    # the second process may not compile at all (its nvrtc_compile raises)
    second = compile_in_subprocess(cache, refuse_compile=True)
    assert second["stats"] == {"hits": 1}
    assert second["sha256"] == first["sha256"] and second["lowered"] == first["lowered"]


def test_a_different_source_options_arch_or_nvrtc_is_a_miss(counted, tmp_path, monkeypatch):
    source, names, options = _request()
    reference = cuda_compile.cached_nvrtc_compile(source, names, options)
    assert len(counted) == 1
    assert cuda_compile.cached_nvrtc_compile(source, names, options) == reference
    assert len(counted) == 1  # served from disk
    variants = [_request(source_suffix="\n// another source\n"),
                _request(options_extra=("--generate-line-info",)),
                _request(arch="compute_80")]
    for n, (other_source, other_names, other_options) in enumerate(variants, start=2):
        cuda_compile.cached_nvrtc_compile(other_source, other_names, other_options)
        assert len(counted) == n, (other_source[-30:], other_options)
    monkeypatch.setattr(cuda_compile, "_nvrtc_version", lambda: (99, 0))
    cuda_compile.cached_nvrtc_compile(source, names, options)
    assert len(counted) == 5
    assert len(entries(tmp_path / "cache")) == 5


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "bad header", "empty", "directory"])
def test_a_damaged_entry_is_compiled_again(counted, tmp_path, damage):
    source, names, options = _request()
    reference = cuda_compile.cached_nvrtc_compile(source, names, options)
    (entry,) = (tmp_path / "cache").iterdir()
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[:len(data) // 2])
    elif damage == "flipped byte":
        entry.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "bad header":
        entry.write_bytes(data.replace(b'"key": "', b'"key": "x', 1))
    elif damage == "empty":
        entry.write_bytes(b"")
    else:  # unreadable: a directory where the file should be
        entry.unlink()
        entry.mkdir()
    corrupt = cuda_compile.cache_stats().get("corrupt", 0)
    assert cuda_compile.cached_nvrtc_compile(source, names, options) == reference
    assert len(counted) == 2
    assert cuda_compile.cache_stats().get("corrupt", 0) == corrupt + 1
    if damage != "directory":  # repaired: the next call is a hit
        assert entry.read_bytes() == data
        assert cuda_compile.cached_nvrtc_compile(source, names, options) == reference
        assert len(counted) == 2


def test_an_unwritable_cache_only_costs_the_compile(counted, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("BF16OPT_CACHE_DIR", str(blocker / "nvrtc"))  # mkdir fails, even for root
    failures = cuda_compile.cache_stats().get("store_failures", 0)
    source, names, options = _request()
    first = cuda_compile.cached_nvrtc_compile(source, names, options)
    assert cuda_compile.cached_nvrtc_compile(source, names, options) == first
    assert len(counted) == 2
    assert cuda_compile.cache_stats()["store_failures"] == failures + 2


def test_concurrent_processes_agree(tmp_path):
    """Two processes miss, compile and store the same entry at the same time."""
    cache = tmp_path / "cache"
    command = _command(rendezvous=str(tmp_path / "rendezvous"), parties=2)
    processes = [subprocess.Popen(command, env=_environment(cache), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert all(result["stats"] == {"misses": 1, "stores": 1} for result in results)
    assert results[0]["sha256"] == results[1]["sha256"]
    assert results[0]["lowered"] == results[1]["lowered"]
    (entry,) = entries(cache)  # one entry, no temporary file left behind
    assert entry.endswith(".nvrtc")
    served = compile_in_subprocess(cache, refuse_compile=True)
    assert served["sha256"] == results[0]["sha256"]


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("BF16OPT_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cuda_compile.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("BF16OPT_CACHE_DIR")
    assert cuda_compile.cache_dir() == tmp_path / "xdg" / "bf16opt" / "nvrtc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cuda_compile.cache_dir() == tmp_path / "home" / ".cache" / "bf16opt" / "nvrtc"


def test_the_key_covers_every_input():
    source, names, options = _request()
    key = cuda_compile.cache_key(source, names, options)
    assert key == cuda_compile.cache_key(source, list(names), list(options))
    changed = [cuda_compile.cache_key(source + " ", names, options),
               cuda_compile.cache_key(source, names + ["bf16opt::other"], options),
               cuda_compile.cache_key(source, names, options[:-1] + ("--gpu-architecture=compute_80",)),
               cuda_compile.cache_key(source, names, options + ("--generate-line-info",)),
               cuda_compile.cache_key(source, names, options, filename="other.cu")]
    assert key not in changed and len(set(changed)) == len(changed)
