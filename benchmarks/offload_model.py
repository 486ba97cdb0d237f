"""CPU offload on a model: the iteration against its parts, and the pipeline on the timeline.

Run:  python benchmarks/offload_model.py [--layers 16 --dim 4096] [--presets bf16,fp32] [--trace t.json]

The model of issue 38: ``--layers`` bf16 ``Linear(dim, dim, bias=False)``, an input of ``--batch``
rows (``dim`` on CUDA, as in the issue; 128 on CPU, whose matmuls would bury the step), loss
``out.float().pow(2).mean()``.  One iteration = forward, backward, ``opt.step()``,
``opt.zero_grad(set_to_none=True)``, synchronize; medians of ``--repeats`` after ``--warmup``.

Per AdamW preset it prints the iteration with state on the device (``offload=None``) and with
``offload="cpu"``, forward+backward alone, the host update alone (the same sizes on host
buffers, ``--threads`` threads), the link alone (every param host->device, every grad
device->host), the exposed time (offloaded iteration - forward+backward) and its ratio to
max(host update, host->device), and the peak GPU memory.  On CUDA, torchao's
``CPUOffloadOptimizer`` too where torchao is installed (an optional peer).

Then the pipeline as the profiler sees it (``bf16opt.offload.PHASES``): per step and per chunk,
the host kernels (on the update thread), the calling thread asleep while they run, and its own
host work (the uploads it enqueues, the Python around them); and, without a profiler, the
per-chunk host overhead: (step at 4x the chunks - step) / the extra chunks.
``--trace PATH`` writes a Chrome/Perfetto trace of the first preset's offloaded iterations.

Without a GPU the device is the CPU and the link a stand-in: a ``ThreadedCopyEngine`` throttled
to ``--bandwidth`` bytes/s each way, whose copies take this machine's cores (a GPU's DMA engines
do not), and ``--chunk`` defaults to as many chunks as the issue's GPU model has (64).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import bf16opt
from bf16opt.offload import PHASES, default_threads, host_threads, use_copy_engine
from bf16opt.offload_copies import ThreadedCopyEngine, engine_for, phase

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.offload_model
    from machine import cpu_name
except ImportError:  # pragma: no cover
    from benchmarks.machine import cpu_name

PRESETS = "bf16,bf16-sr,fp32-remainder-bf16-states,fp32,fp32-remainder-q8"
GiB = 1 << 30


def parse(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--dim", type=int, default=None, help="default: 4096 on CUDA, 1024 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="input rows; default: dim on CUDA, 128 on CPU")
    parser.add_argument("--presets", default=PRESETS, help=f"comma-separated AdamW presets (default {PRESETS})")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="offload_threads (default: the "
                        "package's: all cores of the process, less one on CUDA)")
    parser.add_argument("--chunk", type=int, default=None, help="pipeline chunk, elements (default: the "
                        "package's on CUDA; params/64 on CPU)")
    parser.add_argument("--bandwidth", type=float, default=25e9, help="CPU stand-in link, bytes/s each way")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: "
                        "1 on CPU, where they stand in for the GPU's work, else torch's)")
    parser.add_argument("--profile-steps", type=int, default=3, help="offloaded iterations profiled per preset")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the first preset")
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao's CPUOffloadOptimizer")
    parser.add_argument("--thread-sweep", action="store_true", help="the first preset's offloaded iteration and "
                        "host update alone with every core, one fewer and two fewer (the default's choice)")
    args = parser.parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    args.layers = args.layers or (16 if on_cuda else 4)
    args.dim = args.dim or (4096 if on_cuda else 1024)
    args.batch = args.batch or (args.dim if on_cuda else 128)
    if args.chunk is None and not on_cuda:
        args.chunk = max(1, args.layers * args.dim * args.dim // 64)
    if args.torch_threads is None and not on_cuda:
        args.torch_threads = 1  # on shared cores, torch's 2-thread barriers cost 10x (docs/performance.md)
    return args


# ---------------------------------------------------------------- the model and its iteration

def make_model(args, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)]
    return torch.nn.Sequential(*layers).to(device=args.device, dtype=torch.bfloat16)


def make_input(args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.dim, generator=generator).to(device=args.device, dtype=torch.bfloat16)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def iteration(model, x, opt) -> None:
    """Forward, backward, step, zero_grad, synchronize (no optimizer: the grads are dropped)."""
    model(x).float().pow(2).mean().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None
    synchronize(x.device)


def medians_in_turn(first, second, warmup: int, repeats: int) -> tuple:
    """(median seconds of ``first``, of ``second``), each run in turn with the other: the
    difference holds where the machine's load drifts (the stand-in's cores are shared)."""
    for _ in range(warmup):
        first()
        second()
    samples: tuple = ([], [])
    for _ in range(repeats):
        for function, times in zip((first, second), samples):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


def median_time(function, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fresh_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / GiB if torch.device(device).type == "cuda" else None


def offloaded(model, args, preset: str, threads=None):
    """``offload="cpu"`` with ``threads`` (default ``--threads``) host threads; on CPU through the
    stand-in link (its engine returned to close)."""
    opt = bf16opt.AdamW(model.parameters(), lr=1e-4, precision=preset, offload="cpu",
                        offload_threads=threads or args.threads)
    engine = None
    if torch.device(args.device).type == "cpu":
        engine = ThreadedCopyEngine(bandwidth=args.bandwidth)
        use_copy_engine(opt, engine)
    if args.chunk is not None:
        opt._offloader.chunk_elements = args.chunk
    return opt, engine


def contender(args, make_opt) -> tuple:
    """(median iteration seconds, peak GPU GiB) of a fresh model with ``make_opt(model)``'s optimizer."""
    fresh_memory(args.device)
    model, x = make_model(args), make_input(args)
    opt = make_opt(model)
    with host_threads(args.threads):  # a CPU step uses the offloaded step's thread count
        seconds = median_time(lambda: iteration(model, x, opt), args.warmup, args.repeats)
    peak = peak_gib(args.device)
    del model, x, opt
    return seconds, peak


