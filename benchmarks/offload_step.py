"""CPU-offload step benchmark: pipeline overlap against its parts, and a 7B projection.

Run:  python benchmarks/offload_step.py [--log2-params 26] [--tensors 64] [--bandwidth 25e9]

No machine of this project has a GPU, so the link is a stand-in: CPU params and a
``ThreadedCopyEngine`` whose copies are throttled to ``--bandwidth`` bytes/s each way (PCIe 4
x16 is ~25 GB/s), run on background threads like DMA engines.  Per preset (AdamW, bf16 params
in ``--tensors`` tensors of 2^N elements in all) it measures, repetitions interleaved:

* the parts alone: device->host of every grad, the host update (the same kernels on host
  buffers, no copies), host->device of every param;
* the offloaded step with grads set by hand (their copies start at step()), and after a
  backward pass whose hooks already started the grad copies;
* overlap efficiency = max(parts) / measured step: 1.0 when the copies hide completely.

Then a sweep of the pipeline chunk size, and a projection of a 7B-param step from the measured
host-update throughput, the link bandwidth and ``--backward-seconds``.  On a CUDA machine it
also times the real pipeline (CudaCopyEngine) against the non-offloaded CUDA step.

The stand-in's copies are memcpys on this machine's cores, which compete with the host update
for the same cores and memory bandwidth; a GPU's DMA engines do not.  So the efficiency here is a
lower bound of what a GPU machine gets.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import bf16opt
from bf16opt.offload import default_threads, fingerprint, use_copy_engine
from bf16opt.offload_copies import ThreadedCopyEngine

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.offload_step
    from machine import cpu_name
except ImportError:  # pragma: no cover
    from benchmarks.machine import cpu_name

PRESETS = ("bf16", "bf16-sr", "fp32-remainder-bf16-states")


def make_params(n: int, tensors: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    size = n // tensors
    return [torch.nn.Parameter(torch.randn(size, generator=generator).to(torch.bfloat16)) for _ in range(tensors)]


def grads_for(params: list, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=generator) * 1e-2).to(p.dtype) for p in params]


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


class Setup:
    """One preset's contenders: an offloaded optimizer, a host-only one, and the link alone."""

    def __init__(self, preset: str, n: int, tensors: int, bandwidth: float, chunk: int, threads=None):
        self.engine = ThreadedCopyEngine(bandwidth=bandwidth)
        self.params = make_params(n, tensors)
        self.grads = grads_for(self.params)
        self.opt = bf16opt.AdamW(self.params, lr=1e-4, precision=preset, offload="cpu", offload_threads=threads)
        use_copy_engine(self.opt, self.engine)
        self.opt._offloader.chunk_elements = chunk
        self.host_params = make_params(n, tensors)
        self.host_opt = bf16opt.AdamW(self.host_params, lr=1e-4, precision=preset, backend="numba")
        for p, g in zip(self.host_params, self.grads):
            p.grad = g
        # the link alone: grads down into host buffers, other host buffers up into "device" ones
        self.staging = [torch.empty_like(g) for g in self.grads]
        self.outgoing = [p.detach().clone() for p in self.params]
        self.scratch = [torch.empty_like(p) for p in self.params]
        self.step_hand()        # allocate state, compile, stage once
        self.host_opt.step()

    def _start_down(self) -> list:
        return [self.engine.to_host(s, g) for s, g in zip(self.staging, self.grads)]

    def _start_up(self) -> list:
        return [self.engine.to_device(d, s) for d, s in zip(self.scratch, self.outgoing)]

    def down(self) -> float:
        return timed(lambda: [t.wait() for t in self._start_down()])

    def up(self) -> float:
        return timed(lambda: [t.wait() for t in self._start_up()])

    def update(self) -> float:
        return timed(self.host_opt.step)

    def checks(self) -> float:
        """The device-side checks a step makes (bf16opt/offload.py's fingerprint of every
        param the update reads, and of every grad the hooks copied during backward): on a GPU
        they are the GPU's work, here they take the same cores as everything else."""
        return timed(lambda: self._check(self.grads))

    def _check(self, grads) -> None:
        prints = [fingerprint(p) for p in self.params] + [fingerprint(g) for g in grads]
        torch.stack(prints).tolist()

    def together(self) -> float:
        """The overlap limit of this machine: everything the step must do, started at once on
        independent buffers with no pipeline (no part waits for another): both links, the
        device-side checks of the params, the host update."""
        def run():
            transfers = self._start_down() + self._start_up()
            self._check([])
            self.host_opt.step()
            for t in transfers:
                t.wait()
        return timed(run)

    def together_after_backward(self) -> float:
        """The same limit with the grads already on the host: host->device, the checks of
        params and grads, the host update."""
        def run():
            transfers = self._start_up()
            self._check(self.grads)
            self.host_opt.step()
            for t in transfers:
                t.wait()
        return timed(run)

    def step_hand(self) -> float:
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()  # a new grad tensor: its copy starts at step()
        return timed(self.opt.step)

    def step_after_backward(self) -> float:
        for p in self.params:
            p.grad = None
        loss = sum((p.float() * g.float()).sum() for p, g in zip(self.params, self.grads))
        loss.backward()  # the hooks start every grad's copy during backward
        return timed(self.opt.step)

    def close(self):
        self.engine.close()


