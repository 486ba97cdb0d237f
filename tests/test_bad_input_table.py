"""docs/bad_inputs.md, executed: every row of its table is a test.

The table is parsed from the document; each row's id (first column) maps to a callable in
``CASES`` below that builds the input.  A test asserts the row's exception type, that the
message contains the row's quoted text, and that nothing changed: the live optimizer the
input involves (stepped once, so it has state; for constructor rows, the optimizer that owns
the params passed) is compared bit for bit before and after.  A row without a callable, or a
callable without a row, fails (``test_every_row_has_a_test_and_every_test_a_row``), so the
document and the library cannot drift apart.

Rows whose behaviour is a known library bug are ``xfail(strict=True)`` (``KNOWN_BUGS``, the
reason says what happens instead); fix the library, and the strict xfail turns into a
failure that asks for the marker to be removed.
"""

from __future__ import annotations

import builtins
import copy
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import bf16opt
from test_lifecycle import Snapshot

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad_inputs.md"
COLUMNS = ("id", "call", "input", "raises", "message contains", "torch.optim", "why")
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------ the document
@dataclass(frozen=True)
class Row:
    id: str
    call: str
    input: str
    raises: str
    message: str
    torch: str
    why: str


def _code_span(cell: str) -> str:
    """The text of a markdown code span (`x` or `` x `` for text holding backticks)."""
    match = re.fullmatch(r"(`+) ?(.*?) ?\1", cell)
    return match.group(2) if match else cell


def _cells(line: str) -> list:
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def parse_table(text: str) -> dict:
    """id -> Row for the table whose header starts with ``| id |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if _cells(line)[:1] == ["id"] if line.startswith("|"))
    header = _cells(lines[start])
    assert tuple(header) == COLUMNS, \
        f"docs/bad_inputs.md: the table's columns are {header}, expected {COLUMNS}"
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(COLUMNS), f"docs/bad_inputs.md: {len(cells)} cells in {line!r}"
        row = Row(cells[0].strip("`"), cells[1], cells[2], _code_span(cells[3]), _code_span(cells[4]),
                  cells[5], cells[6])
        assert row.id not in rows, f"docs/bad_inputs.md: id {row.id!r} appears twice"
        rows[row.id] = row
    return rows


ROWS = parse_table(DOC.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------ the inputs
def live(opt_class=bf16opt.AdamW, preset="bf16-states", **kwargs):
    """An optimizer that has stepped once: group 0 holds param 0 (``a``), group 1 param 1 (``b``,
    precision fp32); both hold grads again, so a step that wrongly went ahead would change them."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4).to(torch.bfloat16))
    b = nn.Parameter(torch.randn(3).to(torch.bfloat16))
    opt = opt_class([{"params": [a]}, {"params": [b], "precision": "fp32"}], precision=preset, **kwargs)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    for p in (a, b):
        p.grad = torch.full_like(p, -0.5)
    return opt, a, b


def fresh():
    return nn.Parameter(torch.randn(3))


def saved(opt) -> dict:
    """A deep copy: torch's state dict shares the live per-param state dicts."""
    return copy.deepcopy(opt.state_dict())


CASES: dict = {}


def case(row_id):
    def register(function):
        assert row_id not in CASES, row_id
        CASES[row_id] = function
        return function
    return register


def construct(opt_class, **kwargs):
    """Constructor row: the live optimizer owns the params passed; it must not change."""
    def make():
        opt, a, b = live()
        return opt, lambda: opt_class([a, b], **kwargs)
    return make


