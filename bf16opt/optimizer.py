"""Shared machinery of the bf16opt optimizers.

``MixedPrecisionOptimizer`` owns everything that is not the update math: param-group
validation, lazily created state in the dtypes of each param's ``StoragePlan``, the
master copies, bucketing params for the backend, and state_dict conversion.  The
subclasses (``adam.py``, ``lion.py``) add hyper-parameter checks and the per-step
float32 scalars; the math itself lives in ``backends/reference.py`` and the kernels.

Guarantee kept throughout: a call that raises (``step``, ``load_state_dict``,
``add_param_group``) leaves params, state and param groups exactly as they were.
Everything is checked first, and only then mutated.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from typing import Any, Callable, Optional

import torch

from .backends import Bucket, check_backend_name, resolve_backend
from .precision import PARAM_DTYPES, Precision, StoragePlan, as_precision, plan_for
from .storage import decode, encode, join_remainder, split_remainder

STATE_DICT_FORMAT = 1
# Group entries that describe this optimizer object, not the training run: when a
# state dict is loaded, the live optimizer keeps its own values for these.
IMPLEMENTATION_KEYS = ("precision", "backend", "foreach", "fused", "capturable", "differentiable",
                       "track_precision")
TELEMETRY = ("swallowed", "exp_avg_underflow", "exp_avg_sq_underflow")


# ---------------------------------------------------------------- argument checks
def check_number(value, name: str, *, low: float = 0.0, high: Optional[float] = None,
                 high_inclusive: bool = False) -> float:
    """``value`` as a float in [low, high); TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name} must be a real number or a one-element tensor, got a tensor "
                            f"of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    upper_ok = high is None or value < high or (high_inclusive and value == high)
    if math.isnan(value) or value < low or not upper_ok or math.isinf(value):
        bound = "" if high is None else (f", <= {high}" if high_inclusive else f", < {high}")
        raise ValueError(f"Invalid {name}: {value} (expected a finite value >= {low}{bound})")
    return value


def check_betas(betas, count: int = 2) -> tuple:
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise TypeError(f"betas must be a tuple of {count} numbers, got {betas!r}")
    return tuple(check_number(b, f"beta parameter at index {i} (betas[{i}])", high=1.0)
                 for i, b in enumerate(betas))


def check_flag(value, name: str, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if allow_none else ''}, got {value!r}")


def check_implementation_flags(group: dict) -> None:
    """torch's implementation switches: accepted where bf16opt can honour them."""
    check_flag(group.get("foreach"), "foreach", allow_none=True)
    check_flag(group.get("fused"), "fused", allow_none=True)
    if group.get("foreach") and group.get("fused"):
        raise ValueError("`fused` and `foreach` cannot be `True` together.")
    check_flag(group.get("capturable", False), "capturable")
    check_flag(group.get("differentiable", False), "differentiable")
    if group.get("capturable"):
        raise ValueError("capturable=True is not supported: bf16opt computes per-step scalars "
                         "on the host, which CUDA graph capture cannot record")
    if group.get("differentiable"):
        raise ValueError("differentiable=True is not supported: bf16opt's step is not "
                         "differentiable (it writes rounded results in place)")


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")


def default_seed() -> int:
    """Stochastic-rounding seed derived from torch's, so ``torch.manual_seed`` fixes it."""
    return torch.initial_seed() % 2 ** 64


def check_param(param, index: int) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"params[{index}] must be a torch.Tensor, got {type(param).__name__}")
    if param.is_sparse or param.layout != torch.strided:
        raise TypeError(f"params[{index}] has layout {param.layout}; only dense (strided) params "
                        f"are supported")
    if param.dtype not in PARAM_DTYPES:
        raise TypeError(f"params[{index}] has dtype {param.dtype}; bf16opt optimizes float32, "
                        f"bfloat16 and float16 params (complex, integer and float64 params are "
                        f"not supported)")
    if not param.is_leaf:
        raise ValueError(f"params[{index}] is not a leaf tensor; can't optimize a non-leaf Tensor")


def _plain_plans_only(plan: StoragePlan) -> bool:
    return plan.rounding == "nearest" and plan.compensation is None


