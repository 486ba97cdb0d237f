"""Phase one of a full step: check everything and make everything the step needs, changing
nothing.

For each param group that cannot reuse its kept launch (``step_cache.py``), then each param
with a grad, then each bucket of params that share a kernel configuration and step number:
the param's state is found, converted or made aside (never installed here), its tensors are
paired with the kernel's roles, and each bucket's backend checks its tensors and compiles its
kernel (``backend.prepare``).  The :class:`StepPlan` returned lists what phase two
(``MixedPrecisionOptimizer._step_without_grad``) installs and runs; phase two raises on no
user input, so a step that raises leaves the optimizer exactly as it was.

States made for another configuration (the group's precision, or a param's dtype, was
changed since the last step) are converted into the new one, as ``load_state_dict``
converts a state dict saved with another preset.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple, Optional

import torch

from . import state_dict as state_dicts
from . import capture, clipping, step_cache
from .algorithms import SCALAR_SOURCES, KernelConfig, grad_dtypes, kernel_config
from .backends import Bucket, f32, reference, resolve_backend
from .checks import check_param_names, check_params_listed_once, check_step_count
from .distributed import check_known_tensor, dtensor_type, global_offset, is_dtensor, local
from .precision import plan_for
from .storage import Q8, q8_shape, stream_id
from .tensors import (HOST, check_not_negative, check_writable, layout_name, read_view, real_view, shards,
                      state_is_on, state_moved, wrapped)

__all__ = ["ParamEntry", "StepPlan", "float64_backend", "narrowed_group", "plan_conversions", "plan_step",
           "plan_update"]


class ParamEntry(NamedTuple):
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


class KeptLaunchMaterial(NamedTuple):
    """What ``step_cache.build`` keeps of a group's full step."""

    group: dict
    first_index: int
    precision: object
    entries: list            # ParamEntry of each param with a grad, in group order
    launched: list           # (bucket, backend) of each kernel call


@dataclass
class StepPlan:
    """What phase one of a step prepared for phase two to install and run."""

    precisions: list = field(default_factory=list)     # (group, checked Precision)
    states: dict = field(default_factory=dict)         # param -> new or converted state
    buffers: dict = field(default_factory=dict)        # param -> {key: new buffer}
    param_writes: list = field(default_factory=list)   # (param, new bits): remainder conversions
    mirror_writes: list = field(default_factory=list)  # (offloaded param, new bits): its host mirror
    known: dict = field(default_factory=dict)          # param -> config its state now fits
    launches: list = field(default_factory=list)       # (bucket, prepared launch, user's params, counters)
    reused: list = field(default_factory=list)         # (launches before it, phase two) of reusing groups
    built: list = field(default_factory=list)          # (group number, KeptLaunchMaterial or None)
    offloaded: Optional[set] = None                    # params of offloaded groups (if any offloader)
    clips: list = field(default_factory=list)          # (grad the kernels read, clip factor): scaled first
    stale_launches: bool = False                       # kept launches of groups that are gone
    found_inf: Optional[torch.Tensor] = None           # GradScaler's inf flag of a captured step
    swept: list = field(default_factory=list)          # (number, group, settings): idle states fit these now
    counted: set = field(default_factory=set)          # (device, address) of the step counters so far


def float64_backend(name: str):
    """float64 params are updated in float64 math by the reference backend: the kernels
    compute in float32, which would silently lose the params' precision."""
    if name in ("numba", "cupy"):
        raise ValueError(f"backend={name!r} updates float32, bfloat16 and float16 params; float64 "
                         f"params are updated in float64 math by backend='reference' (or 'auto')")
    return reference


def stream_ids(group: dict, first_index: int) -> list:
    """Each param's stochastic-rounding stream id: its name's hash when the group has names
    (``model.named_parameters()``), else its position in the optimizer; a group loaded from
    a format-1 state dict keeps positions (``sr_streams``, see state_dict.py)."""
    names = group.get("param_names")
    if names is None or group.get("sr_streams") == "position":
        return [first_index + i for i in range(len(group["params"]))]
    check_param_names(names, len(group["params"]))  # (a group edited by hand)
    return [stream_id(first_index + i, name) for i, name in enumerate(names)]