def measure(setup: Setup, repeats: int) -> dict:
    names = ("down", "update", "up", "checks", "together", "together_after_backward", "step_hand",
             "step_after_backward")
    times = {name: [] for name in names}
    for _ in range(repeats):  # interleaved: bandwidth drifts between runs
        for name in names:
            times[name].append(getattr(setup, name)())
    return {name: statistics.median(values) for name, values in times.items()}


def report(preset: str, t: dict) -> str:
    parts = max(t["down"], t["update"], t["up"])
    parts_bwd = max(t["update"], t["up"])
    return (f"{preset:28s} {1e3 * t['down']:7.1f} {1e3 * t['update']:7.1f} {1e3 * t['up']:7.1f} "
            f"{1e3 * t['checks']:7.1f} {1e3 * t['together']:7.1f} {1e3 * t['step_hand']:7.1f} "
            f"{parts / t['step_hand']:5.2f} {t['together'] / t['step_hand']:5.2f} | "
            f"{1e3 * t['together_after_backward']:7.1f} {1e3 * t['step_after_backward']:7.1f} "
            f"{parts_bwd / t['step_after_backward']:5.2f} {t['together_after_backward'] / t['step_after_backward']:5.2f}")


HEADER = (f"{'preset':28s} {'D2H':>7s} {'host':>7s} {'H2D':>7s} {'checks':>7s} {'limit':>7s} {'step':>7s} "
          f"{'eff.':>5s} {'limit':>5s} | {'limit':>7s} {'step':>7s} {'eff.':>5s} {'limit':>5s}")
LEGEND = """\
  times in ms.  Left: grads set by hand (their copies start at step()); right: after a backward
  pass whose hooks already copied the grads.  D2H/host/H2D: each part alone; checks: the
  device-side fingerprints of params and grads (a GPU's work; here on the same cores); limit:
  everything the step must do (left: both links, the params' checks, the host update; right:
  host->device, the checks of params and grads, the host update) started together on
  independent buffers, with no pipeline: the best overlap this machine's cores and memory allow.
  eff. = max(parts) / step (the issue's overlap efficiency; right: max(host, H2D) / step);
  the "limit" columns after the step = limit / step, the pipeline against what is reachable here."""


def host_bytes_per_param(preset: str) -> float:
    """Host RAM per bf16 param: state (README table) + param mirror + grad staging."""
    params = make_params(4096, 1)
    opt = bf16opt.AdamW(params, precision=preset, offload="cpu")
    params[0].grad = torch.zeros_like(params[0])
    opt.step()
    report_ = bf16opt.memory_report(opt)
    state = (report_.host_bytes - 8 * len(params)) / report_.num_params  # less the step counters
    return state + sum(report_.staging.values()) / report_.num_params


