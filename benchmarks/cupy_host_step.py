"""Host time of a CuPy group's step, the GPU launch replaced by a no-op (the adapter's execute
hook), so it runs on any machine: what a step costs the host before the GPU sees it.

For each number of params (small tensors, the shapes of a model's many small params), one
optimizer of one group is stepped with fresh grads (as after ``zero_grad`` and backward);
printed: the median host time of ``opt.step()`` on the reused path (the launch kept between
steps, ``step_cache.py``) and on the full path (no launch kept), the reused path per param, and
torch's fused AdamW on the same params on the CPU (its kernels are negligible at these sizes,
so that is its host work; a peer's figure, with kernels, where bf16opt's has none).
The issue's target: <= 0.1 ms for 150 params, flat in the number of params.

    python benchmarks/cupy_host_step.py [--params 16,64,150,300,600] [--steps 200]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import types

import torch

import bf16opt
from bf16opt import step_plan
from bf16opt.backends import cupy as cuda_backend

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.cupy_host_step
    from machine import cpu_name
except ImportError:  # pragma: no cover
    from benchmarks.machine import cpu_name


def no_launch_backend():
    """The cupy adapter with the GPU launch replaced by a no-op."""
    def execute(prepared):
        return None

    return types.SimpleNamespace(
        name="cupy-no-launch",
        run=functools.partial(cuda_backend.run, execute=execute),
        prepare=functools.partial(cuda_backend.prepare, execute=execute),
        relaunch=functools.partial(cuda_backend.relaunch, execute=execute))


def step_times(n_params: int, steps: int, preset: str, reuse: bool) -> list:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64 + 8 * (i % 5), generator=generator).to(torch.bfloat16))
              for i in range(n_params)]
    opt = bf16opt.AdamW(params, lr=1e-3, precision=preset, backend="reference")
    grads = [[torch.randn(p.shape, generator=generator).to(p.dtype) for p in params] for _ in range(2)]
    times = []
    for step in range(steps + 3):
        for param, grad in zip(params, grads[step % 2]):
            param.grad = grad.clone()
        if not reuse:
            opt._group_launches.clear()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[3:]


def torch_step_times(n_params: int, steps: int) -> list:
    """torch.optim.AdamW(fused=True) on the same params on the CPU: with tensors this small its
    kernel time is negligible, so this is its host work per step (a peer's floor, not a no-op)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64 + 8 * (i % 5), generator=generator).to(torch.bfloat16))
              for i in range(n_params)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    grads = [[torch.randn(p.shape, generator=generator).to(p.dtype) for p in params] for _ in range(2)]
    times = []
    for step in range(steps + 3):
        for param, grad in zip(params, grads[step % 2]):
            param.grad = grad.clone()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[3:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="16,64,150,300,600")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--preset", default="bf16")
    args = parser.parse_args(argv)
    step_plan.resolve_backend = lambda name, device: no_launch_backend()  # every group on the no-op adapter
    print(f"# {cpu_name()}; preset {args.preset}; medians of {args.steps} steps (full path: of fewer)")
    print(f"{'params':>7} {'reused ms':>10} {'full ms':>9} {'reused us/param':>16} {'torch fused CPU ms':>19}")
    for n in map(int, args.params.split(",")):
        reused = statistics.median(step_times(n, args.steps, args.preset, True))
        full = statistics.median(step_times(n, max(20, args.steps // 10), args.preset, False))
        fused = statistics.median(torch_step_times(n, args.steps))
        print(f"{n:7d} {reused * 1e3:10.3f} {full * 1e3:9.3f} {reused * 1e6 / n:16.2f} {fused * 1e3:19.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
