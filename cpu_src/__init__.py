"""Numba CPU kernels (installed as ``bf16opt._cpu``).

Kernels here must produce the same bits as the reference backend
(``bf16opt/backends/reference.py``) for every storage configuration.
"""
