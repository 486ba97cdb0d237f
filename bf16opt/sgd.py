"""SGD with momentum (torch.optim.SGD's arguments and math) with configurable storage precision."""

from __future__ import annotations

import math

from torch import Tensor
from torch.optim.optimizer import ParamsT

from .algorithms import SGD as SGD_ALGORITHM
from .algorithms import SGDScalars
from .backends import f32
from .checks import check_flag, check_number
from .optimizer import MixedPrecisionOptimizer
from .precision import Precision
from .release import BUCKET_ELEMENTS

__all__ = ["SGD", "sgd_scalars"]


def sgd_scalars(group: dict, rounded=f32) -> SGDScalars:
    """The float32 scalars of one SGD step (host float64 math, one rounding each);
    ``rounded=float`` keeps float64 scalars for float64 params."""
    return SGDScalars(
        momentum=rounded(float(group["momentum"])),
        one_minus_dampening=rounded(1.0 - float(group["dampening"])),
        lr=rounded(float(group["lr"])),
        weight_decay=rounded(float(group["weight_decay"])),
    )


class SGD(MixedPrecisionOptimizer):
    r"""Stochastic gradient descent with momentum, a drop-in for :class:`torch.optim.SGD`.

    .. math::
        g_t &= \pm\nabla_\theta f_t(\theta_{t-1})\ (- \text{ if maximize})
              + \lambda\theta_{t-1}\\
        b_t &= g_t \text{ at the buffer's first step, else } \mu b_{t-1} + (1-\tau) g_t\\
        g_t &\leftarrow g_t + \mu b_t \text{ (nesterov) else } b_t \quad (\mu \ne 0)\\
        \theta_t &= \theta_{t-1} - \gamma g_t

    Args: ``params``, ``lr`` (1e-3), ``momentum`` :math:`\mu` (0), ``dampening``
    :math:`\tau` (0), ``weight_decay`` :math:`\lambda` (0, L2 as in torch), ``nesterov``,
    ``maximize``, plus ``precision``, ``backend``, ``seed``, ``track_precision``, ``offload`` and
    ``capturable`` as in :class:`bf16opt.Adam`.  The momentum buffer is stored as ``Precision.exp_avg`` (so
    ``"bf16"`` keeps it in bfloat16); ``exp_avg_sq`` is unused.  Without momentum no
    buffer exists, as in torch.  ``foreach``/``fused`` are accepted and have no effect;
    ``differentiable=True`` is rejected.  The exact float32 operation order is specified
    in ``bf16opt/backends/reference.py``.
    """

    algorithm = SGD_ALGORITHM
    _SAVED_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    _FOREIGN_GROUP_KEYS = ("betas",)  # Adam's and Lion's

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, precision: str | Precision = "fp32", backend: str = "auto",
                 seed: int | None = None, track_precision: bool = False, offload: str | None = None,
                 offload_threads: int | None = None, update_in_backward: bool = False,
                 update_in_backward_bucket: int = BUCKET_ELEMENTS,
                 max_grad_norm_per_param: float | None = None, capturable: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused, precision=precision,
                        backend=backend, seed=seed,
                        track_precision=track_precision, offload=offload,
                        offload_threads=offload_threads, update_in_backward=update_in_backward,
                        update_in_backward_bucket=update_in_backward_bucket,
                        max_grad_norm_per_param=max_grad_norm_per_param, capturable=capturable)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_number(group["lr"], "lr", "learning rate")
        momentum = check_number(group["momentum"], "momentum", "momentum value")
        dampening = check_number(group["dampening"], "dampening", "dampening value", low=-math.inf)
        check_number(group["weight_decay"], "weight_decay", "weight_decay value")
        for flag in ("nesterov", "maximize"):
            check_flag(group[flag], flag)
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _flags(self, group: dict) -> dict:
        return {"momentum": float(group["momentum"]) != 0.0, "maximize": group["maximize"],
                "l2": float(group["weight_decay"]) != 0.0, "nesterov": group["nesterov"]}

    def _fresh_flags(self, created: set) -> dict:
        # torch clones the gradient into a new momentum buffer instead of decaying it
        return {"first": "momentum_buffer" in created}

    def _scalars(self, group: dict, step: int, rounded=f32) -> SGDScalars:
        return sgd_scalars(group, rounded)

    def _live_rates(self, group: dict) -> tuple:
        return 0.0, None
