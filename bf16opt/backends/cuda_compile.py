"""Compiling the CUDA kernels of ``cuda_src/`` (shipped as ``bf16opt._cuda``) with NVRTC.

No GPU is needed to compile: the compile test (``tests/test_cuda_compile.py``) and the
CPU emulation (``tests/cuda_emulation``) use these same functions, so what they check is
what the CuPy backend runs.

Why NVRTC is called directly instead of through ``cupy.RawModule(code=...)``: RawModule
appends ``-ftz=true`` to every compilation, and NVRTC lets the last option win.
Flush-to-zero changes results on subnormal values, so the kernels would no longer be
bit-identical to the reference backend.  The instantiations are requested by name
expression (``nvrtcAddNameExpression``).

Compiled programs are kept on disk across processes (:func:`cached_nvrtc_compile`), one
file per (source, options, architecture, NVRTC version, name expressions), in
``$BF16OPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/bf16opt/nvrtc``, else
``~/.cache/bf16opt/nvrtc``.  Entries are written to a temporary file and renamed into
place, so concurrent processes never read a partial entry; an unreadable or damaged entry
is compiled again, and a cache that cannot be written only costs the compile.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from ..algorithms import ALGORITHMS

KINDS = tuple(ALGORITHMS)

log = logging.getLogger(__name__)


def source_dir() -> Path:
    """Directory of the shipped CUDA sources (``cuda_src/`` in a checkout)."""
    return Path(str(resources.files("bf16opt._cuda")))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$')


def _inline(path: Path, seen: set) -> list:
    lines = [f'#line 1 "{path.as_posix()}"']
    text = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(text, start=1):
        match = _INCLUDE.match(line)
        if match is None:
            # inlined once already (``seen``); a kept #pragma once would warn in a main file
            lines.append("" if _PRAGMA_ONCE.match(line) else line)
            continue
        header = (path.parent / match.group(1)).resolve()
        if header not in seen:
            seen.add(header)
            lines.extend(_inline(header, seen))
        lines.append(f'#line {number + 1} "{path.as_posix()}"')
    return lines


@functools.lru_cache(maxsize=None)
def kernel_source(kind: str) -> str:
    """``cuda_src/<kind>.cu`` with its local headers inlined between ``#line`` markers."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    path = (source_dir() / f"{kind}.cu").resolve()
    return "\n".join(_inline(path, {path})) + "\n"


# IEEE float32 arithmetic, each operation rounded on its own (docs/numerics.md).
BASE_COMPILE_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                        "--ftz=false")


def compile_options(arch: str) -> tuple:
    """NVRTC options for ``arch`` (``"sm_90"`` for a cubin, ``"compute_90"`` for PTX)."""
    return BASE_COMPILE_OPTIONS + (f"--gpu-architecture={arch}",)


class CompiledModule(NamedTuple):
    binary: bytes        # cubin for sm_XX, PTX for compute_XX
    lowered: dict        # name expression -> mangled kernel name
    log: str


class CompileError(RuntimeError):
    pass


def nvrtc_compile(source: str, names: Sequence[str], options: Sequence[str],
                  filename: str = "bf16opt.cu") -> CompiledModule:
    """Compile ``source`` with NVRTC, instantiating ``names``; no GPU needed."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, filename, (), ())
    try:
        for expression in names:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, tuple(options))
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed ({exc}) with options {tuple(options)}:\n"
                               f"{nvrtc.getProgramLog(program)}") from None
        log = nvrtc.getProgramLog(program)
        lowered = {expression: nvrtc.getLoweredName(program, expression) for expression in names}
        cubin = any(str(o).split("=")[-1].startswith("sm_") for o in options
                    if str(o).startswith(("--gpu-architecture", "-arch")))
        binary = nvrtc.getCUBIN(program) if cubin else nvrtc.getPTX(program)
        return CompiledModule(bytes(binary), lowered, log)
    finally:
        nvrtc.destroyProgram(program)


def device_arch(compute_capability: int) -> str:
    """NVRTC target for a device: a cubin when NVRTC knows the arch, else PTX for the
    newest arch it knows below it (the driver JIT-compiles PTX)."""
    from cupy_backends.cuda.libs import nvrtc

    supported = sorted(int(a) for a in nvrtc.getSupportedArchs())
    if compute_capability in supported:
        return f"sm_{compute_capability}"
    lower = [a for a in supported if a <= compute_capability]
    if not lower:
        raise ValueError(f"this NVRTC cannot compile for compute capability {compute_capability}")
    return f"compute_{lower[-1]}"




# ---------------------------------------------------------------- on-disk cache
#: bump when the entry layout or what the key covers changes
CACHE_FORMAT = 1
_MAGIC = b"bf16opt-nvrtc-cache\n"

# hits, misses, corrupt (an entry was there but unusable), stores, store_failures
_stats: collections.Counter = collections.Counter()


def cache_stats() -> dict:
    """This process's cache counters (hits, misses, corrupt, stores, store_failures)."""
    return dict(_stats)