def plan_step(optimizer, inv_grad_scale: float = 1.0, answered=(), amp=None) -> StepPlan:
    """Phase one of a full step (module doc).  ``inv_grad_scale``: every algorithm's last
    scalar (1 / GradScaler's scale).  ``answered``: ``step_cache.reused_step``'s answers for
    the first groups, (group, precision, phase two or None) each (not asked again).  ``amp``:
    GradScaler's tensors of a step captured in a CUDA graph (``amp.captured_amp``), or None."""
    check_params_listed_once(optimizer.param_groups)
    plan = StepPlan(found_inf=None if amp is None else amp.found_inf)
    kept = optimizer._group_launches
    view = step_cache.StateView(optimizer.state) if kept else None  # (one for all groups)
    first_index = 0
    for number, group in enumerate(optimizer.param_groups):
        precision = optimizer._group_precision(number, group)
        if number < len(answered):
            reused = answered[number][2]
        else:
            reused = number in kept and kept[number].prepare(optimizer, group, first_index, precision,
                                                             inv_grad_scale, view)
        if reused:  # nothing the group's launch was built from changed since the last step
            plan.precisions.append((group, precision))
            plan.reused.append((len(plan.launches), reused))
        else:
            _plan_group(optimizer, plan, number, group, first_index, precision, inv_grad_scale, amp)
        first_index += len(group["params"])
    if "_offloader_instance" in optimizer.__dict__:
        plan.offloaded = optimizer._offloaded_params()
    plan.stale_launches = bool(kept) and max(kept) >= len(optimizer.param_groups)  # (groups removed)
    return plan


def narrowed_group(group: dict, start: int, stop: int) -> dict:
    """``group`` narrowed to its params at positions ``start:stop`` (and their names): the same
    settings and hyper-parameters (update in backward, ``release.py``)."""
    narrowed = dict(group)
    narrowed["params"] = group["params"][start:stop]
    names = group.get("param_names")
    if names is not None:
        narrowed["param_names"] = names[start:stop]
    return narrowed


def plan_update(optimizer, number: int, narrowed: dict, first_index: int, precision) -> StepPlan:
    """Phase one of the update of some params of a group (update in backward): the full step's
    plan of ``narrowed`` (group ``number`` narrowed to them, :func:`narrowed_group`), whose
    first param is the optimizer's number ``first_index``.  Each param keeps its state, step
    counter, scalars and random stream, so its bits are the full step's.  The launch built
    (``plan.built``) is the narrowed group's, kept by the caller for these params."""
    plan = StepPlan()
    _plan_group(optimizer, plan, number, narrowed, first_index, precision, 1.0)
    return plan


