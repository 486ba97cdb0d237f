"""What every backend receives: a bucket of tensors and the step's float32 scalars.

The optimizer groups the params of one param group by (device, KernelConfig, step); one
bucket is one call into a backend, so a kernel backend updates all tensors of a bucket in
a single launch.  Scalars are computed once on the host in float64 and rounded to float32
once (``f32``); every backend gets the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol

import numpy as np
import torch

from ..algorithms import KernelConfig


def f32(value: float) -> float:
    """Round a host scalar to float32 once (returned as an exactly representable float); one
    beyond float32's range becomes inf, which the step refuses by name (numpy's warning is noise)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


class LiveInputs(NamedTuple):
    """A live step's inputs (``capturable=True``, bf16opt/capture.py): what the kernels read
    on the device when they run, instead of the step's host scalars."""

    lr: Optional[torch.Tensor]    # one-element float32/float64 tensor on the device; None: lr_value
    lr_value: float
    decay_rate: float             # decoupled weight decay: decay = 1 - lr * decay_rate
    bias: Optional[torch.Tensor]  # Adam: float64 (rows, 2) bias corrections by step; else None
    grad_scale: Optional[torch.Tensor] = None  # GradScaler's loss scale (a captured step's); None: none
    found_inf: Optional[torch.Tensor] = None   # GradScaler's inf flag: non-zero skips the step


@dataclass
class Bucket:
    """The tensors of one kernel call: ``tensors[k][i]`` is role ``k`` (the order of
    ``config.algorithm.roles``) of param ``i``, None where the configuration has no such
    role.  ``bucket["exp_avg"]`` is one role's list."""

    config: KernelConfig
    tensors: list = field(default_factory=list)
    indices: list = field(default_factory=list)  # each param's index in the optimizer
    # index of each tensor's first element in its param: a chunk of a param (the offload
    # pipeline updates params in pieces) keeps its elements' random streams; empty: all 0
    offsets: list = field(default_factory=list)
    # what names each param's random streams (storage.stream_id: its name's hash or its
    # position); empty: ``indices``
    stream_ids: list = field(default_factory=list)
    seed: int = 0     # stochastic rounding: stream_key(seed, step, stream id, buffer)
    step: int = 0
    # Telemetry: when set, the backend writes each param's counters (the algorithm's
    # ``counters`` columns) into this int64 (len(params), 3) tensor.
    counts: Optional[torch.Tensor] = None
    # A live step (capturable=True): each param's step counter (a float64 tensor on its device,
    # advanced before the launch) names its step, and the kernels compute the scalars from it
    live: Optional[LiveInputs] = None
    counters: list = field(default_factory=list)

    def __post_init__(self):
        if not self.tensors:
            self.tensors = [[] for _ in self.config.algorithm.roles]

    @classmethod
    def of(cls, config: KernelConfig, columns: dict, **fields) -> "Bucket":
        """A bucket from ``{role name: list of tensors}``; roles not given are None."""
        names = [role.name for role in config.algorithm.roles]
        unknown = set(columns) - set(names)
        if unknown:
            raise ValueError(f"{config.algorithm.name} has no role {sorted(unknown)}")
        n = len(columns["param"])
        return cls(config, [list(columns.get(name, [None] * n)) for name in names], **fields)

    def __getitem__(self, role: str) -> list:
        return self.tensors[self.config.algorithm.roles.index(self._role(role))]

    def _role(self, name: str):
        for role in self.config.algorithm.roles:
            if role.name == name:
                return role
        raise KeyError(f"{self.config.algorithm.name} has no role {name!r}")

    def append(self, tensors: list, index: int, offset: int = 0, stream_id: Optional[int] = None) -> None:
        """Add one param's tensors (one per role, kernel order), its optimizer index, the
        index of their first element in the (whole, unsharded) param and its stream id
        (default: the index)."""
        for column, tensor in zip(self.tensors, tensors):
            column.append(tensor)
        self.indices.append(index)
        if offset or self.offsets:
            self.offsets.extend([0] * (len(self.indices) - 1 - len(self.offsets)))
            self.offsets.append(offset)
        if (stream_id is not None and stream_id != index) or self.stream_ids:
            self.stream_ids.extend(self.indices[len(self.stream_ids):-1])
            self.stream_ids.append(index if stream_id is None else stream_id)

    def offset(self, i: int) -> int:
        return self.offsets[i] if self.offsets else 0

    def stream_id(self, i: int) -> int:
        return self.stream_ids[i] if self.stream_ids else self.indices[i]

    def streams(self) -> list:
        """Every param's stream id (``stream_ids``, or ``indices`` when none was given)."""
        return list(self.stream_ids) if self.stream_ids else list(self.indices)

    @property
    def plan(self):
        return self.config.plan

    @property
    def params(self) -> list:
        return self.tensors[0]

    def written(self) -> list:
        """Every tensor the update writes (for autograd's version counters)."""
        return [t for role, column in zip(self.config.algorithm.roles, self.tensors) if role.written
                for t in column if t is not None]


def check_scalars(bucket: "Bucket", scalars) -> None:
    """A kernel backend's first check: the scalars are the bucket's algorithm's."""
    algorithm = bucket.config.algorithm
    if not isinstance(scalars, algorithm.scalars):
        raise TypeError(f"{algorithm.name} needs {algorithm.scalars.__name__}, got {type(scalars).__name__}")


class Backend(Protocol):
    name: str

    def run(self, bucket: Bucket, scalars) -> None: ...
