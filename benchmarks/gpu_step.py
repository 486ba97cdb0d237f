"""Step time of backend="cupy" per preset, against the memory-bound limit and torch.

For each preset, 2**28 bfloat16 parameters (fp32 for the "fp32-params" row) are
updated by ``bf16opt.AdamW(..., backend="cupy")``.  In the same run it times

* the limit kernel: one launch reading and writing the same arrays with the same dtypes
  (grad read; param, master copy / Kahan compensation / int16 remainder, exp_avg,
  exp_avg_sq read and written) with trivial integer
  math, vectorised 16-byte accesses, so nothing but memory traffic;
* ``torch.optim.AdamW(fused=True)`` on the equivalent configuration where torch has one
  (fp32 params and states; bf16 params and states), else "n/a".

Prints medians (CUDA events) and each step time as a fraction of the limit kernel.
Targets (issue 4): >= 90% of the limit kernel; never slower than torch's fused AdamW.

    python benchmarks/gpu_step.py [--log2-params 28] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

PRESETS = [  # (row name, param dtype, precision preset, optimizer options)
    ("fp32-params / fp32", torch.float32, "fp32", {}),
    ("bf16-params / fp32", torch.bfloat16, "fp32", {}),
    ("bf16-params / bf16-states", torch.bfloat16, "bf16-states", {}),
    ("bf16-params / bf16-master", torch.bfloat16, "bf16-master", {}),
    ("bf16-params / bf16", torch.bfloat16, "bf16", {}),
    ("bf16-params / bf16 +track", torch.bfloat16, "bf16", dict(track_precision=True)),
    ("bf16-params / bf16-sr", torch.bfloat16, "bf16-sr", {}),
    ("bf16-params / bf16-kahan", torch.bfloat16, "bf16-kahan", {}),
    ("bf16-params / fp32-remainder", torch.bfloat16, "fp32-remainder", {}),
]

LIMIT_SOURCE = r"""
// Trivial math on the same arrays an Adam step moves: 8 elements per thread per array.
template <int WP, int WM, int WA, int WS>   // 16-byte words per 8 elements (0: no array)
__global__ void touch(const uint4* grad, uint4* param, uint4* master, uint4* exp_avg,
                      uint4* exp_avg_sq, long long groups) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups;
       i += (long long)gridDim.x * blockDim.x) {
    const uint4 g = grad[i * WP];
    const uint4 g1 = WP == 2 ? grad[i * WP + 1] : g;  // fp32 grads: 2 words per 8 elements
    #pragma unroll
    for (int k = 0; k < WP; ++k) { uint4 p = param[i * WP + k]; p.x += (k ? g1.x : g.x); p.y += g.y; param[i * WP + k] = p; }
    #pragma unroll
    for (int k = 0; k < WM; ++k) { uint4 p = master[i * WM + k]; p.x += g.x; p.w += g.w; master[i * WM + k] = p; }
    #pragma unroll
    for (int k = 0; k < WA; ++k) { uint4 p = exp_avg[i * WA + k]; p.y += g.y; p.z += g.z; exp_avg[i * WA + k] = p; }
    #pragma unroll
    for (int k = 0; k < WS; ++k) { uint4 p = exp_avg_sq[i * WS + k]; p.z += g.z; p.w += g.w; exp_avg_sq[i * WS + k] = p; }
  }
}
"""


def cuda_time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def limit_kernel(param, grad, master, exp_avg, exp_avg_sq):
    import cupy
    import numpy as np

    def words(t):
        return 0 if t is None else t.element_size() * 8 // 16

    name = (f"touch<{words(param)}, {words(master)}, {words(exp_avg)}, {words(exp_avg_sq)}>")
    module = cupy.RawModule(code=LIMIT_SOURCE, options=("--std=c++17",), name_expressions=[name])
    kernel = module.get_function(name)
    groups = param.numel() // 8
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def ptr(t):
        return np.uint64(0 if t is None else t.data_ptr())

    def run():
        with stream:
            kernel((min((groups + 255) // 256, 65535 * 8),), (256,),
                   (ptr(grad), ptr(param), ptr(master), ptr(exp_avg), ptr(exp_avg_sq),
                    np.int64(groups)))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-params", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 1
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("gpu_step: CuPy is not installed; pip install cupy-cuda12x or cupy-cuda13x "
              "(in the checkout: pip install '.[cuda12]' or '.[cuda13]').")
        return 1
    import bf16opt

    n = 1 << args.log2_params
    print(f"{torch.cuda.get_device_name()}, {n:,} params, median of {args.repeats} steps (ms)")
    print(f"{'configuration':28s} {'limit':>8s} {'bf16opt':>8s} {'%limit':>7s} {'torch fused':>12s}")
    for row, param_dtype, preset, options in PRESETS:
        param = torch.nn.Parameter(torch.randn(n, device="cuda").to(param_dtype))
        param.grad = (torch.randn(n, device="cuda") * 1e-3).to(param_dtype)
        opt = bf16opt.AdamW([param], lr=1e-4, precision=preset, backend="cupy", **options)
        opt.step()  # creates state, compiles the kernel
        state = opt.state[param]
        ours = cuda_time(opt.step, args.repeats)
        companion = next((state[k] for k in ("master", "compensation", "remainder") if k in state), None)
        limit = cuda_time(limit_kernel(param.data, param.grad, companion,
                                       state["exp_avg"], state["exp_avg_sq"]), args.repeats)
        del opt, state, companion
        torch_ms = "n/a"
        equivalent = (param_dtype == torch.float32 and preset == "fp32") or (preset == "bf16" and not options)
        if equivalent:
            reference = torch.optim.AdamW([param], lr=1e-4, fused=True)
            torch_ms = f"{cuda_time(reference.step, args.repeats):12.2f}"
            del reference
        print(f"{row:28s} {limit:8.2f} {ours:8.2f} {limit / ours:7.0%} {torch_ms:>12s}")
        del param
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
