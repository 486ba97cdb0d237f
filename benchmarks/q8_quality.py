"""Quality of q8 moments on ``bf16opt compare``'s default task: the final loss of each q8
preset against fp32 in the same run, the two candidate maps (dynamic tree, companded) on the
reference backend, and the 8-bit peers where they install from PyPI (optional, never
dependencies): torchao's AdamW8bit and bitsandbytes' AdamW8bit, each on bf16 and on fp32 params.

    python benchmarks/q8_quality.py [--steps 300] [--skip-maps] [--no-peers | --peers-only] [--backend numba]
                                    [--json out.json]

Prints each run's final loss (mean of the last 10% of steps) and its gap to fp32 as a
percentage, against the limits of issue 40 (0.3% for fp32-remainder-q8, 0.5% for bf16-sr-q8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from bf16opt import PRESETS, Precision, storage
from bf16opt.cli import DEFAULT_LR, stdlib_corpus
from bf16opt.compare import CharGPT, batches, train, warmup_cosine

LIMITS = {"fp32-remainder-q8": 0.3, "bf16-sr-q8": 0.5}


def _peer_optimizers() -> list:
    """(row name, param dtype, factory) for each 8-bit AdamW peer that imports: torchao's
    AdamW8bit and bitsandbytes' AdamW8bit, each on bf16 params (the model every bf16opt run
    trains; the peer's master is then the bf16 param) and on fp32 params (the peer's master is
    fp32, as fp32-remainder-q8's; the forward then runs in fp32 too)."""
    peers = []
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit  # noqa: PLC0415  (an optional peer)
    except ImportError as exc:
        print(f"torchao AdamW8bit: not importable ({exc})", file=sys.stderr)
    else:
        peers += [("torchao AdamW8bit, bf16 params", torch.bfloat16, TorchaoAdamW8bit),
                  ("torchao AdamW8bit, bf16 params + its bf16_stochastic_round", torch.bfloat16,
                   lambda params, lr: TorchaoAdamW8bit(params, lr=lr, bf16_stochastic_round=True)),
                  ("torchao AdamW8bit, fp32 params", torch.float32, TorchaoAdamW8bit)]
    try:
        import bitsandbytes  # noqa: PLC0415  (an optional peer)
    except ImportError as exc:
        print(f"bitsandbytes AdamW8bit: not importable ({exc})", file=sys.stderr)
    else:
        peers += [("bitsandbytes AdamW8bit, bf16 params", torch.bfloat16, bitsandbytes.optim.AdamW8bit),
                  ("bitsandbytes AdamW8bit, fp32 params", torch.float32, bitsandbytes.optim.AdamW8bit)]
    return peers


def peer_run(name: str, dtype: torch.dtype, factory, data, steps: int, lr: float, seed: int = 0) -> "dict | None":
    """A peer optimizer on compare's model, data and schedule (``train``'s loop without
    bf16opt's telemetry); None, with the exception printed, where it does not run."""
    torch.manual_seed(seed)
    model = CharGPT(width=128, layers=2, block=64).to(dtype)
    start = time.perf_counter()
    losses = []
    try:
        opt = factory(model.parameters(), lr=lr)
        schedule = warmup_cosine(opt, steps)
        for inputs, targets in batches(data, steps, 32, 64, seed):
            loss = F.cross_entropy(model(inputs).float().reshape(-1, 256), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
    except Exception as exc:  # noqa: BLE001  (a peer's failure is reported, not raised)
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    tail = losses[-max(1, len(losses) // 10):]
    seconds = time.perf_counter() - start
    print(f"  ({name}: final {statistics.fmean(tail):.4f}, {seconds:.0f} s)", file=sys.stderr, flush=True)
    return {"preset": name, "final": statistics.fmean(tail), "seconds": seconds}


def run(preset, data, steps: int, lr: float, backend: str) -> dict:
    start = time.perf_counter()
    result = train(preset, data, optimizer="adamw", steps=steps, lr=lr, seed=0, batch=32, block=64, width=128,
                   layers=2, backend=backend, show_progress=False)
    result["seconds"] = time.perf_counter() - start
    print(f"  ({preset}: final {result['final']:.4f}, {result['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-maps", action="store_true", help="no reference-backend runs of the two maps")
    parser.add_argument("--maps-only", action="store_true", help="only the two maps (and fp32, the baseline)")
    parser.add_argument("--no-peers", action="store_true", help="no torchao / bitsandbytes runs")
    parser.add_argument("--peers-only", action="store_true", help="fp32 (the baseline) and the peers only")
    parser.add_argument("--backend", default="numba",
                        help="the presets' backend (reference: the same bits, no kernel to compile)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    lr = DEFAULT_LR["adamw"]
    rows = []
    presets = ("fp32",) if args.maps_only or args.peers_only else ("fp32", "fp32-remainder-q8", "bf16-sr-q8", "fp32-remainder-bf16-states")
    for preset in presets:
        rows.append((preset, run(preset, data, args.steps, lr, args.backend)))
    if not args.skip_maps and not args.peers_only:
        for kind in ("dynamic", "companded"):
            storage.Q8_MAP_KIND = kind  # the reference reads the map kind at each call
            for name in ("fp32-remainder-q8", "bf16-sr-q8"):
                precision = Precision(**{**PRESETS[name].to_dict(), "name": f"{name} ({kind}, reference)"})
                rows.append((precision.name, run(precision, data, args.steps, lr, "reference")))
        storage.Q8_MAP_KIND = "dynamic"
    peers = [(name, result) for name, dtype, factory in ([] if args.no_peers else _peer_optimizers())
             if (result := peer_run(name, dtype, factory, data, args.steps, lr)) is not None]
    base = rows[0][1]["final"]
    print(f"AdamW, {args.steps} steps, bf16 CharGPT (compare's default task); final loss, gap to fp32")
    table = []
    for name, result in rows + peers:
        gap = 100 * (result["final"] - base) / base
        limit = next((f"<= {v}%" for k, v in LIMITS.items() if name.startswith(k)), "")
        print(f"  {name:<40} {result['final']:.4f}  {gap:+.3f}%  {limit}")
        table.append({"preset": str(name), "final": result["final"], "gap_percent": gap})
    if not peers:
        print("  8-bit peers (torchao, bitsandbytes): none installed or none ran (optional peers)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(table, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
