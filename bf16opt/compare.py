"""``bf16opt compare``: train one small language model per precision preset, side by side.

A laptop-scale version of DeepSpeed's bf16 master-weights experiment (seed 000): a
character-level GPT with bfloat16 params is trained on real text, by default the
Python standard library's own sources, once per preset, with the same seed and data
order.  Writes a loss CSV per preset and ``loss_comparison.png`` (when matplotlib is
installed) into ``--out``, and prints the memory breakdown and the loss table.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from . import Adam, AdamW, Lion, memory_report

DEFAULT_PRESETS = ("fp32", "bf16", "bf16-kahan", "bf16-sr", "fp32-remainder")
OPTIMIZERS = {"adamw": AdamW, "adam": Adam, "lion": Lion}


# ---------------------------------------------------------------- data
def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Text every Python installation carries: its standard library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}; pass --corpus FILE")
    return b"".join(chunks)[:max_bytes]


def batches(data: torch.Tensor, steps: int, batch: int, block: int, seed: int):
    """The same (input, target) sequence for every run with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=generator)
        rows = torch.stack([data[s:s + block + 1] for s in starts.tolist()]).long()
        yield rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    """A small GPT over bytes (vocabulary 256)."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, block: int = 64):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(block, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def warmup_cosine(steps: int, warmup: float = 0.1, floor: float = 0.05):
    """LR factor: linear warm-up over 10% of the steps, then cosine decay to 5%."""
    warm = max(1, int(steps * warmup))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# ---------------------------------------------------------------- measuring
class StepPeakMemory:
    """Extra resident memory a step needs beyond what the process held before it
    (temporaries; the state itself is allocated by the first step, which is not measured).

    Linux only (reads and resets the peak RSS in /proc/self); elsewhere reports None.
    """

    def __init__(self):
        self.available = Path("/proc/self/clear_refs").exists()
        self.peak = 0

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        if self.available:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
                self.before = self._status("VmRSS")
            except OSError:
                self.available = False
        return self

    def __exit__(self, *exc):
        if self.available:
            self.peak = max(self.peak, self._status("VmHWM") - self.before)

    @property
    def mib(self):
        return self.peak / 2 ** 20 if self.available else None


def progress(label: str, done: int, total: int, loss: float, stream=None) -> None:
    stream = sys.stderr if stream is None else stream  # the current stderr, not import time's
    width = 30
    filled = width * done // total
    stream.write(f"\r{label:>14s} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} loss {loss:.4f}")
    if done == total:
        stream.write("\n")
    stream.flush()


# ---------------------------------------------------------------- one run
def train(preset: str, data: torch.Tensor, *, optimizer: str, steps: int, lr: float, seed: int,
          batch: int, block: int, width: int, layers: int, backend: str = "auto",
          show_progress: bool = True) -> dict:
    torch.manual_seed(seed)
    model = CharGPT(width=width, layers=layers, block=block).to(torch.bfloat16)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr, precision=preset, seed=seed,
                                backend=backend, track_precision=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    rows, step_times = [], []
    peak = StepPeakMemory()
    for number, (inputs, targets) in enumerate(batches(data, steps, batch, block, seed), start=1):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lr_now = opt.param_groups[0]["lr"]
        with peak if number > 1 else contextlib.nullcontext():  # step 1 allocates the state
            start = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - start)
        schedule.step()
        rows.append({"step": number, "loss": loss.item(), "lr": lr_now, "step_ms": 1000 * step_times[-1],
                     "swallowed": opt.precision_stats()["total"]["swallowed"]})
        if show_progress and (number % max(1, steps // 50) == 0 or number == steps):
            progress(preset, number, steps, rows[-1]["loss"])
    losses = [row["loss"] for row in rows]
    tail = losses[-max(1, len(losses) // 10):]
    return {"preset": preset, "rows": rows, "losses": losses, "final": statistics.fmean(tail),
            "mean": statistics.fmean(losses), "std": statistics.pstdev(losses),
            # step 1 allocates the state and compiles (or loads) the kernels: not a typical step
            "step_ms": 1000 * statistics.fmean(step_times[1:] or step_times),
            "swallowed": statistics.fmean(row["swallowed"] for row in rows),
            "peak_mib": peak.mib, "memory": memory_report(opt)}


# ---------------------------------------------------------------- report
def memory_table(results: list) -> str:
    """Bytes per parameter by component, one column per preset (seed 000's Memory Breakdown)."""
    header = "| Component | " + " | ".join(r["preset"] for r in results) + " |"
    lines = [header, "|---" * (len(results) + 1) + "|"]

    def cell(report, name):
        dtypes = "+".join(sorted(report.dtypes.get(name, ())))
        value = report.bytes_per_param.get(name, 0.0)
        return f"{value:.2f} ({dtypes})" if dtypes else "-"

    names = [name for name in results[0]["memory"].bytes if name != "step"]
    for name in names:
        if not any(r["memory"].bytes.get(name) for r in results):
            continue  # e.g. amsgrad's max_exp_avg_sq
        lines.append(f"| {name} | " + " | ".join(cell(r["memory"], name) for r in results) + " |")
    lines.append("| **optimizer total** | " + " | ".join(
        f"**{r['memory'].optimizer_bytes_per_param:.2f}**" for r in results) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r['memory'].total_per_param:.2f}**" for r in results) + " |")
    lines.append("| step peak extra RSS (MiB) | " + " | ".join(
        "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}" for r in results) + " |")
    return "\n".join(lines)


def loss_table(results: list) -> str:
    base = results[0]["final"]
    lines = [f"| Preset | Final loss | vs {results[0]['preset']} | Mean loss | Loss std | Mean opt.step() (ms) | "
             f"Swallowed updates |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['final']:.4f} | {100 * (r['final'] / base - 1):+.2f}% | "
                     f"{r['mean']:.4f} | {r['std']:.4f} | {r['step_ms']:.2f} | {100 * r['swallowed']:.2f}% |")
    lines.append("\nSwallowed updates: non-zero updates that left the stored weights unchanged "
                 "(Kahan carries them in its compensation buffer, stochastic rounding applies them "
                 "on average; with round to nearest they are lost).")
    return "\n".join(lines)


def write_csv(result: dict, out: Path) -> Path:
    path = out / f"loss_{result['preset']}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
    return path


def plot(results: list, out: Path):
    """loss_comparison.png: loss curves and the gap to the first preset; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (curves, gaps) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    window = max(1, len(results[0]["losses"]) // 50)

    def smooth(values):
        return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]

    base = smooth(results[0]["losses"])
    for r in results:
        curve = smooth(r["losses"])
        curves.plot(curve, label=r["preset"])
        gaps.plot([a - b for a, b in zip(curve, base)], label=r["preset"])
    curves.set_ylabel(f"loss (moving mean of {window})")
    curves.legend()
    gaps.set_ylabel(f"loss - {results[0]['preset']} loss")
    gaps.axhline(0.0, color="grey", linewidth=0.5)
    gaps.set_xlabel("step")
    figure.tight_layout()
    path = out / "loss_comparison.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bf16opt compare", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                        help="comma-separated precision presets (default: %(default)s)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=None, help="default 3e-3 (Adam), 3e-4 (Lion)")
    parser.add_argument("--corpus", type=Path, default=None, help="text file (default: Python stdlib sources)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="bf16opt backend (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="output directory (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    lr = args.lr if args.lr is not None else (3e-4 if args.optimizer == "lion" else 3e-3)
    text = args.corpus.read_bytes() if args.corpus else stdlib_corpus()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    if data.numel() < args.block + 2:
        parser.error(f"the corpus needs at least {args.block + 2} bytes")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = str(args.corpus) if args.corpus else "Python standard library sources"
    print(f"bf16opt compare: {args.optimizer}, {args.steps} steps, {len(presets)} presets, "
          f"{len(text):,} bytes of text ({corpus})", flush=True)
    results = []
    for preset in presets:
        result = train(preset, data, optimizer=args.optimizer, steps=args.steps, lr=lr, seed=args.seed,
                       batch=args.batch, block=args.block, width=args.width, layers=args.layers,
                       backend=args.backend, show_progress=not args.no_progress)
        write_csv(result, args.out)
        results.append(result)
    figure = plot(results, args.out)
    n = results[0]["memory"].num_params
    print(f"\nMemory breakdown, bytes per parameter (N = {n:,} bf16 params)")
    print(memory_table(results))
    print("\nLoss (final = mean of the last 10% of steps)")
    print(loss_table(results))
    print(f"\nwrote {', '.join(f'loss_{p}.csv' for p in presets)}"
          + (", loss_comparison.png" if figure else " (install matplotlib for loss_comparison.png)")
          + f" to {args.out}")
    return 1 if any(math.isnan(r["final"]) for r in results) else 0
