"""State dicts: saving, loading, and converting a param's state from one storage plan to another.

A state dict keeps every state tensor in its stored dtype (bf16 moments stay bf16; a q8
moment is its uint8 tensor of codes and float32 scales, ``storage.py``'s "q8" layout) under
the keys torch.optim uses (``step``, ``exp_avg``, ``momentum_buffer``...) plus the master
policy's buffer (``master``, ``compensation`` or ``remainder``, see
``StoragePlan.companion_key``).  Loading converts each tensor into the dtype the live
optimizer's :class:`~bf16opt.algorithms.KernelConfig` gives it, so a state dict saved
with one preset, or by ``torch.optim``, loads into another.  The same conversion runs
when a group's precision or a param's dtype changes between steps.

Everything here checks before it changes anything: :func:`plan_load` builds the new groups
and state aside (a :class:`LoadPlan`), which the optimizer installs only when all of it fits.

DTensor params (FSDP2): state buffers are DTensors sharded like the param (as torch.optim's,
so ``torch.distributed.checkpoint`` saves and reshards them); a saved buffer is loaded as
this rank's shard -- a DTensor placed like the param gives its local tensor, a plain tensor
of the param's whole shape (a full state dict) the slice this rank holds.  A q8 moment of a
DTensor param is saved as its rank's row of a "rank table" DTensor and loaded back only into
the sharding it was saved with (``q8_sharded.py``; a gathered table also into plain params).

Format (``STATE_DICT_FORMAT``): 3 since stochastic rounding draws two buffers' bits from one
hash; 2 since it names a named param's random streams by its name; a format-1 state dict
keeps position streams (see below and docs/numerics.md, "State-dict format").
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import Callable, NamedTuple

import torch

from .algorithms import KernelConfig, kernel_config
from .checks import check_step_count
from .distributed import is_dtensor, local, shard_of
from .precision import as_precision
from .q8_sharded import is_local_q8, is_rank_table, loaded_shard, rank_table, whole_moment
from .storage import (Q8, Q8_BLOCK, decode, encode, join_copy, join_remainder, q8_decode, q8_encode, q8_shape,
                      q8_signed, split_remainder, written_from)
from .tensors import real_view, state_moved, wrapped

__all__ = ["IMPLEMENTATION_KEYS", "STATE_DICT_FORMAT", "LoadPlan", "LoadTarget", "convert_state", "plan_load",
           "save", "state_fits"]

#: 3: stochastic rounding draws two buffers' 16 random bits from one hash (storage.py; 1 and 2:
#: a hash per buffer).  2: its streams are named by param names when the optimizer has them
#: (1: always by position).  A format-1 state dict loads with ``sr_streams="position"`` in
#: every named group, so a run saved by an older bf16opt keeps its stream ids; the entry is
#: saved with the group and survives later saves and loads (DCP's too).  A format-1 or -2
#: state dict loaded into groups that round stochastically warns: the run continues with
#: format 3's bits, as unbiased, not the ones the older bf16opt would have drawn.
STATE_DICT_FORMAT = 3
# Group entries that describe this optimizer object, not the training run: saved with every
# group (DCP's flattened state dicts look each live group key up), but when a state dict is
# loaded, the live optimizer keeps its own values for these.
IMPLEMENTATION_KEYS = ("precision", "backend", "offload", "offload_threads", "foreach", "fused", "capturable",
                       "differentiable", "track_precision", "update_in_backward", "update_in_backward_bucket")
COMPANION_KEYS = ("master", "compensation", "remainder")


def save(state_dict: dict, family: str, optimizer_name: str, live_groups: list) -> dict:
    """torch's state dict with plain-type ``precision`` entries, a tag naming the algorithm
    ``family`` and the optimizer class that saved it, and each q8 moment of a DTensor param
    as its row of a rank table (``q8_sharded.py``); ``live_groups`` are the optimizer's."""
    _q8_shards_as_tables(state_dict, live_groups)
    for group in state_dict["param_groups"]:
        # as_precision: a precision edited by hand since the last step may still be a name
        group["precision"] = as_precision(group["precision"]).to_dict()
    state_dict["bf16opt"] = {"format": STATE_DICT_FORMAT, "family": family, "optimizer": optimizer_name}
    return state_dict


