"""A digest of every preset's bits: run a few hundred steps per optimizer, preset and backend
and print one SHA-256 per run over the params and the state dict's tensors.

A refactor that must not change a single bit runs this before and after and compares the
lines (``diff``).  Grads are made by a seeded generator, so the lines depend on the code
alone.

    python benchmarks/bits_digest.py [--steps 200] [--backends reference,numba] [--optimizers SGD] > digest.txt
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys

import torch

import bf16opt

SIZES = (1, 33, 4099)  # vector tails and a chunk boundary's neighbourhood
OPTIMIZERS = {
    "Adam": lambda params, **kw: bf16opt.Adam(params, lr=1e-3, weight_decay=0.01, **kw),
    "Adam-amsgrad": lambda params, **kw: bf16opt.Adam(params, lr=1e-3, amsgrad=True, **kw),
    "AdamW": lambda params, **kw: bf16opt.AdamW(params, lr=1e-3, weight_decay=0.1, **kw),
    "Lion": lambda params, **kw: bf16opt.Lion(params, lr=1e-4, weight_decay=0.1, **kw),
    "SGD": lambda params, **kw: bf16opt.SGD(params, lr=1e-2, **kw),
    "SGD-nesterov": lambda params, **kw: bf16opt.SGD(params, lr=1e-2, momentum=0.9, nesterov=True,
                                                     weight_decay=1e-3, **kw),
    "SGD-dampening": lambda params, **kw: bf16opt.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1, **kw),
}


def digest(optimizer_name: str, preset: str, backend: str, param_dtype: torch.dtype, steps: int) -> str:
    generator = torch.Generator().manual_seed(1234)
    params = [torch.randn(n, generator=generator).to(param_dtype).requires_grad_() for n in SIZES]
    optimizer = OPTIMIZERS[optimizer_name](params, precision=preset, backend=backend, seed=7)
    for step in range(steps):
        for param in params:
            grad = torch.randn(param.shape, generator=generator) * (0.1 if step % 7 else 10.0)
            param.grad = grad.to(param_dtype)
        optimizer.step()
    hasher = hashlib.sha256()
    for param in params:
        hasher.update(param.detach().view(torch.uint8).numpy().tobytes())
    buffer = io.BytesIO()
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            value = state[index][key]
            buffer.write(f"{index}.{key}:".encode())
            buffer.write(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                         if isinstance(value, torch.Tensor) else repr(value).encode())
    hasher.update(buffer.getvalue())
    return hasher.hexdigest()[:16]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backends", default="reference,numba")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="of: " + ", ".join(OPTIMIZERS))
    args = parser.parse_args(argv)
    for backend in args.backends.split(","):
        for optimizer_name in args.optimizers.split(","):
            for preset in bf16opt.PRESETS:
                for dtype in (torch.float32, torch.bfloat16):
                    try:
                        line = digest(optimizer_name, preset, backend, dtype, args.steps)
                    except ValueError as error:  # a preset that refuses this param dtype
                        line = f"refused: {str(error)[:60]}"
                    print(f"{backend:9} {optimizer_name:12} {preset:26} {str(dtype)[6:]:8} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