def _plan_group(optimizer, plan: StepPlan, number: int, group: dict, first_index: int, precision,
                inv_grad_scale: float, amp=None) -> None:
    """A group's part of the plan: its params' entries, then its buckets' launches."""
    params = params_with_grad(optimizer, group, first_index)
    _convert_idle_states(optimizer, plan, number, group, first_index, precision)
    if not params:
        plan.built.append((number, None))  # (a kept launch would hold on to its tensors)
        return
    plan.precisions.append((group, precision))
    # an offloaded group's state lives, and its update runs, on the host
    offloader = optimizer._offloader if group.get("offload") == "cpu" else None
    backends = {device: resolve_backend(group["backend"], HOST if offloader else device)
                for device in {param.device for param in params}}
    live = bool(group.get("capturable"))
    if live:
        for backend in backends.values():
            capture.check_backend(backend, number)
    entries = _entries(optimizer, plan, group, first_index, precision, params, offloader)
    max_norm = group.get(clipping.KEY)
    if max_norm is not None:  # the clip scales each grad in place
        for entry in entries:
            check_writable(entry.grad, f"grad of param {entry.number} (clipped in place by "
                                       f"max_grad_norm_per_param)")
    factors = None if max_norm is None else _clip_factors(entries, float(max_norm), inv_grad_scale)
    device_grads = [entry.grad for entry in entries]
    if offloader:  # the kernels read and write host buffers: a mirror of the param, the staged grad
        written = {id(p) for p, _ in plan.mirror_writes}
        staged = offloader.stage([e.original for e in entries],
                                 [id(e.original) not in written for e in entries])
        entries = [entry._replace(param=mirror, grad=grad) for (mirror, grad), entry in zip(staged, entries)]
    if factors is not None:  # (an offloaded grad is scaled in its host copy, by the same factor)
        plan.clips += [(entry.grad, factor.to(entry.grad.device), entry.original if offloader else None)
                       for entry, factor in zip(entries, factors)]
        if offloader:  # and on its device, after the copy: the step leaves .grad clipped either way
            plan.clips += [(grad, factor, None) for grad, factor in zip(device_grads, factors)]
    steps = _steps(entries)  # (None while a graph is captured: the kernels read the counters)
    lives = _live_inputs(optimizer, plan, group, number, entries, steps, backends, amp) if live else {}
    launched = []
    for bucket, originals, counters, step in _buckets(group, entries, steps, live):
        config = bucket.config
        float64 = config.plan.param == torch.float64
        if live:  # the kernels compute the step's scalars; these give the constant ones
            bucket.live = lives[originals[0].device]
            scalars = optimizer._scalars(capture.placeholder_lr(group), 1, f32)
        else:
            scalars = optimizer._scalars(group, step, float if float64 else f32)
            _check_finite(scalars, number, step)
        if inv_grad_scale != 1.0:
            scalars = scalars._replace(inv_grad_scale=inv_grad_scale)
        backend = float64_backend(group["backend"]) if float64 else backends[originals[0].device]
        if config.track:
            bucket.counts = torch.zeros(len(bucket.params), 3, dtype=torch.int64)
        if offloader:  # checks and compiles, and cuts the update into the pipeline's chunks
            launch = offloader.prepare(bucket, originals, backend, scalars, group.get("offload_threads"))
        else:  # checks and compiles
            launch = backend.prepare(bucket, scalars)
        plan.launches.append((bucket, launch, originals, counters))
        launched.append((bucket, backend))
    fresh = any(entry.original in plan.states or entry.original in plan.buffers for entry in entries)
    plan.built.append((number, None if offloader or fresh or factors is not None else
                       KeptLaunchMaterial(group, first_index, precision, entries, launched)))


def _entries(optimizer, plan: StepPlan, group: dict, first_index: int, precision, params: list,
             offloader) -> list:
    """Each param's :class:`ParamEntry`, its state found, converted or made aside."""
    distributed = dtensor_type() is not None  # else no DTensor exists in this process
    live = bool(group.get("capturable"))
    position = {id(p): first_index + i for i, p in enumerate(group["params"])}
    ids = stream_ids(group, first_index)
    flags, track = tuple(optimizer._flags(group).items()), bool(group.get("track_precision"))
    configs = {}  # (see _state_config)
    entries = []
    for original in params:
        number = position[id(original)]
        # complex params are updated as real views, like torch; a DTensor as its local shard
        sharded = distributed and is_dtensor(original)
        shard = local(original) if sharded else original
        # (a .data assignment may have made it unwritable; offload writes it through views)
        check_writable(shard, f"params[{number}]", inference_ok=offloader is None)
        if offloader:  # (its copies move memory, not values)
            check_not_negative(shard, f"params[{number}] (offload='cpu')")
        param = real_view(shard)
        config = _state_config(optimizer, precision, param, original.numel(), flags, track, configs)
        state = _state_for(optimizer, plan, original, param, sharded, config, number, offloader)
        counter = step_counter(state, number, plan.counted)
        if counter.device != (param.device if live else HOST):  # capturable: counters live on the device
            counter = counter.to(param.device if live else HOST)
            state = {**state, "step": counter}
            plan.states[original] = wrapped(state, original)
        made = new_buffers(param, state, config, offloader)
        if made:
            plan.buffers[original] = wrapped(made, original)
        fresh = optimizer._fresh_flags(set(made))
        grad_dtype = original.grad.dtype.to_real()
        if fresh or grad_dtype != config.grad:  # the launch's config (the state's is known above)
            config = kernel_config(config.algorithm, config.plan, config.flags + tuple(fresh.items()),
                                   config.track, grad_dtype)
        # stochastic rounding numbers a shard's elements by their index in the whole param
        offset = shard_offset(optimizer, original, number) if sharded and config.stochastic else 0
        grad = read_view(local(original.grad) if sharded else original.grad)
        entries.append(ParamEntry(param, grad, config, {**state, **made}, counter, number,
                                  original, offset, ids[number - first_index]))
    return entries