def _q8_shards_as_tables(state_dict: dict, live_groups: list) -> None:
    """Replace (never edit: they are the optimizer's own) the state dicts of DTensor params
    that hold q8 moments, so that DCP saves every rank's blocks rather than one rank's copy."""
    param_of = {index: param for saved, live in zip(state_dict["param_groups"], live_groups)
                for index, param in zip(saved["params"], live["params"])}
    for index, state in state_dict["state"].items():
        param = param_of.get(index)
        if is_dtensor(param) and any(is_local_q8(value, param) for value in state.values()):
            state_dict["state"][index] = {
                key: rank_table(value, param, f"{key} of param {index}") if is_local_q8(value, param)
                else value for key, value in state.items()}


def state_fits(state: dict, config: KernelConfig) -> bool:
    """True when ``state`` holds exactly the master-policy buffer ``config`` needs and its
    moments (those present) in the config's dtypes; missing moments are made at the step."""
    needed = config.state_buffers()
    for key in COMPANION_KEYS:
        if (key in state) != (key in needed) or (key in state and _dtype(state[key]) != needed[key]):
            return False
    return all(_dtype(state[key]) == dtype for key, dtype in needed.items() if key in state)


def _dtype(value) -> "torch.dtype | None":
    return value.dtype if isinstance(value, torch.Tensor) else None  # (conversion names a non-tensor)


class LoadTarget(NamedTuple):
    """What loading needs of the live optimizer, passed in by it."""

    name: str                 # its class name, for messages
    family: str               # its algorithm's name: a state dict of another family is refused
    groups: list              # its param groups
    saved_group_keys: tuple   # keys every saved group of this kind has...
    foreign_group_keys: tuple  # ...and keys that betray another kind
    normalise_group: Callable[[dict, list], None]  # pins and checks a new group in place (raises)
    config_of: Callable[[dict, torch.Tensor, int], KernelConfig]  # a param's state's config (real view, numel)
    to_host: Callable[[torch.Tensor], torch.Tensor]  # an offloaded buffer into host memory
    in_use: Callable[[], set] = set  # storage addresses other live optimizers' states hold


class LoadPlan(NamedTuple):
    """A checked state dict, ready for the optimizer to install."""

    groups: list              # the new param groups
    state: dict               # param -> its new state
    param_writes: list        # (param, new bits): params a remainder plan rewrites
    older_format: "int | None"  # the format of an older state dict whose random bits differ


def plan_load(target: LoadTarget, state_dict) -> LoadPlan:
    """Check ``state_dict`` against ``target`` and build the new groups and state aside;
    raises before anything changes (see ``MixedPrecisionOptimizer.load_state_dict``)."""
    _check_shape(state_dict)
    meta = state_dict.get("bf16opt")
    if isinstance(meta, dict) and meta.get("family") != target.family:
        raise ValueError(f"state_dict was saved by bf16opt.{meta.get('optimizer')}, which cannot "
                         f"be loaded into {target.name}")
    if isinstance(meta, dict) and meta.get("format") not in (1, 2, STATE_DICT_FORMAT):
        raise ValueError(f"state_dict has bf16opt state-dict format {meta.get('format')!r}; this bf16opt "
                         f"reads formats 1 to {STATE_DICT_FORMAT} (a newer bf16opt saved it?)")
    legacy = isinstance(meta, dict) and meta.get("format") == 1
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(target.groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"this optimizer has {len(target.groups)}")
    new_groups, param_of_index = [], {}
    for number, (live, saved) in enumerate(zip(target.groups, saved_groups)):
        group = _loaded_group(target, live, saved, number, legacy)
        new_groups.append(group)
        for index, param in zip(saved["params"], live["params"]):
            if not isinstance(index, Hashable):
                raise TypeError(f"param group {number} of the state dict lists a param index of "
                                f"type {type(index).__name__}")
            param_of_index[index] = (param, group)
    new_state, param_writes = defaultdict(dict), []
    taken = target.in_use() | {_storage_address(param)
                               for group in target.groups for param in group["params"]}
    for index, saved_state in state_dict["state"].items():
        if not isinstance(index, Hashable) or index not in param_of_index:
            raise ValueError(f"loaded state dict holds state for param index {index!r}, "
                             f"which none of its param groups lists")
        if isinstance(saved_state, Mapping) and not saved_state:
            continue  # no state yet (a read of the state defaultdict leaves {}; torch loads it too)
        param, group = param_of_index[index]
        new_state[param], new_param = _loaded_state(target, param, group, saved_state, index, taken)
        if new_param is not None:
            real = real_view(local(param))
            param_writes.append((real, new_param.to(real.device)))
    older = meta.get("format") if isinstance(meta, dict) and meta.get("format") in (1, 2) else None
    return LoadPlan(new_groups, new_state, param_writes, older)