def exposed_in_turn(args, model, x, opt) -> tuple:
    """(iteration, forward+backward alone), medians of seconds, timed in turn on ``model`` with
    ``opt`` and a plain copy of the model (made after the peak memory was read)."""
    plain = make_model(args)
    with host_threads(args.threads):
        return medians_in_turn(lambda: iteration(model, x, opt), lambda: iteration(plain, x, None),
                               args.warmup, args.repeats)


def device_contender(args, preset: str) -> tuple:
    """(iteration, forward+backward alone in turn, peak GPU GiB): state on the device."""
    fresh_memory(args.device)
    model, x = make_model(args), make_input(args)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-4, precision=preset)
    with host_threads(args.threads):
        median_time(lambda: iteration(model, x, opt), args.warmup, 1)
    peak = peak_gib(args.device)
    return (*exposed_in_turn(args, model, x, opt), peak)


# ---------------------------------------------------------------- the parts alone

def host_update_alone(args, preset: str, threads=None) -> float:
    """The host update over the model's sizes on host buffers, no copies (``threads``, default
    ``--threads``, else the offloaded step's default)."""
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(args.dim, args.dim, generator=generator).to(torch.bfloat16))
              for _ in range(args.layers)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).mul(1e-2).to(p.dtype)
    opt = bf16opt.AdamW(params, lr=1e-4, precision=preset)
    with host_threads(threads or args.threads, args.device):  # the offloaded step's threads
        return median_time(opt.step, args.warmup, args.repeats)


def link_alone(args) -> tuple:
    """(host->device of every param, device->host of every grad), seconds, on the link the
    offloaded step uses (page-locked buffers on CUDA; the stand-in on CPU)."""
    cpu = torch.device(args.device).type == "cpu"
    engine = ThreadedCopyEngine(bandwidth=args.bandwidth) if cpu else engine_for(args.device)
    shape = (args.dim, args.dim)
    device = [torch.zeros(shape, dtype=torch.bfloat16, device=args.device) for _ in range(args.layers)]
    host = [engine.host_empty(shape, torch.bfloat16).zero_() for _ in range(args.layers)]

    def copies(upward: bool):
        transfers = [engine.to_device(d, h) if upward else engine.to_host(h, d) for d, h in zip(device, host)]
        engine.publish(transfers)
        for t in transfers:
            t.wait()
        synchronize(args.device)

    up = median_time(lambda: copies(True), args.warmup, args.repeats)
    down = median_time(lambda: copies(False), args.warmup, args.repeats)
    engine.close()
    return up, down


