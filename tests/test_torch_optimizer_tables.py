"""torch.optim's own optimizer test tables, run against bf16opt's drop-ins (Adam, AdamW, SGD).

``torch.testing._internal.common_optimizers`` lists, per optimizer, the inputs torch's test
suite constructs it with (``optim_inputs_func``) and the inputs that must fail
(``optim_error_inputs_func``, with the exception type and a message regex).  Here:

* every error input goes to the bf16opt class with the same params and kwargs and must raise
  the same exception type with a message matching torch's regex -- except documented
  deliberate deviations (``DEVIATIONS``; see also docs/bad_inputs.md);
* every other input (default, non-default lr, tensor lr, weight_decay, maximize, amsgrad,
  momentum, dampening, nesterov, ... and each with ``fused=True`` and ``foreach=True``,
  which bf16opt accepts and ignores) trains a small regression for ``STEPS`` steps with
  ``precision="fp32"`` on fp32 params next to torch.optim's class: every param must stay
  within 1e-6 of torch's relative to its tensor's max |w| (tests/test_dropin.py's
  ``assert_params_close``).  Inputs bf16opt refuses by design (``differentiable=True``;
  ``capturable=True`` on these CPU params) are checked to be refused.

Importing the tables needs the ``expecttest`` package (a torch test dependency); without it
this module is skipped.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

try:
    import expecttest  # noqa: F401  (imported by torch.testing._internal)
except ImportError:
    pytest.skip("torch's optimizer tables (torch.testing._internal.common_optimizers) need the "
                "expecttest package: pip install expecttest", allow_module_level=True)

from torch.testing._internal import common_optimizers  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum, OptimizerInput, optim_db)

import bf16opt  # noqa: E402
from test_dropin import assert_params_close  # noqa: E402

NAMES = ("Adam", "AdamW", "SGD")
INFOS = {info.optim_cls.__name__: info for info in optim_db if info.optim_cls.__name__ in NAMES}
STEPS = 20

# desc of a torch error input -> (exception, regex) bf16opt raises instead, by design
DEVIATIONS = {
    # torch warns (and then updates the param twice per step); in one multi-tensor kernel
    # call the two updates of one tensor would race: docs/bad_inputs.md, param-duplicate-in-group
    "a param group cannot have duplicate parameters":
        (ValueError, r"params\[0\] and params\[1\] are the same tensor"),
}
# flag -> (the message of bf16opt's refusal on CPU params, why): such inputs are checked to be
# refused (torch's results do not apply)
REFUSED_BY_DESIGN = {
    "capturable": ("capturable=True needs the CuPy kernels",
                   "capturable=True runs in the CUDA kernels (CUDA params); torch refuses CPU params too"),
    "differentiable": ("differentiable=True is not supported",
                       "bf16opt refuses differentiable=True by design: the step writes rounded results in "
                       "place and has no autograd graph"),
}


# ------------------------------------------------------------------------ error inputs
def _error_inputs() -> dict:
    found = {}
    for name, info in INFOS.items():
        for number, error in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            found[f"{name}-{number}-{error.optimizer_error_input.desc}"] = (name, error)
    return found


ERROR_INPUTS = _error_inputs()


def _expect(cls, error, exception, regex):
    """Build ``cls`` (and step it, for STEP_ERROR inputs) with the error input: ``exception``
    (an exception or a warning class) with a message matching ``regex``."""
    optim_input = error.optimizer_error_input
    # torch's suite passes params=None where the kwargs alone must fail; a real param makes sure
    # the failure comes from the kwargs, not from the missing params
    params = optim_input.params if optim_input.params is not None else [nn.Parameter(torch.randn(1, 1))]
    kwargs = optim_input.kwargs
    context = pytest.warns(exception, match=regex) if issubclass(exception, Warning) else \
        pytest.raises(exception, match=regex)
    with context:
        if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            cls(params, **kwargs)
        else:
            optimizer = cls(params, **kwargs)
            for param in optimizer.param_groups[0]["params"]:
                param.grad = torch.ones_like(param)
            optimizer.step()


@pytest.mark.parametrize("key", list(ERROR_INPUTS))
def test_error_input(key):
    name, error = ERROR_INPUTS[key]
    # torch itself behaves as its table says (else the comparison below is meaningless)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not issubclass(error.error_type, Warning) else "default")
        _expect(INFOS[name].optim_cls, error, error.error_type, error.error_regex)
    exception, regex = DEVIATIONS.get(error.optimizer_error_input.desc, (error.error_type, error.error_regex))
    _expect(getattr(bf16opt, name), error, exception, regex)


def test_deviations_are_still_in_torchs_tables():
    """A deviation whose torch input disappeared would silently stop being tested."""
    descs = {error.optimizer_error_input.desc for _, error in ERROR_INPUTS.values()}
    assert set(DEVIATIONS) <= descs


# ------------------------------------------------------------------------ optimizer inputs
def _optim_inputs(info) -> list:
    """torch's inputs with each implementation flag (foreach, fused, differentiable) off and on,
    as torch's own suite runs them; foreach is added by hand (torch leaves it out on CPU)."""
    helper = getattr(common_optimizers, "_get_optim_inputs_including_global_cliquey_kwargs", None)
    inputs = helper("cpu", torch.float32, info) if helper else info.optim_inputs_func(device="cpu")
    flags = ("foreach", "fused", "differentiable")
    plain = [i for i in inputs if not any(i.kwargs.get(flag) for flag in flags)]
    if "foreach" in info.supported_impls and not any(i.kwargs.get("foreach") for i in inputs):
        inputs = inputs + [OptimizerInput(params=None, kwargs={**copy.deepcopy(i.kwargs), "foreach": True,
                                                               "fused": False},
                                          desc=f"{i.desc} & foreach") for i in plain]
    return inputs