def warn_if_older_format(plan: LoadPlan) -> None:
    """Warn when a format-1 or -2 state dict was loaded into groups that round stochastically."""
    if plan.older_format is not None and \
            any(as_precision(group["precision"]).rounding == "stochastic" for group in plan.groups):
        warnings.warn(f"this state dict was saved by an older bf16opt (state-dict format {plan.older_format}), "
                      f"whose stochastic rounding drew a hash per buffer; this run continues with format "
                      f"{STATE_DICT_FORMAT}'s random bits (two buffers per hash): as unbiased, but not "
                      f"the bits the older version would have drawn", UserWarning, stacklevel=3)


def _check_shape(state_dict) -> None:
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
    if not isinstance(state_dict["state"], Mapping):
        raise TypeError(f"state_dict['state'] must be a dict of param index -> state, got "
                        f"{type(state_dict['state']).__name__}")
    if not isinstance(state_dict["param_groups"], (list, tuple)):
        raise TypeError(f"state_dict['param_groups'] must be a list of dicts, got "
                        f"{type(state_dict['param_groups']).__name__}")


def _loaded_group(target: LoadTarget, live: dict, saved, number: int, legacy: bool) -> dict:
    """The live group with the saved hyper-parameters (implementation keys stay live), checked."""
    _check_saved_group(target, saved, number)
    if len(saved["params"]) != len(live["params"]):
        raise ValueError(f"loaded state dict's param group {number} has "
                         f"{len(saved['params'])} params, this optimizer's has "
                         f"{len(live['params'])}")
    group = {key: value for key, value in live.items() if key not in ("params", "sr_streams")}
    group.update({key: value for key, value in saved.items()
                  if key not in IMPLEMENTATION_KEYS and key != "params"})
    if legacy and "param_names" in group:  # format 1 named every param's streams by position
        group["sr_streams"] = "position"
    target.normalise_group(group, live["params"])
    group["params"] = live["params"]
    return group


def _loaded_state(target: LoadTarget, param, group: dict, saved_state, index, taken: set) -> tuple:
    """(the param's new state, new param bits or None) from its saved state (``taken``: see
    :func:`_adopted`)."""
    real = real_view(local(param))  # a DTensor param: its local shard
    config = target.config_of(group, real, param.numel())
    offloaded = group.get("offload") == "cpu"  # its state lives in host RAM
    like = real.detach().to("cpu").contiguous() if offloaded else real
    if is_dtensor(param) and isinstance(saved_state, Mapping):  # each saved buffer as this rank's shard
        saved_state = {key: value if key == "step" else _saved_shard(value, param, key, index)
                       for key, value in saved_state.items()}
    elif isinstance(saved_state, Mapping):  # a gathered table of a sharded run: its whole moment
        saved_state = {key: whole_moment(value, key, tuple(real.shape), f"{key} of param {index}")
                       if key != "step" and _is_gathered_table(value, real) else value
                       for key, value in saved_state.items()}
    state, new_param = convert_state(config, saved_state, like, index, target.name,
                                     taken=None if is_dtensor(param) else taken)
    if offloaded:
        state = state_moved(state, target.to_host)
    return wrapped(state, param), new_param


