"""Step time of backend="cupy" per preset, against the memory limit and torch's fused step.

Each row is an optimizer configuration (every precision preset of AdamW on bf16 params, the
q8 ones included, the fp32 preset on fp32 params too, Lion bf16-sr, SGD with momentum
bf16-kahan); each is timed on parameter lists of several shapes:

* ``one``: one tensor of 2^N elements (``--log2-params``, 27 by default);
* ``64``: 64 tensors of 2^(N-6) elements (the same size in many tensors);
* ``gpt2``: the 148 tensors of GPT-2 small (124,439,808 elements);
* ``one-gpt2``: one tensor of GPT-2 small's size (what ``gpt2`` is compared with).

In the same run, for each (row, shape):

* the limit kernel: one launch reading and writing arrays of the same total size and dtypes
  as the step (grad read; param, master copy / Kahan compensation / int16 remainder and the
  moments read and written) with trivial integer math and 16-byte accesses: memory traffic
  and nothing else;
* the row's torch peer over the same params: ``torch.optim.AdamW(fused=True)`` for AdamW,
  ``torch.optim.SGD(fused=True)`` for SGD, none for Lion.  Its states are in the params'
  dtype, so it has the row's storage only for fp32 params with the fp32 preset and bf16
  params with the bf16 preset (column ``same``);
* with ``--track`` (default on), the same step with ``track_precision=True``;
* on a GPU (``--no-graph`` skips it), the same step with ``capturable=True`` captured in a CUDA
  graph, timed as the graph's replays (column ``graph``; ``x eager`` = graph / bf16opt).

Times are medians by CUDA events over ``--repeats`` steps after ``--warmup`` steps.  Columns:
``%limit`` = limit / bf16opt; ``x torch`` = bf16opt / torch fused; ``x one`` = the step over
many tensors / the same row's step over one tensor of equal size; ``x untracked`` = tracked /
untracked.  Targets (issue 37): >= 90% of the limit on one tensor; no slower than torch fused
where the storage is the same; many tensors within 1.15x of one; tracked within 1.2x.

``--out DIR`` writes the table (gpu_step.md) and every figure (gpu_step.json) there.
``--dry-run`` runs the same code on the CPU at a small size with bf16opt's CUDA launch
replaced by a no-op (the adapter's ``execute`` hook) and host timers: it checks the
benchmark, and its bf16opt column is the host time of the CuPy path.

    python benchmarks/gpu_step.py [--log2-params 27] [--shapes one,64,gpt2,one-gpt2] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch


class Row(NamedTuple):
    name: str
    optimizer: str            # bf16opt class name
    param_dtype: torch.dtype
    preset: str
    options: dict
    peer: Optional[str]       # torch.optim class with fused=True, or None
    same: bool                # the peer stores what bf16opt stores


ROWS = [
    Row("AdamW fp32-params / fp32", "AdamW", torch.float32, "fp32", {}, "AdamW", True),
    Row("AdamW fp32", "AdamW", torch.bfloat16, "fp32", {}, "AdamW", False),
    Row("AdamW fp32-remainder", "AdamW", torch.bfloat16, "fp32-remainder", {}, "AdamW", False),
    Row("AdamW fp32-remainder-bf16-states", "AdamW", torch.bfloat16, "fp32-remainder-bf16-states", {},
        "AdamW", False),
    Row("AdamW bf16-states", "AdamW", torch.bfloat16, "bf16-states", {}, "AdamW", False),
    Row("AdamW bf16-master", "AdamW", torch.bfloat16, "bf16-master", {}, "AdamW", False),
    Row("AdamW bf16", "AdamW", torch.bfloat16, "bf16", {}, "AdamW", True),
    Row("AdamW bf16-sr", "AdamW", torch.bfloat16, "bf16-sr", {}, "AdamW", False),
    Row("AdamW bf16-kahan", "AdamW", torch.bfloat16, "bf16-kahan", {}, "AdamW", False),
    Row("AdamW fp32-remainder-q8", "AdamW", torch.bfloat16, "fp32-remainder-q8", {}, "AdamW", False),
    Row("AdamW bf16-sr-q8", "AdamW", torch.bfloat16, "bf16-sr-q8", {}, "AdamW", False),
    Row("Lion bf16-sr", "Lion", torch.bfloat16, "bf16-sr", {}, None, False),
    Row("SGD momentum bf16-kahan", "SGD", torch.bfloat16, "bf16-kahan", dict(momentum=0.9), "SGD", False),
]


def gpt2_small_shapes(divisor: int = 1) -> list:
    """The 148 parameter shapes of GPT-2 small (124,439,808 elements); ``divisor`` shrinks
    every width (a dry run's small stand-in with the same tensor count)."""
    vocab, context, width = 50257 // divisor, 1024 // divisor, 768 // divisor
    layer = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
             (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [(vocab, width), (context, width)] + layer * 12 + [(width,), (width,)]


def shapes_for(name: str, log2: int, divisor: int = 1) -> list:
    if name == "one":
        return [(1 << log2,)]
    if name == "64":
        return [(1 << (log2 - 6),)] * 64
    gpt2 = gpt2_small_shapes(divisor)
    if name == "gpt2":
        return gpt2
    if name == "one-gpt2":
        return [(sum(_numel(s) for s in gpt2),)]
    raise ValueError(f"--shapes: unknown shape {name!r}; choose from {SHAPES}")


SHAPES = ("one", "64", "gpt2", "one-gpt2")
EQUAL_SIZE_ONE = {"64": "one", "gpt2": "one-gpt2"}  # many tensors -> one tensor of equal size


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


LIMIT_SOURCE = r"""
// Trivial math on the same arrays an optimizer step moves: 8 elements per thread per array.
// Q: q8 moments (8 codes of 8 elements: one 8-byte word each; their scales, 1/64 of them, left out).
template <int WP, int WM, int WA, int WS, int Q>   // 16-byte words per 8 elements (0: no array)
__global__ void touch(const uint4* grad, uint4* param, uint4* master, uint4* exp_avg,
                      uint4* exp_avg_sq, uint2* q0, uint2* q1, long long groups) {
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
    if (Q > 0) { uint2 c = q0[i]; c.x += g.x; q0[i] = c; }
    if (Q > 1) { uint2 c = q1[i]; c.y += g.y; q1[i] = c; }
  }
}
"""


# ---------------------------------------------------------------- timing
def cuda_timer(fn: Callable, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
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


def host_timer(fn: Callable, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` by the host clock (the dry run's stand-in)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


# ---------------------------------------------------------------- the limit kernel
def limit_arrays(params: list, state: dict) -> list:
    """Flat arrays of the step's total size and dtypes: grad, param, then each per-element state
    buffer (master / compensation / remainder, moments) of the first param's state, then its q8
    moments as one byte per element (uint8)."""
    total = sum(p.numel() for p in params)
    device, first = params[0].device, params[0]
    tensors = [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0]
    states = [v.dtype for v in tensors if v.numel() == first.numel()]
    q8 = [v for v in tensors if v.dtype == torch.uint8 and v.dim() == 2 and v.shape[1] == 260]
    if len(states) > 3 or len(q8) > 2:
        raise ValueError(f"the limit kernel takes at most 3 state buffers and 2 q8 moments, the state has "
                         f"{len(states)} and {len(q8)}")
    dtypes = [first.dtype, first.dtype] + states + [torch.uint8] * len(q8)
    return [torch.zeros(total, dtype=dtype, device=device) for dtype in dtypes]


def cuda_limit(arrays: list) -> Callable:
    import cupy
    import numpy as np

    from bf16opt.backends import cupy as cupy_backend

    grad, param, *rest = arrays
    states = [t for t in rest if t.dtype != torch.uint8]
    q8 = [t for t in rest if t.dtype == torch.uint8]
    states += [None] * (3 - len(states))

    def words(t):
        return 0 if t is None else t.element_size() * 8 // 16

    name = f"touch<{words(param)}, {words(states[0])}, {words(states[1])}, {words(states[2])}, {len(q8)}>"
    kernel = _limit_module(name).get_function(name)
    groups = param.numel() // 8  # (every shape here is a multiple of 8 elements)
    stream = cupy_backend.cupy_stream(cupy, torch.cuda.current_stream())

    def ptr(t):
        return np.uint64(0 if t is None else t.data_ptr())

    def run():
        with stream:
            kernel((min((groups + 255) // 256, 65535 * 8),), (256,),
                   (ptr(grad), ptr(param), *(ptr(s) for s in states), *(ptr(q) for q in q8 + [None] * (2 - len(q8))),
                    np.int64(groups)))
    return run


@functools.lru_cache(maxsize=None)
def _limit_module(name: str):
    import cupy

    return cupy.RawModule(code=LIMIT_SOURCE, options=("--std=c++17",), name_expressions=[name])


def host_limit(arrays: list) -> Callable:
    """The dry run's stand-in: the same arrays read and written by torch on the CPU."""
    grad, *written = arrays

    def run():
        for array in written:
            array.add_(grad.to(array.dtype) if array.dtype not in (torch.int16, torch.uint8) else 1)
    return run


# ---------------------------------------------------------------- one measurement
class Bench(NamedTuple):
    device: str
    timer: Callable
    limit: Callable
    warmup: int
    repeats: int


def make_params(shapes: list, dtype: torch.dtype, device: str, seed: int = 0) -> list:
    generator = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, device=device).to(dtype))
        param.grad = (torch.randn(shape, generator=generator, device=device) * 1e-3).to(dtype)
        params.append(param)
    return params


def bf16opt_time(bench: Bench, row: Row, params: list, track: bool) -> tuple:
    """(median ms, the first param's state) of the row's bf16opt step over ``params``."""
    import bf16opt

    opt = getattr(bf16opt, row.optimizer)(params, lr=1e-4, precision=row.preset, backend="cupy",
                                          track_precision=track, **row.options)
    opt.step()  # creates the state, compiles or loads the kernel
    ms = bench.timer(opt.step, bench.warmup, bench.repeats)
    state = dict(opt.state[params[0]])
    del opt
    return ms, state


def graph_time(bench: Bench, row: Row, params: list) -> Optional[float]:
    """Median ms of the row's capturable=True step replayed from a CUDA graph (None off a GPU)."""
    if bench.device != "cuda":
        return None
    import bf16opt

    lr = torch.tensor(1e-4, dtype=torch.float64, device="cuda")
    opt = getattr(bf16opt, row.optimizer)(params, lr=lr, precision=row.preset, backend="cupy", capturable=True,
                                          **row.options)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps: state, kernels, room for the captured tables
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    ms = bench.timer(graph.replay, bench.warmup, bench.repeats)
    del graph, opt
    return ms


def peer_time(bench: Bench, row: Row, params: list) -> Optional[float]:
    if row.peer is None:
        return None
    options = dict(row.options) if row.peer == "SGD" else {}
    opt = getattr(torch.optim, row.peer)(params, lr=1e-4, fused=True, **options)
    opt.step()
    ms = bench.timer(opt.step, bench.warmup, bench.repeats)
    del opt
    return ms


def measure(bench: Bench, row: Row, shape_name: str, shapes: list, track: bool, graph: bool = True) -> dict:
    params = make_params(shapes, row.param_dtype, bench.device)
    ours, state = bf16opt_time(bench, row, params, track=False)
    arrays = limit_arrays(params, state)
    del state
    limit = bench.timer(bench.limit(arrays), bench.warmup, bench.repeats)
    del arrays
    tracked = bf16opt_time(bench, row, params, track=True)[0] if track else None
    peer = peer_time(bench, row, params)
    graphed = graph_time(bench, row, params) if graph else None
    figures = dict(row=row.name, shape=shape_name, tensors=len(shapes), params=sum(_numel(s) for s in shapes),
                   limit_ms=limit, bf16opt_ms=ours, tracked_ms=tracked, torch_fused_ms=peer,
                   torch_same_storage=row.same and peer is not None, graph_ms=graphed)
    del params
    gc.collect()
    if bench.device == "cuda":
        torch.cuda.empty_cache()
    return figures


# ---------------------------------------------------------------- the table
def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def with_ratios(results: list) -> list:
    """Each result with its ratios: %limit, x torch, x untracked, x one (equal-size one tensor)."""
    by_key = {(r["row"], r["shape"]): r for r in results}
    out = []
    for r in results:
        one = by_key.get((r["row"], EQUAL_SIZE_ONE.get(r["shape"])))
        out.append({**r, "of_limit": ratio(r["limit_ms"], r["bf16opt_ms"]),
                    "vs_torch": ratio(r["bf16opt_ms"], r["torch_fused_ms"]),
                    "tracked_vs_untracked": ratio(r["tracked_ms"], r["bf16opt_ms"]),
                    "graph_vs_eager": ratio(r.get("graph_ms"), r["bf16opt_ms"]),
                    "vs_one_tensor": ratio(r["bf16opt_ms"], one["bf16opt_ms"]) if one else None})
    return out


COLUMNS = [("shape", "{}"), ("configuration", "{}"), ("limit", "{:.3f}"), ("bf16opt", "{:.3f}"),
           ("%limit", "{:.0%}"), ("tracked", "{:.3f}"), ("x untracked", "{:.2f}"), ("torch fused", "{:.3f}"),
           ("x torch", "{:.2f}"), ("same", "{}"), ("x one", "{:.2f}"), ("graph", "{:.3f}"), ("x eager", "{:.2f}")]
KEYS = ["shape", "row", "limit_ms", "bf16opt_ms", "of_limit", "tracked_ms", "tracked_vs_untracked",
        "torch_fused_ms", "vs_torch", "torch_same_storage", "vs_one_tensor", "graph_ms", "graph_vs_eager"]


def table(results: list, title: str) -> str:
    lines = [title, "", "| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    for r in results:
        cells = []
        for (name, form), key in zip(COLUMNS, KEYS):
            value = r.get(key)
            if key == "torch_same_storage":
                value = ("yes" if value else "no") if r["torch_fused_ms"] is not None else None
            cells.append("–" if value is None else form.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the dry run's backend
def no_op_cupy_backend():
    """Make backend='cupy' run its whole host path on CPU tensors with the launch a no-op."""
    import types

    import bf16opt.optimizer as optimizer_module
    import bf16opt.step_plan as step_plan
    from bf16opt.backends import cupy as cupy_backend

    def no_op(prepared):
        return None

    fake = types.SimpleNamespace(
        name="cupy", run=functools.partial(cupy_backend.run, execute=no_op),
        prepare=functools.partial(cupy_backend.prepare, execute=no_op),
        relaunch=functools.partial(cupy_backend.relaunch, execute=no_op))
    for module in (optimizer_module, step_plan):  # (construction's checks, and each full step)
        resolve = module.resolve_backend
        module.resolve_backend = lambda name, device, resolve=resolve: \
            fake if name == "cupy" else resolve(name, device)


# ---------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--log2-params", type=int, default=None,
                        help="size of the 'one' and '64' shapes (default 27; 14 with --dry-run)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="",
                        help="only rows whose name contains one of these (comma-separated)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per figure (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--no-track", action="store_true", help="skip the track_precision=True steps")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replays (capturable=True)")
    parser.add_argument("--out", type=Path, default=None, help="directory for gpu_step.md and gpu_step.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: CPU tensors, no-op launches, host timers, a small size")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        parser.error(f"--shapes: unknown {unknown or 'empty list'}; choose from {', '.join(SHAPES)}")
    args.shapes = shapes
    if args.log2_params is None:
        args.log2_params = 14 if args.dry_run else 27
    if not 6 <= args.log2_params <= 32:
        parser.error(f"--log2-params must be in [6, 32], got {args.log2_params}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def row_kernels(row: Row) -> set:
    """(kind, kernel name) of what a row launches: untracked, tracked and live (capturable), for
    large params and small ones (a q8 preset keeps small params' moments in 16 or 32 bits)."""
    import bf16opt
    from bf16opt.algorithms import kernel_config
    from bf16opt.backends import cupy as cupy_backend
    from bf16opt.precision import as_precision, plan_for

    algorithm = getattr(bf16opt, row.optimizer).algorithm
    template = {"amsgrad": False, "momentum": row.options.get("momentum", 0.0) != 0.0}
    flags = tuple((name, template[name]) for name in algorithm.template_flags)
    kernels = set()
    for numel in (1 << 20, 64):
        plan = plan_for(as_precision(row.preset), row.param_dtype, numel)
        for track, live in ((False, False), (True, False), (False, True)):
            kernels.add((algorithm.name, cupy_backend.kernel_name(kernel_config(algorithm, plan, flags, track), live)))
    return kernels


def _compile_for_the_loader(kind: str, expression: str, arch: str) -> None:
    from bf16opt.backends import cuda_compile

    cuda_compile.cached_nvrtc_compile(cuda_compile.kernel_source(kind), [expression],
                                      cuda_compile.compile_options(arch), filename=f"{kind}.cu")


def precompile(rows: list) -> None:
    """Compile the rows' kernels side by side in worker processes, into the on-disk NVRTC cache
    the adapter's loader reads (one after the other in the measurements: minutes)."""
    import concurrent.futures
    import multiprocessing
    import os

    import cupy
    from bf16opt.backends import cuda_compile

    arch = cuda_compile.device_arch(int(cupy.cuda.Device(torch.cuda.current_device()).compute_capability))
    jobs = sorted({kernel for row in rows for kernel in row_kernels(row)})
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_for_the_loader, *zip(*[(kind, expression, arch) for kind, expression in jobs])))


def cuda_problem() -> Optional[str]:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    from bf16opt.backends import cupy as cupy_backend

    try:
        cupy_backend.check_available(torch.device("cuda"))
    except ValueError as exc:
        return str(exc)
    return None


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        no_op_cupy_backend()
        bench = Bench("cpu", host_timer, host_limit, args.warmup, args.repeats)
        title = (f"gpu_step --dry-run (CPU, no-op launches, host clock: the benchmark's logic and the "
                 f"CuPy path's host time, not GPU figures); median ms of {args.repeats} steps")
        divisor = 16
    else:
        problem = cuda_problem()
        if problem is not None:
            print(f"gpu_step: {problem}; --dry-run checks the benchmark on the CPU", file=sys.stderr)
            return 2
        bench = Bench("cuda", cuda_timer, cuda_limit, args.warmup, args.repeats)
        title = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}: median ms of {args.repeats} "
                 f"steps by CUDA events after {args.warmup} warm-up steps")
        divisor = 1
    wanted = [s.strip() for s in args.rows.split(",") if s.strip()]
    rows = [row for row in ROWS if not wanted or any(w in row.name for w in wanted)]
    if not rows:
        print(f"gpu_step: --rows {args.rows!r} matches no row", file=sys.stderr)
        return 2
    print(title, flush=True)
    if not args.dry_run:
        precompile(rows)
    results = []
    for shape_name in args.shapes:
        shapes = shapes_for(shape_name, args.log2_params, divisor)
        for row in rows:
            results.append(measure(bench, row, shape_name, shapes, track=not args.no_track,
                                   graph=not args.no_graph))
            r = results[-1]
            peer = r["torch_fused_ms"] if r["torch_fused_ms"] is not None else float("nan")
            print(f"  {shape_name:8s} {row.name:34s} limit {r['limit_ms']:8.3f}  "
                  f"bf16opt {r['bf16opt_ms']:8.3f}  torch {peer:8.3f}", flush=True)
            if args.out is not None:  # after each figure: a run cut short keeps what it measured
                write(args.out, title, args, with_ratios(results))
    print("\n" + table(with_ratios(results), title))
    return 0


def write(out: Path, title: str, args: argparse.Namespace, results: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.md").write_text(table(results, title))
    (out / "gpu_step.json").write_text(json.dumps(
        dict(title=title, log2_params=args.log2_params, dry_run=args.dry_run, results=results), indent=1))


if __name__ == "__main__":
    sys.exit(main())