for row_id, opt_class, kwargs in [
    ("lr-negative", bf16opt.AdamW, dict(lr=-1e-3)),
    ("lr-nan", bf16opt.AdamW, dict(lr=NAN)),
    ("lr-inf", bf16opt.AdamW, dict(lr=INF)),
    ("lr-bool", bf16opt.Adam, dict(lr=True)),
    ("lr-string", bf16opt.Adam, dict(lr="0.1")),
    ("lr-tensor-two-elements", bf16opt.SGD, dict(lr=torch.tensor([1e-3, 1e-3]))),
    ("lr-beyond-float", bf16opt.AdamW, dict(lr=10 ** 400)),
    ("lr-meta-tensor", bf16opt.AdamW, dict(lr=torch.tensor(1e-3, device="meta"))),
    ("eps-negative", bf16opt.Adam, dict(eps=-1e-8)),
    ("eps-inf", bf16opt.Adam, dict(eps=INF)),
    ("weight-decay-negative", bf16opt.AdamW, dict(weight_decay=-1)),
    ("weight-decay-inf", bf16opt.AdamW, dict(weight_decay=INF)),
    ("beta1-one", bf16opt.Adam, dict(betas=(1.0, 0.999))),
    ("beta2-negative", bf16opt.Adam, dict(betas=(0.9, -0.1))),
    ("betas-one-number", bf16opt.Adam, dict(betas=(0.9,))),
    ("betas-float-and-tensor", bf16opt.Adam, dict(betas=(0.9, torch.tensor(0.99)))),
    ("amsgrad-string", bf16opt.Adam, dict(amsgrad="yes")),
    ("maximize-none", bf16opt.SGD, dict(maximize=None)),
    ("capturable-with-offload", bf16opt.AdamW, dict(capturable=True, offload="cpu")),
    ("differentiable", bf16opt.AdamW, dict(differentiable=True)),
    ("fused-and-foreach", bf16opt.Adam, dict(fused=True, foreach=True)),
    ("momentum-negative", bf16opt.SGD, dict(momentum=-0.5)),
    ("nesterov-without-momentum", bf16opt.SGD, dict(nesterov=True)),
    ("lion-beta-above-one", bf16opt.Lion, dict(betas=(0.9, 1.5))),
    ("precision-unknown", bf16opt.AdamW, dict(precision="bf17")),
    ("precision-wrong-type", bf16opt.AdamW, dict(precision=3)),
    ("fp16-master-for-bf16-params", bf16opt.AdamW, dict(precision=bf16opt.Precision(master="fp16"))),
    ("backend-unknown", bf16opt.AdamW, dict(backend="tpu")),
    ("seed-negative", bf16opt.AdamW, dict(seed=-1)),
    ("update-in-backward-string", bf16opt.AdamW, dict(update_in_backward="yes")),
    ("update-in-backward-bucket-negative", bf16opt.AdamW, dict(update_in_backward_bucket=-1)),
    ("update-in-backward-bucket-float", bf16opt.AdamW, dict(update_in_backward_bucket=1e6)),
    ("update-in-backward-shared-param", bf16opt.AdamW, dict(update_in_backward=True)),
    ("max-grad-norm-per-param-zero", bf16opt.AdamW, dict(max_grad_norm_per_param=0.0)),
]:
    case(row_id)(construct(opt_class, **kwargs))


def construct_with_precision(**fields):
    """Constructor row whose Precision is refused as it is made (inside the call, not at import)."""
    def make():
        opt, a, b = live()
        return opt, lambda: bf16opt.AdamW([a, b], precision=bf16opt.Precision(**fields))
    return make


for row_id, fields in [
    ("moment-format-unknown", dict(exp_avg="q4")),
    ("q8-rounding-unknown", dict(exp_avg="q8", exp_avg_sq="q8", q8_rounding="up")),
    ("q8-min-numel-negative", dict(exp_avg="q8", exp_avg_sq="q8", q8_min_numel=-1)),
    ("small-moments-fp16", dict(exp_avg="q8", exp_avg_sq="q8", small_moments="fp16")),
]:
    case(row_id)(construct_with_precision(**fields))