def _saved_shard(value, param, key: str, index):
    """A saved buffer of DTensor ``param`` as this rank's shard (q8 rank tables included)."""
    what = f"{key} of param {index}"
    if is_rank_table(value) and not is_local_q8(value, param):  # (a local q8: saved before tables)
        return loaded_shard(value, param, key, what)
    return shard_of(value, param, what)


def _is_gathered_table(value, param: torch.Tensor) -> bool:
    # a q8 tensor of the param itself is never a table, even if its first codes spell the magic
    return is_rank_table(value) and not _is_q8(value, param)


def _check_saved_group(target: LoadTarget, saved, number: int) -> None:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
        raise ValueError(f"param group {number} of the state dict must be a dict with a "
                         f"'params' list")
    missing = [key for key in target.saved_group_keys if key not in saved]
    foreign = [key for key in target.foreign_group_keys if key in saved]
    if missing or foreign:
        found = f"lacks {missing}" if missing else f"has {foreign}"
        raise ValueError(f"param group {number} of the state dict {found}: not a state dict "
                         f"of {target.name} (or of torch.optim's equivalent)")


def _checked_step(saved: dict, index) -> float:
    step = saved.get("step", 0)
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex():
            raise ValueError(f"step of param {index} must be a number or a one-element tensor, "
                             f"got a tensor of shape {tuple(step.shape)}")
        step = step.item()
    return check_step_count(step, f"step of param {index}")


def convert_state(config: KernelConfig, saved: dict, param: torch.Tensor, index, optimizer_name: str,
                  live: bool = False, taken: set = None) -> tuple:
    """(new state, new param bits or None) for one param; raises before changing anything.
    ``taken``: the storages already in use, where a saved tensor that needs no conversion
    may become the state itself (:func:`_adopted`); None: every buffer is a new tensor.

    Every buffer of ``config`` found in ``saved`` is encoded into the config's dtype
    (round to nearest even).  The master comes from the saved copy, param + remainder, or
    the param itself.  A remainder plan holds part of the master in the param, so loading
    a master into it rewrites the param as the master's ties-away rounding (it differs from
    the round-to-nearest-even param only on exact ties).  A copy plan's param is its master's
    round to nearest even (a param that is not reads as edited: ``storage.join_copy``), so a
    master joined from a remainder (whose ties-away param differs on ties) rewrites the param
    as that; a saved copy leaves it, so a param edited since that copy was written wins.
    """
    if not isinstance(saved, Mapping):
        raise ValueError(f"state of param {index} must be a dict, got {type(saved).__name__}")
    # (torch.optim.SGD without momentum saved {"momentum_buffer": None} before torch 2.2)
    saved = {key: value for key, value in saved.items() if not (key == "momentum_buffer" and value is None)}
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
        if isinstance(value, torch.Tensor):
            _check_loadable(value, f"{key} of param {index}")
        if key == "step":
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key} of param {index} must be a tensor, got {type(value).__name__}")
        if key in moments and _is_q8(value, param):
            _check_q8_padding(value, param.numel(), f"{key} of param {index}")
            continue
        if value.shape != param.shape:
            raise ValueError(f"{key} of param {index} has shape {tuple(value.shape)}, but the "
                             f"param has shape {tuple(param.shape)}")
    # float64: exact far beyond float32's 2**24 (torch keeps float32 and stops counting there)
    state = {"step": torch.tensor(_checked_step(saved, index), dtype=torch.float64)}
    needed = config.state_buffers()
    if any(key in saved and key not in needed for key in moments):  # (kept as torch.optim keeps them)
        needed = {**_every_moment(config), **needed}
    for key in moments:
        if key in saved and key in needed:
            state[key] = _converted(saved[key], param, needed[key], f"{key} of param {index}", key, taken)
    new_param = None
    weights = config.weights
    kept_master = _adopted(saved["master"], param, needed["master"], None, taken) \
        if weights == "copy" and "master" in saved and not live else None
    if kept_master is not None:  # (the saved copy, as the param's master)
        state["master"] = kept_master
    elif weights in ("copy", "remainder"):
        master = _saved_master(saved, param, index, live)
        if weights == "copy":
            state["master"] = _converted(master, param, needed["master"], f"master of param {index}")
            if "master" not in saved:  # (a saved copy stays beside the param: an edit since wins)
                new_param = _copy_param(param, state["master"])
        else:
            new_param, remainder = split_remainder(master)
            state["remainder"] = torch.empty_like(param, dtype=torch.int16).copy_(remainder)
            new_param = torch.empty_like(param).copy_(new_param)
    if weights == "kahan" and "compensation" in saved:
        state["compensation"] = _converted(saved["compensation"], param, needed["compensation"],
                                           f"compensation of param {index}", taken=taken)
    return state, new_param