# ---------------------------------------------------------------- the pipeline on the timeline

def all_threads():
    """Profiler options recording every thread (the stand-in's copy workers), where torch has them."""
    try:
        from torch._C._profiler import _ExperimentalConfig  # noqa: PLC0415
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


def activities(device) -> list:
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    return kinds


def profiled(args, model, x, opt, trace=None) -> dict:
    """Per-step totals (seconds) and counts of each bf16opt range over ``--profile-steps``
    offloaded iterations; the trace written to ``trace`` when given."""
    with torch.profiler.profile(activities=activities(args.device), **all_threads()) as prof:
        for _ in range(args.profile_steps):
            iteration(model, x, opt)
    if trace:
        prof.export_chrome_trace(trace)
    totals, counts = {}, {}
    for event in prof.events():
        if event.name.startswith(("bf16opt.", "Optimizer.step#")):
            name = "step" if event.name.startswith("Optimizer.step#") else event.name
            totals[name] = totals.get(name, 0.0) + event.time_range.elapsed_us() * 1e-6 / args.profile_steps
            counts[name] = counts.get(name, 0) + 1 / args.profile_steps
    return {"seconds": totals, "counts": counts}


def range_cost(args) -> float:
    """Seconds one profiled range adds (record_function's own cost; it inflates the breakdown)."""
    n = 2000
    with torch.profiler.profile(activities=activities(args.device)):
        start = time.perf_counter()
        for _ in range(n):
            with phase("bf16opt.calibration"):
                pass
        return (time.perf_counter() - start) / n


def breakdown(profile: dict) -> dict:
    """The pipeline's time per step: its wall time on the driving thread (the caller of step()),
    the host kernels (on the update thread), the driving thread asleep while they run, and the
    driving thread's own host work -- the uploads it enqueues and the Python around them --
    in all and per chunk."""
    t, n = profile["seconds"], profile["counts"]

    def get(key):
        return t.get(PHASES[key], 0.0)

    chunks = max(1, profile["chunks"])
    waits = get("upload_wait") + get("publish")
    driving = get("pipeline") - get("update_wait") - waits  # host work of the driving thread
    return {
        "step": t.get("step", 0.0), "recheck": get("recheck"), "prepare": get("prepare"),
        "pipeline": get("pipeline"), "kernels": get("host_update"), "asleep": get("update_wait"),
        "waits": waits, "driving": driving, "chunks": chunks, "turns": n.get(PHASES["chunk"], 0.0), "beyond_kernels": get("pipeline") - get("host_update"),
        "per_chunk": {"driving": driving / chunks, "upload": get("upload") / chunks,
                      "mirror_print": get("mirror_print") / chunks, "grad_wait": get("grad_wait") / chunks},
    }


# ---------------------------------------------------------------- contenders and the report

