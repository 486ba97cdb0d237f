"""What each optimizer's kernels read and write, declared once as data.

An :class:`Algorithm` is one update rule's description: its buffer **roles in kernel
order** (the columns of the chunk table both kernel backends build), its per-step float32
**scalars** (kernel argument order), its **flags** and its telemetry **counters**.  A
param's :class:`~bf16opt.precision.StoragePlan` says how each role is stored; the two meet
in :func:`kernel_config`, the one place that turns (algorithm, plan, flags) into what a
backend runs: each role's dtype (``None``: absent), the state key that holds it and how
the master weights are held (and the grads' dtype: the param's, or float32 for
bfloat16/float16 params whose grads are accumulated in float32).  The Numba and CuPy adapters, the staging of a bucket, state
creation, the state-dict code and ``memory_report`` all read a :class:`KernelConfig`; none
of them names a buffer.

Roles every algorithm has, first and in this order: ``param``, ``grad`` and
``companion`` -- the master policy's array: the float32 master copy, the Kahan
compensation or the int16 remainder (a plan has at most one of them; see
``StoragePlan.weights``).  Then the algorithm's state buffers (moments), each a row of
``bf16opt._cpu.roles.STATE_ROLES``, the one statement of its stochastic-rounding buffer
(``Role.buffer``: which half of which random stream's bits it rounds with,
``storage.buffer_bits``) and of its q8 map (signed or not), which every backend reads.

Adding an optimizer: a description here (a state with a new name: a row of
``STATE_ROLES`` first), its math in ``backends/reference.py``, a Numba chunk function
``cpu_src/<name>.py`` and a CUDA kernel ``cuda_src/<name>.cu`` whose role and flag enums
follow the description (``tests/test_algorithms.py`` checks them), and the ``torch.optim``
subclass with its hyper-parameter checks and ``scalars``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ._cpu.roles import buffer_of
from .precision import StoragePlan

__all__ = ["ADAM", "ALGORITHMS", "FLOAT32_GRAD_BIT", "LION", "LIVE_LR_DOUBLE_BIT", "SGD", "AdamScalars", "Algorithm",
           "KernelConfig", "LionScalars", "Role", "SCALAR_SOURCES", "SGDScalars", "grad_dtypes",
           "kernel_config"]


# ---------------------------------------------------------------- per-step scalars
# Every algorithm's scalars end with ``inv_grad_scale``: the factor the kernels multiply
# each decoded grad by before anything else (``g = decode(grad) * inv_grad_scale``), the
# float32 reciprocal of a GradScaler's loss scale (``step(grad_scale=...)``), so
# unscaling costs no pass over the grads.  It is exactly 1.0 without a scaler, and
# ``g * 1.0`` is ``g`` bit for bit (NaNs are stored canonical whatever their payload).
class AdamScalars(NamedTuple):
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    step_size: float                  # lr / (1 - beta1**step)
    inv_sqrt_bias_correction2: float  # 1 / sqrt(1 - beta2**step)
    eps: float
    weight_decay: float               # L2 coefficient (Adam); 0.0 when decay is decoupled
    decay: float                      # 1 - lr * weight_decay (AdamW); 1.0 for Adam
    inv_grad_scale: float = 1.0       # float32(1 / loss scale); 1.0 without GradScaler


class LionScalars(NamedTuple):
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    lr: float
    decay: float                      # 1 - lr * weight_decay
    inv_grad_scale: float = 1.0       # float32(1 / loss scale); 1.0 without GradScaler


class SGDScalars(NamedTuple):
    momentum: float
    one_minus_dampening: float
    lr: float
    weight_decay: float               # L2 coefficient (torch.optim.SGD's weight_decay)
    inv_grad_scale: float = 1.0       # float32(1 / loss scale); 1.0 without GradScaler


#: the hyper-parameters each scalar is computed from, for the errors that name them
SCALAR_SOURCES = {
    "beta1": ("betas[0]",), "one_minus_beta1": ("betas[0]",), "beta2": ("betas[1]",),
    "one_minus_beta2": ("betas[1]",), "step_size": ("lr", "betas[0]"), "inv_sqrt_bias_correction2": ("betas[1]",),
    "eps": ("eps",), "weight_decay": ("weight_decay",), "decay": ("lr", "weight_decay"), "lr": ("lr",),
    "momentum": ("momentum",), "one_minus_dampening": ("dampening",), "inv_grad_scale": ("the loss scale",),
}


# ---------------------------------------------------------------- descriptions
@dataclass(frozen=True)
class Role:
    """One array of the update, per param.

    ``storage``: the StoragePlan field giving its dtype (``"param"``, ``"companion"`` or a
    moment field such as ``"exp_avg"``); ``when``: a flag that must be set for the role to
    exist (amsgrad's maximum); ``rounded``: it has a stochastic-rounding buffer (:attr:`buffer`).
    """

    name: str
    storage: str
    written: bool = True
    when: Optional[str] = None
    rounded: bool = True

    @property
    def buffer(self) -> Optional[int]:
        """Its stochastic-rounding buffer number (``roles.buffer_of``: ``WEIGHTS`` for the param,
        a state's row of ``roles.STATE_ROLES``); None for the grad and the companion."""
        return buffer_of(self.name) if self.rounded else None


PARAM = Role("param", "param")
# the grads: the param's dtype, or float32 (kernel_config's ``grad``)
GRAD = Role("grad", "param", written=False, rounded=False)
COMPANION = Role("companion", "companion", rounded=False)


@dataclass(frozen=True, eq=False)  # one object per algorithm: hashed and compared by identity
class Algorithm:
    """An update rule's kernel description.

    ``template_flags`` are compiled into each kernel (a CUDA template parameter, a Numba
    constant); ``runtime_flags`` are bits of the kernels' ``flags`` argument, bit k for
    the k-th.  ``storage_parameters``: the moment fields whose storage type is a template
    parameter of the CUDA kernel, in template order.  ``counters``: telemetry columns.
    ``required_state``: keys every saved state of this algorithm has (torch.optim's too).
    """

    name: str
    roles: tuple
    scalars: type
    template_flags: tuple
    runtime_flags: tuple
    storage_parameters: tuple
    counters: tuple
    required_state: tuple = ()

    def __post_init__(self):
        for role in self.roles:  # each state's row of roles.STATE_ROLES, or a ValueError at import
            role.buffer  # noqa: B018

    @property
    def flags(self) -> tuple:
        return self.template_flags + self.runtime_flags

    @property
    def moment_roles(self) -> tuple:
        return tuple(r for r in self.roles if r.name not in ("param", "grad", "companion"))

    def flag_bits(self, flags: dict) -> int:
        """The algorithm's bits of the kernels' run-time ``flags`` argument."""
        return sum(1 << k for k, name in enumerate(self.runtime_flags) if flags.get(name))


#: bit of the CUDA kernels' ``flags`` argument shared by every algorithm (above their own
#: bits): the grads are float32 while the param is bfloat16/float16 (cuda_src/multi_tensor.cuh's
#: kFloat32Grad).  A run-time bit like maximize, not a template parameter: it would double
#: every instantiation (NVRTC time, the emulation build) for a one-instruction difference.
FLOAT32_GRAD_BIT = 1 << 15
#: bit of a live step's launch (capturable=True, bf16opt/capture.py; kLiveLrDouble): the lr
#: tensor the kernel reads is float64 (else float32)
LIVE_LR_DOUBLE_BIT = 1 << 13


def grad_dtypes(param: torch.dtype) -> tuple:
    """The grad dtypes the kernels read for ``param`` dtype: the param's own, and float32 for
    16-bit params (gradients accumulated in float32, as DeepSpeed's ``grad_accum_dtype``,
    Megatron's ``main_grad`` or a leaf's ``grad_dtype = torch.float32`` make them)."""
    return (param, torch.float32) if param in (torch.bfloat16, torch.float16) else (param,)


ADAM = Algorithm(
    name="adam",
    roles=(PARAM, GRAD, COMPANION,
           Role("exp_avg", "exp_avg"),
           Role("exp_avg_sq", "exp_avg_sq"),
           Role("max_exp_avg_sq", "exp_avg_sq", when="amsgrad")),
    scalars=AdamScalars,
    template_flags=("amsgrad",),
    runtime_flags=("maximize", "l2"),
    storage_parameters=("exp_avg", "exp_avg_sq"),
    counters=("swallowed", "exp_avg_underflow", "exp_avg_sq_underflow"),
    required_state=("step", "exp_avg", "exp_avg_sq"),
)

LION = Algorithm(
    name="lion",
    roles=(PARAM, GRAD, COMPANION, Role("exp_avg", "exp_avg")),
    scalars=LionScalars,
    template_flags=(),
    runtime_flags=("maximize",),
    storage_parameters=("exp_avg",),
    counters=("swallowed", "exp_avg_underflow"),
    required_state=("step", "exp_avg"),
)

# The momentum buffer is SGD's first moment: stored as Precision.exp_avg (its buffer and q8
# map: roles.STATE_ROLES).
SGD = Algorithm(
    name="sgd",
    roles=(PARAM, GRAD, COMPANION,
           Role("momentum_buffer", "exp_avg", when="momentum")),
    scalars=SGDScalars,
    template_flags=("momentum",),
    runtime_flags=("maximize", "l2", "nesterov", "first"),
    storage_parameters=("exp_avg",),
    counters=("swallowed", "momentum_buffer_underflow"),
)

ALGORITHMS = {a.name: a for a in (ADAM, LION, SGD)}


# ---------------------------------------------------------------- (description, plan) -> kernel
@dataclass(frozen=True, eq=False)  # made once per combination by kernel_config: identity is equality
class KernelConfig:
    """What one kernel call runs: an algorithm on one StoragePlan with fixed flags.

    ``dtypes[k]`` is the storage dtype of ``algorithm.roles[k]`` (None: the role does not
    exist here); ``state_keys[k]`` the optimizer-state key holding it (``"master"``,
    ``"compensation"`` or ``"remainder"`` for the companion).  ``weights`` is how the
    master is held: ``"copy"`` (float32 copy), ``"param"`` (the param, round to nearest),
    ``"param-stochastic"``, ``"kahan"`` or ``"remainder"``.
    """

    algorithm: Algorithm
    plan: StoragePlan
    flags: tuple          # (name, bool) for every flag of the algorithm, in its order
    track: bool
    dtypes: tuple
    state_keys: tuple
    weights: str

    def flag(self, name: str) -> bool:
        return dict(self.flags)[name]

    @property
    def template_flags(self) -> tuple:
        return tuple(self.flag(name) for name in self.algorithm.template_flags)

    @property
    def flag_bits(self) -> int:
        """The CUDA kernels' run-time ``flags`` argument."""
        return self.algorithm.flag_bits(dict(self.flags)) | (FLOAT32_GRAD_BIT if self.float32_grad else 0)

    @property
    def grad(self) -> torch.dtype:
        """The grads' dtype."""
        return self.dtypes[1]

    @property
    def float32_grad(self) -> bool:
        """float32 grads of a 16-bit param."""
        return self.dtypes[1] != self.dtypes[0]

    @property
    def stochastic(self) -> bool:
        """Whether any buffer rounds stochastically (16-bit ones, or q8 moments): the
        kernels then need the random streams' keys and each element's row-major index."""
        return self.plan.rounding == "stochastic" or self.plan.q8_rounding == "stochastic"

    @property
    def quantized(self) -> bool:
        """Whether a state buffer is q8 (blocks of the row-major elements)."""
        return self.plan.quantized

    @functools.cached_property  # (asked for every param of every step)
    def _present(self) -> tuple:
        return tuple((k, role, dtype, key) for k, (role, dtype, key)
                     in enumerate(zip(self.algorithm.roles, self.dtypes, self.state_keys)) if dtype is not None)

    def present(self) -> tuple:
        """(role position, role, dtype, state key) of the roles that exist, kernel order."""
        return self._present

    @functools.cached_property
    def _state_buffers(self) -> dict:
        return {key: dtype for k, role, dtype, key in self._present if role.name not in ("param", "grad")}

    def state_buffers(self) -> dict:
        """state key -> dtype of every state buffer this configuration keeps (do not modify)."""
        return self._state_buffers


def _weights(plan: StoragePlan) -> str:
    if plan.weights == "param" and plan.rounding == "stochastic":
        return "param-stochastic"
    return plan.weights


@functools.lru_cache(maxsize=None)  # pure; asked for every bucket of every step
def kernel_config(algorithm: Algorithm, plan: StoragePlan, flags: tuple = (),
                  track: bool = False, grad: Optional[torch.dtype] = None) -> KernelConfig:
    """The one translation of (description, plan, flags, grad dtype) into a kernel configuration.

    ``flags``: (name, value) pairs; flags not named are False.  ``grad``: the grads' dtype,
    one of :func:`grad_dtypes` (default: the param's).
    """
    grad = plan.param if grad is None else grad
    if grad not in grad_dtypes(plan.param):
        raise ValueError(f"the kernels read {' or '.join(map(str, grad_dtypes(plan.param)))} grads "
                         f"for {plan.param} params, not {grad}")
    given = dict(flags)
    unknown = set(given) - set(algorithm.flags)
    if unknown:
        raise ValueError(f"{algorithm.name} has no flag {sorted(unknown)}")
    flags = tuple((name, bool(given.get(name, False))) for name in algorithm.flags)
    on = dict(flags)
    dtypes, keys = [], []
    for role in algorithm.roles:
        if role.when is not None and not on[role.when]:
            dtype, key = None, None
        elif role.storage == "companion":
            dtype, key = plan.companion, plan.companion_key
        elif role is GRAD:
            dtype, key = grad, role.name
        else:
            dtype, key = getattr(plan, role.storage), role.name
        dtypes.append(dtype)
        keys.append(key)
    return KernelConfig(algorithm, plan, flags, bool(track), tuple(dtypes), tuple(keys), _weights(plan))


#: element bytes of each storage dtype as the kernels see it
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int16: 2}
