"""Argument checks shared by the optimizers: TypeError/ValueError naming the argument,
with torch.optim's wording where torch has a message for the same input."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from .distributed import check_known_tensor, local
from .precision import FLOAT64, PARAM_DTYPES
from .tensors import capturing, check_writable

def check_number(value, argument: str, label: Optional[str] = None, *, low: float = 0.0,
                 high: Optional[float] = None, high_inclusive: bool = False) -> float:
    """``value`` as a float in [low, high); TypeError/ValueError naming ``argument`` otherwise.

    ``label`` is torch.optim's word for the argument ("learning rate"), so messages contain
    torch's ("Invalid learning rate: -1").  A one-element tensor is taken by value.
    """
    label = label or argument
    shown = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {argument} must be 1-element, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.is_complex():
            raise TypeError(f"{argument} must be a real number, got a complex tensor")
        if value.is_meta:
            raise ValueError(f"{argument} is a meta tensor, which holds no value")
        if value.device.type != "cpu" and capturing():  # (read when the graph runs, as in torch)
            return math.nan
        shown = value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # (an int or Fraction beyond float's range)
        value = math.inf if value > 0 else -math.inf
        shown = f"{'-' if value < 0 else ''}a number beyond float's range"
    upper_ok = high is None or value < high or (high_inclusive and value == high)
    if math.isnan(value) or value < low or not upper_ok or math.isinf(value):
        bound = "" if high is None else (f" and <= {high}" if high_inclusive else f" and < {high}")
        lower = "" if low == -math.inf else f" >= {low}"
        raise ValueError(f"Invalid {label}: {shown} ({argument} must be a finite number{lower}{bound})")
    return value


def check_betas(betas, count: int = 2) -> tuple:
    """Each beta a number in [0, 1) (a one-element tensor taken by value).  A float and a
    tensor together are refused only by the constructors (:func:`check_beta_kinds`), as in
    torch: its schedulers with ``cycle_momentum`` write a float beside a tensor."""
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise TypeError(f"betas must be a tuple of {count} numbers, got {betas!r}")
    return tuple(check_number(b, f"betas[{i}]", f"beta parameter at index {i}", high=1.0)
                 for i, b in enumerate(betas))


def check_beta_kinds(betas) -> None:
    """torch's constructors' rule: betas are all floats or all tensors."""
    if isinstance(betas, (tuple, list)) and len({isinstance(b, torch.Tensor) for b in betas}) > 1:
        raise ValueError("betas must be either both floats or both Tensors")


def check_tensor_hyperparameters_without_foreach(group: dict, names: tuple) -> None:
    """torch.optim refuses tensor hyper-parameters with foreach=True (capturable=False);
    bf16opt accepts foreach and ignores it, but refuses the same inputs as torch."""
    if not group.get("foreach"):
        return
    if isinstance(group.get("lr"), torch.Tensor) and "lr" in names:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    for i, beta in enumerate(group.get("betas", ()) if "betas" in names else ()):
        if isinstance(beta, torch.Tensor):
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and "
                             f"foreach=True")


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
    if group.get("differentiable"):
        raise ValueError("differentiable=True is not supported: bf16opt's step is not "
                         "differentiable (it writes rounded results in place)")


def check_seed(seed) -> int:
    """The seed as an int: any integer type (numpy's included), never a bool."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def default_seed() -> int:
    """Stochastic-rounding seed derived from torch's, so ``torch.manual_seed`` fixes it."""
    return torch.initial_seed() % 2 ** 64


def check_param(param, name: str) -> None:
    """Everything that makes a tensor impossible to update in place, refused before any
    state exists (``name``: e.g. "params[3]" or the param's name)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(param).__name__}")
    check_known_tensor(param, name)
    if param.is_sparse or param.layout != torch.strided:
        raise TypeError(f"{name} has layout {param.layout}; only dense (strided) params "
                        f"are supported")
    if param.dtype not in PARAM_DTYPES + (FLOAT64, torch.complex64, torch.complex128):
        raise TypeError(f"{name} has dtype {param.dtype}; bf16opt optimizes float64, float32, "
                        f"bfloat16 and float16 params and complex64/complex128 ones (as real "
                        f"views, like torch.optim)")
    if not param.is_leaf:
        raise ValueError(f"{name} is not a leaf tensor; can't optimize a non-leaf Tensor")
    if param.is_meta:
        raise ValueError(f"{name} is on the meta device and holds no data to update; build the "
                         f"optimizer after materialising the model (e.g. module.to_empty(device=...) "
                         f"and loading its weights)")
    check_writable(local(param), name)


def check_param_names(names, count: int) -> None:
    """A group's ``param_names``, where it has them: one str per param (stochastic rounding
    names each param's random stream by it)."""
    if names is None:
        return
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        shown = repr(names) if len(repr(names)) < 80 else repr(names)[:77] + "..."
        raise TypeError(f"param_names must be a list of str, one per param (as named_parameters() "
                        f"gives them), got {shown}")
    if len(names) != count:
        raise ValueError(f"param_names has {len(names)} names for {count} params")


def _byte_range(tensor: torch.Tensor) -> tuple:
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    start = tensor.data_ptr()
    return start, start + (extent + 1) * tensor.element_size()


def check_no_aliasing(tensors: list, names: list) -> None:
    """ValueError naming two params that are the same tensor or whose memory overlaps (views
    of one buffer): their in-place updates would race, differently with every thread count."""
    seen = {}
    for tensor, name in zip(tensors, names):
        if id(tensor) in seen:
            raise ValueError(f"{seen[id(tensor)]} and {name} are the same tensor; each param may "
                             f"appear once in an optimizer (torch.optim: some parameters appear in "
                             f"more than one parameter group)")
        seen[id(tensor)] = name
    by_storage: dict = {}
    for tensor, name in zip(tensors, names):
        tensor = local(tensor)  # a DTensor's memory is its local shard's
        if tensor.numel() == 0:
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        by_storage.setdefault(key, []).append((_byte_range(tensor), name, tensor))
    for spans in by_storage.values():
        spans.sort(key=lambda span: span[0])
        for position, ((_, end), first, tensor) in enumerate(spans):
            for (start, _), second, other in spans[position + 1:]:
                if start >= end:
                    break
                if _share_bytes(tensor, other):  # (interleaved views, a matrix's column blocks, may not)
                    raise ValueError(f"{first} and {second} share memory (views of one buffer); their "
                                     f"in-place updates would race: give each param its own storage")


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage, whose byte ranges overlap, have a byte in common: each
    marks its bytes in a scratch mask of the ranges' union (only params whose ranges overlap
    come here)."""
    (a_start, a_end), (b_start, b_end) = _byte_range(a), _byte_range(b)
    base, size = min(a_start, b_start), a.element_size()
    if b.element_size() != size or (a_start - base) % size or (b_start - base) % size:
        return True  # (views of one buffer in other element sizes or offsets: taken as sharing)
    mask = torch.zeros((max(a_end, b_end) - base) // size, dtype=torch.uint8)
    mask.as_strided(a.shape, a.stride(), (a_start - base) // size).fill_(1)
    return bool(mask.as_strided(b.shape, b.stride(), (b_start - base) // size).any())


def check_params_listed_once(groups: list) -> None:
    """ValueError naming a param listed twice in the groups (appended to a group's ``params``
    by hand: ``add_param_group`` refuses it): it would be updated twice a step."""
    params = [param for group in groups for param in group["params"]]
    if len(set(map(id, params))) == len(params):
        return
    names = [f"param_groups[{i}]['params'][{j}]" for i, group in enumerate(groups)
             for j in range(len(group["params"]))]
    check_no_aliasing(params, names)


def check_amp_tensor(value, argument: str, devices: set) -> None:
    """``grad_scale`` / ``found_inf`` of a step (torch.amp.GradScaler's protocol): a
    one-element float32 tensor, as GradScaler makes them, on the CPU or on a device of the
    optimizer's params (read on the host either way)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument} must be a one-element float32 tensor (as torch.amp.GradScaler "
                        f"passes it), got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"{argument} must be a one-element tensor, got shape {tuple(value.shape)}")
    if value.dtype != torch.float32:
        raise ValueError(f"{argument} must be a float32 tensor (as torch.amp.GradScaler makes it), "
                         f"got {value.dtype}")
    if value.device.type != "cpu" and value.device not in devices:
        raise ValueError(f"{argument} is on {value.device}; it must be on the CPU or on a device of the "
                         f"optimizer's params ({', '.join(sorted(map(str, devices)))})")


#: steps are counted exactly in float64 up to here (a float64 holds every whole number below)
STEP_LIMIT = 2 ** 53


def check_step_count(value, what: str) -> float:
    """A step counter's value as a float: a whole number in [0, 2**53), else a ValueError
    naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or value != int(value) or value >= STEP_LIMIT:
        raise ValueError(f"{what} must be a whole number >= 0, got {value!r} (bf16opt counts steps "
                         f"exactly up to 2**53)")
    return float(value)


def check_ordered_params(params) -> None:
    """torch's refusal of a set of params (its order changes between runs), with torch's words."""
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
