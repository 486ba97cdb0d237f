"""Python overhead of a CPU step over many tiny params (numba backend).

Run:  python benchmarks/step_overhead.py [--repeats 41] [--steps 50] [--profile] [--multi-tensor
      [--multi-tensor-instances 3]] [--cold]

Per param list and preset (AdamW, bf16 params) it times, repetitions interleaved across
all rows (medians reported, in ms per step):

* ``step``: ``opt.step()``;
* ``kernel``: the step's own kernel call replayed with the arguments it was given (the
  chunk table's work, negligible on tiny tensors, plus the parallel dispatch);
* ``empty``: the same parallel driver on an empty chunk table (the dispatch alone);
* ``step-empty``: the step's overhead over an empty kernel call;
* ``Python``: the step with the parallel driver replaced by a Python no-op (a reused step's
  compiled call still runs, over no chunk rows: the counters, version counters and grad
  pointers it handles are the step's bookkeeping), in CPU time of the calling thread: what
  the step spends around its kernel.  On a
  shared machine this is the robust figure: when another process keeps a core busy, the
  wake-up of Numba's worker threads takes milliseconds, and those threads' spinning after
  a kernel call competes with the Python of the next one for the cores (wall clock);
* ``floor``: the same no-op kernel inside the least Python a drop-in optimizer's step runs
  (``cpu_step.ProtocolStep``: torch's hooks and profiler scope, the grads fetched, the
  version counters of params and state buffers bumped), in the same CPU time; ``excess``:
  ``Python`` minus ``floor``, what bf16opt's checks and bookkeeping cost over any step.

The param lists: 150 params of 64 elements, and GPT-2 small's 148 shapes with every
dimension divided by 64 (same count and mix of matrices and vectors, tiny sizes).
``--profile`` adds a cProfile of steps of the first list.

``--multi-tensor``: the full-size GPT-2-small-shaped list (~124M params in 148 tensors)
against one flat tensor of the same size, whole steps and their kernel calls alone, with
the median over repetitions of each repetition's list/flat ratio (memory bandwidth drifts
between repetitions on a shared machine; a paired ratio cancels most of it);
``--multi-tensor-instances K``: K optimizers of each, made alternately (a tensor's placement
in memory moves its step by up to 1.5x on these VMs; K draws of it per layout).

``--cold``: the step's Python as a training step meets it, with the caches cold after the
last kernel's stream (SGD and AdamW over one 2^25 param, and with ``--multi-tensor`` the
full-size GPT-2-small list): its time before and after the kernel call inside each step, its
share of the step, and its excess over the floor: the same kernel call inside the least
Python a drop-in optimizer's step runs (``cpu_step.ProtocolStep``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from typing import Optional

import numpy as np
import torch

import bf16opt
from bf16opt import _cpu

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.step_overhead
    from cpu_step import (ProtocolStep, captured_kernel_call, driver_users, gpt2_small_shapes, kernel_driver,
                          kernel_step, state_buffers)
    from machine import cpu_name
except ImportError:  # pragma: no cover
    from benchmarks.cpu_step import (ProtocolStep, captured_kernel_call, driver_users, gpt2_small_shapes, kernel_driver,
                                     kernel_step, state_buffers)
    from benchmarks.machine import cpu_name

PRESETS = ("bf16", "fp32", "bf16-sr")


def param_lists() -> dict:
    gpt2 = [tuple(max(1, d // 64) for d in shape) for shape in gpt2_small_shapes()]
    return {"150 x 64": [(64,)] * 150, f"GPT-2 small / 64 ({len(gpt2)})": gpt2}


def tiny_optimizer(shapes: list, preset: str, dtype: torch.dtype = torch.bfloat16, algorithm: str = "AdamW"):
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype).normal_(0, 0.02))
        p.grad = torch.empty(shape, dtype=dtype).normal_(0, 1e-3)
        params.append(p)
    cls, hyper = {"AdamW": (bf16opt.AdamW, dict(lr=1e-3, weight_decay=1e-2)),
                  "SGD": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4))}[algorithm]
    opt = cls(params, precision=preset, backend="numba", **hyper)
    opt.step()  # creates state, compiles or loads the kernel
    opt.step()  # builds the launch the next steps reuse
    return opt


def empty_kernel_call(args: tuple) -> tuple:
    address, table, scalars, keys, row_counts, _ = args
    return address, table[:0], scalars, keys, row_counts[:0], np.zeros(2, dtype=np.int64)


def _no_kernel(*args) -> None:
    pass


_NO_PARTS = np.zeros(1, dtype=np.int64)  # chunk bounds of no thread: the driver runs no row


def without_kernel(step):
    """``step`` with its kernel call a no-op (the Python around it alone): the chunk
    drivers of a full step; a kept launch's compiled call (``Relaunch.run``) of a reused one
    runs, over no chunk rows on this thread: the bookkeeping it holds (the step counters
    advanced, autograd's version counters bumped, the grads pointed) is the step's, not its
    kernel's."""
    from bf16opt.backends import numba as backend  # noqa: PLC0415

    driver_users()
    rerun, run_in_one_call = backend.Relaunch.run, backend.Relaunch.run_in_one_call

    def bookkeeping_only(call):
        def over_no_rows(self, *args):
            bounds, self.bounds = self.bounds, _NO_PARTS
            forked, backend._FORKED = backend._FORKED, True  # (the serial driver: no thread woken)
            try:
                return call(self, *args)
            finally:
                self.bounds, backend._FORKED = bounds, forked
        return over_no_rows

    def run():
        drivers = _cpu.chunks.run_chunks, _cpu.chunks.run_chunks_serial
        _cpu.chunks.run_chunks = _cpu.chunks.run_chunks_serial = _no_kernel
        backend.Relaunch.run = bookkeeping_only(rerun)
        backend.Relaunch.run_in_one_call = bookkeeping_only(run_in_one_call)
        try:
            step()
        finally:
            _cpu.chunks.run_chunks, _cpu.chunks.run_chunks_serial = drivers
            backend.Relaunch.run, backend.Relaunch.run_in_one_call = rerun, run_in_one_call
    return run


def repeated(fn, steps: int):
    def run():
        for _ in range(steps):
            fn()
    return run


def timings(contenders: dict, repeats: int, steps: int = 1, clocks: Optional[dict] = None) -> dict:
    """Seconds per call of each contender in each repetition, repetitions interleaved across all
    of them; ``clocks``: contender -> its clock (default: wall clock)."""
    times = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            clock = (clocks or {}).get(name, time.perf_counter)
            start = clock()
            fn()
            times[name].append((clock() - start) / steps)
    return times


def measure(contenders: dict, repeats: int, steps: int, clocks: Optional[dict] = None) -> dict:
    """Median seconds per call of each contender, repetitions interleaved across all of them."""
    return {name: statistics.median(t) for name, t in timings(contenders, repeats, steps, clocks).items()}


def overhead_table(repeats: int, steps: int) -> None:
    from numba import get_num_threads  # noqa: PLC0415  (after bf16opt's first step imported it)

    contenders, clocks, rows, keep = {}, {}, [], []
    for list_name, shapes in param_lists().items():
        for preset in PRESETS:
            opt = tiny_optimizer(shapes, preset)
            args = captured_kernel_call(opt)
            empty = empty_kernel_call(args)
            row = (list_name, preset)
            contenders[row + ("step",)] = repeated(opt.step, steps)
            driver = kernel_driver(args[1])  # (the empty call through the same driver)
            contenders[row + ("kernel",)] = repeated(lambda a=args, d=driver: d(*a), steps)
            contenders[row + ("empty",)] = repeated(lambda a=empty, d=driver: d(*a), steps)
            contenders[row + ("Python",)] = without_kernel(repeated(opt.step, steps))
            clocks[row + ("Python",)] = time.thread_time
            # the floor: the least Python a drop-in step runs, around the same no-op kernel
            params = opt.param_groups[0]["params"]
            written = params + [b for p in params for b in state_buffers(opt.state[p])]
            contenders[row + ("floor",)] = repeated(ProtocolStep(params, _no_kernel, written).step, steps)
            clocks[row + ("floor",)] = time.thread_time
            rows.append(row)
            keep.append(opt)
    t = measure(contenders, repeats, steps, clocks)
    print(f"Python overhead of an AdamW step (bf16 params, numba backend), {get_num_threads()} Numba threads, "
          f"{cpu_name()}; median of {repeats} interleaved repetitions of {steps} steps; ms per step")
    header = (f"{'param list':26} {'preset':8} {'step':>7} {'kernel':>7} {'empty':>7} {'step-empty':>10} "
              f"{'Python CPU':>10} {'floor CPU':>9} {'excess':>7}")
    print(header)
    print("-" * len(header))
    for row in rows:
        step, kernel, empty, python, floor = (t[row + (what,)] for what in ("step", "kernel", "empty", "Python",
                                                                             "floor"))
        print(f"{row[0]:26} {row[1]:8} {1e3 * step:7.3f} {1e3 * kernel:7.3f} {1e3 * empty:7.3f} "
              f"{1e3 * (step - empty):10.3f} {1e3 * python:10.3f} {1e3 * floor:9.3f} {1e3 * (python - floor):7.3f}",
              flush=True)


def list_vs_flat(repeats: int, instances: int = 1) -> None:
    """The GPT-2-small-shaped list against one flat tensor.  ``instances`` > 1: that many
    optimizers of each, made alternately, every repetition timing all of them: where a
    tensor's memory lands moves these memory-bound steps by up to 1.5x on these VMs, fixed
    for an optimizer's life, so one list against one flat tensor compares two draws of
    placement as much as the two layouts.  A repetition's ratio is then the geometric mean
    of its list steps over that of its flat ones; each instance's median is printed too."""
    shapes = gpt2_small_shapes()
    total = sum(int(np.prod(shape)) for shape in shapes)
    print(f"\nGPT-2-small-shaped param list ({len(shapes)} tensors, {total} params) vs one flat tensor of the "
          f"same size; AdamW, numba backend, {cpu_name()}; {instances} optimizer(s) of each, made alternately; "
          f"median of {repeats} interleaved repetitions, ms; list/flat: median of the repetitions' ratios")
    header = (f"{'configuration':20} {'list':>7} {'flat':>7} {'list/flat':>9} {'kernel list':>11} "
              f"{'kernel flat':>11} {'list/flat':>9}")
    print(header)
    print("-" * len(header))
    for label, dtype, preset in [("bf16 params, bf16", torch.bfloat16, "bf16"),
                                 ("fp32 params, fp32", torch.float32, "fp32")]:
        contenders, keep = {}, []
        for k in range(instances):
            for name, layout in (("list", shapes), ("flat", [(total,)])):
                opt = tiny_optimizer(layout, preset, dtype)
                contenders[(name, "", k)] = opt.step
                contenders[(name, " kernel", k)] = kernel_step(opt)
                keep.append(opt)
        t = timings(contenders, repeats)

        def geomean(name: str, kind: str, rep: int) -> float:
            return statistics.geometric_mean(t[(name, kind, k)][rep] for k in range(instances))

        median = {(name, kind): 1e3 * statistics.median(geomean(name, kind, r) for r in range(repeats))
                  for name in ("list", "flat") for kind in ("", " kernel")}
        ratio = {kind: statistics.median(geomean("list", kind, r) / geomean("flat", kind, r) for r in range(repeats))
                 for kind in ("", " kernel")}
        print(f"{label:20} {median[('list', '')]:7.1f} {median[('flat', '')]:7.1f} {ratio['']:9.3f} "
              f"{median[('list', ' kernel')]:11.1f} {median[('flat', ' kernel')]:11.1f} {ratio[' kernel']:9.3f}",
              flush=True)
        if instances > 1:
            for name in ("list", "flat"):
                steps = " ".join(f"{1e3 * statistics.median(t[(name, '', k)]):.1f}" for k in range(instances))
                print(f"  {name} steps of each instance: {steps}")
        del contenders, t, keep
        gc.collect()


def cold_bookkeeping(log2_params: int, repeats: int, with_list: bool) -> None:
    """The step's Python with the caches cold, as a training step runs it: a step's own kernel
    streams its tensors through the caches, so the bookkeeping of the next step starts cold.
    Times the Python before and after the kernel call inside each step (the call is timed
    by wrapping the backend's ``_call``, ``Relaunch.run`` and ``Relaunch.run_in_one_call``, a reused
    step's one compiled call -- for a single group, with the compiled checks in it), and the
    whole step's excess over the floor's (paired by repetition), for one large param and
    (``with_list``) for the
    full-size GPT-2-small list; and, interleaved, the same kernel call inside
    ``cpu_step.ProtocolStep`` (the least Python a drop-in optimizer's step runs: the floor)."""
    from bf16opt.backends import numba as backend  # noqa: PLC0415

    marks = []
    call, rerun, run_in_one_call = backend._call, backend.Relaunch.run, backend.Relaunch.run_in_one_call

    def timed(kernel):
        def run(*args):
            start = time.perf_counter()
            answer = kernel(*args)
            marks.append((start, time.perf_counter()))
            return answer
        return run

    def python_around_kernel(step) -> tuple:
        marks.clear()
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        if len(marks) != 1:
            raise RuntimeError(f"expected one kernel call per step, got {len(marks)}")
        (enter, leave), = marks
        return enter - start, leave - enter, end - leave, end - start

    cases = [(f"1 param of 2^{log2_params}, {preset}", algorithm, [(1 << log2_params,)], preset)
             for algorithm, preset in (("SGD", "bf16-sr"), ("AdamW", "bf16"))]
    if with_list:
        cases.append((f"GPT-2 small list ({len(gpt2_small_shapes())})", "AdamW", gpt2_small_shapes(), "bf16"))
    print(f"\nThe step's Python with cold caches (bf16 params, numba backend), {cpu_name()}; medians of {repeats} "
          f"steps; before / after: the step's time before its kernel call and after it, ms; step excess: the "
          f"whole step's time over the floor's, paired by repetition (with the compiled checks a single "
          f"group's kernel call holds); floor: the same "
          f"kernel call inside the least Python a drop-in step runs (cpu_step.ProtocolStep), interleaved")
    header = (f"{'params':30} {'optimizer':9} {'before':>7} {'after':>7} {'Python':>7} {'kernel':>8} {'share':>6} "
              f"{'floor':>7} {'excess':>7} {'step excess':>11}")
    print(header)
    print("-" * len(header))
    try:
        for label, algorithm, shapes, preset in cases:
            opt = tiny_optimizer(shapes, preset, algorithm=algorithm)
            params = [p for group in opt.param_groups for p in group["params"]]
            written = params + [t for p in params for t in state_buffers(opt.state[p])]
            floor = ProtocolStep(params, timed(kernel_step(opt)), written)
            ours, theirs = [], []
            for _ in range(repeats):
                backend._call, backend.Relaunch.run, backend.Relaunch.run_in_one_call = \
                    timed(call), timed(rerun), timed(run_in_one_call)
                ours.append(python_around_kernel(opt.step))
                backend._call, backend.Relaunch.run, backend.Relaunch.run_in_one_call = call, rerun, run_in_one_call
                theirs.append(python_around_kernel(floor.step))
            (b, k, a, _), (fb, _, fa, _) = ([statistics.median(x) for x in zip(*runs)]
                                            for runs in (ours, theirs))
            step_excess = statistics.median(mine[3] - floors[3] for mine, floors in zip(ours, theirs))
            print(f"{label:30} {algorithm:9} {1e3 * b:7.3f} {1e3 * a:7.3f} {1e3 * (b + a):7.3f} {1e3 * k:8.2f} "
                  f"{100 * (b + a) / (b + a + k):5.1f}% {1e3 * (fb + fa):7.3f} "
                  f"{1e3 * (b + a - fb - fa):7.3f} {1e3 * step_excess:11.3f}", flush=True)
            del opt, floor, params, written
            gc.collect()
    finally:
        backend._call, backend.Relaunch.run, backend.Relaunch.run_in_one_call = call, rerun, run_in_one_call


def profile(preset: str, steps: int, lines: int = 25) -> None:
    opt = tiny_optimizer(next(iter(param_lists().values())), preset)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        opt.step()
    profiler.disable()
    print(f"\ncProfile of {steps} steps, 150 x 64, {preset} (internal time; times include cProfile's own cost)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed repetition")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of 500 steps per preset")
    parser.add_argument("--multi-tensor", action="store_true",
                        help="add the full-size GPT-2-small-shaped list against one flat tensor")
    parser.add_argument("--multi-tensor-repeats", type=int, default=21)
    parser.add_argument("--multi-tensor-instances", type=int, default=1,
                        help="optimizers of each layout, made alternately (placement varies between them)")
    parser.add_argument("--cold", action="store_true",
                        help="add the step's Python with cold caches, around the kernels of large params")
    parser.add_argument("--cold-log2-params", type=int, default=25)
    args = parser.parse_args()
    overhead_table(args.repeats, args.steps)
    if args.cold:
        cold_bookkeeping(args.cold_log2_params, args.multi_tensor_repeats, args.multi_tensor)
    if args.profile:
        for preset in PRESETS:
            profile(preset, 500)
    if args.multi_tensor:
        list_vs_flat(args.multi_tensor_repeats, args.multi_tensor_instances)


if __name__ == "__main__":
    main()
