"""Run the CUDA kernels of cuda_src/ on the CPU (see emulator.py)."""
