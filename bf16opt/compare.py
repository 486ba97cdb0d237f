"""``bf16opt compare``: train one small language model per precision preset, side by side.

A laptop-scale version of DeepSpeed's bf16 master-weights experiment (seed 000): a
character-level GPT with bfloat16 params is trained on real text, by default the
Python standard library's own sources, once per preset, with the same seed, data
order and learning-rate schedule.  Writes a loss CSV per preset and
``loss_comparison.png`` (when matplotlib is installed) into ``--out`` (``--json``: also
``results.json``), and prints the memory breakdown and the loss table.

Every argument is checked before the first run trains: a bad one ends the command with
exit status 2 and a one-line message naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.nn import functional as F

from . import SGD, Adam, AdamW, Lion, __version__, memory_report
from .cli import HEADS, RESULTS_JSON, Corpus
from .memory import MemoryReport, format_table

try:  # the live progress bar (bf16opt[plot]); plain progress lines without it
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

__all__ = ["OPTIMIZERS", "CharGPT", "Progress", "StepPeakMemory", "execute", "train"]

OPTIMIZERS: dict[str, type[Adam | Lion | SGD]] = {"adamw": AdamW, "adam": Adam, "lion": Lion,
                                                   "sgd": SGD}
#: extra constructor arguments per optimizer
OPTIMIZER_KWARGS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.9}}


# ---------------------------------------------------------------- data
def batches(data: torch.Tensor, steps: int, batch: int, block: int,
            seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class CharGPT(nn.Module):
    """A small GPT over bytes (vocabulary 256)."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = HEADS, block: int = 64):
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
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: float = 0.1,
                  floor: float = 0.05) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's schedulers: linear warm-up over 10% of the steps (``LinearLR``), then cosine
    decay to 5% of the peak (``CosineAnnealingLR``), chained by ``SequentialLR``.

    The factor of step k (from 0) is (k + 1) / warm during warm-up, then
    floor + (1 - floor) (1 + cos(pi (k - warm) / (steps - warm))) / 2.
    """
    warm = max(1, int(steps * warmup))
    peak = [float(group["lr"]) for group in optimizer.param_groups]
    rise = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / warm, end_factor=1.0,
                                             total_iters=warm - 1)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps - warm),
                                                       eta_min=floor * min(peak))
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [rise, decay], milestones=[warm])


# ---------------------------------------------------------------- measuring
class StepPeakMemory:
    """Extra resident memory a step needs beyond what the process held before it
    (temporaries; the state itself is allocated by the first step, which is not measured).

    ``method``: ``"proc"`` (Linux: resets and reads the process's peak RSS in /proc/self,
    exact), ``"psutil"`` (any OS with psutil installed: the RSS sampled every 0.5 ms by a
    thread during the step, so a shorter peak can be missed) or ``None``: the first of the
    two that works here.  ``available`` is False when neither does (``mib`` is then None).
    """

    LABELS = {"proc": "/proc/self peak RSS, exact", "psutil": "psutil, RSS sampled every 0.5 ms",
              None: "not measured: needs Linux /proc or psutil"}

    def __init__(self, method: str | None = None):
        if method not in (None, "proc", "psutil"):
            raise ValueError(f"method must be None, 'proc' or 'psutil', got {method!r}")
        self.peak = 0
        self.before = 0
        self._process: Any = None
        self._sampling: threading.Event | None = None
        self._sampler: threading.Thread | None = None
        self._sampled = 0
        candidates = [method] if method else ["proc", "psutil"]
        self.method = next((m for m in candidates if self._usable(m)), None)

    @property
    def available(self) -> bool:
        return self.method is not None

    @property
    def label(self) -> str:
        return self.LABELS[self.method]

    def _usable(self, method: str) -> bool:
        if method == "proc":
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
                return self._status("VmHWM") > 0
            except OSError:
                return False
        try:
            import psutil
        except ImportError:
            return False
        self._process = psutil.Process()
        return True

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        assert self._sampling is not None
        while not self._sampling.wait(0.0005):
            self._sampled = max(self._sampled, self._process.memory_info().rss)

    def __enter__(self) -> StepPeakMemory:
        if self.method == "proc":
            Path("/proc/self/clear_refs").write_text("5")
            self.before = self._status("VmRSS")
        elif self.method == "psutil":
            self.before = self._sampled = self._process.memory_info().rss
            self._sampling = threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.method == "proc":
            self.peak = max(self.peak, self._status("VmHWM") - self.before)
        elif self.method == "psutil":
            assert self._sampling is not None and self._sampler is not None
            self._sampling.set()
            self._sampler.join()
            rss = max(self._sampled, self._process.memory_info().rss)
            self.peak = max(self.peak, rss - self.before)

    @property
    def mib(self) -> float | None:
        return self.peak / 2 ** 20 if self.available else None


class Progress:
    """One run's progress on ``stream`` (stderr by default).

    On a terminal: a live ``tqdm`` bar.  Otherwise (a pipe, a file, a CI log) or without
    tqdm: a plain line every 10% of the steps, so logs get lines, not carriage returns.
    """

    def __init__(self, label: str, total: int, stream: IO[str] | None = None, enabled: bool = True):
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream  # the current stderr, not import time's
        self.enabled = enabled
        self.every = max(1, total // 10)
        self.start = time.perf_counter()
        self.bar = None
        if enabled and tqdm is not None and _is_terminal(self.stream):
            self.bar = tqdm(total=total, desc=f"{label:>14s}", file=self.stream, unit="step",
                            dynamic_ncols=True, leave=True)

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            self.bar.update(done - self.bar.n)
        elif done % self.every == 0 or done == self.total:
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"{self.label}: step {done}/{self.total} ({100 * done // self.total}%) "
                              f"loss {loss:.4f}, {done / max(elapsed, 1e-9):.1f} steps/s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ---------------------------------------------------------------- one run
def train(preset: str, data: torch.Tensor, *, optimizer: str, steps: int, lr: float, seed: int,
          batch: int, block: int, width: int, layers: int, backend: str = "auto",
          show_progress: bool = True, peak_method: str | None = None) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = CharGPT(width=width, layers=layers, block=block).to(torch.bfloat16)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr, precision=preset, seed=seed, backend=backend,
                                track_precision=True, **OPTIMIZER_KWARGS.get(optimizer, {}))
    schedule = warmup_cosine(opt, steps)
    rows: list[dict[str, Any]] = []
    step_times: list[float] = []
    peak = StepPeakMemory(peak_method)
    progress = Progress(preset, steps, enabled=show_progress)
    try:
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
            progress.update(number, rows[-1]["loss"])
    finally:
        progress.close()
    losses = [row["loss"] for row in rows]
    tail = losses[-max(1, len(losses) // 10):]
    return {"preset": preset, "rows": rows, "losses": losses, "final": statistics.fmean(tail),
            "mean": statistics.fmean(losses), "std": statistics.pstdev(losses),
            # step 1 allocates the state and compiles (or loads) the kernels: not a typical step,
            # so a run of one step measures no step time or peak (None: "n/a" in the tables)
            "step_ms": 1000 * statistics.fmean(step_times[1:]) if len(step_times) > 1 else None,
            "swallowed": statistics.fmean(row["swallowed"] for row in rows),
            "peak_mib": peak.mib if len(step_times) > 1 else None, "peak_method": peak.label,
            "memory": memory_report(opt)}


# ---------------------------------------------------------------- report
def _components(results: Sequence[dict[str, Any]]) -> list[str]:
    """Components any run holds, in report order (e.g. no amsgrad's max_exp_avg_sq)."""
    names = [name for name in results[0]["memory"].bytes if name != "step"]
    return [name for name in names if any(r["memory"].bytes.get(name) for r in results)]


def memory_table(results: Sequence[dict[str, Any]]) -> str:
    """Bytes per parameter by component, one column per preset (seed 000's Memory Breakdown)."""

    def cell(report: MemoryReport, name: str) -> str:
        dtypes = "+".join(sorted(report.dtypes.get(name, ())))
        return f"{report.bytes_per_param.get(name, 0.0):.2f} ({dtypes})" if dtypes else "-"

    rows = [[name, *(cell(r["memory"], name) for r in results)] for name in _components(results)]
    rows.append(["**optimizer total**",
                 *(f"**{r['memory'].optimizer_bytes_per_param:.2f}**" for r in results)])
    rows.append(["**total**", *(f"**{r['memory'].total_per_param:.2f}**" for r in results)])
    rows.append([f"step peak extra RSS (MiB; {results[0]['peak_method']})",
                 *("n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}" for r in results)])
    header = ["Component", *(r["preset"] for r in results)]
    return format_table(header, rows, align="l" + "r" * len(results))


def loss_table(results: Sequence[dict[str, Any]]) -> str:
    base = results[0]["final"]
    header = ["Preset", "Final loss", f"vs {results[0]['preset']}", "Mean loss", "Loss std",
              "Mean opt.step() (ms)", "Swallowed updates"]
    rows = [[r["preset"], f"{r['final']:.4f}", f"{100 * (r['final'] / base - 1):+.2f}%", f"{r['mean']:.4f}",
             f"{r['std']:.4f}", "n/a" if r["step_ms"] is None else f"{r['step_ms']:.2f}",
             f"{100 * r['swallowed']:.2f}%"] for r in results]
    return (format_table(header, rows, align="lrrrrrr")
            + "\n\nSwallowed updates: non-zero updates that left the stored weights unchanged "
              "(Kahan carries them in its compensation buffer, stochastic rounding applies them "
              "on average; with round to nearest they are lost).")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def results_json(results: Sequence[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The two tables as data (results.json): raw numbers, non-finite ones as null."""
    base = results[0]["final"]
    components = _components(results)
    memory = []
    for r in results:
        report: MemoryReport = r["memory"]
        memory.append({
            "preset": r["preset"], "num_params": report.num_params,
            "bytes_per_param": {name: report.bytes_per_param.get(name, 0.0) for name in components},
            "dtypes": {name: sorted(report.dtypes.get(name, ())) for name in components},
            "optimizer_bytes_per_param": report.optimizer_bytes_per_param,
            "total_bytes_per_param": report.total_per_param,
            "step_peak_extra_mib": _finite(r["peak_mib"])})
    loss = [{"preset": r["preset"], "final_loss": _finite(r["final"]),
             "vs_first_preset": _finite(r["final"] / base - 1), "mean_loss": _finite(r["mean"]),
             "loss_std": _finite(r["std"]), "mean_step_ms": r["step_ms"],
             "swallowed_fraction": r["swallowed"],
             "csv": f"loss_{r['preset']}.csv"} for r in results]
    return {"bf16opt": __version__, "settings": settings, "peak_memory_method": results[0]["peak_method"],
            "final_loss": "mean loss of the last 10% of steps", "memory": memory, "loss": loss}


def write_csv(result: dict[str, Any], out: Path) -> Path:
    path = out / f"loss_{result['preset']}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
    return path


def plot(results: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """loss_comparison.png: loss curves and the gap to the first preset; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (curves, gaps) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    window = max(1, len(results[0]["losses"]) // 50)

    def smooth(values: list[float]) -> list[float]:
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


def execute(args: argparse.Namespace, corpus: Corpus) -> int:
    """The runs, the files and the tables of ``bf16opt compare``, with ``args`` and ``corpus``
    that :func:`bf16opt.cli.parse` has checked."""
    presets: list[str] = args.presets
    data = torch.frombuffer(bytearray(corpus.text), dtype=torch.uint8)
    print(f"bf16opt compare: {args.optimizer}, {args.steps} steps, {len(presets)} presets, "
          f"{len(corpus.text):,} bytes of text ({corpus.name})", flush=True)
    results = []
    for preset in presets:
        result = train(preset, data, optimizer=args.optimizer, steps=args.steps, lr=args.lr, seed=args.seed,
                       batch=args.batch, block=args.block, width=args.width, layers=args.layers,
                       backend=args.backend, show_progress=not args.no_progress)
        write_csv(result, args.out)
        results.append(result)
    figure = plot(results, args.out)
    written = [f"loss_{p}.csv" for p in presets]
    if figure:
        written.append(figure.name)
    if args.json:
        settings = {"optimizer": args.optimizer, "optimizer_kwargs": OPTIMIZER_KWARGS.get(args.optimizer, {}),
                    "steps": args.steps, "lr": args.lr,
                    "schedule": "LinearLR warm-up (10%), CosineAnnealingLR to 5%",
                    "seed": args.seed, "batch": args.batch, "block": args.block, "width": args.width,
                    "layers": args.layers, "heads": HEADS, "backend": args.backend, "presets": presets,
                    "corpus": corpus.name, "corpus_bytes": len(corpus.text)}
        (args.out / RESULTS_JSON).write_text(json.dumps(results_json(results, settings), indent=2,
                                                        allow_nan=False) + "\n")
        written.append(RESULTS_JSON)
    n = results[0]["memory"].num_params
    print(f"\nMemory breakdown, bytes per parameter (N = {n:,} bf16 params)")
    print(memory_table(results))
    print("\nLoss (final = mean of the last 10% of steps)")
    print(loss_table(results))
    print(f"\nwrote {', '.join(written)} to {args.out}"
          + ("" if figure else " (install matplotlib, bf16opt's [plot] extra, for loss_comparison.png)"))
    return 1 if any(math.isnan(r["final"]) for r in results) else 0

