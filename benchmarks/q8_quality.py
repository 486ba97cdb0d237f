"""Quality of q8 moments on ``bf16opt compare``'s default task: the final loss of each q8
preset against fp32 in the same run, the two candidate maps (dynamic tree, companded) on the
reference backend, and the 8-bit peers where they install from PyPI (optional, never
dependencies): torchao's AdamW8bit and bitsandbytes' AdamW8bit, each on bf16 and on fp32 params.

    python benchmarks/q8_quality.py [--steps 300] [--seed 0] [--skip-maps] [--no-peers | --peers-only]
                                    [--rows NAME [NAME ...]] [--backend numba] [--json out.json]

Prints each run's final loss (mean of the last 10% of steps) and its gap to fp32 as a
percentage, against the limits of issue 40 (0.3% for fp32-remainder-q8, 0.5% for bf16-sr-q8).
``--seed`` seeds every row alike (model init, data order, stochastic rounding); ``--rows`` runs
only the rows named exactly as the table prints them (a row with no fp32 row beside it prints
no gap), so that one seed's rows can run as separate processes.
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


def run(preset, data, steps: int, lr: float, backend: str, seed: int = 0) -> dict:
    start = time.perf_counter()
    result = train(preset, data, optimizer="adamw", steps=steps, lr=lr, seed=seed, batch=32, block=64, width=128,
                   layers=2, backend=backend, show_progress=False)
    result["seconds"] = time.perf_counter() - start
    print(f"  ({preset}: final {result['final']:.4f}, {result['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return result


def map_run(kind: str, name: str, data, steps: int, lr: float, seed: int) -> dict:
    """``name``'s preset on the reference backend with the ``kind`` map (dynamic or companded)."""
    precision = Precision(**{**PRESETS[name].to_dict(), "name": f"{name} ({kind}, reference)"})
    storage.Q8_MAP_KIND = kind  # the reference reads the map kind at each call
    try:
        return run(precision, data, steps, lr, "reference", seed)
    finally:
        storage.Q8_MAP_KIND = "dynamic"


def plan(args, data, lr: float) -> list:
    """(row name, is a peer, zero-argument run) for every row the flags ask for, in the table's
    order; nothing runs yet, so that ``--rows`` is checked before minutes are spent."""
    steps, seed = args.steps, args.seed
    rows = []
    presets = ("fp32",) if args.maps_only or args.peers_only else \
        ("fp32", "fp32-remainder-q8", "bf16-sr-q8", "fp32-remainder-bf16-states")
    for preset in presets:
        rows.append((preset, False, lambda preset=preset: run(preset, data, steps, lr, args.backend, seed)))
    if not args.skip_maps and not args.peers_only:
        for kind in ("dynamic", "companded"):
            for name in ("fp32-remainder-q8", "bf16-sr-q8"):
                rows.append((f"{name} ({kind}, reference)", False,
                             lambda kind=kind, name=name: map_run(kind, name, data, steps, lr, seed)))
    for name, dtype, factory in ([] if args.no_peers else _peer_optimizers()):
        rows.append((name, True, lambda name=name, dtype=dtype, factory=factory:
                     peer_run(name, dtype, factory, data, steps, lr, seed)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0,
                        help="model init, data order and rounding streams of every row")
    parser.add_argument("--skip-maps", action="store_true", help="no reference-backend runs of the two maps")
    parser.add_argument("--maps-only", action="store_true", help="only the two maps (and fp32, the baseline)")
    parser.add_argument("--no-peers", action="store_true", help="no torchao / bitsandbytes runs")
    parser.add_argument("--peers-only", action="store_true", help="fp32 (the baseline) and the peers only")
    parser.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                        help="only these rows, named exactly as the table prints them "
                             "(names hold commas: quote each)")
    parser.add_argument("--backend", default="numba",
                        help="the presets' backend (reference: the same bits, no kernel to compile)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    lr = DEFAULT_LR["adamw"]
    rows = plan(args, data, lr)
    if args.rows is not None:
        unknown = sorted(set(args.rows) - {name for name, _, _ in rows})
        if unknown:
            parser.error(f"--rows: no row named {unknown} with these flags (a peer must be installed); "
                         f"rows: {[name for name, _, _ in rows]}")
        rows = [row for row in rows if row[0] in args.rows]
    results = [(name, is_peer, result) for name, is_peer, run_row in rows
               if (result := run_row()) is not None]
    base = next((result["final"] for name, _, result in results if name == "fp32"), None)
    print(f"AdamW, {args.steps} steps, seed {args.seed}, bf16 CharGPT (compare's default task); "
          "final loss, gap to fp32")
    table = []
    width = max([40] + [len(name) for name, _, _ in results])  # peer names run past 40 characters
    for name, _, result in results:
        gap = None if base is None else 100 * (result["final"] - base) / base
        limit = next((f"<= {v}%" for k, v in LIMITS.items() if name.startswith(k)), "")
        shown = "(no fp32 row)" if gap is None else f"{gap:+.3f}%"
        print(f"  {name:<{width}} {result['final']:.4f}  {shown}  {limit}")
        table.append({"preset": str(name), "seed": args.seed, "final": result["final"], "gap_percent": gap})
    if not any(is_peer for _, is_peer, _ in results) and not args.no_peers and args.rows is None:
        print("  8-bit peers (torchao, bitsandbytes): none installed or none ran (optional peers)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(table, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
