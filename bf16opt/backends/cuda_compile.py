"""Compiling the CUDA kernels of ``cuda_src/`` (shipped as ``bf16opt._cuda``) with NVRTC.

No GPU is needed to compile: the compile test (``tests/test_cuda_compile.py``) and the
CPU emulation (``tests/cuda_emulation``) use these same functions, so what they check is
what the CuPy backend runs.

Why NVRTC is called directly instead of through ``cupy.RawModule(code=...)``: RawModule
appends ``-ftz=true`` to every compilation, and NVRTC lets the last option win.
Flush-to-zero changes results on subnormal values, so the kernels would no longer be
bit-identical to the reference backend.  The instantiations are requested by name
expression (``nvrtcAddNameExpression``).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path
from typing import NamedTuple, Sequence

from ..algorithms import ALGORITHMS

KINDS = tuple(ALGORITHMS)

def source_dir() -> Path:
    """Directory of the shipped CUDA sources (``cuda_src/`` in a checkout)."""
    return Path(str(resources.files("bf16opt._cuda")))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$')


def _inline(path: Path, seen: set) -> list:
    lines = [f'#line 1 "{path.as_posix()}"']
    text = path.read_text().splitlines()
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


# IEEE float32 arithmetic, each operation rounded on its own (DESIGN.md section 3).
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


