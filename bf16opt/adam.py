"""Adam and AdamW with configurable storage precision."""

from __future__ import annotations

import math

from torch import Tensor
from torch.optim.optimizer import ParamsT

from .algorithms import ADAM, AdamScalars
from .backends import f32
from .checks import (check_beta_kinds, check_betas, check_flag, check_number,
                     check_tensor_hyperparameters_without_foreach)
from .optimizer import MixedPrecisionOptimizer
from .precision import Precision
from .release import BUCKET_ELEMENTS

__all__ = ["Adam", "AdamW", "adam_scalars"]


def adam_scalars(group: dict, step: int, rounded=f32) -> AdamScalars:
    """The float32 scalars of one Adam step (host float64 math, one rounding each);
    ``rounded=float`` keeps float64 scalars for float64 params."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    weight_decay = float(group["weight_decay"])
    decoupled = group["decoupled_weight_decay"]
    return AdamScalars(
        beta1=rounded(beta1),
        beta2=rounded(beta2),
        one_minus_beta1=rounded(1.0 - beta1),
        one_minus_beta2=rounded(1.0 - beta2),
        step_size=rounded(lr / (1.0 - beta1 ** step)),
        inv_sqrt_bias_correction2=rounded(1.0 / math.sqrt(1.0 - beta2 ** step)),
        eps=rounded(float(group["eps"])),
        weight_decay=0.0 if decoupled else rounded(weight_decay),
        decay=rounded(1.0 - lr * weight_decay) if decoupled else 1.0,
    )


class Adam(MixedPrecisionOptimizer):
    r"""Adam (Kingma & Ba, 2014) whose master weights and moments live in chosen dtypes.

    A drop-in for :class:`torch.optim.Adam`: same arguments and defaults, plus

    * ``precision``: a preset name (``"fp32"``, ``"bf16"``, ``"bf16-master"``,
      ``"bf16-states"``) or a :class:`bf16opt.Precision`; also per param group.
    * ``backend``: ``"auto"``, ``"reference"``, ``"numba"`` or ``"cupy"``.
    * ``seed``: stochastic rounding's seed (default: from ``torch.initial_seed()``); it is
      saved in the state dict, so a resumed run draws the same random bits.
    * ``track_precision``: count swallowed updates and underflowed moments every step,
      read with :meth:`precision_stats`.
    * ``offload``: ``None`` (state lives with the param) or ``"cpu"``: master weights and
      moments in host RAM, updated by the CPU kernels, overlapped with the copies
      (``bf16opt/offload.py``); also per param group.  ``offload_threads``: host threads of
      the offloaded update (default: the cores of the process's affinity, less one for CUDA
      params).
    * ``update_in_backward``: update each param in backward once its grad is final, and free
      the grad (``bf16opt/release.py``; README, "Update in backward"); also per param group.
      ``step()`` then completes the step.  ``update_in_backward_bucket``: small params that
      backward reaches one after another are updated together once their grads have this many
      elements (or backward ends); 0: each param alone.
    * ``max_grad_norm_per_param``: scale each param's grad to at most this L2 norm, on its
      own, as its update reads it (``bf16opt/clipping.py``): the clipping that works with
      ``update_in_backward``; also per param group.  Default None: no clipping.

    The math, with :math:`\theta` the master weights, per step :math:`t`:

    .. math::
        g_t &= \pm\nabla_\theta f_t(\theta_{t-1})\ (- \text{ if maximize}),
              \quad g_t \leftarrow g_t + \lambda\theta_{t-1}\ \text{(Adam, } \lambda \ne 0)\\
        \theta_{t-1} &\leftarrow \theta_{t-1}(1 - \gamma\lambda)\ \text{(AdamW)}\\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t,\qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2\\
        \hat v_t &= \max(\hat v_{t-1}, v_t)\ \text{(amsgrad) else } v_t\\
        \theta_t &= \theta_{t-1} - \frac{\gamma}{1-\beta_1^t}\,
            \frac{m_t}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    The exact float32 operation order is specified in ``bf16opt/backends/reference.py``.

    ``foreach`` and ``fused`` are accepted and have no effect (every backend is
    multi-tensor already); ``differentiable=True`` is rejected.  ``capturable=True`` (CUDA params,
    CuPy kernels) makes the step capturable in a CUDA graph (``torch.cuda.graph``): each param's
    ``state['step']`` lives on its device and the kernels read it, and the lr, when they run, so
    a replay has the bits of an eager step (``bf16opt/capture.py``; README, "CUDA graphs").  Give
    ``lr`` as a tensor on the device for a schedule to reach the replays; a float lr is fixed at
    capture, as in torch.
    """

    algorithm = ADAM
    _SAVED_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 precision: str | Precision = "fp32", backend: str = "auto", seed: int | None = None,
                 track_precision: bool = False, offload: str | None = None,
                 offload_threads: int | None = None, update_in_backward: bool = False,
                 update_in_backward_bucket: int = BUCKET_ELEMENTS,
                 max_grad_norm_per_param: float | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        foreach=foreach, maximize=maximize, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        precision=precision, backend=backend,
                        seed=seed, track_precision=track_precision,
                        offload=offload, offload_threads=offload_threads,
                        update_in_backward=update_in_backward,
                        update_in_backward_bucket=update_in_backward_bucket,
                        max_grad_norm_per_param=max_grad_norm_per_param)
        check_beta_kinds(betas)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_number(group["lr"], "lr", "learning rate")
        check_number(group["eps"], "eps", "epsilon value")
        check_number(group["weight_decay"], "weight_decay", "weight_decay value")
        check_betas(group["betas"])
        check_tensor_hyperparameters_without_foreach(group, ("lr", "betas"))
        for flag in ("amsgrad", "maximize", "decoupled_weight_decay"):
            check_flag(group[flag], flag)

    def _flags(self, group: dict) -> dict:
        l2 = (not group["decoupled_weight_decay"]) and float(group["weight_decay"]) != 0.0
        return {"amsgrad": group["amsgrad"], "maximize": group["maximize"], "l2": l2}

    def _scalars(self, group: dict, step: int, rounded=f32) -> AdamScalars:
        return adam_scalars(group, step, rounded)

    def _live_rates(self, group: dict) -> tuple:
        decoupled = float(group["weight_decay"]) if group["decoupled_weight_decay"] else 0.0
        return decoupled, tuple(float(b) for b in group["betas"])


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay.

    A drop-in for :class:`torch.optim.AdamW` (``weight_decay`` defaults to 1e-2);
    see :class:`Adam` for ``precision`` and ``backend``.
    """

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, precision: str | Precision = "fp32", backend: str = "auto",
                 seed: int | None = None, track_precision: bool = False, offload: str | None = None,
                 offload_threads: int | None = None, update_in_backward: bool = False,
                 update_in_backward_bucket: int = BUCKET_ELEMENTS,
                 max_grad_norm_per_param: float | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, precision=precision,
                         backend=backend, seed=seed, track_precision=track_precision, offload=offload,
                         offload_threads=offload_threads, update_in_backward=update_in_backward,
                         update_in_backward_bucket=update_in_backward_bucket,
                         max_grad_norm_per_param=max_grad_norm_per_param)

    def _force_group_entries(self, group: dict) -> None:
        group["decoupled_weight_decay"] = True
