"""Update in backward on a model: peak memory and the exposed step, normal vs release.

Run:  python benchmarks/release_model.py [--layers 16 --dim 4096] [--presets bf16,fp32] [--no-clipping]

The model of issue 38 (``benchmarks/offload_model.py``): ``--layers`` bf16 ``Linear(dim, dim,
bias=False)``, an input of ``--batch`` rows, loss ``out.float().pow(2).mean()``.  One iteration =
forward, backward, ``opt.step()``, ``opt.zero_grad()``, synchronize; medians of ``--repeats``.

Per AdamW preset, four runs: state on the device or ``offload="cpu"``, each with the normal step
and with ``update_in_backward=True``.  Each row: the iteration, the exposed step (iteration -
forward+backward alone), the peak GPU memory of an iteration (CUDA; ``max_memory_allocated``
after warm-up) and the most grad bytes alive at once (counted by hooks, on any device: the part
of the peak release removes).  Offloaded rows add the target of issue 39: exposed <= max(0, host
update alone - backward alone) + the last param's upload, and with update in backward the tail:
how long backward's end and ``step()`` waited for the host updates (the rest of the exposed time
is host work inside backward: the hooks' checks and the host update competing with backward
for the CPU's cores, which a GPU's backward does not).  The iterations of the settings of a
preset are interleaved (this machine's speed drifts between runs); the peaks are measured with
one model alive at a time.  Then the parts: forward, backward, the host update of all params
alone, one param's upload.

Then (``--no-clipping`` skips it) what each clipping choice of update in backward costs per param, measured on
one ``dim x dim`` param: its update alone, a per-update clip (``max_grad_norm_per_param``: a
float32 norm and a scale of its grad), and a speculative clip's snapshot (a copy of the param and its
state, taken before each update so a redo can restore it), with the bytes each keeps.

Without a GPU the device is the CPU and the link a stand-in (``ThreadedCopyEngine`` throttled
to ``--bandwidth`` bytes/s each way); GPU memory is then not measured (the grads' column is).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import bf16opt
from bf16opt import clipping, release
from bf16opt.offload import host_threads, use_copy_engine
from bf16opt.offload_copies import ThreadedCopyEngine, engine_for

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.release_model
    from machine import cpu_name
    from offload_model import host_update_alone, iteration, make_input, make_model, median_time, synchronize
except ImportError:  # pragma: no cover
    from benchmarks.machine import cpu_name
    from benchmarks.offload_model import (host_update_alone, iteration, make_input, make_model, median_time,
                                          synchronize)

PRESETS = "bf16,fp32"
MiB = 1 << 20


def parse(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--dim", type=int, default=None, help="default: 4096 on CUDA, 1024 on CPU")
    parser.add_argument("--batch", type=int, default=None,
                        help="input rows; default: dim on CUDA, 128 on CPU")
    parser.add_argument("--presets", default=PRESETS,
                        help=f"comma-separated AdamW presets (default {PRESETS})")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="offload_threads (default: all cores)")
    parser.add_argument("--bandwidth", type=float, default=25e9, help="CPU stand-in link, bytes/s each way")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: "
                        "torch's); on the CPU stand-in, backward and the host update share the cores")
    parser.add_argument("--no-offload", action="store_true", help="only the runs with state on the device")
    parser.add_argument("--no-clipping", action="store_true", help="skip the clipping costs")
    args = parser.parse_args(argv)
    cpu = torch.device(args.device).type == "cpu"
    args.layers = args.layers or (4 if cpu else 16)
    args.dim = args.dim or (1024 if cpu else 4096)
    args.batch = args.batch or (128 if cpu else args.dim)
    return args


# ---------------------------------------------------------------- the model and its iteration

class GradMeter:
    """The most grad bytes alive at once, seen from hooks registered before the optimizer's (so
    each sees its param's grad before an update in backward frees it)."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._seen) for p in self.params]

    def _seen(self, _param) -> None:
        alive = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        self.peak = max(self.peak, alive)