def _copy_param(param: torch.Tensor, master: torch.Tensor):
    """The param bits a float32 master copy writes (round to nearest even), or None where the
    param holds them already (NaN: any NaN, the update reads a NaN either way)."""
    if master.dtype != torch.float32 or param.dtype == master.dtype:
        return None
    value = param.detach().resolve_neg()
    if bool((written_from(value, master) | (torch.isnan(master) & torch.isnan(value))).all()):
        return None
    return torch.empty_like(param).copy_(encode(master, param.dtype))


def _every_moment(config: KernelConfig) -> dict:
    """The state buffers of ``config`` with every optional moment on: a moment whose flag is off
    now (amsgrad's maximum, SGD's momentum) stays in the state, in the dtype it would have, for
    when the flag is set again, as torch.optim keeps it."""
    optional = tuple((role.when, True) for role in config.algorithm.moment_roles if role.when)
    return kernel_config(config.algorithm, config.plan, config.flags + optional, config.track).state_buffers()


def _check_loadable(value: torch.Tensor, what: str) -> None:
    """A saved tensor holds data to read, laid out densely (every saved tensor is checked
    here before it is read)."""
    if value.is_meta:
        raise ValueError(f"{what} is a meta tensor (no data to load)")
    if value.layout != torch.strided:
        raise TypeError(f"{what} has layout {value.layout}; saved state tensors are dense (strided)")


def _saved_master(saved: dict, param: torch.Tensor, index, live: bool = False) -> torch.Tensor:
    """The float32 master a saved state holds: its copy, param + remainder, or the param.
    ``live``: the state is the optimizer's own and the param the user's now (a settings edit
    converts it), so a param edited since the copy was written is the master there, as the
    step would read it (``storage.join_copy``); a load cannot tell an edit from a param not
    loaded yet, and keeps the copy."""
    if "master" in saved:
        master = _converted(saved["master"], param, torch.float32, f"master of param {index}")
        if live and param.dtype in (torch.bfloat16, torch.float16):
            return join_copy(param.detach().resolve_neg(), master)
        return master
    if "remainder" in saved and param.dtype == torch.bfloat16:
        remainder = saved["remainder"]
        if not isinstance(remainder, torch.Tensor) or remainder.dtype != torch.int16 \
                or remainder.shape != param.shape:
            raise ValueError(f"remainder of param {index} must be an int16 tensor of shape "
                             f"{tuple(param.shape)}")
        return join_remainder(param.detach().resolve_neg(), remainder.to(param.device))
    return decode(param.detach()).float().clone()