OPTIM_INPUTS = {f"{name}-{optim_input.desc}": (name, optim_input)
                for name, info in INFOS.items() for optim_input in _optim_inputs(info)}


def regression(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(STEPS, 16, 6, generator=generator)
    noise = 0.1 * torch.randn(STEPS, 16, 2, generator=generator)
    y = torch.sin(x.sum(-1, keepdim=True)).expand(-1, -1, 2) + noise
    return model, x, y


@pytest.mark.parametrize("key", list(OPTIM_INPUTS))
def test_optim_input_follows_torch(key):
    name, optim_input = OPTIM_INPUTS[key]
    kwargs = optim_input.kwargs
    refused = [flag for flag in REFUSED_BY_DESIGN if kwargs.get(flag)]
    if refused:  # refused by design (REFUSED_BY_DESIGN says why): the refusal is the behaviour checked
        param = nn.Parameter(torch.randn(3))
        param.grad = torch.ones(3)
        with pytest.raises(ValueError, match=REFUSED_BY_DESIGN[refused[0]][0]):
            getattr(bf16opt, name)([param], **copy.deepcopy(kwargs)).step()
        return
    theirs_model, x, y = regression()
    ours_model = copy.deepcopy(theirs_model)
    theirs = INFOS[name].optim_cls(theirs_model.parameters(), **copy.deepcopy(kwargs))
    ours = getattr(bf16opt, name)(ours_model.parameters(), precision="fp32", **copy.deepcopy(kwargs))
    losses = []
    for i in range(STEPS):
        for model, opt in ((theirs_model, theirs), (ours_model, ours)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[i]), y[i])
            loss.backward()
            opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, (p.detach().sum() for p in ours_model.parameters())))
    assert_params_close(ours_model, theirs_model)
    start = regression()[0]
    moved = max((a - b).abs().max().item() for a, b in zip(ours_model.parameters(), start.parameters()))
    assert moved > 0, "the params did not move: the comparison would be vacuous"


def test_every_table_input_is_used():
    """The parametrisation above covers torch's tables for all three optimizers."""
    assert set(INFOS) == set(NAMES)
    descs = {re.sub(r" & (foreach|fused|differentiable)$", "", key.split("-", 1)[1]) for key in OPTIM_INPUTS}
    for expected in ("default", "non-default lr", "tensor lr", "maximize", "amsgrad", "momentum", "dampening",
                     "nesterov"):
        assert expected in descs, expected
