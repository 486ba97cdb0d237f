"""``bf16opt compare``: train one small language model per precision preset, side by side.

A laptop-scale version of DeepSpeed's bf16 master-weights experiment (seed 000): a
character-level GPT with bfloat16 params is trained on real text, by default the
Python standard library's own sources, once per preset, with the same seed and data
order.  Prints the loss table and the optimizer memory breakdown of each preset.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from . import Adam, AdamW, Lion, memory_report

DEFAULT_PRESETS = ("fp32", "bf16")
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


# ---------------------------------------------------------------- one run
def train(preset: str, data: torch.Tensor, *, optimizer: str, steps: int, lr: float, seed: int,
          batch: int, block: int, width: int, layers: int) -> dict:
    torch.manual_seed(seed)
    model = CharGPT(width=width, layers=layers, block=block).to(torch.bfloat16)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr, precision=preset)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)))  # linear warm-up
    losses, step_times = [], []
    for inputs, targets in batches(data, steps, batch, block, seed):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        start = time.perf_counter()
        opt.step()
        step_times.append(time.perf_counter() - start)
        schedule.step()
        losses.append(loss.item())
    tail = losses[-max(1, len(losses) // 10):]
    return {"preset": preset, "losses": losses, "final": statistics.fmean(tail),
            "mean": statistics.fmean(losses), "std": statistics.pstdev(losses),
            "step_ms": 1000 * statistics.median(step_times), "memory": memory_report(opt)}


# ---------------------------------------------------------------- report
def loss_table(results: list) -> str:
    lines = ["| Preset | Final loss | Mean loss | Loss std | Step time (ms) | Optimizer B/param |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['final']:.4f} | {r['mean']:.4f} | {r['std']:.4f} | "
                     f"{r['step_ms']:.2f} | {r['memory'].optimizer_bytes_per_param:.2f} |")
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    lr = args.lr if args.lr is not None else (3e-4 if args.optimizer == "lion" else 3e-3)
    text = args.corpus.read_bytes() if args.corpus else stdlib_corpus()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    if data.numel() < args.block + 2:
        parser.error(f"the corpus needs at least {args.block + 2} bytes")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for preset in (p.strip() for p in args.presets.split(",") if p.strip()):
        print(f"training with precision={preset!r} ({args.optimizer}, {args.steps} steps) ...", flush=True)
        result = train(preset, data, optimizer=args.optimizer, steps=args.steps, lr=lr, seed=args.seed,
                       batch=args.batch, block=args.block, width=args.width, layers=args.layers)
        results.append(result)
        print(result["memory"])
        print()
    print(f"Loss ({args.optimizer}, {len(text):,} bytes of text, final = mean of the last 10% of steps)")
    print(loss_table(results))
    if any(math.isnan(r["final"]) for r in results):
        return 1
    return 0