class Overriding(torch.Tensor):
    """A subclass that overrides torch's ops (as quantised or logging tensors do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Wrapper(torch.Tensor):
    """A wrapper subclass: no storage of its own, data pointer 0."""

    @staticmethod
    def __new__(cls, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Wrapper does not implement {func}")


def construct_with(params_of):
    """Constructor row with special params: ``params_of(a, b)`` gives the params argument."""
    def make():
        opt, a, b = live()
        return opt, lambda: bf16opt.AdamW(params_of(a, b))
    return make


def _inference_tensor():
    with torch.inference_mode():
        return torch.zeros(3)


def _overlapping_views():
    buffer = torch.zeros(10)
    return [buffer[0:6], buffer[4:10]]


for row_id, params_of in [
    ("params-single-tensor", lambda a, b: a),
    ("params-top-level-set", lambda a, b: {a, b}),
    ("param-not-a-tensor", lambda a, b: [3.0]),
    ("param-integer", lambda a, b: [torch.zeros(3, dtype=torch.int32)]),
    ("param-non-leaf", lambda a, b: [torch.zeros(3, requires_grad=True) * 2]),
    ("param-duplicate-in-group", lambda a, b: [a, a]),
    ("param-in-two-groups", lambda a, b: [{"params": [a]}, {"params": [a]}]),
    ("params-overlapping-views", lambda a, b: _overlapping_views()),
    ("param-meta", lambda a, b: [torch.empty(3, device="meta")]),
    ("param-expanded", lambda a, b: [torch.zeros(1).expand(4)]),
    ("param-inference-mode", lambda a, b: [_inference_tensor()]),
    ("param-names-not-str", lambda a, b: [(0, torch.nn.Parameter(torch.zeros(3)))]),
    ("param-names-wrong-length", lambda a, b: [{"params": [torch.nn.Parameter(torch.zeros(3))], "param_names": []}]),
    ("param-conjugate-view", lambda a, b: [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64).conj())]),
    ("param-tensor-subclass", lambda a, b: [torch.zeros(3).as_subclass(Overriding)]),
    ("param-storageless-subclass", lambda a, b: [Wrapper((3,), torch.float32)]),
]:
    case(row_id)(construct_with(params_of))


def add_group(group_of):
    """add_param_group row: ``group_of(a, b)`` is the argument."""
    def make():
        opt, a, b = live()
        return opt, lambda: opt.add_param_group(group_of(a, b))
    return make


for row_id, group_of in [
    ("params-set-in-group", lambda a, b: {"params": {fresh()}}),
    ("add-group-not-a-dict", lambda a, b: [fresh()]),
    ("add-group-without-params", lambda a, b: {"lr": 0.1}),
    ("add-group-existing-param", lambda a, b: {"params": [b]}),
    ("add-group-view-of-param", lambda a, b: {"params": [b.detach()[1:3]]}),
    ("add-group-bad-lr", lambda a, b: {"params": [fresh()], "lr": -1}),
    ("add-group-bad-precision", lambda a, b: {"params": [fresh()], "precision": "fp8"}),
]:
    case(row_id)(add_group(group_of))


def step_after(change, opt_class=bf16opt.AdamW):
    """step() row: ``change(opt, a, b)`` breaks something first (outside the snapshot)."""
    def make():
        opt, a, b = live(opt_class)
        change(opt, a, b)
        return opt, opt.step
    return make


def _set(mapping, key, value):
    mapping[key] = value


def _set_grad_data(param, value):
    param.grad.data = value


def _inference_copy(tensor):
    with torch.inference_mode():
        return tensor.clone()


def _clip_an_expanded_grad(opt, param):
    opt.param_groups[1]["max_grad_norm_per_param"] = 1.0
    param.grad = torch.ones(1, dtype=param.dtype).expand(param.shape)


for row_id, change, opt_class in [
    ("grad-wrong-shape", lambda opt, a, b: _set_grad_data(b, torch.ones(5, dtype=b.dtype)), bf16opt.AdamW),
    ("grad-wrong-dtype", lambda opt, a, b: _set_grad_data(b, torch.ones(3, dtype=torch.float64)),
     bf16opt.AdamW),
    ("grad-sparse", lambda opt, a, b: setattr(b, "grad", torch.ones(3, dtype=b.dtype).to_sparse()),
     bf16opt.AdamW),
    ("grad-sparse-sgd", lambda opt, a, b: setattr(b, "grad", torch.ones(3, dtype=b.dtype).to_sparse()),
     bf16opt.SGD),
    ("grad-tensor-subclass", lambda opt, a, b: setattr(b, "grad", torch.ones(3, dtype=b.dtype)
                                                       .as_subclass(Overriding)), bf16opt.AdamW),
    ("state-tensor-subclass", lambda opt, a, b: _set(opt.state[b], "exp_avg", torch.zeros(3).as_subclass(Overriding)),
     bf16opt.AdamW),
    ("edited-param-in-two-groups", lambda opt, a, b: opt.param_groups[1]["params"].append(a), bf16opt.AdamW),
    ("edited-sr-streams", lambda opt, a, b: _set(opt.param_groups[1], "sr_streams", "name"), bf16opt.AdamW),
    ("edited-param-names", lambda opt, a, b: _set(opt.param_groups[1], "param_names", [5]), bf16opt.AdamW),
    ("edited-lr-negative", lambda opt, a, b: _set(opt.param_groups[1], "lr", -1.0), bf16opt.AdamW),
    ("edited-lr-overflows-float32", lambda opt, a, b: _set(opt.param_groups[1], "lr", 1e39), bf16opt.AdamW),
    ("edited-eps-overflows-float32", lambda opt, a, b: _set(opt.param_groups[1], "eps", 1e39), bf16opt.AdamW),
    ("edited-dampening-overflows-float32", lambda opt, a, b: _set(opt.param_groups[1], "dampening", -1e39),
     bf16opt.SGD),
    ("edited-precision-unknown", lambda opt, a, b: _set(opt.param_groups[1], "precision", "bf17"),
     bf16opt.AdamW),
    ("edited-maximize-none", lambda opt, a, b: _set(opt.param_groups[0], "maximize", None), bf16opt.AdamW),
    ("state-wrong-shape", lambda opt, a, b: _set(opt.state[b], "exp_avg", torch.zeros(5)), bf16opt.AdamW),
    ("state-not-a-tensor", lambda opt, a, b: _set(opt.state[b], "exp_avg", [0.0, 0.0, 0.0]), bf16opt.AdamW),
    ("state-step-nan", lambda opt, a, b: _set(opt.state[b], "step", torch.tensor(NAN)), bf16opt.AdamW),
    ("state-step-negative", lambda opt, a, b: _set(opt.state[b], "step", torch.tensor(-5.0)), bf16opt.AdamW),
    ("state-step-inf", lambda opt, a, b: _set(opt.state[b], "step", torch.tensor(INF)), bf16opt.AdamW),
    ("state-step-huge", lambda opt, a, b: _set(opt.state[b], "step",
                                               torch.tensor(2.0 ** 60, dtype=torch.float64)), bf16opt.AdamW),
    ("state-step-bool", lambda opt, a, b: _set(opt.state[b], "step", torch.tensor(True)), bf16opt.AdamW),
    ("state-step-bfloat16",
     lambda opt, a, b: _set(opt.state[b], "step", torch.tensor(1.0, dtype=torch.bfloat16)), bf16opt.AdamW),
    ("state-step-shared", lambda opt, a, b: _set(opt.state[b], "step", opt.state[a]["step"]), bf16opt.AdamW),
    ("state-step-view-shared", lambda opt, a, b: _set(opt.state[b], "step", opt.state[a]["step"].view(())),
     bf16opt.AdamW),
    ("state-moment-expanded", lambda opt, a, b: _set(opt.state[b], "exp_avg", torch.zeros(1).expand(3)),
     bf16opt.AdamW),
    ("state-moment-inference",
     lambda opt, a, b: _set(opt.state[b], "exp_avg", _inference_copy(opt.state[b]["exp_avg"])),
     bf16opt.AdamW),
    ("edited-param-data-expanded",
     lambda opt, a, b: setattr(b, "data", torch.zeros(1, dtype=b.dtype).expand(3)), bf16opt.AdamW),
    ("grad-expanded-clipped", lambda opt, a, b: _clip_an_expanded_grad(opt, b), bf16opt.AdamW),
]:
    case(row_id)(step_after(change, opt_class))


def offloaded_step_after(change):
    """step() row of an offloaded optimizer: ``change(opt, a, b)`` breaks something first."""
    def make():
        opt, a, b = live(offload="cpu")
        change(opt, a, b)
        return opt, opt.step
    return make


for row_id, change in [
    ("offloaded-param-data-inference", lambda opt, a, b: setattr(b, "data", _inference_copy(b.data))),
]:
    case(row_id)(offloaded_step_after(change))


def step_with(**arguments):
    """step() row with GradScaler's arguments (``grad_scale`` / ``found_inf``) as keywords."""
    def make():
        opt, a, b = live()
        return opt, lambda: opt.step(**arguments)
    return make


