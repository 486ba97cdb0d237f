"""The two candidate q8 maps (dynamic tree, companded) on real Adam moments: the moments of
``bf16opt compare``'s default model after ``--steps`` AdamW steps with fp32 moments, each
quantized with each map (round to nearest, bf16opt/storage.py), and the error that makes in
the moments and in Adam's update direction ``m / (sqrt(v) + eps)``.

    python benchmarks/q8_maps.py [--steps 100]

Prints, per map, the relative RMS error of exp_avg, of exp_avg_sq and of the update over every
param of 4096+ elements (the ones q8 stores), and the share of non-zero moments stored as 0.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn import functional as F

import bf16opt
from bf16opt import storage
from bf16opt.cli import DEFAULT_LR, stdlib_corpus
from bf16opt.compare import CharGPT, batches, warmup_cosine


def trained_moments(steps: int) -> list:
    data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    torch.manual_seed(0)
    model = CharGPT(width=128, layers=2, block=64).to(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), lr=DEFAULT_LR["adamw"], precision="fp32-remainder", backend="numba")
    schedule = warmup_cosine(opt, 300)  # the default run's schedule, stopped after ``steps``
    for inputs, targets in batches(data, steps, 32, 64, 0):
        loss = F.cross_entropy(model(inputs).float().reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
    return [(state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)) for state in opt.state.values()
            if state["exp_avg"].numel() >= 4096]


def errors(moments: list, kind: str, eps: float = 1e-8) -> dict:
    sums = {"exp_avg": [0.0, 0.0], "exp_avg_sq": [0.0, 0.0], "update": [0.0, 0.0]}
    zeros, nonzero = 0, 0
    for m, v in moments:
        mq = storage.q8_decode(storage.q8_encode(m, True, kind=kind), m.shape, True, kind=kind)
        vq = storage.q8_decode(storage.q8_encode(v, False, kind=kind), v.shape, False, kind=kind)
        u, uq = m / (v.sqrt() + eps), mq / (vq.sqrt() + eps)
        for name, exact, got in (("exp_avg", m, mq), ("exp_avg_sq", v, vq), ("update", u, uq)):
            sums[name][0] += float(((got.double() - exact.double()) ** 2).sum())
            sums[name][1] += float((exact.double() ** 2).sum())
        zeros += int(((m != 0) & (mq == 0)).sum() + ((v != 0) & (vq == 0)).sum())
        nonzero += int((m != 0).sum() + (v != 0).sum())
    result = {name: (err / ref) ** 0.5 for name, (err, ref) in sums.items()}
    result["stored as 0"] = zeros / max(nonzero, 1)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    moments = trained_moments(args.steps)
    print(f"relative RMS error after {args.steps} AdamW steps ({len(moments)} q8-sized params)")
    for kind in ("dynamic", "companded"):
        row = errors(moments, kind)
        print(f"  {kind:10s} " + "   ".join(f"{name} {value:.4%}" for name, value in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