def _state_config(optimizer, precision, param, numel: int, flags: tuple, track: bool,
                  configs: dict) -> KernelConfig:
    """The configuration a param's state is kept for (``param``: its real view; ``numel``: the
    whole param's), memoised in ``configs`` by dtype and q8 size class, not looked up per param."""
    size = (param.dtype, numel < precision.q8_min_numel)  # (q8 keeps small params' moments)
    config = configs.get(size)
    if config is None:
        config = configs[size] = kernel_config(optimizer.algorithm, plan_for(precision, param.dtype, numel),
                                               flags, track)
    return config


def _state_for(optimizer, plan: StepPlan, original, param, sharded: bool, config: KernelConfig, number: int,
               offloader) -> dict:
    """The param's state as the kernels see it (a DTensor's buffers as their local shards):
    new at its first step, moved or converted when its configuration or home changed (the
    new state recorded in ``plan.states``), else as it is; ``plan.known`` records what it fits."""
    home = HOST if offloader else param.device
    known = plan.known[original] = (config, home, offloader is not None)
    held = optimizer.state.get(original)
    state = shards(held) if sharded else held
    if state and any(map(operator.is_, state.values(), repeat(None))):
        # as torch.optim: a None buffer is none yet (SGD's momentum reset), made at this step
        state = {key: value for key, value in state.items() if value is not None}
        plan.states[original] = wrapped(state, original)
    if not state:  # first step: a new state, installed in phase two
        state = plan.states[original] = {"step": torch.tensor(0.0, dtype=torch.float64)}
        return state
    memo = optimizer._state_configs.get(original)
    if memo is not None and memo[0] == known and _same_tensors(memo[1], held):
        return state
    changed = False
    if not state_is_on(state, home, offloader is not None):  # `offload` was edited
        changed = True
        state = state_moved(state, offloader.to_host if offloader else lambda value: value.to(param.device))
    if not state_dicts.state_fits(state, config):
        # offloaded: contiguous host state (the pipeline walks it in flat pieces)
        like = param.detach().to(HOST).contiguous() if offloader else param
        state, new_param = state_dicts.convert_state(config, state, like, number, type(optimizer).__name__,
                                                     live=True)
        if offloader:
            state = state_moved(state, offloader.to_host)
        changed = True
        if new_param is not None:
            plan.param_writes.append((param, new_param.to(param.device)))
            if offloader:  # the host mirror takes the new bits too, not a stale read
                plan.mirror_writes.append((original, new_param))
    if changed:
        plan.states[original] = wrapped(state, original)
    return state


def _same_tensors(values: tuple, state: dict) -> bool:
    """Whether ``state`` holds the very tensors ``values`` (its values when last checked)."""
    return len(values) == len(state) and all(map(operator.is_, values, state.values()))


def plan_conversions(optimizer) -> StepPlan:
    """Phase one of a step GradScaler skips: no update, but every param's state converted
    where its group's settings changed, as the step would have converted it."""
    plan = StepPlan()
    first_index = 0
    for number, group in enumerate(optimizer.param_groups):
        precision = optimizer._group_precision(number, group)
        _convert_idle_states(optimizer, plan, number, group, first_index, precision, every=True)
        first_index += len(group["params"])
    return plan


def _convert_idle_states(optimizer, plan: StepPlan, number: int, group: dict, first_index: int, precision,
                         every: bool = False) -> None:
    """The state of the group's params without a grad this step (``every``: of all its params),
    converted (or moved) where the group's settings changed since it was made (a precision or
    offload edit): a step converts every param's state, as a load does, not only the params
    it updates."""
    if capture.capturing():  # (a capture refuses conversions; its params all have grads)
        return
    if number >= len(optimizer.param_groups) or optimizer.param_groups[number] is not group:
        return  # (a group narrowed to the params an update in backward updates: all have grads)
    flags, track = tuple(optimizer._flags(group).items()), bool(group.get("track_precision"))
    settings = (precision, flags, track, group.get("offload"))
    swept = optimizer._side_dict("_idle_sweeps").get(number)
    if not every and swept is not None and swept[0] is group and swept[1] == settings:
        return  # (the settings are those the idle states were last converted for)
    offloader = optimizer._offloader if group.get("offload") == "cpu" else None
    distributed, configs = dtensor_type() is not None, {}
    for index, original in enumerate(group["params"], start=first_index):
        if (original.grad is not None and not every) or not optimizer.state.get(original):
            continue
        sharded = distributed and is_dtensor(original)
        param = real_view(local(original) if sharded else original)
        config = _state_config(optimizer, precision, param, original.numel(), flags, track, configs)
        _state_for(optimizer, plan, original, param, sharded, config, index, offloader)
    plan.swept.append((number, group, settings))