def compare_cuda(n: int, tensors: int, repeats: int) -> None:
    """The real pipeline (CudaCopyEngine: side streams, page-locked memory) against the
    non-offloaded CUDA step, for the same sizes (only where a GPU exists)."""
    print(f"\nCUDA ({torch.cuda.get_device_name()}): step ms, offload='cpu' vs state on the GPU")
    for preset in PRESETS:
        times = {}
        for offload in (None, "cpu"):
            params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(n, tensors)]
            grads = [g.cuda() for g in grads_for(params)]
            opt = bf16opt.AdamW(params, lr=1e-4, precision=preset, offload=offload)
            samples = []
            for _ in range(repeats + 1):
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                torch.cuda.synchronize()
                samples.append(timed(lambda: (opt.step(), torch.cuda.synchronize())))
            times[offload] = statistics.median(samples[1:])
            del opt, params, grads
            gc.collect()
            torch.cuda.empty_cache()
        print(f"  {preset:28s} on GPU {1e3 * times[None]:8.1f}   offloaded {1e3 * times['cpu']:8.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-params", type=int, default=26)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--bandwidth", type=float, default=25e9, help="stand-in link, bytes/s each way")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=None, help="pipeline chunk (elements, a power of 2); "
                        "default: swept")
    parser.add_argument("--threads", type=int, default=None, help="offload_threads; default: swept")
    parser.add_argument("--backward-seconds", type=float, default=1.0,
                        help="length of a 7B backward pass for the projection")
    parser.add_argument("--gpu-params-per-second", type=float, default=0.0,
                        help="optional: a GPU's non-offloaded step throughput, for the projection")
    args = parser.parse_args(argv)
    n = 1 << args.log2_params
    print(f"bf16opt offload benchmark: AdamW, 2^{args.log2_params} bf16 params in {args.tensors} tensors, "
          f"stand-in link {args.bandwidth / 1e9:.0f} GB/s each way; {cpu_name()}; medians of {args.repeats}")

    # the stand-in's copies run on this machine's cores: fewer update threads may leave
    # them a core (a GPU's DMA engines need none, so there all cores update)
    cores = default_threads()
    print("\nsweep (bf16): chunk elements x update threads -> step ms (grads set by hand)")
    results = {}
    for log2 in ((18, 20, 21, 22, 23) if args.chunk is None else (args.chunk.bit_length() - 1,)):
        for count in (sorted({1, max(1, cores - 1), cores}) if args.threads is None else (args.threads,)):
            setup = Setup("bf16", n, args.tensors, args.bandwidth, 1 << log2, count)
            t = statistics.median(setup.step_hand() for _ in range(max(3, args.repeats // 2)))
            setup.close()
            del setup
            gc.collect()
            results[(1 << log2, count)] = t
            print(f"  2^{log2:<3d} {count:2d} thread(s) {1e3 * t:8.1f}", flush=True)
    chunk, threads = min(results, key=results.get)
    print(f"  chosen: 2^{chunk.bit_length() - 1} elements, {threads} thread(s)")

    print("\n" + HEADER)
    update_rate = {}
    for preset in PRESETS:
        setup = Setup(preset, n, args.tensors, args.bandwidth, chunk, threads)
        t = measure(setup, args.repeats)
        print(report(preset, t))
        update_rate[preset] = n / t["update"]
        setup.close()
        del setup
        gc.collect()
    print(LEGEND)

    print(f"\nprojection, 7B bf16 params, link {args.bandwidth / 1e9:.0f} GB/s each way, "
          f"host update at this machine's measured rate, backward {args.backward_seconds:.2f} s:")
    params7b = 7e9
    link = params7b * 2 / args.bandwidth
    print(f"{'preset':28s} {'GPU B/param':>11s} {'host B/param':>12s} {'host update s':>13s} "
          f"{'link s (each way)':>17s} {'step s':>7s} {'grad copies hidden':>18s}")
    for preset in PRESETS:
        update = params7b / update_rate[preset]
        step = max(update, link)  # grads down during backward; params up overlapped with the update
        hidden = min(1.0, args.backward_seconds / link)
        print(f"{preset:28s} {4:11d} {host_bytes_per_param(preset):12.1f} {update:13.2f} {link:17.2f} "
              f"{step:7.2f} {100 * hidden:17.0f}%")
    print("  GPU bytes/param: the bf16 param and its bf16 grad (no optimizer state on the GPU).")

    if torch.cuda.is_available():
        compare_cuda(n, args.tensors, args.repeats)
    else:
        print("\n(no CUDA device: the real pipeline against the CUDA step is not measured here)")


if __name__ == "__main__":
    main()