class Variant:
    """A fresh model with one optimizer setting (``preset=None``: no optimizer, grads dropped)."""

    def __init__(self, args, preset=None, offload=None, release=False):
        self.args, self.cuda = args, torch.device(args.device).type == "cuda"
        self.model, self.x = make_model(args), make_input(args)
        self.meter = GradMeter(self.model)
        self.opt = self.engine = None
        if preset is not None:
            self.opt = bf16opt.AdamW(self.model.parameters(), lr=1e-4, precision=preset, offload=offload,
                                     offload_threads=args.threads, update_in_backward=release)
            if offload and not self.cuda:
                self.engine = ThreadedCopyEngine(bandwidth=args.bandwidth)
                use_copy_engine(self.opt, self.engine)
        self.samples, self.tails = [], []

    def timed(self) -> None:
        _WAITS.clear()
        start = time.perf_counter()
        with host_threads(self.args.threads):
            iteration(self.model, self.x, self.opt)
        self.samples.append(time.perf_counter() - start)
        self.tails.append(sum(_WAITS))

    def peak(self) -> tuple:
        """(peak GPU MiB of one iteration or None, the most grad MiB alive at once)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.meter.peak = 0
        with host_threads(self.args.threads):
            iteration(self.model, self.x, self.opt)
        gpu = torch.cuda.max_memory_allocated() / MiB if self.cuda else None
        return gpu, self.meter.peak / MiB

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


#: seconds waited for the offloaded updates in backward this iteration (at backward's end, or in step)
_WAITS: list = []
_finish = release.Background.finish


def _timed_finish(self) -> None:
    start = time.perf_counter()
    try:
        _finish(self)
    finally:
        _WAITS.append(time.perf_counter() - start)


release.Background.finish = _timed_finish  # (this benchmark's own measurement)


def peaks(args, settings: list) -> list:
    """Each setting's peaks, one model alive at a time (the GPU peak is the process's)."""
    found = []
    for setting in settings:
        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        variant = Variant(args, *setting)
        for _ in range(args.warmup):
            variant.timed()
        found.append(variant.peak())
        variant.close()
        del variant
    return found


def interleaved(args, settings: list) -> list:
    """Each setting's median iteration, the settings' iterations interleaved (this machine's
    speed drifts between runs)."""
    variants = [Variant(args, *setting) for setting in settings]
    for round_number in range(args.warmup + args.repeats):
        for variant in variants:
            variant.timed()
    medians = [(statistics.median(v.samples[args.warmup:]), statistics.median(v.tails[args.warmup:]))
               for v in variants]
    for variant in variants:
        variant.close()
    return medians


# ---------------------------------------------------------------- the parts alone

def forward_alone(args) -> float:
    model, x = make_model(args), make_input(args)

    def forward():
        with torch.no_grad():
            model(x).float().pow(2).mean()
        synchronize(args.device)
    return median_time(forward, args.warmup, args.repeats)


def one_upload(args) -> float:
    """One param's host->device copy on the link the offloaded step uses."""
    cpu = torch.device(args.device).type == "cpu"
    engine = ThreadedCopyEngine(bandwidth=args.bandwidth) if cpu else engine_for(args.device)
    device = torch.zeros(args.dim, args.dim, dtype=torch.bfloat16, device=args.device)
    host = engine.host_empty(device.shape, device.dtype).zero_()

    def upload():
        transfer = engine.to_device(device, host)
        engine.publish([transfer])
        transfer.wait()
        synchronize(args.device)
    seconds = median_time(upload, args.warmup, args.repeats)
    if cpu:
        engine.close()
    return seconds


# ---------------------------------------------------------------- clipping choices

def clipping_costs(args, preset: str) -> dict:
    """Seconds per param of its update, a per-update clip and a speculative snapshot, and the
    bytes per element each keeps beyond update in backward's."""
    generator = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(args.dim, args.dim, generator=generator)
                               .to(device=args.device, dtype=torch.bfloat16))
    param.grad = torch.randn(param.shape, generator=generator).mul(1e-2).to(param)
    opt = bf16opt.AdamW([param], lr=1e-4, precision=preset)
    opt.step()  # (its state made)
    state = [t for t in opt.state[param].values() if t.numel() > 1]
    snapshot = [torch.empty_like(t) for t in [param.detach(), *state]]

    def snap():
        for copy, tensor in zip(snapshot, [param.detach(), *state]):
            copy.copy_(tensor)

    def clip():  # what max_grad_norm_per_param adds to an update (bf16opt/clipping.py)
        param.grad.mul_(clipping.coefficient(param.grad, 1.0))

    parts = {"update": opt.step, "clip": clip, "snapshot": snap}
    samples = {name: [] for name in parts}
    for round_number in range(args.warmup + args.repeats):  # interleaved: this machine's speed drifts
        for name, function in parts.items():
            start = time.perf_counter()
            function()
            synchronize(args.device)
            samples[name].append(time.perf_counter() - start)
    costs = {name: statistics.median(values[args.warmup:]) for name, values in samples.items()}
    state_bytes = sum(t.element_size() for t in state)
    # the grad kept until the norm is known, plus the snapshot of param and state
    costs["snapshot_bytes"] = param.grad.element_size() + param.element_size() + state_bytes
    return costs


