"""The optimizer lifecycle as a hypothesis state machine, reference and Numba backends side by side.

Each example builds TWO optimizers of one kind (AdamW; Adam with amsgrad; Adam with L2 decay;
Lion; SGD with momentum; SGD with nesterov) that differ only in ``backend="reference"`` /
``backend="numba"``, on identical copies of 1-3 tiny params (<= 64 elements; bf16, fp16 or
fp32, some non-contiguous) with a random preset of ``bf16opt.PRESETS``.  The rules then
apply the same operation to both:

* ``step`` with random grads (some params without a grad, some grads holding inf/nan);
* ``zero_grad`` (``set_to_none`` True or False);
* editing hyper-parameters (lr, betas or momentum/dampening, weight_decay, maximize) and a
  group's ``precision`` (any preset, as a name, a Precision or its dict form) between steps;
* ``add_param_group``;
* ``state_dict`` -> ``load_state_dict`` into a FRESH pair built on clones of the current
  params, which replaces the old pair; first both the old and the new pair continue one
  step with the same grads and must agree bit for bit (params, every state tensor, groups);
* bad input of every category: invalid hyper-parameters and precisions edited into a
  group, grads of the wrong shape/dtype/device or sparse, a state tensor replaced by one of
  another shape, malformed state dicts (container types, non-dict entries, shapes, unknown
  keys and indices, NaN/negative/huge/fractional steps, group counts, another optimizer's
  state dict), and ``add_param_group`` with aliasing params (the same tensor twice, a param
  already in the optimizer, overlapping views of one buffer), meta, expanded (stride-0),
  inference-mode, non-leaf and integer params.

Checked after every rule: a call that raised raised ``ValueError``/``TypeError`` on both
backends alike and left every param, state tensor and group exactly as before (a bit-level
snapshot); and the reference optimizer equals the Numba one bit for bit (params, every state
tensor, hyper-parameters).

Also here: the non-finite gradient policy (an inf/nan grad element poisons only its own
elements), on every available backend, for every optimizer and preset.

Cost: the default settings run ``EXAMPLES`` examples of up to ``STEPS`` rules per optimizer
kind, derandomized under ``HYPOTHESIS_PROFILE=ci`` (conftest.py), sized to stay well under a
minute on 2 cores once Numba's kernel cache is warm.  For a long fuzzing run on demand::

    BF16OPT_LONG_FUZZ=1 .venv/bin/pytest tests/test_lifecycle.py

(500 examples of up to 40 rules per optimizer kind, not derandomized: every run explores
new examples; failures are saved in ``.hypothesis/`` and replayed first the next time.)
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from torch import nn

import bf16opt
from bf16opt.algorithms import grad_dtypes
from bf16opt.precision import as_precision
from snapshots import same_bits

LONG_FUZZ = os.environ.get("BF16OPT_LONG_FUZZ", "") not in ("", "0")
EXAMPLES, STEPS = (500, 40) if LONG_FUZZ else (15, 12)
MACHINE_SETTINGS = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    **({"derandomize": False} if LONG_FUZZ else {}))  # otherwise inherited: derandomized under ci

BACKENDS = ("reference", "numba")
PRESET_NAMES = sorted(bf16opt.PRESETS)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = ((1,), (3,), (8,), (64,), (2, 5), (4, 4), (3, 1, 5))
MAX_PARAMS = 3
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------ bit-level snapshots
def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (any layout; NaN payloads included)."""
    return a.shape == b.shape and same_bits(a.detach().contiguous(), b.detach().contiguous())