for row_id, arguments in [
    ("grad-scale-not-a-tensor", dict(grad_scale=1024.0)),
    ("grad-scale-two-elements", dict(grad_scale=torch.tensor([2.0, 2.0]))),
    ("grad-scale-float64", dict(grad_scale=torch.tensor(2.0, dtype=torch.float64))),
    ("grad-scale-meta", dict(grad_scale=torch.tensor(2.0, device="meta"))),
    ("grad-scale-zero", dict(grad_scale=torch.tensor(0.0))),
    ("found-inf-int", dict(found_inf=torch.tensor(0, dtype=torch.int32))),
    ("found-inf-two-elements", dict(found_inf=torch.zeros(2))),
]:
    case(row_id)(step_with(**arguments))


@case("grad-scale-given-twice")
def _():
    opt, a, b = live()
    opt.grad_scale = torch.tensor(2.0)  # as torch.amp.GradScaler.step sets it
    return opt, lambda: opt.step(grad_scale=torch.tensor(2.0))


@case("capturable-on-cpu")
def _():
    opt, a, b = live()
    opt.param_groups[1]["capturable"] = True  # the second group: the first must not be updated either
    return opt, opt.step


@case("release-closure")
def _():
    opt, a, b = live(update_in_backward=True)
    return opt, lambda: opt.step(lambda: 0.0)


