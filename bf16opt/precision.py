"""Precision policies: which dtype each optimizer buffer is stored in.

A :class:`Precision` is what the user asks for; a :class:`StoragePlan` is what one
parameter actually gets once the request meets that parameter's dtype.

Rules that turn a request into a plan (documented in the README too):

* **The master may not be less precise than the param.**  Precision order is
  float32 > float16 > bfloat16 (24, 11 and 8 significand bits).  When the requested
  master is not more precise than the param, the param itself is the master and no
  copy exists: ``"bf16"`` on float32 params keeps float32 weights, on float16 params
  keeps float16 weights.  When it is more precise (float32 master for bf16/fp16
  params) the optimizer owns a float32 copy and writes the rounded result into the
  param after every step.
* A float16 master for bfloat16 params is rejected: float16 cannot hold bfloat16's
  range (max 65504 vs 3.4e38).
* Moments (``exp_avg``, ``exp_avg_sq`` and amsgrad's ``max_exp_avg_sq``) are float32 or
  bfloat16 whatever the param dtype; float16 moments are rejected (``exp_avg_sq``
  holds squared gradients, which leave float16's range).
* ``rounding="stochastic"`` applies to the buffers that accumulate across steps and are
  16-bit: the master weights (when the 16-bit param is the master) and 16-bit moments.
  A param written from a float32 master copy is its round to nearest even; a param edited
  between steps is the master from then on (``storage.join_copy``).
* ``compensation="kahan"`` adds a buffer (``compensation_dtype``, bfloat16 by default)
  that carries each step's rounding error of 16-bit master weights into the next step;
  with a float32 master there is nothing to compensate and no buffer is made.
* ``"q8"`` moments (``exp_avg``/``exp_avg_sq``, SGD's momentum through ``exp_avg``) are
  8-bit codes in blocks of 256 elements with a float32 scale per block (``storage.py``,
  "q8"), rounded to nearest unless ``q8_rounding="stochastic"``.  A param of fewer than
  ``q8_min_numel`` elements (4096 by default, counted over the whole param, so every
  shard of a sharded param decides alike) keeps ``small_moments`` (float32 or bfloat16)
  instead.
* float64 params are their own master (no preset is more precise) and are updated in
  float64 math; their moments keep the preset's dtypes.
* ``compensation="remainder"`` (requires ``master="fp32"``) stores the float32 master of
  bfloat16 params exactly as the param plus a 16-bit remainder.  The param is then the
  master rounded to nearest with ties away from zero (not to even): an even bfloat16
  value owns 65537 float32 patterns once both ties are counted, one more than 16 bits
  can name.  float32 params are their own master; float16 params get a float32 copy.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .storage import Q8

__all__ = ["Precision", "PRESETS", "StoragePlan", "all_plans", "as_precision", "plan_for", "q8_plans"]

#: dtypes a Precision may name, and the params the kernels update
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: float64 params are updated too, in float64 math, by the reference backend (see plan_for)
FLOAT64 = torch.float64
MOMENT_DTYPES = (torch.float32, torch.bfloat16, Q8)
#: the dtypes of moments kept element by element (a q8 moment's small params keep one of these)
ELEMENT_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
ROUNDINGS = ("nearest", "stochastic")
COMPENSATIONS = (None, "kahan", "remainder")

# significand bits, the order in which a master may replace a param
_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
SHORT_NAME = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
              torch.int16: "int16", Q8: "q8"}
_Q8_ARGUMENTS = ("exp_avg", "exp_avg_sq")
# the names each dtype argument takes (the torch dtypes of the same names too)
_ALLOWED_NAMES = {"master": ("fp32", "bf16", "fp16"), "exp_avg": ("fp32", "bf16", "q8"),
                  "exp_avg_sq": ("fp32", "bf16", "q8"), "compensation_dtype": ("bf16", "fp32"),
                  "small_moments": ("fp32", "bf16")}


def _as_dtype(value, argument: str) -> torch.dtype:
    """The dtype an argument names: ValueError for an unknown name or a dtype of no float
    format, TypeError for a value that is neither a name nor a dtype."""
    if argument in _Q8_ARGUMENTS and (value is Q8 or (isinstance(value, str) and value.lower() == "q8")):
        return Q8
    allowed = ", ".join(f"'{name}'" for name in _ALLOWED_NAMES[argument])
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.lower()]
    else:
        error = ValueError if isinstance(value, str) else TypeError
        raise error(f"Precision({argument}=...) must be one of {allowed} or the matching torch dtype, "
                    f"got {value!r}")
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"Precision({argument}=...) must be one of {allowed} or the matching torch dtype, "
                         f"got {dtype}")
    return dtype


@dataclass(frozen=True)
class Precision:
    """Storage dtypes of the optimizer's buffers.

    Args:
        master: dtype of the master weights the update is applied to (see module doc
            for how it combines with the param dtype).
        exp_avg: dtype of the first moment (Adam and Lion).
        exp_avg_sq: dtype of the second moment (Adam only; also amsgrad's maximum).
        rounding: how float32 results are encoded into 16-bit storage:
            ``"nearest"`` (round to nearest, ties to even) or ``"stochastic"``.
        compensation: ``None``, ``"kahan"`` (a buffer carrying each update's rounding
            error into the next step) or ``"remainder"`` (exact float32 master as
            bfloat16 param + 16-bit remainder; needs ``master="fp32"``).
        compensation_dtype: dtype of the Kahan buffer (``"bf16"`` or ``"fp32"``).
        small_moments: dtype (``"fp32"`` or ``"bf16"``) of the ``"q8"`` moments of params
            with fewer than ``q8_min_numel`` elements.
        q8_min_numel: the smallest param (in elements) whose moments are ``"q8"``.
        q8_rounding: how ``"q8"`` moments are rounded to their codes: ``"nearest"`` or
            ``"stochastic"`` (on the same counter-based streams as 16-bit stochastic rounding).
    """

    master: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32
    rounding: str = "nearest"
    compensation: str | None = None
    compensation_dtype: torch.dtype = torch.bfloat16
    small_moments: torch.dtype = torch.float32
    q8_min_numel: int = 4096
    q8_rounding: str = "nearest"
    name: str | None = field(default=None, compare=False)

    if TYPE_CHECKING:  # the generated __init__ also takes dtype names ("bf16"): __post_init__ converts them
        def __init__(self, master: torch.dtype | str = ..., exp_avg: torch.dtype | str = ...,
                     exp_avg_sq: torch.dtype | str = ..., rounding: str = ..., compensation: str | None = ...,
                     compensation_dtype: torch.dtype | str = ..., small_moments: torch.dtype | str = ...,
                     q8_min_numel: int = ..., q8_rounding: str = ..., name: str | None = ...) -> None: ...

    def __post_init__(self):
        for argument in ("master", "exp_avg", "exp_avg_sq", "compensation_dtype", "small_moments"):
            object.__setattr__(self, argument, _as_dtype(getattr(self, argument), argument))
        for argument in ("exp_avg", "exp_avg_sq"):
            if getattr(self, argument) not in MOMENT_DTYPES:
                raise ValueError(
                    f"Precision({argument}=float16) is not supported: moments are stored in "
                    f"float32, bfloat16 or q8 (float16 cannot hold squared gradients' range)")
        if self.small_moments not in ELEMENT_MOMENT_DTYPES:
            raise ValueError("Precision(small_moments=...) must be 'fp32' or 'bf16'")
        if isinstance(self.q8_min_numel, bool) or not isinstance(self.q8_min_numel, int) or self.q8_min_numel < 0:
            raise ValueError(f"Precision(q8_min_numel=...) must be an int >= 0, got {self.q8_min_numel!r}")
        if self.q8_rounding not in ROUNDINGS:
            raise ValueError(f"Precision(q8_rounding=...) must be one of {ROUNDINGS}, got {self.q8_rounding!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Precision(rounding=...) must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.compensation not in COMPENSATIONS:
            raise ValueError(f"Precision(compensation=...) must be None, 'kahan' or 'remainder', "
                             f"got {self.compensation!r}")
        if self.compensation_dtype not in MOMENT_DTYPES:
            raise ValueError("Precision(compensation_dtype=...) must be bfloat16 or float32")
        if self.compensation == "remainder" and self.master != torch.float32:
            raise ValueError("Precision(compensation='remainder') stores a float32 master; it needs "
                             "master='fp32'")
        if self.compensation is not None and self.rounding == "stochastic":
            raise ValueError("Precision(rounding='stochastic') and compensation=... are alternatives; "
                             "choose one")

    def to_dict(self) -> dict:
        """Plain-type form for state dicts (loadable with ``torch.load(weights_only=True)``)."""
        return {"master": SHORT_NAME[self.master], "exp_avg": SHORT_NAME[self.exp_avg],
                "exp_avg_sq": SHORT_NAME[self.exp_avg_sq], "rounding": self.rounding,
                "compensation": self.compensation,
                "compensation_dtype": SHORT_NAME[self.compensation_dtype],
                "small_moments": SHORT_NAME[self.small_moments], "q8_min_numel": self.q8_min_numel,
                "q8_rounding": self.q8_rounding, "name": self.name}

    @property
    def quantized(self) -> bool:
        """Whether any moment is ``"q8"``."""
        return Q8 in (self.exp_avg, self.exp_avg_sq)

    def __str__(self) -> str:
        if self.name:
            return self.name
        return (f"Precision(master={SHORT_NAME[self.master]}, exp_avg={SHORT_NAME[self.exp_avg]}, "
                f"exp_avg_sq={SHORT_NAME[self.exp_avg_sq]}, rounding={self.rounding}, "
                f"compensation={self.compensation})")

    @property
    def label(self) -> str:
        return self.name or str(self)


PRESETS: dict[str, Precision] = {
    # classic mixed precision: fp32 master (a copy for 16-bit params), fp32 moments
    "fp32": Precision(torch.float32, torch.float32, torch.float32, name="fp32"),
    # DeepSpeed bf16_master_weights_and_grads + bf16_optimizer_states
    "bf16": Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16, name="bf16"),
    # DeepSpeed bf16_master_weights_and_grads alone (its CPU-offload cell)
    "bf16-master": Precision(torch.bfloat16, torch.float32, torch.float32, name="bf16-master"),
    # fp32 master copy, bf16 moments
    "bf16-states": Precision(torch.float32, torch.bfloat16, torch.bfloat16, name="bf16-states"),
    # bf16 master and moments, stochastic rounding: no update is lost on average
    "bf16-sr": Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16, rounding="stochastic",
                         name="bf16-sr"),
    # bf16 master and moments plus a bf16 Kahan buffer for the weights' rounding error
    "bf16-kahan": Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16, compensation="kahan",
                            name="bf16-kahan"),
    # exact fp32 master as bf16 param + 16-bit remainder, fp32 or bf16 moments
    "fp32-remainder": Precision(torch.float32, torch.float32, torch.float32, compensation="remainder",
                                name="fp32-remainder"),
    "fp32-remainder-bf16-states": Precision(torch.float32, torch.bfloat16, torch.bfloat16,
                                            compensation="remainder", name="fp32-remainder-bf16-states"),
    # exact fp32 master (bf16 param + remainder) with 8-bit block-quantized moments
    "fp32-remainder-q8": Precision(torch.float32, Q8, Q8, compensation="remainder", small_moments=torch.float32,
                                   name="fp32-remainder-q8"),
    # bf16 master and 8-bit block-quantized moments (bf16 for small params), all stochastically
    # rounded: with q8 moments rounded to nearest the quality run ended far worse (docs/numerics.md)
    "bf16-sr-q8": Precision(torch.bfloat16, Q8, Q8, rounding="stochastic", small_moments=torch.bfloat16,
                            q8_rounding="stochastic", name="bf16-sr-q8"),
}


def as_precision(value) -> Precision:
    """Turn a preset name, a :class:`Precision` or its ``to_dict()`` form into a Precision."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        if value in PRESETS:
            return PRESETS[value]
        raise ValueError(f"Unknown precision preset {value!r}; choose one of {sorted(PRESETS)} "
                         f"or pass a bf16opt.Precision(...)")
    if isinstance(value, dict):
        try:
            return Precision(**value)
        except TypeError as exc:
            raise TypeError(f"precision dict {value!r} does not describe a Precision: {exc}") from None
    raise TypeError(f"precision must be a preset name or a bf16opt.Precision, got {type(value).__name__}")


@dataclass(frozen=True)
class StoragePlan:
    """What is stored for one parameter.

    ``master is None``: the param is the master (with ``compensation="remainder"`` the
    param plus the int16 remainder is an exact float32 master).  ``rounding`` is
    ``"stochastic"`` only when some accumulating buffer is 16-bit; ``compensation`` is
    ``"kahan"`` only when the master is 16-bit.
    """

    param: torch.dtype
    master: torch.dtype | None
    exp_avg: torch.dtype
    exp_avg_sq: torch.dtype
    rounding: str = "nearest"
    compensation: str | None = None
    compensation_dtype: torch.dtype | None = None
    q8_rounding: str = "nearest"

    @property
    def quantized(self) -> bool:
        """Whether a moment is q8 (``storage.Q8``)."""
        return Q8 in (self.exp_avg, self.exp_avg_sq)

    @property
    def weights(self) -> str:
        """How the master weights are held: ``"param"`` (the param is the master),
        ``"copy"`` (a master copy of dtype ``master``), ``"kahan"`` (the param plus a
        compensation buffer) or ``"remainder"`` (bfloat16 param + int16 remainder)."""
        if self.compensation is not None:
            return self.compensation
        return "param" if self.master is None else "copy"

    @property
    def companion(self) -> torch.dtype | None:
        """dtype of the master policy's own buffer (copy, compensation, remainder), if any."""
        return {"param": None, "copy": self.master, "kahan": self.compensation_dtype,
                "remainder": torch.int16}[self.weights]

    @property
    def companion_key(self) -> str | None:
        """Optimizer-state key of that buffer (the names state dicts have always used)."""
        return {"param": None, "copy": "master", "kahan": "compensation",
                "remainder": "remainder"}[self.weights]

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the value the update is applied to."""
        if self.compensation == "remainder":
            return torch.float32
        return self.master if self.master is not None else self.param


def plan_for(precision: Precision, param_dtype: torch.dtype, numel: int | None = None) -> StoragePlan:
    """The plan of a param of ``param_dtype`` and ``numel`` elements (the whole param's, for
    a shard; None: as large as q8 asks)."""
    small = numel is not None and precision.quantized and numel < precision.q8_min_numel
    return _plan_for(precision, param_dtype, small)


@functools.lru_cache(maxsize=None)  # pure, and called for every param at every step
def _plan_for(precision: Precision, param_dtype: torch.dtype, small: bool) -> StoragePlan:
    if param_dtype not in PARAM_DTYPES and param_dtype != FLOAT64:
        raise TypeError(f"params must be float64, float32, bfloat16 or float16, got {param_dtype}")
    if precision.master == torch.float16 and param_dtype == torch.bfloat16:
        raise ValueError(
            "Precision(master=float16) is invalid for bfloat16 params: float16 cannot hold "
            "bfloat16's range; use master='fp32' or 'bf16'")
    more_precise = _SIGNIFICAND_BITS[precision.master] > _SIGNIFICAND_BITS[param_dtype]
    master = precision.master if more_precise else None
    compensation = precision.compensation
    if compensation == "remainder" and param_dtype == torch.bfloat16:
        master = None  # the param and the remainder are the master
    elif compensation == "remainder" or (compensation == "kahan" and (master or param_dtype) in (torch.float32,
                                                                                                FLOAT64)):
        compensation = None  # float32 params are their own master; nothing to compensate
    master_dtype = master or param_dtype
    exp_avg, exp_avg_sq = (precision.small_moments if small and d == Q8 else d
                           for d in (precision.exp_avg, precision.exp_avg_sq))
    sixteen_bit = {master_dtype, exp_avg, exp_avg_sq} - {torch.float32, FLOAT64, Q8}
    return StoragePlan(
        param=param_dtype,
        master=master,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        rounding=precision.rounding if sixteen_bit else "nearest",
        compensation=compensation,
        compensation_dtype=precision.compensation_dtype if compensation == "kahan" else None,
        q8_rounding=precision.q8_rounding if Q8 in (exp_avg, exp_avg_sq) else "nearest",
    )


def all_plans(quality: bool = False) -> list:
    """Every StoragePlan the policy allows (what a kernel backend must be able to run).

    ``quality=True`` adds the stochastic-rounding, Kahan and remainder plans (q8 plans:
    :func:`q8_plans`).
    """
    plans = []
    for param in PARAM_DTYPES:
        masters = [None] + [d for d in PARAM_DTYPES
                            if _SIGNIFICAND_BITS[d] > _SIGNIFICAND_BITS[param]
                            and not (d == torch.float16 and param == torch.bfloat16)]
        for master in masters:
            for exp_avg in ELEMENT_MOMENT_DTYPES:
                for exp_avg_sq in ELEMENT_MOMENT_DTYPES:
                    plans.append(StoragePlan(param, master, exp_avg, exp_avg_sq))
    if quality:
        extra = set()
        for precision in _quality_precisions():
            for param in PARAM_DTYPES:
                try:
                    plan = plan_for(precision, param)
                except ValueError:
                    continue
                if plan.rounding != "nearest" or plan.compensation is not None:
                    extra.add(plan)
        plans += sorted(extra, key=str)
    return plans


def q8_plans() -> list:
    """The plans with q8 moments the CUDA kernels are instantiated for: each plan of
    ``all_plans(quality=True)`` with float32 moments, with both moments q8 instead, rounded
    to nearest or stochastically.  (A precision mixing a q8 moment with an element one runs
    on the Numba and reference backends.)"""
    return [dataclasses.replace(plan, exp_avg=Q8, exp_avg_sq=Q8, q8_rounding=q8_rounding)
            for q8_rounding in ROUNDINGS for plan in all_plans(quality=True)
            if plan.exp_avg == plan.exp_avg_sq == torch.float32]


def _quality_precisions():
    for master in PARAM_DTYPES:
        for exp_avg in ELEMENT_MOMENT_DTYPES:
            for exp_avg_sq in ELEMENT_MOMENT_DTYPES:
                yield Precision(master, exp_avg, exp_avg_sq, rounding="stochastic")
                for dtype in ELEMENT_MOMENT_DTYPES:
                    yield Precision(master, exp_avg, exp_avg_sq, compensation="kahan", compensation_dtype=dtype)
                if master == torch.float32:
                    yield Precision(master, exp_avg, exp_avg_sq, compensation="remainder")
