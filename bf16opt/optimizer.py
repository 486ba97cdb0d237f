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

Integrations (docs/integrations_amp.md): ``torch.amp.GradScaler``'s protocol for optimizers
that unscale inside their kernels (``_step_supports_amp_scaling``: ``step`` takes
``grad_scale`` and ``found_inf``, as keywords or as the attributes GradScaler sets);
float32 grads of bfloat16/float16 params, read by the kernels as they are; and
``torch.compile``: ``step`` is excluded from tracing (one graph break around it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch.optim import optimizer as torch_optimizer

from . import state_dict as state_dicts
from . import step_cache
from .algorithms import Algorithm, KernelConfig, grad_dtypes, kernel_config
from .backends import Bucket, check_backend_name, f32, reference, resolve_backend
from .checks import (check_amp_tensor, check_flag, check_implementation_flags, check_no_aliasing,
                     check_number, check_param, check_seed)
from .distributed import check_known_tensor, dtensor_type, global_offset, is_dtensor, local, wrap_like
from .offload import Offloader, check_offload
from .precision import Precision, as_precision, plan_for
from .storage import stream_id


def real_view(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A complex tensor as the real tensor of its (re, im) pairs (torch.optim's treatment of
    complex params: the update acts on each part); other tensors as they are."""
    return torch.view_as_real(tensor) if tensor is not None and tensor.is_complex() else tensor


HOST = torch.device("cpu")


def shards(state: Optional[dict]) -> Optional[dict]:
    """A param's state with every DTensor buffer as its local shard (what the backends update)."""
    if not state or not any(is_dtensor(value) for value in state.values()):
        return state
    return {key: local(value) for key, value in state.items()}


def wrapped(state: dict, param) -> dict:
    """Local state buffers of ``param`` as DTensors sharded like it (``step`` stays a plain
    tensor, as in torch.optim); unchanged for plain params."""
    if not is_dtensor(param):
        return state
    return {key: value if key == "step" or not isinstance(value, torch.Tensor) else wrap_like(value, param)
            for key, value in state.items()}


def _at_home(state: dict, device: torch.device, offloaded: bool) -> bool:
    """True when every state buffer is on ``device`` (the step counter lives on the CPU), and
    contiguous when offloaded (the pipeline walks host buffers in flat pieces)."""
    return all(value.device == device and (not offloaded or value.is_contiguous())
               for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor))


_IMMUTABLE = frozenset((bool, int, float, str, type(None), Precision))


def _immutable(value) -> bool:
    """Whether ``value`` cannot change in place (exact types: a subclass could)."""
    kind = type(value)
    return kind in _IMMUTABLE or (kind is tuple and all(map(_immutable, value)))


def _layout(tensor) -> str:
    return f"a DTensor placed {tuple(tensor.placements)} on {tensor.device_mesh}" if is_dtensor(tensor) \
        else "a plain tensor"


def _stream_ids(group: dict, first_index: int) -> list:
    """Each param's stochastic-rounding stream id: its name's hash when the group has names
    (``model.named_parameters()``), else its position in the optimizer; a group loaded from
    a format-1 state dict keeps positions (``sr_streams``, see state_dict.py)."""
    names = group.get("param_names")
    if names is None or group.get("sr_streams") == "position":
        return [first_index + i for i in range(len(group["params"]))]
    return [stream_id(first_index + i, name) for i, name in enumerate(names)]


def _float64_backend(name: str):
    """float64 params are updated in float64 math by the reference backend: the kernels
    compute in float32, which would silently lose the params' precision."""
    if name in ("numba", "cupy"):
        raise ValueError(f"backend={name!r} updates float32, bfloat16 and float16 params; float64 "
                         f"params are updated in float64 math by backend='reference' (or 'auto')")
    return reference


class _Entry(NamedTuple):
    """One param's part of a step."""

    param: torch.Tensor      # what the kernels update: the param, its real view or local shard, or its host mirror
    grad: torch.Tensor       # what the kernels read: likewise
    config: KernelConfig     # the launch's (the state's, plus flags of fresh buffers and the grads' dtype)
    state: dict              # the state with the buffers made at this step
    counter: torch.Tensor    # state["step"]
    number: int              # the param's index in the optimizer
    original: torch.Tensor   # the param as the group lists it
    offset: int              # index of a shard's first element in the whole param
    stream: int              # stochastic rounding's stream id


@dataclass
class _StepPlan:
    """What phase one of a step prepared for phase two to install and run."""

    precisions: list = field(default_factory=list)     # (group, checked Precision)
    states: dict = field(default_factory=dict)         # param -> new or converted state
    buffers: dict = field(default_factory=dict)        # param -> {key: new buffer}
    param_writes: list = field(default_factory=list)   # (param, new bits): remainder conversions
    mirror_writes: list = field(default_factory=list)  # (offloaded param, new bits): its host mirror
    counters: list = field(default_factory=list)       # step tensors to advance
    known: dict = field(default_factory=dict)          # param -> config its state now fits
    launches: list = field(default_factory=list)       # (bucket, prepared launch)
    reused: list = field(default_factory=list)         # phase two of each group whose kept launch is reused
    built: list = field(default_factory=list)          # (group number, what step_cache.build keeps, or None)
    offloaded: Optional[set] = None                    # params of offloaded groups (if any offloader)
    stale_launches: bool = False                       # kept launches of groups that are gone


#: torch.optim.optimizer's dicts of the hooks registered for every optimizer's step (private)
_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
#: the C++ bindings behind ``torch.autograd.profiler.record_function``'s enter and exit
#: (private), or None
_SCOPE = tuple(getattr(torch._C._autograd, name, None) for name in
               ("_record_function_with_args_enter", "_record_function_with_args_exit"))
_SCOPE = _SCOPE if all(map(callable, _SCOPE)) else None
#: autograd's grad mode switched directly (private; what ``torch.set_grad_enabled`` calls,
#: without making its context-manager object), else torch's
_set_grad_mode = getattr(torch._C, "_set_grad_enabled", None) or torch.set_grad_enabled


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Base of :class:`bf16opt.Adam`, :class:`bf16opt.AdamW`, :class:`bf16opt.Lion` and
    :class:`bf16opt.SGD`."""

    #: the update's kernel description (``algorithms.py``); a state dict only loads into an
    #: optimizer of the same algorithm
    algorithm: Algorithm

    #: torch.amp.GradScaler.step hands this optimizer the loss scale and the inf check
    #: (attributes ``grad_scale``, ``found_inf``) instead of unscaling the grads itself: the
    #: kernels fold the unscale into their one pass, and a step with infs changes nothing
    _step_supports_amp_scaling = True

    #: hyper-parameters every saved param group of this optimizer kind has, and ones that
    #: betray another kind (e.g. Adam's eps in a state dict offered to Lion); an empty
    #: state cannot tell the kinds apart, the groups can
    _SAVED_GROUP_KEYS: tuple = ()
    _FOREIGN_GROUP_KEYS: tuple = ()

    def __init__(self, params, defaults: dict):
        if isinstance(params, set):  # torch would list it, in an order that changes between runs
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                            "ordering of tensors in sets will change between runs. Please use a list instead.")
        super().__init__(params, defaults)

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
        if "params" not in param_group:
            raise ValueError("param_group must have a 'params' entry (a tensor or a list of tensors)")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        params = list(params)
        named = [isinstance(p, tuple) and len(p) == 2 for p in params]
        tensors = [p[1] if is_named else p for p, is_named in zip(params, named)]
        names = [f"params[{i}] ({p[0]!r})" if is_named else f"params[{i}]"
                 for i, (p, is_named) in enumerate(zip(params, named))]
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        for param, name in zip(tensors, names):
            check_param(param, name)
        existing = [p for g in getattr(self, "param_groups", []) for p in g["params"]]
        check_no_aliasing(existing + tensors,
                          [f"a param of group {i}" for i, g in enumerate(getattr(self, "param_groups", []))
                           for _ in g["params"]] + [f"{name} of the new group" if existing else name
                                                    for name in names])
        devices = {p.device for p in tensors}
        if len(devices) > 1:
            raise ValueError(f"params of one param group must be on one device, got "
                             f"{sorted(str(d) for d in devices)}; put each device in its own group")
        self._check_group(group, tensors)
        group["params"] = params
        super().add_param_group(group)
        if group.get("offload") == "cpu":  # grads start leaving during the first backward
            for param in tensors:
                self._offloader.record(param)

    def _check_group(self, group: dict, params: list) -> None:
        """Validate and normalise a group in place (precision, backend, hyper-parameters)."""
        group["precision"] = self._checked_precision(group)
        for param in params:
            plan_for(group["precision"], real_view(param).dtype)  # rejects invalid dtype combinations
            if real_view(param).dtype == torch.float64:
                _float64_backend(group["backend"])
        for device in {p.device for p in params}:
            resolve_backend(group["backend"], device)

    def _checked_precision(self, group: dict) -> Precision:
        """The group's settings checked without changing anything; its Precision.

        A user may edit a group between steps (lr by a scheduler, or precision and
        backend by hand): everything is checked again here, before any param moves.
        """
        precision = as_precision(group["precision"])
        check_backend_name(group["backend"])
        check_offload(group.get("offload"), group.get("offload_threads"))
        if group.get("offload") == "cpu" and group["backend"] == "cupy":
            raise ValueError("backend='cupy' updates state on the GPU; with offload='cpu' the state "
                             "lives in host RAM and is updated by backend='numba' (or 'auto')")
        check_implementation_flags(group)
        check_flag(group.get("track_precision", False), "track_precision")
        if "seed" in group:
            group["seed"] = check_seed(group["seed"])  # numpy integers become ints
        if group.get("sr_streams", "position") != "position":
            raise ValueError(f"sr_streams may only be 'position' (random streams named by position, as "
                             f"in format-1 state dicts), got {group['sr_streams']!r}")
        self._check_hyperparameters(group)
        return precision

    def _group_precision(self, number: int, group: dict) -> Precision:
        """:meth:`_checked_precision` of group ``number``, remembered while the group holds
        the same keys and the same values (identical objects, each of an immutable type: a
        list or tensor hyper-parameter can change in place, and is checked at every step).
        The checks read nothing but the group's values (its params aside).  A new float lr
        alone (an lr scheduler sets one every step) is checked alone: the full checks would
        pass all else as before, and raise on a bad lr with the same message."""
        memo = self._side_dict("_checked_groups")
        values = list(group.values())
        kept = memo.get(number)
        if kept is not None and kept[0] is group and list(group) == kept[1]:
            if step_cache.same_objects(values, kept[2]):
                return kept[3]
            at = kept[4]  # (lr's place in the group)
            if type(values[at]) is float and step_cache.same_objects(values[:at], kept[2][:at]) \
                    and step_cache.same_objects(values[at + 1:], kept[2][at + 1:]):
                check_number(values[at], "lr", "learning rate")
                memo[number] = (group, kept[1], values, kept[3], at)
                return kept[3]
        precision = self._checked_precision(group)
        if all(map(_immutable, (value for key, value in group.items() if key != "params"))):
            keys = list(group)  # (after seed's normalisation)
            memo[number] = (group, keys, list(group.values()), precision, keys.index("lr"))
        else:
            memo.pop(number, None)
        return precision

    # ---- state
    def _config(self, group: dict, precision: Precision, param: torch.Tensor) -> KernelConfig:
        return kernel_config(self.algorithm, plan_for(precision, param.dtype),
                             tuple(self._flags(group).items()), bool(group.get("track_precision")))

    def _state_config(self, group: dict, param: torch.Tensor) -> KernelConfig:
        """The configuration a param's state is kept for (state_dict.py converts into it);
        ``param``: its real view."""
        return self._config(group, as_precision(group["precision"]), param)

    @property
    def _offloader(self) -> Offloader:
        """The host side of the offloaded groups (made at the first one)."""
        offloader = self.__dict__.get("_offloader_instance")
        if offloader is None:
            offloader = self.__dict__["_offloader_instance"] = Offloader(self)
        return offloader

    @property
    def _state_configs(self) -> dict:
        """param -> (KernelConfig, device, offloaded) its state was last made or checked for (a cache)."""
        return self._side_dict("_state_config_cache")

    def _side_dict(self, name: str) -> dict:
        """A dict kept beside torch's attributes; torch's pickling drops it, so it is made
        again on first use."""
        return self.__dict__.setdefault(name, {})

    def _new_buffers(self, param: torch.Tensor, state: dict, config: KernelConfig, offloader=None) -> dict:
        """The state buffers ``config`` needs that ``state`` lacks, made aside (not installed):
        moments and Kahan compensation start at 0, a master copy as the param, a remainder
        at 0 (a bf16 value is an exact float32 master with remainder 0)."""
        made = {}
        for _, role, dtype, key in config.present()[2:]:  # after param and grad
            if key in state:
                continue
            copy = role.storage == "companion" and config.weights == "copy"  # the master starts as the param
            if offloader is not None:  # in host memory (page-locked for CUDA params)
                made[key] = offloader.host_like(param, dtype, param.detach() if copy else None)
            elif copy:
                made[key] = param.detach().to(dtype, memory_format=torch.preserve_format, copy=True)
            else:
                made[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return made

    # ---- step
    def _params_with_grad(self, group: dict, first_index: int = 0) -> list:
        """The group's params that have grads; raises on grads the step cannot use (naming each
        param by its index in the optimizer, as state dicts do)."""
        params = []
        distributed = dtensor_type() is not None  # else no DTensor exists in this process
        for index, param in enumerate(group["params"], start=first_index):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse or grad.layout != torch.strided:
                raise TypeError(f"{type(self).__name__} does not support sparse gradients "
                                f"(param {index} has a {grad.layout} grad)")
            grad_sharded = distributed and is_dtensor(grad)
            if type(grad) is not torch.Tensor and not grad_sharded:  # (one C-level test for the common case)
                check_known_tensor(grad, f"grad of param {index}")  # (a DTensor's local: staging checks it)
            if distributed and (grad_sharded != is_dtensor(param) or grad_sharded and (
                    grad.placements != param.placements or grad.device_mesh != param.device_mesh)):
                raise TypeError(f"grad of param {index} is {_layout(grad)} but the param is {_layout(param)}; "
                                f"the update pairs each shard of a param with the same shard of its grad")
            # float32 grads of 16-bit params are read as they are (float32 accumulation);
            # complex params keep grads of their own dtype
            dtype_ok = grad.dtype == param.dtype or (
                grad.dtype in grad_dtypes(param.dtype) and not param.is_complex())
            if grad.shape != param.shape or not dtype_ok or grad.device != param.device:
                raise ValueError(f"grad of param {index} ({tuple(grad.shape)}, {grad.dtype}, "
                                 f"{grad.device}) does not match the param "
                                 f"({tuple(param.shape)}, {param.dtype}, {param.device}); grads "
                                 f"have the param's shape, device and dtype (or float32 for a "
                                 f"bfloat16/float16 param)")
            params.append(param)
        return params

    def _shard_offset(self, param, number: int) -> int:
        """``distributed.global_offset`` of a DTensor param, cached while its placement holds."""
        key = (param.placements, param.device_mesh, param.shape, local(param).shape)
        cached = self._side_dict("_shard_offsets").get(param)
        if cached is None or cached[0] != key:
            cached = self._side_dict("_shard_offsets")[param] = (key, global_offset(param, f"param {number}"))
        return cached[1]

    @staticmethod
    def _step_count(state: dict, number: int) -> int:
        step = state.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or step.is_complex():
            raise ValueError(f"state['step'] of param {number} must be a one-element tensor, got {step!r:.60}")
        return step

    @staticmethod
    def _check_steps(steps: list, numbers: list) -> None:
        for value, number in zip(steps, numbers):
            if not (math.isfinite(value) and value >= 0 and value == int(value) and value < 2 ** 53):
                raise ValueError(f"state['step'] of param {number} is {value!r}; it must be a whole number "
                                 f"in [0, 2**53)")

    def _prepare_step(self, inv_grad_scale: float = 1.0, asked: Sequence = ()) -> "_StepPlan":
        """Phase one of a step: check everything and make everything the step needs -- converted
        or new state (aside, not installed), each bucket's tensors, scalars and launch (the
        backends check dtypes, shapes, devices and compile their kernels here) -- without
        changing any param, state or group.  A step that raises here leaves the optimizer as
        it was.  States made for another configuration (the group's precision, or a param's
        dtype, was changed since the last step) are converted into the new one, as
        ``load_state_dict`` converts a state dict saved with another preset.
        ``inv_grad_scale``: every algorithm's last scalar (1 / GradScaler's scale).
        ``asked``: :meth:`_reused_step`'s answers for the first groups (not asked again).
        """
        plan = _StepPlan()
        known = self._state_configs
        distributed = dtensor_type() is not None  # else no DTensor exists in this process
        kept = self._group_launches
        view = step_cache.StateView(self.state) if kept else None  # (one for all groups)
        index = 0
        for group_number, group in enumerate(self.param_groups):
            precision = self._group_precision(group_number, group)
            first_index, index = index, index + len(group["params"])
            if group_number < len(asked):  # (its kept launch answered already)
                reused = asked[group_number] and asked[group_number][2]
            else:
                reused = group_number in kept and kept[group_number].prepare(self, group, first_index,
                                                                             precision, inv_grad_scale, view)
            if reused:  # nothing the group's launch was built from changed since the last step
                plan.precisions.append((group, precision))
                plan.reused.append(reused)
                continue
            params = self._params_with_grad(group, first_index)
            if not params:
                plan.built.append((group_number, None))  # (a kept launch would hold on to its tensors)
                continue
            plan.precisions.append((group, precision))
            # an offloaded group's state lives, and its update runs, on the host
            offloader = self._offloader if group.get("offload") == "cpu" else None
            backends = {device: resolve_backend(group["backend"], HOST if offloader else device)
                        for device in {param.device for param in params}}
            position = {id(p): first_index + i for i, p in enumerate(group["params"])}
            ids = _stream_ids(group, first_index)
            flags, track = tuple(self._flags(group).items()), bool(group.get("track_precision"))
            configs = {}  # param dtype -> config (one lookup per dtype, not per param)
            entries = []
            for original in params:
                number = position[id(original)]
                # complex params are updated as real views, like torch; a DTensor as its local shard
                sharded = distributed and is_dtensor(original)
                param = real_view(local(original) if sharded else original)
                config = configs.get(param.dtype)
                if config is None:
                    config = configs[param.dtype] = kernel_config(self.algorithm, plan_for(precision, param.dtype),
                                                                  flags, track)
                home = HOST if offloader else param.device
                # the state as the kernels see it: a DTensor param's buffers are DTensors
                # sharded like it (what state_dict() and DCP save), read as their local shards
                state = shards(self.state.get(original)) if sharded else self.state.get(original)
                if not state:  # first step: a new state, installed in phase two
                    state = plan.states[original] = {"step": torch.tensor(0.0, dtype=torch.float64)}
                elif known.get(original) != (config, home, offloader is not None):
                    changed = False
                    if not _at_home(state, home, offloader is not None):  # `offload` was edited
                        changed, state = True, {
                            key: value if key == "step" or not isinstance(value, torch.Tensor)
                            else (offloader.to_host(value) if offloader else value.to(param.device))
                            for key, value in state.items()}
                    if not state_dicts.state_fits(state, config):
                        # offloaded: contiguous host state (the pipeline walks it in flat pieces)
                        like = param.detach().to(HOST).contiguous() if offloader else param
                        state, new_param = state_dicts.convert_state(config, state, like, number,
                                                                     type(self).__name__)
                        if offloader:
                            state = {key: value if key == "step" else offloader.to_host(value)
                                     for key, value in state.items()}
                        changed = True
                        if new_param is not None:
                            plan.param_writes.append((param, new_param.to(param.device)))
                            if offloader:  # the host mirror takes the new bits too, not a stale read
                                plan.mirror_writes.append((original, new_param))
                    if changed:
                        plan.states[original] = wrapped(state, original)
                counter = self._step_count(state, number)
                made = self._new_buffers(param, state, config, offloader)
                if made:
                    plan.buffers[original] = wrapped(made, original)
                plan.known[original] = (config, home, offloader is not None)
                fresh = self._fresh_flags(set(made))
                grad_dtype = real_view(original.grad).dtype
                if fresh or grad_dtype != config.grad:  # the launch's config (the state's is known above)
                    config = kernel_config(config.algorithm, config.plan, config.flags + tuple(fresh.items()),
                                           config.track, grad_dtype)
                # stochastic rounding numbers a shard's elements by their index in the whole param
                offset = self._shard_offset(original, number) if sharded and config.stochastic else 0
                entries.append(_Entry(param, real_view(local(original.grad) if sharded else original.grad), config,
                                      {**state, **made}, counter, number, original, offset,
                                      ids[number - first_index]))
            if offloader:  # the kernels read and write host buffers: a mirror of the param, the staged grad
                written = {id(p) for p, _ in plan.mirror_writes}
                staged = offloader.stage([e.original for e in entries],
                                         [e.config.weights != "copy" and id(e.original) not in written
                                          for e in entries])
                entries = [entry._replace(param=mirror, grad=grad) for (mirror, grad), entry in zip(staged, entries)]
            plan.counters.extend(entry.counter for entry in entries)
            counts = torch.stack([e.counter.double() for e in entries]).tolist()
            self._check_steps(counts, [e.number for e in entries])
            steps = [int(s) + 1 for s in counts]
            buckets, originals, launched = {}, {}, []
            for entry, step in zip(entries, steps):
                config = entry.config
                key = (entry.param.device, config, step)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = Bucket(config, seed=group["seed"], step=step)
                    originals[key] = []
                bucket.append([entry.param, entry.grad] + [None if state_key is None else entry.state[state_key]
                                                           for state_key in config.state_keys[2:]],
                              entry.number, entry.offset, entry.stream)
                originals[key].append(entry.original)
            for key, bucket in buckets.items():
                device, config, step = key
                float64 = config.plan.param == torch.float64
                scalars = self._scalars(group, step, float if float64 else f32)
                if inv_grad_scale != 1.0:
                    scalars = scalars._replace(inv_grad_scale=inv_grad_scale)
                backend = _float64_backend(group["backend"]) if float64 else \
                    backends[originals[key][0].device]
                bad = [name for name, value in zip(scalars._fields, scalars) if not math.isfinite(value)]
                if bad:
                    raise ValueError(f"param group {group_number}: its hyper-parameters give non-finite "
                                     f"float32 {', '.join(bad)} at step {step}; lower lr or weight_decay")
                if config.track:
                    bucket.counts = torch.zeros(len(bucket.params), 3, dtype=torch.int64)
                launch = backend.prepare(bucket, scalars)  # checks and compiles, offloaded or not
                if offloader:
                    offloader.check(bucket)
                    launch = functools.partial(offloader.run, bucket, originals[key], backend, scalars,
                                               group.get("offload_threads"))
                plan.launches.append((bucket, launch))
                launched.append((bucket, backend))
            fresh = any(entry.original in plan.states or entry.original in plan.buffers for entry in entries)
            plan.built.append((group_number, None if offloader or fresh else
                               (group, first_index, precision, entries, launched)))
        if "_offloader_instance" in self.__dict__:
            plan.offloaded = {p for g in self.param_groups if g.get("offload") == "cpu" for p in g["params"]}
        plan.stale_launches = bool(kept) and max(kept) >= len(self.param_groups)  # (groups removed)
        return plan

    def _reused_step(self, inv_grad_scale: float = 1.0) -> Optional[list]:
        """Phase one of the common training step, in which every group reuses the launch kept
        from its last step (step_cache.py), without the full path's plan and its loops (tens of
        µs with the caches cold after the last step's kernel stream): (group, precision, phase
        two) of each group in order, up to and with a None for the first group that cannot
        reuse -- then :meth:`_prepare_step` takes these answers and goes on from there.  Asks
        no group when one has no kept launch, or host buffers may be released (offload).
        Changes nothing (but the view each launch last found its states under) -- except where
        the optimizer's only group has a launch that runs its whole step in one compiled call
        (``GroupLaunch.step_alone``): then None once that step ran."""
        kept, groups = self._group_launches, self.param_groups
        if len(kept) != len(groups) or "_offloader_instance" in self.__dict__:
            return []
        view = step_cache.StateView(self.state)
        only = kept.get(0) if len(groups) == 1 else None  # (the only group's kept launch)
        if only is not None and only.alone is not None:  # the whole step in one compiled call
            group = groups[0]
            precision = self._group_precision(0, group)
            if not only.step_alone(self, group, 0, precision, inv_grad_scale, view):
                return [None]  # (the full path, which asks this launch no more)
            group["precision"] = precision
            return None
        asked, first_index = [], 0
        for number, group in enumerate(groups):
            precision = self._group_precision(number, group)
            launch = kept.get(number)
            run = None if launch is None else launch.prepare(self, group, first_index, precision,
                                                             inv_grad_scale, view)
            asked.append(None if run is None else (group, precision, run))
            if run is None:
                break
            first_index += len(group["params"])
        return asked

    def _amp_arguments(self, grad_scale, found_inf) -> tuple:
        """(inv_grad_scale, skip) of a step: from its keywords, or from the attributes
        torch.amp.GradScaler.step sets (``grad_scale``: the loss scale, None once the user
        called ``unscale_``; ``found_inf``: non-zero when a grad had an inf or NaN).  Both are
        checked before anything changes; reading them is a host sync."""
        devices = None
        values = {}
        for name, given in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            attribute = getattr(self, name, None)
            if given is not None and attribute is not None:
                raise ValueError(f"{name} was given to step() and set as an attribute (by "
                                 f"torch.amp.GradScaler.step); give it one way")
            value = given if given is not None else attribute
            if value is None:
                continue
            if devices is None:
                devices = {p.device for group in self.param_groups for p in group["params"]}
            check_amp_tensor(value, name, devices)
            values[name] = float(value.item())
        inv_grad_scale = 1.0
        if "grad_scale" in values:
            scale = values["grad_scale"]
            # float32 of the float64 reciprocal: GradScaler.unscale_'s inv_scale, so folding the
            # unscale gives the bits of unscale_ followed by a step, whatever the scale
            # (reciprocals from 2**128 - 2**103 on round to float32 infinity)
            if not (math.isfinite(scale) and scale > 0 and 1.0 / scale < 2.0 ** 128 - 2.0 ** 103):
                raise ValueError(f"grad_scale is {scale!r}; it must be a positive float32 whose "
                                 f"reciprocal is a finite float32 (about 2**-128 or more)")
            inv_grad_scale = f32(1.0 / scale)
        return inv_grad_scale, values.get("found_inf", 0.0) != 0.0

    @staticmethod
    def profile_hook_step(func: Callable) -> Callable:
        """torch's wrapper of ``step`` (``Optimizer.profile_hook_step``): the step pre- and
        post-hooks, global and the optimizer's, around the step, all in the scope
        ``Optimizer.step#<class>.step`` that profilers and other observers of torch's
        record-function events see -- the same scope, entered through its C++ binding
        (``_record_function_with_args_enter``, private) rather than ``record_function``, which
        costs ~20 µs a step through torch's operator dispatch, a seventh of a step over 150
        small params.  While torch.compile traces it, and on a torch without the global hook
        dicts or that binding, torch's wrapper."""
        profiled = torch.optim.Optimizer.profile_hook_step(func)
        if _SCOPE is None or \
                not all(isinstance(getattr(torch_optimizer, name, None), dict) for name in _GLOBAL_STEP_HOOKS):
            return profiled
        enter_scope, exit_scope = _SCOPE

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling():  # (Dynamo traces torch's scope, not the binding)
                return profiled(*args, **kwargs)
            self = args[0]
            scope = enter_scope(f"Optimizer.step#{self.__class__.__name__}.step")
            try:
                pre_hooks, post_hooks = (getattr(torch_optimizer, name) for name in _GLOBAL_STEP_HOOKS)
                for pre_hook in chain(pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
                    result = pre_hook(self, args, kwargs)
                    if result is not None:  # (torch's rule and message)
                        if isinstance(result, tuple) and len(result) == 2:
                            args, kwargs = result
                        else:
                            raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), "
                                               f"but got {result}.")
                out = func(*args, **kwargs)
                self._optimizer_step_code()
                for post_hook in chain(self._optimizer_step_post_hooks.values(), post_hooks.values()):
                    post_hook(self, args, kwargs)
                return out
            finally:
                exit_scope(scope)

        return wrapper

    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None):
        """Perform a single optimization step; ``closure`` re-evaluates the model (optional).

        ``grad_scale``: the loss scale the grads carry (a one-element float32 tensor); the
        kernels multiply every grad by float32(1 / grad_scale) as they read it.
        ``found_inf``: a one-element float32 tensor; non-zero skips the step (params, state
        and step counters unchanged).  torch.amp.GradScaler passes both as attributes
        (``_step_supports_amp_scaling``); a step called by hand may pass them here.
        """
        if torch.compiler.is_compiling():  # (Dynamo is tracing this frame)
            return _step_outside_compile(self, closure, grad_scale, found_inf)
        return self._step(closure, grad_scale, found_inf)  # (eager: without the exclusion's wrappers)

    def _step(self, closure, grad_scale, found_inf):
        """The step, autograd off (as under ``torch.no_grad()``, switched directly: the
        decorator's context manager adds several Python calls to every step, each slow with
        the caches cold after a kernel's stream)."""
        grad_enabled = torch.is_grad_enabled()
        _set_grad_mode(False)
        try:
            return self._step_without_grad(closure, grad_scale, found_inf)
        finally:
            _set_grad_mode(grad_enabled)

    def _step_without_grad(self, closure, grad_scale, found_inf):
        inv_grad_scale, skip = self._amp_arguments(grad_scale, found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if skip:  # inf/NaN grads: GradScaler lowers its scale, the optimizer changes nothing
            return loss
        asked = self._reused_step(inv_grad_scale)
        if asked is None:  # the step ran, its group's kept launch reused in one compiled call
            return loss
        if len(asked) == len(self.param_groups) and all(asked):  # every group reuses its kept launch
            for group, precision, _ in asked:
                group["precision"] = precision
            for _, _, run in asked:
                run()
            return loss
        plan = self._prepare_step(inv_grad_scale, asked)
        # ---- phase two: nothing has changed so far, and nothing below raises on user input
        for group, precision in plan.precisions:
            group["precision"] = precision
        for param, state in plan.states.items():
            self.state[param] = state
        for param, buffers in plan.buffers.items():
            self.state[param].update(buffers)
        for param, new_param in plan.param_writes:
            param.copy_(new_param)
        for param, new_param in plan.mirror_writes:
            self._offloader.set_mirror(param, new_param)
        if plan.counters:
            torch._foreach_add_(plan.counters, 1)  # one call, not one per param (hundreds in a model)
        self._state_configs.update(plan.known)
        if plan.offloaded is not None:  # params that left the offloaded groups free their host buffers
            self._offloader.release(plan.offloaded)
        for run in plan.reused:
            run()
        for bucket, launch in plan.launches:
            launch()
            if bucket.counts is not None:
                for param, counts in zip(bucket.params, bucket.counts.tolist()):
                    self._precision_counts[param] = (param.numel(), counts)
        if plan.built or plan.stale_launches:
            self._keep_launches(plan.built)
        return loss

    @property
    def _group_launches(self) -> dict:
        """group number -> the group's launch kept for the next steps (step_cache.py)."""
        return self._side_dict("_group_launch_cache")

    def _keep_launches(self, built: list) -> None:
        """Keep the launches this step built for the next steps to reuse; forget those of
        groups that changed beyond reuse, or are gone, and what is kept of params no longer
        in the optimizer (their tensors are released)."""
        kept = self._group_launches
        for number, material in built:
            launch = None if material is None else step_cache.build(self, *material)
            if launch is None:
                kept.pop(number, None)
            else:
                kept[number] = launch
        for number in [number for number in kept if number >= len(self.param_groups)]:
            del kept[number]
        self._forget_removed_params()

    def _forget_removed_params(self) -> None:
        """Forget what the side dicts hold of params no longer in any group (a group or param
        taken out of ``param_groups``): they must not keep its tensors alive."""
        memo = self.__dict__.get("_checked_groups")
        for number in [number for number in memo or () if number >= len(self.param_groups)]:
            del memo[number]
        caches = [self.__dict__[name] for name in ("_state_config_cache", "_telemetry", "_shard_offsets")
                  if self.__dict__.get(name)]
        if caches:
            live = {id(param) for group in self.param_groups for param in group["params"]}
            for cache in caches:
                for param in [param for param in cache if id(param) not in live]:
                    del cache[param]

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


def _run_step(optimizer: MixedPrecisionOptimizer, closure, grad_scale, found_inf):
    return optimizer._step(closure, grad_scale, found_inf)


# torch.compile: a step is Python bookkeeping around raw-pointer kernel calls (Numba,
# CuPy), which Dynamo cannot trace (tracing into Numba's compiler crashes).  Excluded from
# tracing: ``torch.compile(opt.step)`` runs it eagerly, and a compiled training step breaks
# its graph around ``opt.step()``.  torch's lazy wrapper, as torch.optim uses it: its frame
# is on Dynamo's skip list, and it imports ``torch._dynamo`` at its first call (which
# torch.optim.Optimizer's constructor has made already), not at ``import bf16opt``.  Taken
# only while Dynamo traces ``step``: its wrappers (the eval-frame callback switched off and
# back) cost ~10 µs a step with the caches cold, and an eager step needs none of them.
_step_outside_compile = torch._disable_dynamo(_run_step)


__all__ = ["MixedPrecisionOptimizer", "Precision"]
