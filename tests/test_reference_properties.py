"""Property tests of the reference backend (the specification) against independent oracles.

Every allowed dtype combination (each plan of ``all_plans()``) is a test case of its own;
hypothesis draws random shapes (0-d, 1, odd sizes, non-contiguous) and hyper-parameters
for each:
* state tensors have exactly the configured dtypes;
* every stored value is the round-to-nearest-even encoding of the float32 result computed
  in the spec's operation order by a numpy oracle (bit for bit);
* the stored values agree with a float64 computation within the float32 rounding bound
  (plus half an ulp of the storage format).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bf16opt
from bf16opt.adam import adam_scalars
from bf16opt.lion import lion_scalars
from bf16opt.precision import SHORT_NAME, all_plans, plan_for
from oracles import (adam_f32, adam_f64, bits, encode_bits, half_ulp, lion_f32, lion_f64,
                     to_numpy_f32)

SHAPES = [(), (1,), (7,), (22,), (3, 5), (2, 3, 4), (64,), (5, 13)]
PLANS = all_plans()
# every plan is a case of its own, so each draws fewer examples than the profile's default
PER_PLAN = settings(max_examples=max(4, settings.default.max_examples // 3))


def plan_id(plan) -> str:
    master = SHORT_NAME[plan.master] if plan.master is not None else "param"
    return (f"p={SHORT_NAME[plan.param]}-w={master}-m={SHORT_NAME[plan.exp_avg]}"
            f"-v={SHORT_NAME[plan.exp_avg_sq]}")


def precision_for(plan) -> bf16opt.Precision:
    """The Precision that gives params of ``plan.param`` exactly ``plan``."""
    precision = bf16opt.Precision(master=plan.master or plan.param, exp_avg=plan.exp_avg,
                                  exp_avg_sq=plan.exp_avg_sq)
    assert plan_for(precision, plan.param) == plan
    return precision


all_plans_param = pytest.mark.parametrize("plan", PLANS, ids=plan_id)


@st.composite
def cases(draw, plan):
    shape = draw(st.sampled_from(SHAPES))
    return dict(
        param_dtype=plan.param,
        precision=precision_for(plan),
        shape=shape,
        non_contiguous=len(shape) == 2 and draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        weight_scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        grad_scale=draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3])),
        steps=draw(st.integers(1, 3)),
    )


def make_param(case, generator):
    shape, dtype = case["shape"], case["param_dtype"]
    if case["non_contiguous"]:
        rows, cols = shape
        base = torch.randn(rows, 2 * cols, generator=generator) * case["weight_scale"]
        param = base.to(dtype)[:, ::2]
        assert not param.is_contiguous()
    else:
        param = (torch.randn(shape, generator=generator) * case["weight_scale"]).to(dtype)
    return param


def make_grad(param, case, generator):
    grad = torch.randn(param.shape, generator=generator) * case["grad_scale"]
    grad[torch.rand(param.shape, generator=generator) < 0.1] = 0.0  # some exact zeros
    return grad.to(param.dtype)


def decoded_state(state, key, like):
    return to_numpy_f32(state[key]) if key in state else np.zeros(like.shape, np.float32)


def check_stored(tensor, expected_f32, dtype, what):
    assert tensor.dtype == dtype, f"{what} stored as {tensor.dtype}, configured {dtype}"
    np.testing.assert_array_equal(bits(tensor), encode_bits(expected_f32, dtype).reshape(-1),
                                  err_msg=f"{what}: stored bits are not RNE of the float32 result")


def overflow_threshold(dtype) -> float:
    """Smallest magnitude that rounds to inf in ``dtype``: the largest finite value + half its ulp."""
    info = torch.finfo(dtype)
    top_exponent = math.frexp(info.max)[1] - 1  # max = 1.xx * 2^top_exponent
    return info.max + info.eps * 2.0 ** top_exponent / 2


def check_close(stored, exact, bound, dtype, what):
    stored = to_numpy_f32(stored).astype(np.float64)
    with np.errstate(invalid="ignore"):
        error = np.abs(stored - exact)
    limit = bound + half_ulp(exact, dtype)
    # IEEE overflow: a result that may lie beyond the format's range is stored as inf of its sign
    overflow = np.isinf(stored) & (np.sign(stored) == np.sign(exact)) & (
        np.abs(exact) + bound >= overflow_threshold(dtype))
    assert np.all((error <= limit) | overflow), (
        f"{what}: max error {np.nanmax(np.where(overflow, 0, error)):.3g} exceeds the float32 bound "
        f"(worst excess {np.nanmax(np.where(overflow, 0, error - limit)):.3g})")


@all_plans_param
@PER_PLAN
@given(data=st.data(), amsgrad=st.booleans(), maximize=st.booleans(),
       decoupled=st.booleans(), lr=st.sampled_from([1e-4, 1e-3, 3e-2]),
       betas=st.sampled_from([(0.9, 0.999), (0.0, 0.99), (0.5, 0.0), (0.95, 0.9999)]),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.sampled_from([0.0, 1e-2, 0.3]))
def test_adam_matches_oracles(plan, data, amsgrad, maximize, decoupled, lr, betas, eps, weight_decay):
    """State dtypes, RNE bits against the float32 oracle and the float64 bound, for one plan."""
    case = data.draw(cases(plan), label="case")
    generator = torch.Generator().manual_seed(case["seed"])
    param = make_param(case, generator)
    opt = bf16opt.Adam([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                       amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled,
                       precision=case["precision"], backend="reference")
    group = opt.param_groups[0]
    l2 = not decoupled and weight_decay != 0
    for step in range(1, case["steps"] + 1):
        param.grad = make_grad(param, case, generator)
        state = opt.state[param]
        w0 = to_numpy_f32(state["master"] if "master" in state else param)
        g = to_numpy_f32(param.grad)
        m0, v0, vmax0 = (decoded_state(state, k, w0) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        scalars = adam_scalars(group, step)
        opt.step()

        state = opt.state[param]
        w, m, v, v_hat = adam_f32(w0, g, m0, v0, vmax0, scalars, maximize=maximize, l2=l2, amsgrad=amsgrad)
        check_stored(state["exp_avg"], m, plan.exp_avg, "exp_avg")
        check_stored(state["exp_avg_sq"], v, plan.exp_avg_sq, "exp_avg_sq")
        if amsgrad:
            check_stored(state["max_exp_avg_sq"], v_hat, plan.exp_avg_sq, "max_exp_avg_sq")
        else:
            assert "max_exp_avg_sq" not in state
        if plan.master is not None:
            check_stored(state["master"], w, plan.master, "master")
        else:
            assert "master" not in state
        check_stored(param, w, param.dtype, "param")

        (w64, m64, v64, _), bound = adam_f64(w0, g, m0, v0, vmax0, scalars, maximize=maximize,
                                             l2=l2, amsgrad=amsgrad)
        check_close(state["exp_avg"], m64, bound["m"], plan.exp_avg, "exp_avg")
        check_close(state["exp_avg_sq"], v64, bound["v"], plan.exp_avg_sq, "exp_avg_sq")
        check_close(state.get("master", param), w64, bound["w"], plan.master_dtype, "master weights")


@pytest.mark.parametrize("opt_name", ["Adam", "Lion"])
def test_large_tensors_with_special_values_match_the_float32_oracle(opt_name):
    """Vectorised torch paths (not only scalar tails) and NaN/inf/subnormal inputs."""
    generator = torch.Generator().manual_seed(5)
    n = 100_003
    param = (torch.randn(n, generator=generator) * 10.0 ** torch.randint(-20, 5, (n,), generator=generator))
    grad = torch.randn(n, generator=generator) * 10.0 ** torch.randint(-25, 3, (n,), generator=generator)
    grad[:12] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                              -1e-42, 3e38, -3e38, 1e-45, float("nan"), 2.0])
    param[12:16] = torch.tensor([float("inf"), -0.0, 1e-41, float("nan")])
    w0 = param.numpy().copy()
    param.grad = grad
    opt = getattr(bf16opt, opt_name)([param], lr=1e-2, weight_decay=0.1, amsgrad=True,
                                     backend="reference") if opt_name == "Adam" else \
        bf16opt.Lion([param], lr=1e-2, weight_decay=0.1, backend="reference")
    opt.step()
    group = opt.param_groups[0]
    zeros = np.zeros(n, np.float32)
    if opt_name == "Adam":
        w, m, v, v_hat = adam_f32(w0, grad.numpy(), zeros, zeros, zeros, adam_scalars(group, 1),
                                  maximize=False, l2=True, amsgrad=True)
        check_stored(opt.state[param]["exp_avg_sq"], v, torch.float32, "exp_avg_sq")
        check_stored(opt.state[param]["max_exp_avg_sq"], v_hat, torch.float32, "max_exp_avg_sq")
    else:
        w, m = lion_f32(w0, grad.numpy(), zeros, lion_scalars(group), maximize=False)
    check_stored(opt.state[param]["exp_avg"], m, torch.float32, "exp_avg")
    check_stored(param, w, torch.float32, "param")


@all_plans_param
@PER_PLAN
@given(data=st.data(), maximize=st.booleans(), lr=st.sampled_from([1e-4, 1e-3, 3e-2]),
       betas=st.sampled_from([(0.9, 0.99), (0.0, 0.5), (0.95, 0.98)]),
       weight_decay=st.sampled_from([0.0, 1e-2, 1.0]))
def test_lion_matches_oracles(plan, data, maximize, lr, betas, weight_decay):
    """Lion keeps exactly exp_avg (and a master copy if planned), RNE bits, float64 bound."""
    case = data.draw(cases(plan), label="case")
    generator = torch.Generator().manual_seed(case["seed"])
    param = make_param(case, generator)
    opt = bf16opt.Lion([param], lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                       precision=case["precision"], backend="reference")
    scalars = lion_scalars(opt.param_groups[0])
    for _ in range(case["steps"]):
        param.grad = make_grad(param, case, generator)
        state = opt.state[param]
        w0 = to_numpy_f32(state["master"] if "master" in state else param)
        g = to_numpy_f32(param.grad)
        m0 = decoded_state(state, "exp_avg", w0)
        opt.step()
        state = opt.state[param]
        w, m = lion_f32(w0, g, m0, scalars, maximize=maximize)
        check_stored(state["exp_avg"], m, plan.exp_avg, "exp_avg")
        assert set(state) == {"step", "exp_avg"} | ({"master"} if plan.master is not None else set())
        if plan.master is not None:
            check_stored(state["master"], w, plan.master, "master")
        check_stored(param, w, param.dtype, "param")

        w64, m64 = lion_f64(w0, g, m0, lr, *betas, weight_decay, maximize=maximize)
        # the sign flips only where c is within rounding of 0; elsewhere the bound holds
        c64 = betas[0] * m0.astype(np.float64) + (1 - betas[0]) * (-g if maximize else g)
        decided = np.abs(c64) > 1e-5 * (np.abs(m0) + np.abs(g))
        stored_w = to_numpy_f32(state.get("master", param)).astype(np.float64)
        limit = 4 * 2.0 ** -24 * (np.abs(w64) + lr) + lr * 2.0 ** -23 + half_ulp(w64, plan.master_dtype)
        assert np.all(np.abs(stored_w - w64)[decided] <= limit[decided])


@pytest.mark.parametrize("plan", [p for p in PLANS if p.master_dtype == torch.float32], ids=plan_id)
@PER_PLAN
@given(seed=st.integers(0, 2 ** 31 - 1), shape=st.sampled_from(SHAPES), log2_lr=st.integers(-12, -4),
       betas=st.sampled_from([(0.9, 0.99), (0.0, 0.0), (0.5, 0.999)]), maximize=st.booleans())
def test_lion_moves_each_fp32_param_by_exactly_lr(plan, seed, shape, log2_lr, betas, maximize):
    """fp32 masters on a 2^-10 grid and lr = 2^-k make w - lr exact: each moves by exactly lr
    (wd = 0), for fp32 params and fp32 master copies of 16-bit params alike."""
    generator = torch.Generator().manual_seed(seed)
    # the 2^-10 grid survives rounding to bf16/fp16 (a coarser grid keeps multiples of 2^-10)
    param = (torch.randint(-1024, 1025, shape, generator=generator).float() / 1024).to(plan.param)
    lr = 2.0 ** log2_lr
    opt = bf16opt.Lion([param], lr=lr, betas=betas, maximize=maximize, precision=precision_for(plan),
                       backend="reference")
    scalars = lion_scalars(opt.param_groups[0])
    for _ in range(2):
        param.grad = (torch.randn(shape, generator=generator) + 0.5).to(plan.param)  # few tiny grads
        state = opt.state[param]
        before = (state["master"] if "master" in state else param).float().clone()
        m = to_numpy_f32(state["exp_avg"]) if state else np.zeros(shape, np.float32)
        g = to_numpy_f32(param.grad)
        c = m * np.float32(scalars.beta1) + (-g if maximize else g) * np.float32(scalars.one_minus_beta1)
        opt.step()
        master = opt.state[param]["master"] if plan.master is not None else param
        assert master.dtype == torch.float32
        moved = (master - before).abs().numpy().reshape(shape)
        assert np.all(moved[c != 0] == lr)
        assert np.all(moved[c == 0] == 0)


@all_plans_param
@PER_PLAN
@given(data=st.data(), amsgrad=st.booleans(), maximize=st.booleans(), decoupled=st.booleans())
def test_zero_grad_adam_without_weight_decay_leaves_params_unchanged(plan, data, amsgrad, maximize,
                                                                     decoupled):
    """Zero gradients and wd = 0: m = 0, so the update is 0 and the params keep their bits."""
    case = data.draw(cases(plan), label="case")
    generator = torch.Generator().manual_seed(case["seed"])
    param = make_param(case, generator)
    before = bits(param)
    opt = bf16opt.Adam([param], weight_decay=0.0, amsgrad=amsgrad, maximize=maximize,
                       decoupled_weight_decay=decoupled, precision=case["precision"], backend="reference")
    for _ in range(case["steps"]):
        param.grad = torch.zeros_like(param)
        opt.step()
    np.testing.assert_array_equal(bits(param), before)


@pytest.mark.parametrize("opt_class", [bf16opt.Adam, bf16opt.AdamW, bf16opt.Lion])
def test_params_without_grad_or_requires_grad_false_are_skipped(opt_class):
    trained = torch.randn(5)
    frozen = torch.randn(5)
    no_grad = torch.randn(5, requires_grad=True)
    opt = opt_class([trained, frozen, no_grad], lr=0.1)
    trained.grad = torch.ones(5)
    frozen_before, no_grad_before = frozen.clone(), no_grad.detach().clone()
    trained_before = trained.clone()
    opt.step()
    assert not torch.equal(trained, trained_before)
    assert torch.equal(frozen, frozen_before) and torch.equal(no_grad.detach(), no_grad_before)
    assert frozen not in opt.state and no_grad not in opt.state


# ---------------------------------------------------------------- a param edited beside a master copy
EDIT_OPTIMIZERS = {"AdamW": (bf16opt.AdamW, dict(lr=1e-3, weight_decay=1e-2)),
                   "Lion": (bf16opt.Lion, dict(lr=1e-3, weight_decay=1e-2)),
                   "SGD": (bf16opt.SGD, dict(lr=1e-3, momentum=0.9))}


def _edited_copy_run(opt_name, preset, dtype, backend, edit, steps=3):
    """``steps`` steps of one (16, 40) param, then ``edit(param, master)`` under no_grad, then
    one more step; the param, its master and moments."""
    cls, options = EDIT_OPTIMIZERS[opt_name]
    gen = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(16, 40, generator=gen).to(dtype))
    opt = cls([p], precision=preset, backend=backend, **options)
    grads = [torch.randn(16, 40, generator=gen).to(dtype) for _ in range(steps + 1)]
    for k, g in enumerate(grads):
        if k == steps:
            with torch.no_grad():
                edit(p, opt.state[p]["master"])
        p.grad = g.clone()
        opt.step()
    return p.detach().clone(), {key: value.clone() for key, value in opt.state[p].items()}


def _prune(p, master):
    p[:, :8] = 0
    p[0, 8:12] = torch.tensor([-0.0, 1.5, float("inf"), 2.0 ** -20])


def _prune_both(p, master):  # the same edit written into the master too, by hand
    _prune(p, master)
    master[:, :8] = p[:, :8].float()
    master[0, 8:12] = p[0, 8:12].float()


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-states"])
@pytest.mark.parametrize("opt_name", list(EDIT_OPTIMIZERS))
def test_a_param_edited_beside_a_master_copy_is_the_master_from_then_on(opt_name, preset, dtype, backend):
    """Pruned (and otherwise edited) elements of a 16-bit param with a float32 master copy
    follow the edit, as in torch.optim: the step starts from the edited param, exactly as if
    the master had been edited too (storage.join_copy), the pruned elements stay within one
    update of 0, and the other elements step as without the edit."""
    if backend == "numba":
        pytest.importorskip("numba")
    edited, edited_state = _edited_copy_run(opt_name, preset, dtype, backend, _prune)
    both, both_state = _edited_copy_run(opt_name, preset, dtype, backend, _prune_both)
    plain, plain_state = _edited_copy_run(opt_name, preset, dtype, backend, lambda p, master: None)
    assert torch.equal(edited.view(torch.int16), both.view(torch.int16))
    for key, value in both_state.items():
        assert torch.equal(edited_state[key].reshape(-1).view(torch.uint8),
                           value.reshape(-1).view(torch.uint8)), key
    assert float(edited[:, :8].float().abs().max()) < 0.02  # (one update of lr 1e-3; the weights are ~1)
    assert float(edited_state["master"][:, :8].abs().max()) < 0.02
    assert float(plain[:, :8].float().abs().max()) > 0.5
    assert float(edited[0, 10]) == float("inf") and not bool(edited.isnan().any())
    kept = torch.ones(16, 40, dtype=torch.bool)
    kept[:, :8] = kept[0, 8:12] = False
    assert torch.equal(edited.view(torch.int16)[kept], plain.view(torch.int16)[kept])
    assert torch.equal(edited_state["master"].view(torch.int32)[kept],
                       plain_state["master"].view(torch.int32)[kept])
