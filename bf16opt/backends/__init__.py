"""Backend registry: one picker chooses the implementation for a device.

``"reference"`` is plain torch (the specification), ``"numba"`` runs the CPU kernels of
``cpu_src/``, ``"cupy"`` the CUDA kernels of ``cuda_src/``; ``"auto"`` picks the fastest
one available for the device and falls back to the reference.

A fallback on a CUDA device is visible: the first time in a process that ``"auto"``
settles for the reference on CUDA params, :func:`resolve_backend` issues a
``UserWarning`` naming what is missing and how to install it (once, not at every step:
the optimizer resolves its groups' backends at every full step).  :func:`backend_name`
says which backend a group runs on without warning.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from . import reference
from .base import Backend, Bucket, f32

__all__ = ["BACKEND_NAMES", "Backend", "Bucket", "f32", "backend_name", "check_backend_name",
           "resolve_backend"]

BACKEND_NAMES = ("auto", "reference", "numba", "cupy")

# reasons of the CUDA fallbacks already warned about in this process
_warned: set = set()
_warned_lock = threading.Lock()


def check_backend_name(name) -> None:
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")


def _resolve(name: str, device: torch.device) -> tuple:
    """(backend module, why "auto" fell back to the reference on a CUDA device, or None)."""
    check_backend_name(name)
    device_type = torch.device(device).type
    if name == "numba" or (name == "auto" and device_type == "cpu"):
        from . import numba as numba_backend  # importing it compiles nothing
        if name == "auto" and not numba_backend.available():
            return reference, None
        numba_backend.check_device(device)
        return numba_backend, None
    if name == "cupy" or (name == "auto" and device_type == "cuda"):
        from . import cupy as cupy_backend  # imports CuPy only when checking availability
        if name == "auto":
            try:
                cupy_backend.check_available(device)
            except ValueError as exc:
                return reference, _fallback(device, str(exc), cupy_backend.INSTALL_HINT)
            return cupy_backend, None
        cupy_backend.check_available(device)
        return cupy_backend, None
    if name in ("auto", "reference"):
        return reference, None
    raise ValueError(f"backend={name!r} is not available in this release; use 'reference' or 'auto'")


def _fallback(device, problem: str, hint: str) -> tuple:
    """(key, message) of a fallback warning: one per reason, whichever device hits it first."""
    problem = problem.removeprefix("backend='cupy' is unavailable: ")
    if hint not in problem:
        problem = f"{problem}; {hint}"
    return problem, (f"backend='auto' runs params on {device} on the pure-torch reference backend, "
                     f"much slower than the CUDA kernels: {problem}. Pass backend='reference' to "
                     f"choose it without this warning.")


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend object for ``name`` on ``device``; raises ValueError if unavailable.

    ``"auto"`` on a CUDA device without a working CuPy returns the reference backend and
    warns once per process (a UserWarning naming the missing package and its install).
    """
    backend, fallback = _resolve(name, device)
    if fallback is not None:
        _warn_once(fallback)
    return backend


def backend_name(name: str, device: torch.device) -> str:
    """Name of the backend ``name`` resolves to on ``device`` ("numba", "cupy" or
    "reference"), without warning; raises ValueError as :func:`resolve_backend` does."""
    return _resolve(name, device)[0].name


def _warn_once(fallback: tuple) -> None:
    key, message = fallback
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=_caller_level())


# frames in these directories are skipped: the warning points at the user's line
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                      for path in (os.path.dirname(__file__), torch.__file__))


def _caller_level() -> int:
    """stacklevel of the first frame outside bf16opt and torch (the user's line that built or
    stepped the optimizer), counted from the ``warnings.warn`` call in :func:`_warn_once`."""
    frame, level = sys._getframe(2), 2  # resolve_backend's frame is level 2 of that call
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