def offload_contender(args, preset: str, trace=None) -> tuple:
    """(median iteration seconds, forward+backward alone timed in turn, peak GPU GiB, profile,
    per-chunk seconds) of the offloaded model."""
    fresh_memory(args.device)
    model, x = make_model(args), make_input(args)
    opt, engine = offloaded(model, args, preset)
    median_time(lambda: iteration(model, x, opt), args.warmup, 1)
    peak = peak_gib(args.device)
    seconds, fwd_bwd = exposed_in_turn(args, model, x, opt)
    profile = profiled(args, model, x, opt, trace)
    profile["chunks"] = sum(-(-p.numel() // opt._offloader.chunk_elements) for p in model.parameters())
    model(x).float().pow(2).mean().backward()
    per_chunk = chunk_slope(args, opt)
    if engine is not None:
        engine.close()
    return seconds, fwd_bwd, peak, profile, per_chunk


def chunk_slope(args, opt) -> float:
    """Seconds a step spends per chunk beyond the work itself, without a profiler: the step's
    time at 4x the chunks less its time at the chunk size, per extra chunk (same grads)."""
    offloader = opt._offloader
    chunk = offloader.chunk_elements
    small = max(1, chunk // 4)
    chunks = [-(-args.dim * args.dim // c) * args.layers for c in (chunk, small)]
    times = {chunk: [], small: []}

    def step():
        opt.step()
        synchronize(args.device)

    for _ in range(args.repeats + 1):  # interleaved: the machine's load drifts
        for size in (chunk, small):
            offloader.chunk_elements = size
            times[size].append(median_time(step, 0, 1))
    offloader.chunk_elements = chunk
    return (statistics.median(times[small][1:]) - statistics.median(times[chunk][1:])) / (chunks[1] - chunks[0])


def torchao_rows(args) -> list:
    """(name, seconds, peak GiB) of torchao's CPUOffloadOptimizer on CUDA, where installed."""
    if args.no_torchao or torch.device(args.device).type != "cuda":
        return []
    try:
        from torchao.optim import CPUOffloadOptimizer  # noqa: PLC0415  (an optional peer)
    except ImportError:
        print("torchao: not installed (its CPUOffloadOptimizer is not measured)")
        return []
    rows = []
    for gradients in (False, True):
        name = f"torchao CPUOffloadOptimizer(AdamW, fused){', offload_gradients' if gradients else ''}"
        try:
            seconds, peak = contender(args, lambda m: CPUOffloadOptimizer(
                m.parameters(), torch.optim.AdamW, offload_gradients=gradients, fused=True, lr=1e-4))
        except Exception as exc:  # noqa: BLE001 -- a peer's API drift must not end the run
            print(f"{name}: failed ({type(exc).__name__}: {exc})")
            continue
        rows.append((name, seconds, peak))
    return rows


def gib(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def header(args) -> str:
    params = args.layers * args.dim * args.dim
    device = torch.device(args.device)
    where = (f"{torch.cuda.get_device_name(device)} (host: {cpu_name()})" if device.type == "cuda" else
             f"CPU stand-in: {cpu_name()}; link {args.bandwidth / 1e9:g} GB/s each way (ThreadedCopyEngine)")
    return (f"bf16opt offload on a model: {args.layers} x bf16 Linear({args.dim}, {args.dim}, bias=False) "
            f"({params / 1e6:.1f}M params), input {args.batch} x {args.dim}; AdamW; {where}; "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads); chunk {args.chunk or 'default'} elements; offload_threads "
            f"{args.threads or f'default ({default_threads(args.device)})'}; medians of {args.repeats} after {args.warmup}")


def main(argv=None) -> None:
    args = parse(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    presets = [p for p in args.presets.split(",") if p]
    print(header(args), flush=True)
    fwd_bwd, fwd_peak = contender(args, lambda m: None)
    up, down = link_alone(args)
    print(f"forward+backward alone {1e3 * fwd_bwd:.1f} ms (peak GPU GiB {gib(fwd_peak)}); link alone: "
          f"host->device {1e3 * up:.1f} ms, device->host {1e3 * down:.1f} ms\n")
    print(f"{'ms':34s} {'iteration':>9s} {'exposed':>8s} {'host alone':>10s} {'exp/max':>7s} {'peak GiB':>8s}")
    profiles = {}
    for number, preset in enumerate(presets):
        on_device, device_fwd_bwd, device_peak = device_contender(args, preset)
        seconds, offload_fwd_bwd, peak, profile, per_chunk = offload_contender(
            args, preset, args.trace if number == 0 else None)
        profiles[preset] = (profile, per_chunk)
        host = host_update_alone(args, preset)
        exposed = seconds - offload_fwd_bwd
        print(f"{preset + ', state on the device':34s} {1e3 * on_device:9.1f} "
              f"{1e3 * (on_device - device_fwd_bwd):8.1f} {'':10s} {'':7s} {gib(device_peak):>8s}")
        print(f"{preset + ', offload=cpu':34s} {1e3 * seconds:9.1f} {1e3 * exposed:8.1f} {1e3 * host:10.1f} "
              f"{exposed / max(host, up):7.2f} {gib(peak):>8s}", flush=True)
        gc.collect()
    for name, seconds, peak in torchao_rows(args):
        print(f"{name:34s} {1e3 * seconds:9.1f} {1e3 * (seconds - fwd_bwd):8.1f} {'':10s} {'':7s} {gib(peak):>8s}")
    print("  exposed = iteration - forward+backward alone (timed in turn with the iteration: the load drifts); "
          "exp/max = exposed / max(host update alone, host->device)")
    print_breakdown(args, profiles)
    if args.thread_sweep:
        thread_sweep(args, presets[0], up)


def thread_sweep(args, preset: str, up: float) -> None:
    """The offloaded iteration and the host update alone with every core of the process, one
    fewer and two fewer (issue 38: the thread driving CUDA needs a core)."""
    cores = default_threads()
    print(f"\nhost threads, {preset} (default here: {default_threads(args.device)}; the process has {cores} cores)")
    print(f"{'threads':>7s} {'iteration':>9s} {'exposed':>8s} {'host alone':>10s} {'exp/max':>7s}")
    for threads in sorted({max(1, cores - k) for k in (0, 1, 2)}, reverse=True):
        fresh_memory(args.device)
        model, x = make_model(args), make_input(args)
        opt, engine = offloaded(model, args, preset, threads)
        seconds, fwd_bwd = exposed_in_turn(args, model, x, opt)
        if engine is not None:
            engine.close()
        del model, x, opt
        host = host_update_alone(args, preset, threads)
        exposed = seconds - fwd_bwd
        print(f"{threads:7d} {1e3 * seconds:9.1f} {1e3 * exposed:8.1f} {1e3 * host:10.1f} "
              f"{exposed / max(host, up):7.2f}", flush=True)


def print_breakdown(args, profiles: dict) -> None:
    cost = range_cost(args)
    print(f"\nthe offloaded step on the profiler timeline, per step (ms) and per chunk (us); medians "
          f"are not taken: sums over {args.profile_steps} profiled iterations / {args.profile_steps}")
    print(f"{'preset':28s} {'step':>7s} {'recheck':>7s} {'prepare':>7s} {'pipeline':>8s} {'kernels':>7s} "
          f"{'asleep':>7s} {'waits':>7s} {'driving':>7s} {'p-kern':>7s} {'chunks':>6s} {'turns':>5s} | {'driving':>7s} "
          f"{'upload':>7s} {'m.print':>7s} {'g.wait':>7s} {'slope':>7s}")
    for preset, (profile, per_chunk) in profiles.items():
        b = breakdown(profile)
        pc = b["per_chunk"]
        print(f"{preset:28s} {1e3 * b['step']:7.2f} {1e3 * b['recheck']:7.2f} {1e3 * b['prepare']:7.2f} "
              f"{1e3 * b['pipeline']:8.2f} {1e3 * b['kernels']:7.2f} {1e3 * b['asleep']:7.2f} "
              f"{1e3 * b['waits']:7.2f} {1e3 * b['driving']:7.2f} {1e3 * b['beyond_kernels']:7.2f} "
              f"{b['chunks']:6.0f} {b['turns']:5.1f} | {1e6 * pc['driving']:7.1f} {1e6 * pc['upload']:7.1f} "
              f"{1e6 * pc['mirror_print']:7.1f} {1e6 * pc['grad_wait']:7.1f} {1e6 * per_chunk:7.1f}")
    print(f"  step: Optimizer.step; recheck: the staged grads' and mirrors' checks; prepare: the bucket's one "
          f"prepare;\n  pipeline: update, uploads and publish, on the driving thread (the caller of step()); "
          f"kernels: the host\n  kernel calls (update thread); asleep: the driving thread waiting for a chunk "
          f"to be written; waits: on last\n  step's uploads and the publish; driving = pipeline - asleep - "
          f"waits (the driving thread's host work);\n  turns: the driving thread's turns (it uploads the chunks written since its last turn); p-kern = pipeline - kernels (what the pipeline adds to "
          f"its kernels). Per chunk: driving, the upload\n  enqueue (with m.print, the fingerprints taken from "
          f"the mirrors), g.wait: the update thread waiting for grads;\n  slope: the per-chunk host overhead "
          f"without a profiler, (step at 4x the chunks - step) / the extra chunks.\n"
          f"  A profiled range costs ~{1e6 * cost:.1f} us here (included above; ~4 ranges per chunk).")
    if args.trace:
        print(f"  trace of {args.presets.split(',')[0]}: {args.trace} (chrome://tracing or ui.perfetto.dev)")


if __name__ == "__main__":
    main()