@case("release-grad-scaler")
def _():
    opt, a, b = live(update_in_backward=True)
    opt.grad_scale, opt.found_inf = torch.tensor(65536.0), torch.tensor(0.0)  # as GradScaler.step sets them
    return opt, opt.step


@case("release-sparse-grad")
def _():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = bf16opt.SGD(emb.parameters(), lr=0.1, update_in_backward=True)
    return opt, lambda: emb(torch.tensor([1, 2])).sum().backward()


@case("state-master-wrong-shape")
def _():
    param = nn.Parameter(torch.randn(3).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], precision="fp32")  # fp32 master copy of the bf16 param
    param.grad = torch.ones_like(param)
    opt.step()
    assert "master" in opt.state[param]
    opt.state[param]["master"] = torch.zeros(5)
    return opt, opt.step


def load(corrupt):
    """load_state_dict row: ``corrupt(sd)`` returns the malformed state dict."""
    def make():
        opt, a, b = live()
        bad = corrupt(saved(opt))
        return opt, lambda: opt.load_state_dict(bad)
    return make


def _item(sd, path, value):
    node = sd
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return sd


def _lion_state_dict(sd):
    opt, a, b = live(bf16opt.Lion)
    return saved(opt)


for row_id, corrupt in [
    ("sd-not-a-dict", lambda sd: None),
    ("sd-state-not-a-dict", lambda sd: {**sd, "state": list(sd["state"].values())}),
    ("sd-groups-not-a-list", lambda sd: {**sd, "param_groups": dict(enumerate(sd["param_groups"]))}),
    ("sd-state-entry-not-a-dict", lambda sd: _item(sd, ("state", 1), 5)),
    ("sd-group-not-a-dict", lambda sd: _item(sd, ("param_groups", 0), "x")),
    ("sd-shape-mismatch", lambda sd: _item(sd, ("state", 1, "exp_avg"), torch.zeros(5))),
    ("sd-unknown-state-key", lambda sd: _item(sd, ("state", 1, "foo"), torch.zeros(3))),
    ("sd-step-nan", lambda sd: _item(sd, ("state", 1, "step"), torch.tensor(NAN))),
    ("sd-step-negative", lambda sd: _item(sd, ("state", 1, "step"), torch.tensor(-3.0))),
    ("sd-step-huge", lambda sd: _item(sd, ("state", 1, "step"),
                                      torch.tensor(2.0 ** 53, dtype=torch.float64))),
    ("sd-unknown-param-index", lambda sd: _item(sd, ("state", 99), sd["state"][0])),
    ("sd-extra-group", lambda sd: {**sd, "param_groups": sd["param_groups"] + [dict(sd["param_groups"][0],
                                                                                       params=[])]}),
    ("sd-fewer-params", lambda sd: _item(sd, ("param_groups", 1, "params"), [])),
    ("sd-other-optimizer", _lion_state_dict),
    ("sd-invalid-hyperparameter", lambda sd: _item(sd, ("param_groups", 1, "lr"), -1.0)),
    ("sd-meta-state-tensor", lambda sd: _item(sd, ("state", 1, "exp_avg"), torch.zeros(3, device="meta"))),
    ("sd-param-names-wrong-length", lambda sd: _item(sd, ("param_groups", 1, "param_names"), ["x", "y"])),
    ("sd-newer-format", lambda sd: {**sd, "bf16opt": {**sd["bf16opt"], "format": 99}}),
    ("sd-meta-step", lambda sd: _item(sd, ("state", 1, "step"), torch.tensor(1.0, device="meta"))),
    ("sd-sparse-state-tensor", lambda sd: _item(sd, ("state", 1, "exp_avg"), torch.zeros(3).to_sparse())),
]:
    case(row_id)(load(corrupt))