def _clip_factors(entries: list, max_norm: float, inv_grad_scale: float) -> list:
    """Each entry's per-update clip factor (``clipping.py``), from its grad on its device."""
    if inv_grad_scale != 1.0:
        raise ValueError(f"{clipping.KEY} clips grads as they are read; with GradScaler they are still "
                         f"scaled then: call scaler.unscale_(optimizer) before scaler.step")
    for entry in entries:
        if is_dtensor(entry.original):
            raise clipping.refuse_dtensor(f"param {entry.number}")
    return [clipping.coefficient(entry.grad, max_norm) for entry in entries]


def _live_inputs(optimizer, plan: StepPlan, group: dict, number: int, entries: list, steps: Optional[list],
                 devices, amp) -> dict:
    """A capturable group's :class:`LiveInputs` per device (capture.py), once its live steps
    are known to work: no new or converted state while a graph is captured, no float64 params
    (the reference backend's), finite scalars at the steps the kernels will run (eager)."""
    if capture.capturing() and (plan.param_writes or any(
            entry.original in plan.states or entry.original in plan.buffers for entry in entries)):
        capture.refuse_while_capturing(number, "a param's first step, or a change of its state (precision, "
                                               "dtype, device or capturable)")
    if any(entry.param.dtype == torch.float64 for entry in entries):
        raise ValueError(f"param group {number}: capturable=True needs the CuPy kernels, and float64 "
                         f"params are updated by the reference backend")
    for step in sorted(set(steps or ())):
        _check_finite(optimizer._scalars(group, step, f32), number, step)
    return {device: capture.live_inputs(optimizer, group, number, device, amp) for device in devices}


def _steps(entries: list) -> Optional[list]:
    """The step each entry runs (its counter + 1, checked), or None while a CUDA graph is
    captured (a capturable group's counters are on the device: reading them would sync)."""
    if capture.capturing():
        return None
    counts = torch.stack([e.counter.double().reshape(()) for e in entries]).tolist()  # (any one-element)
    for value, entry in zip(counts, entries):
        check_step_count(value, f"state['step'] of param {entry.number}")
    return [int(s) + 1 for s in counts]


def _buckets(group: dict, entries: list, steps: Optional[list], live: bool = False) -> list:
    """(bucket, original params, their step counters, step number) of each set of entries
    sharing a device, a kernel configuration and a step number, in first-seen order.  A live
    step's buckets (capturable) do not split by step: each param's counter names its own."""
    buckets = {}
    for k, entry in enumerate(entries):
        config = entry.config
        step = None if live else steps[k]
        key = (entry.param.device, config, step)
        if key not in buckets:
            buckets[key] = (Bucket(config, seed=group["seed"], step=step or 0), [], [], step)
        bucket, originals, counters, _ = buckets[key]
        counters.append(entry.counter)
        bucket.append([entry.param, entry.grad] + [None if state_key is None else entry.state[state_key]
                                                   for state_key in config.state_keys[2:]],
                      entry.number, entry.offset, entry.stream)
        if live:
            bucket.counters.append(entry.counter)
        originals.append(entry.original)
    return list(buckets.values())


def _check_finite(scalars, number: int, step: int) -> None:
    bad = [name for name, value in zip(scalars._fields, scalars) if not math.isfinite(value)]
    if bad:
        sources = dict.fromkeys(source for name in bad for source in SCALAR_SOURCES.get(name, (name,)))
        names = list(sources)
        named = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        verb = "gives" if len(names) == 1 else "give"
        raise ValueError(f"param group {number}: {named} {verb} a non-finite float32 scalar "
                         f"({', '.join(bad)}) at step {step}; float32 holds magnitudes up to about 3.4e38")


