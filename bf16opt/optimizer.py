"""The torch.optim API shared by the bf16opt optimizers.

``MixedPrecisionOptimizer`` owns param groups (validation, per-group ``precision`` and
``backend``), step orchestration and lazily created state; it names no buffer.  What an
update reads and writes is its :class:`~bf16opt.algorithms.Algorithm` (``algorithm``);
each param's :class:`~bf16opt.algorithms.KernelConfig` (algorithm x the param's
StoragePlan x the group's flags) says which state buffers exist and in which dtypes.
State-dict saving, loading and conversion between plans live in ``state_dict.py``;
argument checks in ``checks.py``.  The subclasses (``adam.py``, ``lion.py``, ``sgd.py``)
add hyper-parameter checks, flags and the per-step float32 scalars; the math itself lives
in ``backends/reference.py`` and the kernels.

Guarantee kept throughout: a call that raises (``step``, ``load_state_dict``,
``add_param_group``) leaves params, state and param groups exactly as they were.
Everything is checked first, and only then mutated.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import state_dict as state_dicts
from .algorithms import Algorithm, KernelConfig, kernel_config
from .backends import Bucket, check_backend_name, resolve_backend
from .checks import check_flag, check_implementation_flags, check_param, check_seed
from .precision import Precision, as_precision, plan_for


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Base of :class:`bf16opt.Adam`, :class:`bf16opt.AdamW`, :class:`bf16opt.Lion` and
    :class:`bf16opt.SGD`."""

    #: the update's kernel description (``algorithms.py``); a state dict only loads into an
    #: optimizer of the same algorithm
    algorithm: Algorithm

    #: hyper-parameters every saved param group of this optimizer kind has, and ones that
    #: betray another kind (e.g. Adam's eps in a state dict offered to Lion); an empty
    #: state cannot tell the kinds apart, the groups can
    _SAVED_GROUP_KEYS: tuple = ()
    _FOREIGN_GROUP_KEYS: tuple = ()

    # ---- subclass interface
    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def _flags(self, group: dict) -> dict:
        """The algorithm's flags for a group (e.g. ``{"amsgrad": False, "maximize": True}``)."""
        raise NotImplementedError

    def _fresh_flags(self, created: set) -> dict:
        """Flags of a param whose state buffers ``created`` were made at this step."""
        return {}

    def _scalars(self, group: dict, step: int):
        """The step's float32 scalars (a NamedTuple of ``algorithm.scalars``)."""
        raise NotImplementedError

    def _force_group_entries(self, group: dict) -> None:
        """Entries a subclass pins whatever the state dict says (AdamW: decoupled decay)."""

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

    # ---- state
    def _config(self, group: dict, precision: Precision, param: torch.Tensor) -> KernelConfig:
        return kernel_config(self.algorithm, plan_for(precision, param.dtype),
                             tuple(self._flags(group).items()), bool(group.get("track_precision")))

    def _state_config(self, group: dict, param: torch.Tensor) -> KernelConfig:
        """The configuration a param's state is kept for (state_dict.py converts into it)."""
        return self._config(group, as_precision(group["precision"]), param)

    @property
    def _state_configs(self) -> dict:
        """param -> the KernelConfig its state was last made or checked for (a cache)."""
        return self._side_dict("_state_config_cache")

    def _side_dict(self, name: str) -> dict:
        """A dict kept beside torch's attributes; torch's pickling drops it, so it is made
        again on first use."""
        return self.__dict__.setdefault(name, {})

    def _init_state(self, param: torch.Tensor, config: KernelConfig) -> tuple:
        """(state, keys of the buffers made now): missing state entries in the config's dtypes."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        created = set()
        for _, role, dtype, key in config.present()[2:]:  # after param and grad
            if key in state:
                continue
            if role.storage == "companion" and config.weights == "copy":  # the master starts as the param
                state[key] = param.detach().to(dtype, memory_format=torch.preserve_format, copy=True)
            else:  # moments and Kahan compensation start at 0; a bf16 param is an exact
                # float32 master with remainder 0
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            created.add(key)
        return state, created

    # ---- step
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

    def _prepare_step(self) -> list:
        """Check everything a step needs and compute what must change before the update,
        without changing anything: a step that raises leaves the optimizer as it was.

        Returns one entry per group with work: (group, precision, params, configs,
        {device: backend}, [(param, converted state, new param bits or None)]).
        States made for another configuration (the group's precision, or a param's dtype,
        was changed since the last step) are converted into the new one, as
        ``load_state_dict`` converts a state dict saved with another preset.
        """
        work, known = [], self._state_configs
        index = 0
        for group in self.param_groups:
            precision = self._checked_precision(group)
            params = self._params_with_grad(group)
            first_index, index = index, index + len(group["params"])
            if not params:
                continue
            configs = [self._config(group, precision, param) for param in params]
            backends = {device: resolve_backend(group["backend"], device)
                        for device in {param.device for param in params}}
            conversions = []
            for param, config in zip(params, configs):
                if known.get(param) is config:
                    continue
                state = self.state.get(param)
                if state and not state_dicts.state_fits(state, config):
                    number = first_index + next(i for i, p in enumerate(group["params"]) if p is param)
                    converted, new_param = state_dicts.convert_state(config, state, param, number,
                                                                     type(self).__name__)
                    conversions.append((param, converted, new_param))
            work.append((group, precision, params, configs, backends, conversions))
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
        known = self._state_configs
        for group, precision, _, _, _, conversions in work:
            group["precision"] = precision
            for param, converted, new_param in conversions:
                self.state[param] = converted
                if new_param is not None:
                    param.copy_(new_param)
        index_of = None
        for group, _, params, configs, backends, _ in work:
            if index_of is None:  # a param's index names its random streams
                index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            buckets: dict = {}
            made = [self._init_state(param, config) for param, config in zip(params, configs)]
            counters = [state["step"] for state, _ in made]
            torch._foreach_add_(counters, 1)  # one call, not one per param (hundreds in a model)
            steps = torch.stack(counters).tolist()
            for param, config, (state, created), step in zip(params, configs, made, steps):
                known[param] = config
                fresh = self._fresh_flags(created)
                if fresh:
                    config = kernel_config(config.algorithm, config.plan, config.flags + tuple(fresh.items()),
                                           config.track)
                key = (param.device, config, int(step))
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = Bucket(config, seed=group["seed"], step=key[2])
                bucket.append([param, param.grad] + [None if state_key is None else state[state_key]
                                                     for state_key in config.state_keys[2:]],
                              index_of[id(param)])
            for (device, config, step), bucket in buckets.items():
                if config.track:
                    bucket.counts = torch.zeros(len(bucket.params), 3, dtype=torch.int64)
                backends[device].run(bucket, self._scalars(group, step))
                if bucket.counts is not None:
                    for param, counts in zip(bucket.params, bucket.counts.tolist()):
                        self._precision_counts[param] = (param.numel(), counts)
        return loss

    @property
    def _precision_counts(self) -> dict:
        """param -> (numel, telemetry counts of its last step)."""
        return self._side_dict("_telemetry")

    def precision_stats(self) -> dict:
        """Precision telemetry of the last step (needs ``track_precision=True``).

        Returns ``{param index: {counter: fraction}}`` plus ``"total"`` over all tracked
        params, with the algorithm's counters: ``swallowed`` (non-zero updates that left
        the stored master weights unchanged) and ``<moment>_underflow`` (non-zero moments
        stored as zero), as fractions of each param's elements.
        """
        if not any(group.get("track_precision") for group in self.param_groups):
            raise RuntimeError("precision_stats() needs the optimizer built with track_precision=True")
        names = self.algorithm.counters
        stats, totals, elements = {}, [0] * len(names), 0
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param in self._precision_counts:
                    numel, counts = self._precision_counts[param]
                    stats[index] = {name: c / max(numel, 1) for name, c in zip(names, counts)}
                    totals = [t + c for t, c in zip(totals, counts)]
                    elements += numel
                index += 1
        stats["total"] = {name: t / max(elements, 1) for name, t in zip(names, totals)}
        return stats

    # ---- state dict
    def state_dict(self) -> dict:
        """torch's state dict, with plain-type ``precision`` entries and a format tag.

        State tensors keep their storage dtypes (bf16 moments stay bf16).
        """
        return state_dicts.save(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a bf16opt or torch.optim state dict, converting into this optimizer's dtypes.

        Hyper-parameters come from the state dict (as in torch); precision, backend and
        implementation flags stay this optimizer's own.  Every state tensor is encoded
        into the dtype this optimizer's precision gives it (round to nearest even), so
        a state dict saved with one preset, or by ``torch.optim``, loads into another.
        A master copy missing from the state dict is taken from the param.  Anything that
        does not fit raises before the optimizer changes.
        """
        state_dicts.load(self, state_dict)


__all__ = ["MixedPrecisionOptimizer", "Precision"]