KNOWN_BUGS: dict = {}  # row id -> what the library does instead (strict xfail); none left


# ------------------------------------------------------------------------ the tests
def test_every_row_has_a_test_and_every_test_a_row():
    assert len(ROWS) >= 30
    assert not set(CASES) - set(ROWS), \
        f"tests without a row in docs/bad_inputs.md: {sorted(set(CASES) - set(ROWS))}"
    assert not set(ROWS) - set(CASES), \
        f"rows of docs/bad_inputs.md without a test: {sorted(set(ROWS) - set(CASES))}"
    assert not set(KNOWN_BUGS) - set(ROWS), sorted(set(KNOWN_BUGS) - set(ROWS))


def test_rows_are_complete():
    """Every row has an input, an exception, a message; a deviation from torch says why; known bugs
    are marked in the document too."""
    for row in ROWS.values():
        assert row.call and row.input and row.message and row.torch and row.why, row.id
        assert isinstance(getattr(builtins, row.raises, None), type), \
            f"{row.id}: {row.raises!r} is not an exception"
        if row.torch == "same":
            assert row.why == "—", f"{row.id}: torch does the same, so there is nothing to explain"
        elif not row.torch.startswith("("):  # "(no such argument in torch)": nothing to compare
            assert row.why != "—", f"{row.id}: deviates from torch.optim without saying why"
        assert ("*(known bug" in row.input) == (row.id in KNOWN_BUGS), \
            f"{row.id}: the document and KNOWN_BUGS disagree on whether this is a known bug"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # lr=1e39, refused
@pytest.mark.parametrize("row_id", [
    pytest.param(row_id, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[row_id]))
    if row_id in KNOWN_BUGS else row_id
    for row_id in sorted(set(ROWS) | set(CASES))])
def test_row(row_id):
    assert row_id in ROWS, f"{row_id}: a test without a row in docs/bad_inputs.md"
    assert row_id in CASES, f"{row_id}: a row of docs/bad_inputs.md without a test"
    row = ROWS[row_id]
    opt, action = CASES[row_id]()
    before = Snapshot(opt)
    with pytest.raises(getattr(builtins, row.raises)) as info:
        action()
    assert row.message in str(info.value), f"{row.message!r} is not in the message {str(info.value)!r}"
    before.assert_unchanged(opt)
