"""Quality of q8 moments on ``bf16opt compare``'s default task: the final loss of each q8
preset against fp32 in the same run, the two candidate maps (dynamic tree, companded) on the
reference backend, and torchao's AdamW8bit where it installs (an optional peer).

    python benchmarks/q8_quality.py [--steps 300] [--skip-maps] [--json out.json]

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


def torchao_run(data, steps: int, lr: float, seed: int = 0) -> "dict | None":
    """torchao's AdamW8bit on the same model, data and schedule (fp32 params: torchao keeps
    the param dtype as its master), or None where torchao does not install or run."""
    try:
        from torchao.optim import AdamW8bit  # noqa: PLC0415  (an optional peer)
    except ImportError:
        return None
    torch.manual_seed(seed)
    model = CharGPT(width=128, layers=2, block=64).to(torch.bfloat16)
    try:
        opt = AdamW8bit(model.parameters(), lr=lr)
    except Exception as exc:  # noqa: BLE001  (a peer's failure is reported, not raised)
        print(f"torchao AdamW8bit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    schedule = warmup_cosine(opt, steps)
    losses = []
    for inputs, targets in batches(data, steps, 32, 64, seed):
        loss = F.cross_entropy(model(inputs).float().reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    tail = losses[-max(1, len(losses) // 10):]
    return {"preset": "torchao AdamW8bit", "final": statistics.fmean(tail)}


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
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    lr = DEFAULT_LR["adamw"]
    rows = []
    presets = ("fp32",) if args.maps_only else ("fp32", "fp32-remainder-q8", "bf16-sr-q8", "fp32-remainder-bf16-states")
    for preset in presets:
        rows.append((preset, run(preset, data, args.steps, lr, "numba")))
    if not args.skip_maps:
        for kind in ("dynamic", "companded"):
            storage.Q8_MAP_KIND = kind  # the reference reads the map kind at each call
            for name in ("fp32-remainder-q8", "bf16-sr-q8"):
                precision = Precision(**{**PRESETS[name].to_dict(), "name": f"{name} ({kind}, reference)"})
                rows.append((precision.name, run(precision, data, args.steps, lr, "reference")))
        storage.Q8_MAP_KIND = "dynamic"
    peer = torchao_run(data, args.steps, lr)
    base = rows[0][1]["final"]
    print(f"AdamW, {args.steps} steps, bf16 CharGPT (compare's default task); final loss, gap to fp32")
    table = []
    for name, result in rows + ([("torchao AdamW8bit", peer)] if peer else []):
        gap = 100 * (result["final"] - base) / base
        limit = next((f"<= {v}%" for k, v in LIMITS.items() if name.startswith(k)), "")
        print(f"  {name:<40} {result['final']:.4f}  {gap:+.3f}%  {limit}")
        table.append({"preset": str(name), "final": result["final"], "gap_percent": gap})
    if peer is None:
        print("  torchao AdamW8bit: not installed (optional peer)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(table, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