# ---------------------------------------------------------------- report

def header(args) -> str:
    params = args.layers * args.dim * args.dim
    device = torch.device(args.device)
    where = (f"{torch.cuda.get_device_name(device)} (host: {cpu_name()})" if device.type == "cuda" else
             f"CPU stand-in: {cpu_name()}; link {args.bandwidth / 1e9:g} GB/s each way (ThreadedCopyEngine)")
    return (f"bf16opt update in backward on a model: {args.layers} x bf16 Linear({args.dim}, {args.dim}, "
            f"bias=False) ({params / 1e6:.1f}M params), input {args.batch} x {args.dim}; AdamW; {where}; "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads); offload_threads "
            f"{args.threads or 'all'}; update_in_backward_bucket {release.BUCKET_ELEMENTS} elements (its default: "
            f"{'each param alone' if args.dim * args.dim >= release.BUCKET_ELEMENTS else 'small params together'}); "
            f"medians of {args.repeats} after {args.warmup}")


def mib(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv=None) -> None:
    args = parse(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    presets = [p for p in args.presets.split(",") if p]
    print(header(args), flush=True)
    forward = forward_alone(args)
    upload = one_upload(args)
    print(f"forward {1e3 * forward:.1f} ms; one param's upload {1e3 * upload:.2f} ms\n")
    print(f"{'ms / MiB':44s} {'iteration':>9s} {'exposed':>8s} {'tail':>6s} {'target':>7s} {'peak GPU':>8s} "
          f"{'grads':>6s}")
    for preset in presets:
        settings = [(preset, offload, release) for offload in ((None,) if args.no_offload else (None, "cpu"))
                    for release in (False, True)]
        found = peaks(args, [(None,)] + settings)
        seconds = interleaved(args, [(None,)] + settings)
        alone = seconds[0][0]
        host = host_update_alone(args, preset)
        backward = alone - forward
        target = max(0.0, host - backward) + upload
        print(f"{'forward+backward alone':44s} {1e3 * alone:9.1f} {'':8s} {'':6s} {'':7s} "
              f"{mib(found[0][0]):>8s} {found[0][1]:6.0f}")
        for (_, offload, in_backward), (iteration_seconds, tail), (gpu, grads) in zip(settings, seconds[1:],
                                                                                     found[1:]):
            name = f"{preset}, {'offload=cpu' if offload else 'state on device'}, " \
                   f"{'update_in_backward' if in_backward else 'normal step'}"
            shown = f"{1e3 * target:7.1f}" if offload else f"{'':7s}"
            tail_shown = f"{1e3 * tail:6.1f}" if offload and in_backward else f"{'':6s}"
            print(f"{name:44s} {1e3 * iteration_seconds:9.1f} {1e3 * (iteration_seconds - alone):8.1f} "
                  f"{tail_shown} {shown} {mib(gpu):>8s} {grads:6.0f}", flush=True)
        print(f"  {preset}: host update alone {1e3 * host:.1f} ms, backward alone {1e3 * backward:.1f} ms")
    print("  exposed = iteration - forward+backward alone (interleaved); tail = time backward's end and "
          "step() waited for the host updates in backward; target (offloaded) = max(0, host update alone "
          "- backward alone) + one upload; grads = most grad MiB alive at once")
    if args.no_clipping:
        return
    print(f"\nclipping with update in backward, per Linear({args.dim}, {args.dim}) param "
          f"(ms; bytes/param kept)")
    for preset in presets:
        costs = clipping_costs(args, preset)
        print(f"  {preset:10s} update {1e3 * costs['update']:.2f}; per-update clip {1e3 * costs['clip']:.2f} "
              f"({costs['clip'] / costs['update']:.2f}x the update, 0 B); speculative snapshot "
              f"{1e3 * costs['snapshot']:.2f} ({costs['snapshot'] / costs['update']:.2f}x, "
              f"{costs['snapshot_bytes']} B/param)")


if __name__ == "__main__":
    main()
