"""State dicts: saving, loading, and converting a param's state from one storage plan to another.

A state dict keeps every state tensor in its stored dtype (bf16 moments stay bf16) under
the keys torch.optim uses (``step``, ``exp_avg``, ``momentum_buffer``...) plus the master
policy's buffer (``master``, ``compensation`` or ``remainder``, see
``StoragePlan.companion_key``).  Loading converts each tensor into the dtype the live
optimizer's :class:`~bf16opt.algorithms.KernelConfig` gives it, so a state dict saved
with one preset, or by ``torch.optim``, loads into another.  The same conversion runs
when a group's precision or a param's dtype changes between steps.

Everything here checks before it changes anything: :func:`load` builds the new groups
and state aside and swaps them in only when all of it fits.

DTensor params (FSDP2): state buffers are DTensors sharded like the param (as torch.optim's,
so ``torch.distributed.checkpoint`` saves and reshards them); a saved buffer is loaded as
this rank's shard -- a DTensor placed like the param gives its local tensor, a plain tensor
of the param's whole shape (a full state dict) the slice this rank holds.

Format (``STATE_DICT_FORMAT``): 3 since stochastic rounding draws two buffers' bits from one
hash; 2 since it names a named param's random streams by its name; a format-1 state dict
keeps position streams (see below and docs/numerics.md, "State-dict format").
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import defaultdict
from collections.abc import Hashable, Mapping

import torch

from .algorithms import KernelConfig
from .distributed import is_dtensor, local, shard_of
from .precision import as_precision


def real_view(tensor):
    from .optimizer import real_view as view  # (optimizer imports this module)
    return view(tensor)


def wrapped(state, param):
    from .optimizer import wrapped as wrap  # noqa: PLC0415
    return wrap(state, param)


from .storage import decode, encode, join_remainder, split_remainder

__all__ = ["IMPLEMENTATION_KEYS", "STATE_DICT_FORMAT", "convert_state", "load", "save", "state_fits"]

#: 3: stochastic rounding draws two buffers' 16 random bits from one hash (storage.py; 1 and 2:
#: a hash per buffer).  2: its streams are named by param names when the optimizer has them
#: (1: always by position).  A format-1 state dict loads with ``sr_streams="position"`` in
#: every named group, so a run saved by an older bf16opt keeps its stream ids; the entry is
#: saved with the group and survives later saves and loads (DCP's too).  A format-1 or -2
#: state dict loaded into groups that round stochastically warns: the run continues with
#: format 3's bits, as unbiased, not the ones the older bf16opt would have drawn.
STATE_DICT_FORMAT = 3
# Group entries that describe this optimizer object, not the training run: when a
# state dict is loaded, the live optimizer keeps its own values for these.
IMPLEMENTATION_KEYS = ("precision", "backend", "offload", "offload_threads", "foreach", "fused", "capturable",
                       "differentiable", "track_precision")
COMPANION_KEYS = ("master", "compensation", "remainder")


def save(optimizer, state_dict: dict) -> dict:
    """torch's state dict of ``optimizer`` with plain-type ``precision`` entries and a tag."""
    for group in state_dict["param_groups"]:
        # as_precision: a precision edited by hand since the last step may still be a name
        group["precision"] = as_precision(group["precision"]).to_dict()
    state_dict["bf16opt"] = {"format": STATE_DICT_FORMAT, "family": optimizer.algorithm.name,
                             "optimizer": type(optimizer).__name__}
    return state_dict


def state_fits(state: dict, config: KernelConfig) -> bool:
    """True when ``state`` holds exactly the master-policy buffer ``config`` needs and its
    moments (those present) in the config's dtypes; missing moments are made at the step."""
    needed = config.state_buffers()
    for key in COMPANION_KEYS:
        if (key in state) != (key in needed) or (key in state and state[key].dtype != needed[key]):
            return False
    return all(state[key].dtype == dtype for key, dtype in needed.items() if key in state)