# ---------------------------------------------------------------- the base class
class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Base of :class:`bf16opt.Adam`, :class:`bf16opt.AdamW` and :class:`bf16opt.Lion`."""

    #: ``"adam"`` or ``"lion"``; a state dict only loads into the same family
    family: str = ""

    # ---- subclass interface
    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def _moment_keys(self, group: dict) -> tuple:
        """State keys of moment buffers, e.g. ``("exp_avg", "exp_avg_sq")``."""
        raise NotImplementedError

    def _update(self, backend, bucket: Bucket, group: dict, step: int) -> None:
        """Compute the step's scalars and call the backend on one bucket."""
        raise NotImplementedError

    # Moment key -> which Precision field gives its dtype
    _MOMENT_DTYPE_FIELD = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                           "max_exp_avg_sq": "exp_avg_sq"}

    # ---- param groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after checking its params and hyper-parameters.

        Accepts ``"precision"`` and ``"backend"`` per group, like any hyper-parameter.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        params = list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # named params
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        for index, param in enumerate(tensors):
            check_param(param, index)
        devices = {p.device for p in tensors}
        if len(devices) > 1:
            raise ValueError(f"params of one param group must be on one device, got "
                             f"{sorted(str(d) for d in devices)}; put each device in its own group")
        self._check_group(group, tensors)
        group["params"] = params
        super().add_param_group(group)

    def _check_group(self, group: dict, params: list) -> None:
        """Validate and normalise a group in place (precision, backend, hyper-parameters)."""
        group["precision"] = self._checked_precision(group)
        for param in params:
            plan_for(group["precision"], param.dtype)  # rejects invalid dtype combinations
        for device in {p.device for p in params}:
            resolve_backend(group["backend"], device)

    # ---- state
    def _plan(self, group: dict, param: torch.Tensor) -> StoragePlan:
        return plan_for(group["precision"], param.dtype)

    def _init_state(self, group: dict, param: torch.Tensor, plan: StoragePlan) -> dict:
        """Create missing state entries for ``param`` in the plan's dtypes."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in self._moment_keys(group):
            if key not in state:
                dtype = getattr(plan, self._MOMENT_DTYPE_FIELD[key])
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        if plan.master is not None and "master" not in state:
            state["master"] = param.detach().to(plan.master, memory_format=torch.preserve_format,
                                                copy=True)
        if plan.compensation == "kahan" and "compensation" not in state:
            state["compensation"] = torch.zeros_like(param, dtype=plan.compensation_dtype,
                                                     memory_format=torch.preserve_format)
        if plan.compensation == "remainder" and "remainder" not in state:
            # a bf16 value is an exact float32 master with remainder 0
            state["remainder"] = torch.zeros_like(param, dtype=torch.int16,
                                                  memory_format=torch.preserve_format)
        return state

    # ---- step
    def _checked_precision(self, group: dict) -> Precision:
        """The group's settings checked without changing anything; its Precision.

        A user may edit a group between steps (lr by a scheduler, or precision and
        backend by hand): everything is checked again here, before any param moves.
        """
        precision = as_precision(group["precision"])
        check_backend_name(group["backend"])
        check_implementation_flags(group)
        check_flag(group.get("track_precision", False), "track_precision")
        if "seed" in group:
            check_seed(group["seed"])
        self._check_hyperparameters(group)
        return precision

    def _params_with_grad(self, group: dict) -> list:
        """The group's params that have grads; raises on grads the step cannot use."""
        params = []
        for index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse or grad.layout != torch.strided:
                raise TypeError(f"{type(self).__name__} does not support sparse gradients "
                                f"(param {index} of its group has a {grad.layout} grad)")
            if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
                raise ValueError(f"grad of param {index} ({tuple(grad.shape)}, {grad.dtype}, "
                                 f"{grad.device}) does not match the param "
                                 f"({tuple(param.shape)}, {param.dtype}, {param.device})")
            params.append(param)
        return params

    def _side_dict(self, name: str) -> dict:
        """A dict kept beside torch's attributes; torch's pickling drops it, so it is made
        again on first use."""
        return self.__dict__.setdefault(name, {})

    @property
    def _state_plans(self) -> dict:
        """param -> the StoragePlan its state was last made or checked for (a cache)."""
        return self._side_dict("_state_plan_cache")

    def _state_fits(self, state: dict, plan: StoragePlan, group: dict) -> bool:
        """True when ``state`` holds exactly the buffers ``plan`` stores, in its dtypes
        (buffers still missing are made by ``_init_state``)."""
        for key in self._moment_keys(group):
            if key in state and state[key].dtype != getattr(plan, self._MOMENT_DTYPE_FIELD[key]):
                return False
        if ("master" in state) != (plan.master is not None) or \
                ("master" in state and state["master"].dtype != plan.master):
            return False
        if ("remainder" in state) != (plan.compensation == "remainder"):
            return False
        kahan = plan.compensation == "kahan"
        return ("compensation" in state) == kahan and \
            (not kahan or state["compensation"].dtype == plan.compensation_dtype)

    def _prepare_step(self) -> list:
        """Check everything a step needs and compute what must change before the update,
        without changing anything: a step that raises leaves the optimizer as it was.

        Returns one entry per group with work: (group, precision, params, plans,
        {(device, plan): backend}, [(param, converted state, new param bits or None)]).
        States made for another plan (the group's precision, or a param's dtype, was
        changed since the last step) are converted into the new plan's dtypes, as
        ``load_state_dict`` converts a state dict saved with another preset.
        """
        work, known = [], self._state_plans
        index = 0
        for group in self.param_groups:
            precision = self._checked_precision(group)
            params = self._params_with_grad(group)
            first_index, index = index, index + len(group["params"])
            if not params:
                continue
            plans = [plan_for(precision, param.dtype) for param in params]
            backends = {}
            for param, plan in zip(params, plans):
                key = (param.device, plan)
                if key not in backends:
                    backends[key] = self._backend_for(group, param.device, plan)
            conversions = []
            for param, plan in zip(params, plans):
                if known.get(param) is plan:
                    continue
                state = self.state.get(param)
                if state and not self._state_fits(state, plan, group):
                    number = first_index + next(i for i, p in enumerate(group["params"]) if p is param)
                    converted, new_param = self._convert_state(state, param, dict(group, precision=precision),
                                                               number)
                    conversions.append((param, converted, new_param))
            work.append((group, precision, params, plans, backends, conversions))
        return work

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform a single optimization step; ``closure`` re-evaluates the model (optional)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._prepare_step()
        # ---- nothing has changed so far; from here on the step commits
        known = self._state_plans
        for group, precision, params, plans, _, conversions in work:
            group["precision"] = precision
            for param, converted, new_param in conversions:
                self.state[param] = converted
                if new_param is not None:
                    param.copy_(new_param)
        index_of = None
        for group, _, params, plans, backends, _ in work:
            if index_of is None:  # a param's index names its random streams
                index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            buckets: dict = {}
            states = [self._init_state(group, param, plan) for param, plan in zip(params, plans)]
            counters = [state["step"] for state in states]
            torch._foreach_add_(counters, 1)  # one call, not one per param (hundreds in a model)
            steps = torch.stack(counters).tolist()
            for param, plan, state, step in zip(params, plans, states, steps):
                known[param] = plan
                key = (param.device, plan, int(step))
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = self._new_bucket(group, plan, key[2])
                self._add_to_bucket(bucket, group, param, state)
                bucket.indices.append(index_of[id(param)])
            for (device, plan, step), bucket in buckets.items():
                if group.get("track_precision"):
                    bucket.counts = torch.zeros(len(bucket.params), len(TELEMETRY), dtype=torch.int64)
                self._update(backends[(device, plan)], bucket, group, step)
                if bucket.counts is not None:
                    for param, counts in zip(bucket.params, bucket.counts.tolist()):
                        self._precision_counts[param] = (param.numel(), counts)
        return loss

    @staticmethod
    def _backend_for(group: dict, device, plan: StoragePlan):
        backend = resolve_backend(group["backend"], device)
        if not getattr(backend, "supports", _plain_plans_only)(plan):
            if group["backend"] != "auto":
                raise NotImplementedError(f"backend={group['backend']!r} does not implement {plan}; "
                                          f"use backend='auto' or 'reference'")
            backend = resolve_backend("reference", device)
        return backend

    @property
    def _precision_counts(self) -> dict:
        """param -> (numel, telemetry counts of its last step)."""
        return self._side_dict("_telemetry")

    def precision_stats(self) -> dict:
        """Precision telemetry of the last step (needs ``track_precision=True``).

        Returns ``{param index: {"swallowed": f, "exp_avg_underflow": f,
        "exp_avg_sq_underflow": f}}`` as fractions of each param's elements, plus
        ``"total"`` over all tracked params.  ``swallowed``: non-zero updates that left
        the stored master weights unchanged; ``*_underflow``: non-zero moments stored
        as zero.
        """
        if not any(group.get("track_precision") for group in self.param_groups):
            raise RuntimeError("precision_stats() needs the optimizer built with track_precision=True")
        stats, totals, elements = {}, [0] * len(TELEMETRY), 0
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param in self._precision_counts:
                    numel, counts = self._precision_counts[param]
                    stats[index] = {name: c / max(numel, 1) for name, c in zip(TELEMETRY, counts)}
                    totals = [t + c for t, c in zip(totals, counts)]
                    elements += numel
                index += 1
        stats["total"] = {name: t / max(elements, 1) for name, t in zip(TELEMETRY, totals)}
        return stats

    def _new_bucket(self, group: dict, plan: StoragePlan, step: int) -> Bucket:
        return Bucket(plan=plan, maximize=group["maximize"], amsgrad=group.get("amsgrad", False),
                      seed=group["seed"], step=step)

    def _add_to_bucket(self, bucket: Bucket, group: dict, param: torch.Tensor, state: dict) -> None:
        bucket.compensations.append(state.get("compensation"))
        bucket.remainders.append(state.get("remainder"))
        bucket.params.append(param)
        bucket.grads.append(param.grad)
        bucket.masters.append(state.get("master"))
        bucket.exp_avgs.append(state["exp_avg"])
        if "exp_avg_sq" in state:
            bucket.exp_avg_sqs.append(state["exp_avg_sq"])
        if bucket.amsgrad:
            bucket.max_exp_avg_sqs.append(state["max_exp_avg_sq"])

    # ---- state dict
    def state_dict(self) -> dict:
        """torch's state dict, with plain-type ``precision`` entries and a format tag.

        State tensors keep their storage dtypes (bf16 moments stay bf16).
        """
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["precision"] = group["precision"].to_dict()
        state_dict["bf16opt"] = {"format": STATE_DICT_FORMAT, "family": self.family,
                                 "optimizer": type(self).__name__}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a bf16opt or torch.optim state dict, converting into this optimizer's dtypes.

        Hyper-parameters come from the state dict (as in torch); precision, backend and
        implementation flags stay this optimizer's own.  Every state tensor is encoded
        into the dtype this optimizer's precision gives it (round to nearest even), so
        a state dict saved with one preset, or by ``torch.optim.Adam``/``AdamW``, loads
        into another.  A master copy missing from the state dict is taken from the
        param.  Anything that does not fit raises before the optimizer changes.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
        meta = state_dict.get("bf16opt")
        if isinstance(meta, dict) and meta.get("family") != self.family:
            raise ValueError(f"state_dict was saved by bf16opt.{meta.get('optimizer')}, which cannot "
                             f"be loaded into {type(self).__name__}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")

        new_groups, param_of_index = [], {}
        for number, (live, saved) in enumerate(zip(self.param_groups, saved_groups)):
            self._check_saved_group(saved, number)
            if len(saved["params"]) != len(live["params"]):
                raise ValueError(f"loaded state dict's param group {number} has "
                                 f"{len(saved['params'])} params, this optimizer's has "
                                 f"{len(live['params'])}")
            group = {key: value for key, value in live.items() if key != "params"}
            group.update({key: value for key, value in saved.items()
                          if key not in IMPLEMENTATION_KEYS and key != "params"})
            self._force_group_entries(group)
            self._check_group(group, live["params"])
            group["params"] = live["params"]
            new_groups.append(group)
            for index, param in zip(saved["params"], live["params"]):
                param_of_index[index] = (param, group)

        new_state, param_writes = defaultdict(dict), []
        for index, saved_state in state_dict["state"].items():
            if index not in param_of_index:
                raise ValueError(f"loaded state dict holds state for param index {index!r}, "
                                 f"which none of its param groups lists")
            param, group = param_of_index[index]
            new_state[param], new_param = self._convert_state(saved_state, param, group, index)
            if new_param is not None:
                param_writes.append((param, new_param))

        self.param_groups[:] = new_groups
        self.state = new_state
        self._state_plans.clear()
        with torch.no_grad():
            for param, new_param in param_writes:
                param.copy_(new_param)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    #: hyper-parameters every saved param group of this optimizer kind has, and ones that
    #: betray another kind (e.g. Adam's eps in a state dict offered to Lion); an empty
    #: state cannot tell the kinds apart, the groups can
    _SAVED_GROUP_KEYS: tuple = ()
    _FOREIGN_GROUP_KEYS: tuple = ()

    def _check_saved_group(self, saved, number: int) -> None:
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"param group {number} of the state dict must be a dict with a "
                             f"'params' list")
        missing = [key for key in self._SAVED_GROUP_KEYS if key not in saved]
        foreign = [key for key in self._FOREIGN_GROUP_KEYS if key in saved]
        if missing or foreign:
            found = f"lacks {missing}" if missing else f"has {foreign}"
            raise ValueError(f"param group {number} of the state dict {found}: not a state dict "
                             f"of {type(self).__name__} (or of torch.optim's equivalent)")

    def _force_group_entries(self, group: dict) -> None:
        """Entries a subclass pins whatever the state dict says (AdamW: decoupled decay)."""

    def _convert_state(self, saved: dict, param: torch.Tensor, group: dict, index) -> tuple:
        """(new state, new param bits or None) for one param; raises before changing anything.

        A remainder plan holds part of the master in the param, so loading a master into
        it rewrites the param as the master's ties-away rounding (it differs from the
        round-to-nearest-even param only on exact ties).
        """
        if not isinstance(saved, dict):
            raise ValueError(f"state of param {index} must be a dict, got {type(saved).__name__}")
        plan = self._plan(group, param)
        moment_keys = self._moment_keys(group)
        known = {"step", "master", "compensation", "remainder"} | set(self._all_moment_keys())
        unknown = set(saved) - known
        if unknown:
            raise ValueError(f"state of param {index} holds {sorted(unknown)}, which "
                             f"{type(self).__name__} does not use: not a state dict of this "
                             f"kind of optimizer")
        required = {"step", "exp_avg"} | ({"exp_avg_sq"} & set(moment_keys))
        missing = required - set(saved)
        if missing:
            raise ValueError(f"state of param {index} lacks {sorted(missing)}: not a "
                             f"{type(self).__name__} state dict")
        for key, value in saved.items():
            if key == "step":
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{key} of param {index} must be a tensor, got {type(value).__name__}")
            if value.shape != param.shape:
                raise ValueError(f"{key} of param {index} has shape {tuple(value.shape)}, but the "
                                 f"param has shape {tuple(param.shape)}")
        step = saved["step"]
        if isinstance(step, torch.Tensor):
            if step.numel() != 1 or step.is_complex():
                raise ValueError(f"step of param {index} must be a number or a one-element tensor, "
                                 f"got a tensor of shape {tuple(step.shape)}")
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step) \
                or step < 0 or step != int(step):
            raise ValueError(f"step of param {index} must be a whole number >= 0, got {step!r}")
        step = float(step)
        state = {"step": torch.tensor(step, dtype=torch.float32)}
        for key in moment_keys:
            if key in saved:
                dtype = getattr(plan, self._MOMENT_DTYPE_FIELD[key])
                state[key] = self._converted(saved[key], param, dtype, f"{key} of param {index}")
        new_param = None
        if plan.master is not None or plan.compensation == "remainder":
            master = self._saved_master(saved, param, index)
            if plan.master is not None:
                state["master"] = self._converted(master, param, plan.master, f"master of param {index}")
            else:
                new_param, remainder = split_remainder(master)
                state["remainder"] = torch.empty_like(param, dtype=torch.int16).copy_(remainder)
                new_param = torch.empty_like(param).copy_(new_param)
        if plan.compensation == "kahan" and "compensation" in saved:
            state["compensation"] = self._converted(saved["compensation"], param, plan.compensation_dtype,
                                                    f"compensation of param {index}")
        return state, new_param

    def _saved_master(self, saved: dict, param: torch.Tensor, index) -> torch.Tensor:
        """The float32 master a saved state holds: its copy, param + remainder, or the param."""
        if "master" in saved:
            return self._converted(saved["master"], param, torch.float32, f"master of param {index}")
        if "remainder" in saved and param.dtype == torch.bfloat16:
            remainder = saved["remainder"]
            if not isinstance(remainder, torch.Tensor) or remainder.dtype != torch.int16 \
                    or remainder.shape != param.shape:
                raise ValueError(f"remainder of param {index} must be an int16 tensor of shape "
                                 f"{tuple(param.shape)}")
            return join_remainder(param.detach(), remainder.to(param.device))
        return decode(param.detach()).clone()

    def _all_moment_keys(self) -> tuple:
        """Every moment key this optimizer kind may hold, whatever its settings."""
        raise NotImplementedError

    @staticmethod
    def _converted(value, param: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A new tensor laid out like ``param`` holding ``encode(value, dtype)``."""
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"{what} must be a floating-point tensor, got {value!r:.80}")
        if value.shape != param.shape:
            raise ValueError(f"{what} has shape {tuple(value.shape)}, but the param has shape "
                             f"{tuple(param.shape)}")
        value_f32 = decode(value.detach().to(param.device))  # float64 states round here
        result = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
        result.copy_(encode(value_f32, dtype))
        return result


__all__ = ["MixedPrecisionOptimizer", "Precision"]