def params_with_grad(optimizer, group: dict, first_index: int = 0) -> list:
    """The group's params that have grads; raises on grads the step cannot use (naming each
    param by its index in the optimizer, as state dicts do)."""
    params = []
    distributed = dtensor_type() is not None  # else no DTensor exists in this process
    name = type(optimizer).__name__
    for index, param in enumerate(group["params"], start=first_index):
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse or grad.layout != torch.strided:
            raise TypeError(f"{name} does not support sparse gradients "
                            f"(param {index} has a {grad.layout} grad)")
        grad_sharded = distributed and is_dtensor(grad)
        if type(grad) is not torch.Tensor and not grad_sharded:  # (one C-level test for the common case)
            check_known_tensor(grad, f"grad of param {index}")  # (a DTensor's local: staging checks it)
        if distributed and (grad_sharded != is_dtensor(param) or grad_sharded and (
                grad.placements != param.placements or grad.device_mesh != param.device_mesh)):
            raise TypeError(f"grad of param {index} is {layout_name(grad)} but the param is {layout_name(param)}; "
                            f"the update pairs each shard of a param with the same shard of its grad")
        # float32 grads of 16-bit params are read as they are (float32 accumulation);
        # complex params keep grads of their own dtype
        dtype_ok = grad.dtype == param.dtype or (grad.dtype in grad_dtypes(param.dtype) and not param.is_complex())
        if grad.shape != param.shape or not dtype_ok or grad.device != param.device:
            raise ValueError(f"grad of param {index} ({tuple(grad.shape)}, {grad.dtype}, "
                             f"{grad.device}) does not match the param "
                             f"({tuple(param.shape)}, {param.dtype}, {param.device}); grads "
                             f"have the param's shape, device and dtype (or float32 for a "
                             f"bfloat16/float16 param)")
        params.append(param)
    return params


def new_buffers(param: torch.Tensor, state: dict, config: KernelConfig, offloader=None) -> dict:
    """The state buffers ``config`` needs that ``state`` lacks, made aside (not installed):
    moments and Kahan compensation start at 0, a master copy as the param, a remainder
    at 0 (a bf16 value is an exact float32 master with remainder 0)."""
    made = {}
    for _, role, dtype, key in config.present()[2:]:  # after param and grad
        if key in state:
            continue
        copy = role.storage == "companion" and config.weights == "copy"  # the master starts as the param
        if offloader is not None and dtype == Q8:
            made[key] = offloader.to_host(torch.zeros(q8_shape(param.numel()), dtype=dtype))
        elif offloader is not None:  # in host memory (page-locked for CUDA params)
            made[key] = offloader.host_like(param, dtype, param.detach() if copy else None)
        elif copy:
            made[key] = param.detach().to(dtype, memory_format=torch.preserve_format, copy=True)
        elif dtype == Q8:  # all codes and scales 0: every element decodes to +0
            made[key] = torch.zeros(q8_shape(param.numel()), dtype=dtype, device=param.device)
        else:
            made[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    return made


def shard_offset(optimizer, param, number: int) -> int:
    """``distributed.global_offset`` of a DTensor param, cached while its placement holds."""
    key = (param.placements, param.device_mesh, param.shape, local(param).shape)
    offsets = optimizer._side_dict("_shard_offsets")
    cached = offsets.get(param)
    if cached is None or cached[0] != key:
        cached = offsets[param] = (key, global_offset(param, f"param {number}"))
    return cached[1]


#: step counter dtypes that count a run's steps exactly (torch.optim's float32 up to 2**24)
COUNTER_DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32)


def step_counter(state: dict, number: int, counted: set) -> torch.Tensor:
    """A param's step counter, checked; ``counted``: the (device, address) of the counters
    found so far this step, which it joins (a shared one would advance once per param)."""
    step = state.get("step")
    if not isinstance(step, torch.Tensor) or step.numel() != 1 or step.is_complex():
        raise ValueError(f"state['step'] of param {number} must be a one-element tensor, got {step!r:.60}")
    if step.dtype not in COUNTER_DTYPES:
        raise ValueError(f"state['step'] of param {number} is {step.dtype}, which cannot count steps "
                         f"exactly; use a float64, float32, int64 or int32 tensor")
    check_writable(step, f"state['step'] of param {number}")
    place = (step.device, step.data_ptr())
    if place in counted:
        raise ValueError(f"state['step'] of param {number} is another param's step counter; each "
                         f"param counts its own steps (give it its own tensor)")
    counted.add(place)
    return step