def load(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict``: see its docstring."""
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
    if not isinstance(state_dict["state"], Mapping):
        raise TypeError(f"state_dict['state'] must be a dict of param index -> state, got "
                        f"{type(state_dict['state']).__name__}")
    if not isinstance(state_dict["param_groups"], (list, tuple)):
        raise TypeError(f"state_dict['param_groups'] must be a list of dicts, got "
                        f"{type(state_dict['param_groups']).__name__}")
    name = type(optimizer).__name__
    meta = state_dict.get("bf16opt")
    if isinstance(meta, dict) and meta.get("family") != optimizer.algorithm.name:
        raise ValueError(f"state_dict was saved by bf16opt.{meta.get('optimizer')}, which cannot "
                         f"be loaded into {name}")
    legacy = isinstance(meta, dict) and meta.get("format") == 1
    older = isinstance(meta, dict) and meta.get("format") in (1, 2)  # a hash per buffer
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"this optimizer has {len(optimizer.param_groups)}")

    new_groups, param_of_index = [], {}
    for number, (live, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        _check_saved_group(optimizer, saved, number)
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(f"loaded state dict's param group {number} has "
                             f"{len(saved['params'])} params, this optimizer's has "
                             f"{len(live['params'])}")
        group = {key: value for key, value in live.items() if key not in ("params", "sr_streams")}
        group.update({key: value for key, value in saved.items()
                      if key not in IMPLEMENTATION_KEYS and key != "params"})
        if legacy and "param_names" in group:  # format 1 named every param's streams by position
            group["sr_streams"] = "position"
        optimizer._force_group_entries(group)
        optimizer._check_group(group, live["params"])
        group["params"] = live["params"]
        new_groups.append(group)
        for index, param in zip(saved["params"], live["params"]):
            if not isinstance(index, Hashable):
                raise TypeError(f"param group {number} of the state dict lists a param index of "
                                f"type {type(index).__name__}")
            param_of_index[index] = (param, group)

    new_state, param_writes = defaultdict(dict), []
    for index, saved_state in state_dict["state"].items():
        if not isinstance(index, Hashable) or index not in param_of_index:
            raise ValueError(f"loaded state dict holds state for param index {index!r}, "
                             f"which none of its param groups lists")
        param, group = param_of_index[index]
        real = real_view(local(param))  # a DTensor param: its local shard
        config = optimizer._state_config(group, real)
        offloaded = group.get("offload") == "cpu"  # its state lives in host RAM
        like = real.detach().to("cpu").contiguous() if offloaded else real
        if is_dtensor(param) and isinstance(saved_state, Mapping):  # each saved buffer as this rank's shard
            saved_state = {key: value if key == "step" else shard_of(value, param, f"{key} of param {index}")
                           for key, value in saved_state.items()}
        state, new_param = convert_state(config, saved_state, like, index, name)
        if offloaded:
            state = {key: value if key == "step" else optimizer._offloader.to_host(value)
                     for key, value in state.items()}
        new_state[param] = wrapped(state, param)
        if new_param is not None:
            param_writes.append((real, new_param.to(real.device)))

    optimizer.param_groups[:] = new_groups
    optimizer.state = new_state
    optimizer._state_configs.clear()
    optimizer._group_launches.clear()  # (they would be rebuilt anyway; this releases the old state now)
    with torch.no_grad():
        for param, new_param in param_writes:
            param.copy_(new_param)
    if older and any(as_precision(group["precision"]).rounding == "stochastic" for group in new_groups):
        warnings.warn(f"this state dict was saved by an older bf16opt (state-dict format {meta['format']}), "
                      f"whose stochastic rounding drew a hash per buffer; this run continues with format "
                      f"{STATE_DICT_FORMAT}'s random bits (two buffers per hash): as unbiased, but not "
                      f"the bits the older version would have drawn", UserWarning, stacklevel=3)
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


def _check_saved_group(optimizer, saved, number: int) -> None:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
        raise ValueError(f"param group {number} of the state dict must be a dict with a "
                         f"'params' list")
    missing = [key for key in optimizer._SAVED_GROUP_KEYS if key not in saved]
    foreign = [key for key in optimizer._FOREIGN_GROUP_KEYS if key in saved]
    if missing or foreign:
        found = f"lacks {missing}" if missing else f"has {foreign}"
        raise ValueError(f"param group {number} of the state dict {found}: not a state dict "
                         f"of {type(optimizer).__name__} (or of torch.optim's equivalent)")


def _checked_step(saved: dict, index) -> float:
    step = saved.get("step", 0)
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex():
            raise ValueError(f"step of param {index} must be a number or a one-element tensor, "
                             f"got a tensor of shape {tuple(step.shape)}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step) \
            or step < 0 or step != int(step):
        raise ValueError(f"step of param {index} must be a whole number >= 0, got {step!r}")
    if step >= 2 ** 53:
        raise ValueError(f"step of param {index} is {step!r}; bf16opt counts steps exactly up to 2**53")
    return float(step)


def convert_state(config: KernelConfig, saved: dict, param: torch.Tensor, index, optimizer_name: str) -> tuple:
    """(new state, new param bits or None) for one param; raises before changing anything.

    Every buffer of ``config`` found in ``saved`` is encoded into the config's dtype
    (round to nearest even).  The master comes from the saved copy, param + remainder, or
    the param itself.  A remainder plan holds part of the master in the param, so loading
    a master into it rewrites the param as the master's ties-away rounding (it differs from
    the round-to-nearest-even param only on exact ties).
    """
    if not isinstance(saved, Mapping):
        raise ValueError(f"state of param {index} must be a dict, got {type(saved).__name__}")
    # torch.optim keeps a complex param's state complex; bf16opt keeps its real view
    saved = {key: torch.view_as_real(value) if isinstance(value, torch.Tensor) and value.is_complex()
             and key != "step" else value for key, value in saved.items()}
    algorithm = config.algorithm
    moments = [role.name for role in algorithm.moment_roles]
    unknown = set(saved) - {"step", *COMPANION_KEYS, *moments}
    if unknown:
        raise ValueError(f"state of param {index} holds {sorted(unknown)}, which "
                         f"{optimizer_name} does not use: not a state dict of this "
                         f"kind of optimizer")
    missing = set(algorithm.required_state) - set(saved)
    if missing:
        raise ValueError(f"state of param {index} lacks {sorted(missing)}: not a "
                         f"{optimizer_name} state dict")
    for key, value in saved.items():
        if key == "step":
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key} of param {index} must be a tensor, got {type(value).__name__}")
        if value.shape != param.shape:
            raise ValueError(f"{key} of param {index} has shape {tuple(value.shape)}, but the "
                             f"param has shape {tuple(param.shape)}")
    # float64: exact far beyond float32's 2**24 (torch keeps float32 and stops counting there)
    state = {"step": torch.tensor(_checked_step(saved, index), dtype=torch.float64)}
    needed = config.state_buffers()
    for key in moments:
        if key in saved and key in needed:
            state[key] = _converted(saved[key], param, needed[key], f"{key} of param {index}")
    new_param = None
    weights = config.weights
    if weights in ("copy", "remainder"):
        master = _saved_master(saved, param, index)
        if weights == "copy":
            state["master"] = _converted(master, param, needed["master"], f"master of param {index}")
        else:
            new_param, remainder = split_remainder(master)
            state["remainder"] = torch.empty_like(param, dtype=torch.int16).copy_(remainder)
            new_param = torch.empty_like(param).copy_(new_param)
    if weights == "kahan" and "compensation" in saved:
        state["compensation"] = _converted(saved["compensation"], param, needed["compensation"],
                                           f"compensation of param {index}")
    return state, new_param


def _saved_master(saved: dict, param: torch.Tensor, index) -> torch.Tensor:
    """The float32 master a saved state holds: its copy, param + remainder, or the param."""
    if "master" in saved:
        return _converted(saved["master"], param, torch.float32, f"master of param {index}")
    if "remainder" in saved and param.dtype == torch.bfloat16:
        remainder = saved["remainder"]
        if not isinstance(remainder, torch.Tensor) or remainder.dtype != torch.int16 \
                or remainder.shape != param.shape:
            raise ValueError(f"remainder of param {index} must be an int16 tensor of shape "
                             f"{tuple(param.shape)}")
        return join_remainder(param.detach(), remainder.to(param.device))
    return decode(param.detach()).float().clone()


def _converted(value, param: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A new tensor laid out like ``param`` holding ``encode(value, dtype)``."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {value!r:.80}")
    if value.is_meta:
        raise ValueError(f"{what} is a meta tensor (no data to load)")
    if value.shape != param.shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)}, but the param has shape "
                         f"{tuple(param.shape)}")
    value = value.detach().to(param.device)
    if dtype == torch.float64:  # (no storage plan keeps float64 today; exact if one does)
        return torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
    value_f32 = decode(value)  # float64 states round here
    result = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    result.copy_(encode(value_f32, dtype))
    return result
