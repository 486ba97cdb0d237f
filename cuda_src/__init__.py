"""CUDA C sources of the GPU kernels (installed as ``bf16opt._cuda``, read as package data)."""
