"""Backend registry: one picker chooses the implementation for a device.

``"reference"`` is plain torch (the specification), ``"numba"`` runs the CPU kernels of
``cpu_src/``, ``"cupy"`` the CUDA kernels of ``cuda_src/``; ``"auto"`` picks the fastest
one available for the device and falls back to the reference.
"""

from __future__ import annotations

import torch

from . import reference
from .base import Backend, Bucket, f32

__all__ = ["BACKEND_NAMES", "Backend", "Bucket", "backend_name", "f32", "check_backend_name", "resolve_backend"]

BACKEND_NAMES = ("auto", "reference", "numba", "cupy")


def check_backend_name(name) -> None:
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend object for ``name`` on ``device``; raises ValueError if unavailable."""
    check_backend_name(name)
    if name == "numba" or (name == "auto" and torch.device(device).type == "cpu"):
        from . import numba as numba_backend  # importing it compiles nothing
        if name == "auto" and not numba_backend.available():
            return reference
        numba_backend.check_device(device)
        return numba_backend
    if name == "cupy" or (name == "auto" and torch.device(device).type == "cuda"):
        from . import cupy as cupy_backend  # imports CuPy only when checking availability
        if name == "auto" and not cupy_backend.is_available(device):
            return reference
        cupy_backend.check_available(device)
        return cupy_backend
    if name in ("auto", "reference"):
        return reference
    raise ValueError(f"backend={name!r} is not available in this release; use 'reference' or 'auto'")


def backend_name(name: str, device: torch.device) -> str:
    """The name of the backend ``name`` resolves to on ``device`` ("numba", "cupy" or "reference")."""
    return resolve_backend(name, device).name