def _frozen(value):
    """A value as a comparable, independent copy: tensors by their bits, layout and device."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided or t.device.type == "meta":
            return ("opaque tensor", value)  # compared by identity
        return ("tensor", t.dtype, t.device, tuple(t.shape), tuple(t.stride()),
                t.contiguous().reshape(-1).view(torch.uint8).clone())
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    return ("value", value)


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot compare are different
        return False


class Snapshot:
    """Everything a failed call must leave alone: the groups (their params by identity, every
    other entry), every param's bits, which params have state, and every state entry.

    Like ``tests/snapshots.py`` (whose ``same_bits`` it uses), but it also holds odd state
    values a test planted (lists, non-contiguous or meta tensors) and compares counts, so a
    call that added a group or a state entry is caught."""

    def __init__(self, opt):
        self.groups = [([id(p) for p in g["params"]], _frozen({k: v for k, v in g.items() if k != "params"}))
                       for g in opt.param_groups]
        self.params = [p for g in opt.param_groups for p in g["params"]]  # kept alive: ids stay unique
        self.param_bits = [_frozen(p) for p in self.params]
        self.state_owners = list(opt.state)
        self.state = {id(p): _frozen(dict(s)) for p, s in opt.state.items()}

    def assert_unchanged(self, opt, context: str = "") -> None:
        now = Snapshot(opt)
        where = f"{context}: " if context else ""
        assert len(now.groups) == len(self.groups), f"{where}the number of param groups changed"
        for number, (old, new) in enumerate(zip(self.groups, now.groups)):
            assert old[0] == new[0], f"{where}the params of group {number} changed"
            assert _same(old[1], new[1]), f"{where}the settings of group {number} changed"
        for index, (old, new) in enumerate(zip(self.param_bits, now.param_bits)):
            assert _same(old, new), f"{where}param {index} changed"
        assert set(self.state) == set(now.state), f"{where}the set of params with state changed"
        for key, old in self.state.items():
            assert _same(old, now.state[key]), f"{where}a state entry changed"


# ------------------------------------------------------------------------ optimizer kinds
class Spec:
    """One optimizer kind of the machine: class, constructor arguments, algorithm family."""

    def __init__(self, name, cls, family, **kwargs):
        self.name, self.cls, self.family, self.kwargs = name, cls, family, kwargs

    @property
    def nesterov(self) -> bool:
        return bool(self.kwargs.get("nesterov"))

    def __repr__(self):
        return self.name


SPECS = [
    Spec("AdamW", bf16opt.AdamW, "adam", lr=1e-2, weight_decay=0.05),
    Spec("Adam-amsgrad", bf16opt.Adam, "adam", lr=1e-2, amsgrad=True),
    Spec("Adam-L2", bf16opt.Adam, "adam", lr=1e-2, weight_decay=0.05),
    Spec("Lion", bf16opt.Lion, "lion", lr=1e-3, weight_decay=0.1),
    Spec("SGD-momentum", bf16opt.SGD, "sgd", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    Spec("SGD-nesterov", bf16opt.SGD, "sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
]
FIRST_MOMENT = {"adam": "exp_avg", "lion": "exp_avg", "sgd": "momentum_buffer"}


def valid_edits(spec: Spec) -> dict:
    """Hyper-parameter -> strategy of values the next step must accept."""
    edits = {"lr": st.floats(0.0, 0.1 if spec.family == "sgd" else 0.03),
             "weight_decay": st.floats(0.0, 0.2), "maximize": st.booleans()}
    if spec.family in ("adam", "lion"):
        edits["betas"] = st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.999))
    if spec.family == "sgd":
        edits["momentum"] = st.floats(0.05, 0.95) if spec.nesterov else st.floats(0.0, 0.95)
        if not spec.nesterov:
            edits["dampening"] = st.floats(0.0, 0.5)
    return edits


def invalid_edits(spec: Spec) -> list:
    """(hyper-parameter, value) pairs the next step must refuse with a message naming it."""
    bad = [("lr", -1e-3), ("lr", NAN), ("lr", INF), ("lr", True), ("lr", "0.1"), ("lr", None),
           ("lr", 1e39),  # finite, but float32 step scalars overflow: refused at the step
           ("weight_decay", -0.1), ("weight_decay", NAN), ("weight_decay", "x"),
           ("maximize", None), ("maximize", "yes")]
    if spec.family in ("adam", "lion"):
        bad += [("betas", (0.9, 1.0)), ("betas", (1.0, 0.9)), ("betas", (NAN, 0.9)), ("betas", (0.9,)),
                ("betas", (True, 0.9)), ("betas", 0.9)]
    if spec.family == "adam":
        bad += [("eps", -1e-8), ("eps", NAN), ("eps", INF), ("amsgrad", "yes")]
    if spec.family == "sgd":
        bad += [("momentum", -0.5), ("momentum", NAN), ("momentum", True), ("dampening", NAN),
                ("nesterov", "yes")]
    if spec.nesterov:
        bad += [("momentum", 0.0), ("dampening", 0.5)]
    return bad


INVALID_PRECISIONS = ["bf17", "FP32", "", 3, None, ("fp32",), {"master": "fp8"}, {"rounding": "up"},
                      {"bogus": 1}]


# ------------------------------------------------------------------------ tensors
def draw_tensor(data) -> torch.Tensor:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(st.sampled_from(SHAPES), label="shape")
    transposed = len(shape) == 2 and data.draw(st.booleans(), label="transposed (non-contiguous)")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="values seed"))
    values = torch.randn(shape[::-1] if transposed else shape, generator=generator)
    return (values.t() if transposed else values).to(dtype)  # .to keeps the transposed strides


def draw_grad(data, param: torch.Tensor, *, non_finite: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="grad seed"))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 50.0]), label="grad scale")
    grad = (torch.randn(param.shape, generator=generator) * scale).to(param.dtype)
    if non_finite and data.draw(st.integers(0, 7), label="non-finite?") == 0:
        flat = grad.view(-1)
        for _ in range(data.draw(st.integers(1, 2), label="non-finite count")):
            flat[data.draw(st.integers(0, flat.numel() - 1), label="at")] = \
                data.draw(st.sampled_from([INF, -INF, NAN]), label="value")
    return grad


def params_of(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def assert_same_optimizer(a, b, what: str, *, skip_group_keys=()) -> None:
    """Params, every state tensor and the groups' entries of ``a`` and ``b`` agree bit for bit."""
    pa, pb = params_of(a), params_of(b)
    assert len(pa) == len(pb), f"{what}: param counts differ"
    for index, (p, q) in enumerate(zip(pa, pb)):
        assert bits_equal(p, q), f"{what}: param {index} differs"
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        assert set(sa) == set(sb), f"{what}: state keys of param {index} differ: {sorted(sa)} vs {sorted(sb)}"
        for key in sa:
            assert bits_equal(sa[key], sb[key]), f"{what}: state[{key!r}] of param {index} differs"
    assert len(a.param_groups) == len(b.param_groups), f"{what}: group counts differ"
    for number, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        keys = (set(ga) | set(gb)) - {"params", *skip_group_keys}
        for key in keys:
            assert key in ga and key in gb, f"{what}: group {number}[{key!r}] exists in one optimizer only"
            # a precision edited since the last step is still the name (or dict) the user wrote;
            # the step (or a load) normalises it into a Precision
            x, y = (as_precision(g[key]) for g in (ga, gb)) if key == "precision" else (ga[key], gb[key])
            assert x == y, f"{what}: group {number}[{key!r}] differs: {ga[key]!r} vs {gb[key]!r}"


