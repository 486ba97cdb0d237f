"""Lion with configurable storage precision."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from .algorithms import LION, LionScalars
from .backends import f32
from .checks import check_beta_kinds, check_betas, check_flag, check_number
from .optimizer import MixedPrecisionOptimizer
from .precision import Precision
from .release import BUCKET_ELEMENTS

__all__ = ["Lion", "lion_scalars"]


def lion_scalars(group: dict, rounded=f32) -> LionScalars:
    """The float32 scalars of one Lion step (host float64 math, one rounding each);
    ``rounded=float`` keeps float64 scalars for float64 params."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    return LionScalars(
        beta1=rounded(beta1),
        beta2=rounded(beta2),
        one_minus_beta1=rounded(1.0 - beta1),
        one_minus_beta2=rounded(1.0 - beta2),
        lr=rounded(lr),
        decay=rounded(1.0 - lr * float(group["weight_decay"])),
    )


class Lion(MixedPrecisionOptimizer):
    r"""Lion, EvoLved Sign Momentum (Chen et al., 2023), with configurable storage precision.

    .. math::
        c_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t\\
        \theta_t &= \theta_{t-1}(1 - \gamma\lambda) - \gamma\,\mathrm{sign}(c_t)\\
        m_t &= \beta_2 m_{t-1} + (1-\beta_2) g_t

    Args: ``params``, ``lr`` (1e-4), ``betas`` ((0.9, 0.99)), ``weight_decay`` (0.0,
    decoupled), ``maximize``, plus ``precision``, ``backend``, ``seed``,
    ``track_precision``, ``offload`` and ``capturable`` as in :class:`bf16opt.Adam`.
    Lion keeps one moment, so ``Precision.exp_avg_sq`` is unused.  The exact float32
    operation order is specified in ``bf16opt/backends/reference.py``.
    """

    algorithm = LION
    _SAVED_GROUP_KEYS = ("lr", "betas", "weight_decay")
    _FOREIGN_GROUP_KEYS = ("eps", "amsgrad")  # Adam's

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-4,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False, precision: str | Precision = "fp32", backend: str = "auto",
                 seed: int | None = None, track_precision: bool = False, offload: str | None = None,
                 offload_threads: int | None = None, update_in_backward: bool = False,
                 update_in_backward_bucket: int = BUCKET_ELEMENTS,
                 max_grad_norm_per_param: float | None = None, capturable: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                        precision=precision, backend=backend,
                        seed=seed, track_precision=track_precision,
                        offload=offload, offload_threads=offload_threads,
                        update_in_backward=update_in_backward,
                        update_in_backward_bucket=update_in_backward_bucket,
                        max_grad_norm_per_param=max_grad_norm_per_param, capturable=capturable)
        check_beta_kinds(betas)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_number(group["lr"], "lr", "learning rate")
        check_number(group["weight_decay"], "weight_decay", "weight_decay value")
        check_betas(group["betas"])
        check_flag(group["maximize"], "maximize")

    def _flags(self, group: dict) -> dict:
        return {"maximize": group["maximize"]}

    def _scalars(self, group: dict, step: int, rounded=f32) -> LionScalars:
        return lion_scalars(group, rounded)

    def _live_rates(self, group: dict) -> tuple:
        return float(group["weight_decay"]), None