def _check_q8_padding(value: torch.Tensor, numel: int, what: str) -> None:
    """The codes past the param's last element are 0 (never written), as in a q8 moment of
    this param: one saved for a longer param of as many blocks has codes there.  (A shorter
    one's cannot be told from zero moments: a q8 tensor does not record its element count.)"""
    used = numel - Q8_BLOCK * (value.shape[0] - 1)
    if value.shape[0] and bool(value[-1, used:Q8_BLOCK].any()):
        raise ValueError(f"{what} holds codes past the param's {numel} elements: it was saved for "
                         f"a param with more elements")


def _is_q8(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a saved moment is a q8 tensor of the param (uint8 codes and scales)."""
    return value.dtype == Q8 and tuple(value.shape) == q8_shape(param.numel())


def _converted(value, param: torch.Tensor, dtype: torch.dtype, what: str, role: str = None,
               taken: set = None) -> torch.Tensor:
    """A new tensor laid out like ``param`` holding ``encode(value, dtype)``, or ``value``
    itself where that would be a copy of it (:func:`_adopted`); a q8 moment (``role`` names its
    map) is dequantized from, or quantized into, to nearest."""
    adopted = _adopted(value, param, dtype, role, taken)
    if adopted is not None:
        return adopted
    if role is not None and isinstance(value, torch.Tensor) and _is_q8(value, param):
        value = value.detach().to(param.device)
        if dtype == Q8:  # the same codes and scales
            return value.clone(memory_format=torch.contiguous_format)
        value = q8_decode(value, param.shape, q8_signed(role))
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {value!r:.80}")
    if value.shape != param.shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)}, but the param has shape "
                         f"{tuple(param.shape)}")
    value = value.detach().to(param.device)
    if dtype == torch.float64:  # (no storage plan keeps float64 today; exact if one does)
        return torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
    value_f32 = decode(value)  # float64 states round here
    if dtype == Q8:
        return q8_encode(value_f32.contiguous(), q8_signed(role))
    result = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    result.copy_(encode(value_f32, dtype))
    return result


def _storage_address(tensor: torch.Tensor) -> int:
    return real_view(local(tensor)).untyped_storage().data_ptr()


def storages_of(states) -> set:
    """The storage addresses of the tensors of ``states`` (per-param state dicts)."""
    return {_storage_address(value) for state in states for value in state.values()
            if isinstance(value, torch.Tensor)}


#: elements per pass of the NaN check of an adopted tensor (a bool per element at a time)
_NAN_CHECK_ELEMENTS = 1 << 24


def _adopted(value, param: torch.Tensor, dtype: torch.dtype, role, taken) -> "torch.Tensor | None":
    """``value`` itself, to be the state, where a converted copy would hold its bits in its
    layout, as torch.optim keeps loaded tensors that need no conversion (a resumed run then
    holds its state once, not twice): a plain contiguous tensor of ``dtype`` (not an inference
    tensor, not a negative or conjugate view) on the param's device and of its shape (q8: of
    its codes' shape), not needing grad, whose storage no param, no state adopted before and no
    other live bf16opt optimizer's state holds (``taken``, which it joins:
    ``opt2.load_state_dict(opt1.state_dict())`` copies), and without a NaN (a copy stores NaN
    canonical).  Else None."""
    if taken is None or type(value) is not torch.Tensor or value.requires_grad or value.dtype != dtype:
        return None
    if value.is_inference() or value.is_neg() or value.is_conj():  # (kernels write raw memory)
        return None
    quantized = dtype == Q8
    if quantized != (role is not None and _is_q8(value, param)):
        return None
    if value.device != param.device or not value.is_contiguous() or not param.is_contiguous():
        return None
    if not quantized and (value.shape != param.shape or dtype not in (torch.float32, torch.bfloat16,
                                                                      torch.float16)):
        return None
    address = value.untyped_storage().data_ptr()
    if address in taken:
        return None
    if not quantized:
        flat = value.view(-1)
        for start in range(0, flat.numel(), _NAN_CHECK_ELEMENTS):
            if bool(torch.isnan(flat[start:start + _NAN_CHECK_ELEMENTS]).any()):
                return None
    taken.add(address)
    return value