def save_load(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------ state-dict corruptions
def _state_index(sd):
    return min(sd["state"], key=str)


def _with(path_value):
    """sd -> sd with sd[path...] = value (the path may start with 'state:first', the first
    state entry)."""
    *path, value = path_value

    def corrupt(sd):
        node = sd
        keys = [(_state_index(sd) if key == "state:first" else key) for key in path]
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value(sd) if callable(value) else value
        return sd
    return corrupt


def _first_shape(sd):
    state = sd["state"][_state_index(sd)]
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors[0].shape if tensors else None


def corruptions(spec: Spec, sd: dict) -> dict:
    """name -> function making a malformed copy of ``sd``; only those that apply to it."""
    other_family = "lion" if spec.family != "lion" else "adam"
    found = {
        "None": lambda sd: None,
        "a list": lambda sd: [sd],
        "state is a list": lambda sd: {**sd, "state": list(sd["state"].values())},
        "param_groups is a dict": lambda sd: {**sd, "param_groups": dict(enumerate(sd["param_groups"]))},
        "no param_groups": lambda sd: {k: v for k, v in sd.items() if k != "param_groups"},
        "group is a string": _with(("param_groups", 0, "x")),
        "group params is a string": _with(("param_groups", 0, "params", "0")),
        "unhashable param index": _with(("param_groups", 0, "params",
                                         lambda sd: [[i] for i in sd["param_groups"][0]["params"]])),
        "extra group": lambda sd: {**sd, "param_groups": sd["param_groups"] + [dict(sd["param_groups"][0],
                                                                                   params=[])]},
        "one group fewer": lambda sd: {**sd, "param_groups": sd["param_groups"][:-1]},
        "one param fewer": _with(("param_groups", -1, "params",
                                  lambda sd: sd["param_groups"][-1]["params"][:-1])),
        "negative lr": _with(("param_groups", 0, "lr", -1.0)),
        "string weight_decay": _with(("param_groups", 0, "weight_decay", "x")),
        "another optimizer's": _with(("bf16opt", "family", other_family)),
        "state for an unknown index": _with(("state", 10 ** 6, {"step": torch.tensor(1.0)})),
    }
    if sd["state"]:
        moment = FIRST_MOMENT[spec.family]
        shape = _first_shape(sd)
        numel = 1 if shape is None else int(torch.Size(shape).numel())
        found.update({
            "state entry is an int": _with(("state", "state:first", 5)),
            "state entry is a tensor": _with(("state", "state:first", torch.zeros(3))),
            f"{moment} of another shape": _with(("state", "state:first", moment, torch.zeros(numel + 1))),
            f"{moment} is a list": _with(("state", "state:first", moment, [0.0] * numel)),
            f"{moment} is an int tensor": _with(("state", "state:first", moment,
                                                 torch.zeros(shape or (1,), dtype=torch.int32))),
            "unknown state key": _with(("state", "state:first", "bogus", torch.zeros(shape or (1,)))),
            "step NaN": _with(("state", "state:first", "step", torch.tensor(NAN))),
            "step negative": _with(("state", "state:first", "step", torch.tensor(-1.0))),
            "step inf": _with(("state", "state:first", "step", INF)),
            "step 2**60": _with(("state", "state:first", "step",
                                 torch.tensor(2.0 ** 60, dtype=torch.float64))),
            "step 1.5": _with(("state", "state:first", "step", 1.5)),
            "step a string": _with(("state", "state:first", "step", "3")),
        })
    return found


# ------------------------------------------------------------------------ the machine
class LifecycleMachine(RuleBasedStateMachine):
    spec: Spec  # set by the per-kind subclasses below

    def __init__(self):
        super().__init__()
        self.opts = {}

    # ---- helpers
    @property
    def reference(self):
        return self.opts["reference"]

    def params(self, backend: str) -> list:
        return params_of(self.opts[backend])

    @property
    def n_params(self) -> int:
        return len(self.params("reference"))

    def group_of(self, index: int) -> dict:
        for group in self.reference.param_groups:
            if index < len(group["params"]):
                return group
            index -= len(group["params"])
        raise IndexError(index)

    def set_grads(self, grads: list) -> None:
        """Same grads (or None) on both optimizers' params."""
        for backend in BACKENDS:
            for param, grad in zip(self.params(backend), grads):
                param.grad = None if grad is None else grad.clone()

    def give_every_param_a_grad(self, data) -> None:
        """Valid finite grads everywhere: a step that wrongly went ahead would change everything."""
        self.set_grads([draw_grad(data, p, non_finite=False) for p in self.params("reference")])

    def must_fail(self, call, what: str, words=()) -> None:
        """``call(backend, opt)`` raises ValueError or TypeError (the same on both backends), its
        message names one of ``words``, and the optimizer is unchanged, bit for bit."""
        raised = {}
        for backend, opt in self.opts.items():
            before = Snapshot(opt)
            try:
                call(backend, opt)
            except (ValueError, TypeError) as error:
                raised[backend] = error
                note(f"{backend}: {what} -> {type(error).__name__}: {error}")
            else:
                raise AssertionError(f"{backend}: {what} did not raise")
            before.assert_unchanged(opt, f"{backend}: {what} raised {raised[backend]!r}")
        assert len({type(e) for e in raised.values()}) == 1, f"{what}: backends raised {raised}"
        for error in raised.values():
            assert not words or any(w.lower() in str(error).lower() for w in words), \
                f"{what}: the message does not name {words}: {error}"

    # ---- life
    @initialize(data=st.data())
    def build(self, data):
        preset = data.draw(st.sampled_from(PRESET_NAMES), label="preset")
        tensors = [draw_tensor(data) for _ in range(data.draw(st.integers(1, 2), label="params"))]
        second = data.draw(st.sampled_from([None] + PRESET_NAMES), label="2nd group precision") \
            if len(tensors) == 2 else None
        seed = data.draw(st.integers(0, 2 ** 64 - 1), label="seed")
        for backend in BACKENDS:
            params = [nn.Parameter(t.clone()) for t in tensors]
            groups = [{"params": params}] if second is None else \
                [{"params": params[:1]}, {"params": params[1:], "precision": second}]
            self.opts[backend] = self.spec.cls(groups, precision=preset, backend=backend, seed=seed,
                                               **self.spec.kwargs)

    @rule(data=st.data())
    def step(self, data):
        for index in range(self.n_params):
            action = data.draw(st.sampled_from(["new grad", "new grad", "keep", "no grad"]),
                               label=f"param {index}")
            if action == "keep":
                continue
            grad = None if action == "no grad" else draw_grad(data, self.params("reference")[index])
            for backend in BACKENDS:
                self.params(backend)[index].grad = None if grad is None else grad.clone()
        for opt in self.opts.values():
            opt.step()

    @rule(data=st.data())
    def step_every_param(self, data):
        self.set_grads([draw_grad(data, p) for p in self.params("reference")])
        for opt in self.opts.values():
            opt.step()

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        for opt in self.opts.values():
            opt.zero_grad(set_to_none=set_to_none)

    @rule(data=st.data())
    def edit_hyperparameter(self, data):
        edits = valid_edits(self.spec)
        key = data.draw(st.sampled_from(sorted(edits)), label="key")
        value = data.draw(edits[key], label="value")
        number = data.draw(st.integers(0, len(self.reference.param_groups) - 1), label="group")
        for opt in self.opts.values():
            opt.param_groups[number][key] = value

    @rule(data=st.data())
    def edit_precision(self, data):
        name = data.draw(st.sampled_from(PRESET_NAMES), label="preset")
        form = data.draw(st.sampled_from(["name", "Precision", "dict"]), label="as")
        value = {"name": name, "Precision": bf16opt.PRESETS[name],
                 "dict": bf16opt.PRESETS[name].to_dict()}[form]
        number = data.draw(st.integers(0, len(self.reference.param_groups) - 1), label="group")
        for opt in self.opts.values():
            opt.param_groups[number]["precision"] = copy.copy(value)

    @precondition(lambda self: self.n_params < MAX_PARAMS)
    @rule(data=st.data())
    def add_param_group(self, data):
        tensor = draw_tensor(data)
        options = {}
        if data.draw(st.booleans(), label="own precision"):
            options["precision"] = data.draw(st.sampled_from(PRESET_NAMES), label="precision")
        if data.draw(st.booleans(), label="own lr"):
            options["lr"] = data.draw(valid_edits(self.spec)["lr"], label="lr")
        for opt in self.opts.values():
            opt.add_param_group({"params": [nn.Parameter(tensor.clone())], **options})

    @rule(data=st.data(), through_bytes=st.booleans())
    def state_dict_into_fresh_optimizers(self, data, through_bytes):
        fresh = {}
        for backend, opt in self.opts.items():
            saved = save_load(opt.state_dict()) if through_bytes else copy.deepcopy(opt.state_dict())
            groups = [{"params": [nn.Parameter(p.detach().clone()) for p in g["params"]],
                       "precision": g["precision"]} for g in opt.param_groups]
            fresh[backend] = self.spec.cls(groups, backend=backend, **self.spec.kwargs)
            fresh[backend].load_state_dict(saved)
        # continuation: old and new continue one step with the same grads, and must agree.  Every
        # param gets a grad: a param the step skips keeps its state as it was (a load converts it
        # into the group's precision at once, a step only when it updates the param).
        grads = [draw_grad(data, p) for p in self.params("reference")]
        for backend in BACKENDS:
            for opt in (self.opts[backend], fresh[backend]):
                for param, grad in zip(params_of(opt), grads):
                    param.grad = None if grad is None else grad.clone()
                opt.step()
            assert_same_optimizer(self.opts[backend], fresh[backend],
                                  f"{backend}: continued after load_state_dict vs uninterrupted")
        self.opts = fresh

    # ---- bad input
    @rule(data=st.data())
    def bad_hyperparameter(self, data):
        self.give_every_param_a_grad(data)
        key, value = data.draw(st.sampled_from(invalid_edits(self.spec)), label="bad edit")
        number = data.draw(st.integers(0, len(self.reference.param_groups) - 1), label="group")
        saved = {backend: opt.param_groups[number].get(key) for backend, opt in self.opts.items()}
        for opt in self.opts.values():
            opt.param_groups[number][key] = value
        self.must_fail(lambda backend, opt: opt.step(), f"step with group {number}[{key!r}] = {value!r}",
                       words=(key,))
        for backend, opt in self.opts.items():
            opt.param_groups[number][key] = saved[backend]

    @rule(data=st.data())
    def bad_precision(self, data):
        self.give_every_param_a_grad(data)
        number = data.draw(st.integers(0, len(self.reference.param_groups) - 1), label="group")
        choices = list(INVALID_PRECISIONS)
        if any(p.dtype == torch.bfloat16 for p in self.reference.param_groups[number]["params"]):
            choices.append(bf16opt.Precision(master="fp16"))  # valid object, invalid for bf16 params
        value = data.draw(st.sampled_from(choices), label="bad precision")
        saved = {backend: opt.param_groups[number]["precision"] for backend, opt in self.opts.items()}
        for opt in self.opts.values():
            opt.param_groups[number]["precision"] = copy.deepcopy(value)
        self.must_fail(lambda backend, opt: opt.step(), f"step with group {number}['precision'] = {value!r}",
                       words=("precision",))
        for backend, opt in self.opts.items():
            opt.param_groups[number]["precision"] = saved[backend]

    @rule(data=st.data())
    def bad_grad(self, data):
        self.give_every_param_a_grad(data)
        index = data.draw(st.integers(0, self.n_params - 1), label="param")
        kind = data.draw(st.sampled_from(["shape", "dtype", "sparse", "device"]), label="bad grad")
        dtype = self.params("reference")[index].dtype
        # (float32 grads of 16-bit params are not wrong: the kernels read them as they are)
        other = data.draw(st.sampled_from([d for d in (*DTYPES, torch.float64) if d not in grad_dtypes(dtype)]),
                          label="dtype")
        good = {backend: self.params(backend)[index].grad.detach().clone() for backend in BACKENDS}
        for backend in BACKENDS:
            param = self.params(backend)[index]
            if kind == "device":
                # torch refuses the assignment itself (no GPU here: meta is the other device)
                with pytest.raises(RuntimeError, match="device"):
                    param.grad = torch.zeros(param.shape, dtype=param.dtype, device="meta")
            elif kind == "shape":
                param.grad.data = torch.ones(param.numel() + 1, dtype=param.dtype)
            elif kind == "dtype":
                param.grad.data = torch.ones(param.shape, dtype=other)
            else:
                param.grad = torch.ones(param.shape, dtype=param.dtype).to_sparse()
        if kind != "device":
            self.must_fail(lambda backend, opt: opt.step(),
                           f"step with a grad of the wrong {kind} on param {index}", words=("grad",))
        for backend in BACKENDS:
            self.params(backend)[index].grad = good[backend]

    @precondition(lambda self: any(self.reference.state.values()))
    @rule(data=st.data())
    def bad_state_tensor(self, data):
        self.give_every_param_a_grad(data)
        candidates = []
        for index, param in enumerate(self.params("reference")):
            momentum_off = float(self.group_of(index).get("momentum", 1.0)) == 0.0
            for key, value in self.reference.state.get(param, {}).items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue
                if key == "momentum_buffer" and momentum_off:
                    continue  # kept from earlier steps, unused while momentum is 0 (as in torch)
                candidates.append((index, key))
        if not candidates:
            return
        index, key = data.draw(st.sampled_from(candidates), label="state entry")
        how = data.draw(st.sampled_from(["one element more", "an extra dim"]), label="replaced by")
        saved = {}
        for backend in BACKENDS:
            state = self.opts[backend].state[self.params(backend)[index]]
            saved[backend] = value = state[key]
            state[key] = torch.zeros(value.numel() + 1, dtype=value.dtype) if how == "one element more" \
                else torch.zeros(*value.shape, 1, dtype=value.dtype)
        self.must_fail(lambda backend, opt: opt.step(),
                       f"step with state[{key!r}] of param {index} replaced by a tensor with {how}")
        for backend in BACKENDS:
            self.opts[backend].state[self.params(backend)[index]][key] = saved[backend]

    @rule(data=st.data())
    def bad_state_dict(self, data):
        available = corruptions(self.spec, copy.deepcopy(self.reference.state_dict()))
        name = data.draw(st.sampled_from(sorted(available)), label="malformed state dict")

        def load(backend, opt):
            corrupt = corruptions(self.spec, copy.deepcopy(opt.state_dict()))[name]
            opt.load_state_dict(corrupt(copy.deepcopy(opt.state_dict())))
        self.must_fail(load, f"load_state_dict of a state dict with {name}")

    @rule(data=st.data())
    def bad_param_group(self, data):
        kind = data.draw(st.sampled_from([
            "the same tensor twice", "a param already in the optimizer", "a fresh param and an existing one",
            "overlapping views of one buffer", "a view of an existing param", "a meta param",
            "an expanded (stride-0) param", "an inference-mode param", "a non-leaf param", "an integer param",
            "an invalid lr", "an invalid precision", "not a dict", "a set of params"]), label="bad group")
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")

        def group(backend, opt):
            fresh = nn.Parameter(torch.randn(4).to(dtype))
            existing = self.params(backend)[0]
            if kind == "the same tensor twice":
                return {"params": [fresh, fresh]}
            if kind == "a param already in the optimizer":
                return {"params": [existing]}
            if kind == "a fresh param and an existing one":
                return {"params": [fresh, existing]}
            if kind == "overlapping views of one buffer":
                buffer = torch.zeros(10, dtype=dtype)
                return {"params": [buffer[0:6], buffer[4:10]]}
            if kind == "a view of an existing param":
                return {"params": [existing.detach()[tuple(slice(0, 1) for _ in range(existing.dim()))]]}
            if kind == "a meta param":
                return {"params": [torch.empty(4, dtype=dtype, device="meta")]}
            if kind == "an expanded (stride-0) param":
                return {"params": [torch.zeros(1, dtype=dtype).expand(4)]}
            if kind == "an inference-mode param":
                with torch.inference_mode():
                    made = torch.zeros(4, dtype=dtype)
                return {"params": [made]}
            if kind == "a non-leaf param":
                return {"params": [torch.zeros(4, requires_grad=True).to(dtype) * 2]}
            if kind == "an integer param":
                return {"params": [torch.zeros(4, dtype=torch.int32)]}
            if kind == "an invalid lr":
                return {"params": [fresh], "lr": -1.0}
            if kind == "an invalid precision":
                return {"params": [fresh], "precision": "fp8"}
            if kind == "not a dict":
                return [fresh]
            return {"params": {fresh}}
        self.must_fail(lambda backend, opt: opt.add_param_group(group(backend, opt)),
                       f"add_param_group with {kind}")

    # ---- invariant
    @invariant()
    def backends_agree(self):
        if self.opts:
            assert_same_optimizer(self.opts["reference"], self.opts["numba"], "reference vs numba",
                                  skip_group_keys=("backend",))


MACHINES = {spec.name: type(f"Lifecycle_{spec.name.replace('-', '_')}", (LifecycleMachine,), {"spec": spec})
            for spec in SPECS}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # lr=1e39, refused
@pytest.mark.parametrize("name", list(MACHINES))
def test_lifecycle(name):
    run_state_machine_as_test(MACHINES[name], settings=MACHINE_SETTINGS)


# ------------------------------------------------------------------------ non-finite gradients
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cupy backend needs a CUDA device")
KERNEL_BACKENDS = ["reference", "numba", pytest.param("cupy", marks=NEEDS_CUDA)]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_non_finite_gradient_poisons_only_its_own_elements(spec, backend):
    """inf/nan in some grad elements changes nothing of the other elements: their params and
    state are finite and bit-equal (a) to a run where those grad elements are 0 instead, and
    (b) without stochastic rounding (whose random bits hash the tensor and element index), to a
    run where the poisoned elements are a separate param."""
    device = "cuda" if backend == "cupy" else "cpu"
    n, steps = 24, 4
    bad = torch.tensor([3, 10, 11, 20])
    good = torch.tensor([i for i in range(n) if i not in bad.tolist()])
    everything = torch.arange(n)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=generator)
    clean = [torch.randn(n, generator=generator) for _ in range(steps)]
    poisoned = [g.clone() for g in clean]
    poisoned[1][bad] = torch.tensor([INF, NAN, -INF, NAN])
    poisoned[2][bad[:2]] = torch.tensor([NAN, -INF])
    zeroed = [torch.where(torch.isfinite(g), g, torch.zeros_like(g)) for g in poisoned]

    def run(layout, grads, preset, dtype):
        params = [nn.Parameter(start[idx].to(dtype).to(device)) for idx in layout]
        opt = spec.cls(params, precision=preset, backend=backend, seed=11, **spec.kwargs)
        for grad in grads:
            for param, idx in zip(params, layout):
                param.grad = grad[idx].to(dtype).to(device)
            opt.step()
        return [{"param": p.detach(), **{k: v for k, v in opt.state[p].items() if k != "step"}}
                for p in params]

    for preset in PRESET_NAMES:
        stochastic = bf16opt.PRESETS[preset].rounding == "stochastic"
        for dtype in DTYPES:
            where = f"{preset}, {dtype}"
            [poisoned_run] = run([everything], poisoned, preset, dtype)
            [zeroed_run] = run([everything], zeroed, preset, dtype)
            split_good, _ = run([good, bad], poisoned, preset, dtype)
            assert set(poisoned_run) == set(zeroed_run) == set(split_good), where
            for key, value in poisoned_run.items():
                others = value[good]
                if others.is_floating_point():
                    assert torch.isfinite(others.float()).all(), \
                        f"{where}: {key} of other elements not finite"
                assert bits_equal(others, zeroed_run[key][good]), \
                    f"{where}: {key} of other elements differs from the run with zero grads there"
                if not stochastic:
                    assert bits_equal(others, split_good[key]), \
                        f"{where}: {key} of other elements differs from the run with the poisoned ones " \
                        f"split off"