def cache_dir() -> Path:
    """Where compiled programs are kept (see the module doc)."""
    explicit = os.environ.get("BF16OPT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "bf16opt" / "nvrtc"


@functools.lru_cache(maxsize=None)
def _nvrtc_version() -> tuple:
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def _arch(options: Sequence[str]) -> str:
    archs = [str(o).split("=", 1)[-1] for o in options
             if str(o).startswith(("--gpu-architecture=", "-arch="))]
    return archs[-1] if archs else ""  # NVRTC lets the last option win


def cache_key(source: str, names: Sequence[str], options: Sequence[str],
              filename: str = "bf16opt.cu") -> str:
    """Hex digest naming the cache entry of one compilation."""
    described = json.dumps({
        "format": CACHE_FORMAT,
        "nvrtc": list(_nvrtc_version()),
        "arch": _arch(options),
        "options": [str(o) for o in options],
        "names": list(names),
        "filename": filename,  # appears in diagnostics and debug info
        "source": hashlib.sha256(source.encode()).hexdigest(),
    }, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


def _encode_entry(key: str, compiled: CompiledModule) -> bytes:
    header = json.dumps({"key": key, "lowered": compiled.lowered, "log": compiled.log,
                         "size": len(compiled.binary),
                         "sha256": hashlib.sha256(compiled.binary).hexdigest()})
    return _MAGIC + header.encode() + b"\n" + compiled.binary


def _decode_entry(data: bytes, key: str, names: Sequence[str]) -> Optional[CompiledModule]:
    """The entry's module, or None if it is not a complete entry for ``key``."""
    if not data.startswith(_MAGIC):
        return None
    header, _, binary = data[len(_MAGIC):].partition(b"\n")
    try:
        fields = json.loads(header)
        if (fields["key"] != key or fields["size"] != len(binary)
                or fields["sha256"] != hashlib.sha256(binary).hexdigest()):
            return None
        return CompiledModule(binary, {n: str(fields["lowered"][n]) for n in names}, str(fields["log"]))
    except (ValueError, KeyError, TypeError):  # not JSON, not a dict, a field missing
        return None


def _read_entry(path: Path, key: str, names: Sequence[str]) -> Optional[CompiledModule]:
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory)
        return None
    except OSError as exc:  # unreadable: compile instead
        log.debug("NVRTC cache entry %s unreadable: %s", path, exc)
        _stats["corrupt"] += 1
        return None
    compiled = _decode_entry(data, key, names)
    if compiled is None:
        log.debug("NVRTC cache entry %s is damaged; compiling again", path)
        _stats["corrupt"] += 1
    return compiled


def _write_entry(path: Path, data: bytes) -> None:
    """Atomically (temporary file in the same directory, then rename); never raises."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        log.debug("NVRTC cache not written (%s): %s", path, exc)
        _stats["store_failures"] += 1
        return
    _stats["stores"] += 1


def cached_nvrtc_compile(source: str, names: Sequence[str], options: Sequence[str],
                         filename: str = "bf16opt.cu") -> CompiledModule:
    """:func:`nvrtc_compile`, served from the on-disk cache when this exact compilation
    (:func:`cache_key`) was done before, by this or any other process."""
    names, options = tuple(names), tuple(str(o) for o in options)
    try:
        key = cache_key(source, names, options, filename)
        path = cache_dir() / f"{key}.nvrtc"
    except (OSError, RuntimeError, KeyError) as exc:  # no home directory: no cache
        log.debug("NVRTC cache unavailable: %s", exc)
        path = None
    if path is not None:
        compiled = _read_entry(path, key, names)
        if compiled is not None:
            _stats["hits"] += 1
            log.debug("NVRTC cache hit %s", path)
            return compiled
    _stats["misses"] += 1
    compiled = nvrtc_compile(source, names, options, filename=filename)
    if path is not None:
        _write_entry(path, _encode_entry(key, compiled))
    return compiled
