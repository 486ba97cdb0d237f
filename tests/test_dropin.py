"""Drop-in behaviour: with precision="fp32" on fp32 params bf16opt follows torch.optim.

100 steps of training a small network with an LR scheduler; every param element within
1e-6 of torch's, relative to the magnitude of its tensor (max |w|).  Bit equality is not
expected: torch uses lerp/addcmul/addcdiv (fused on its vector paths), the spec uses
separately rounded ops, an ulp apart per op.  Relative to the tensor rather than to each
element because weights that pass near zero make elementwise relative error meaningless.
Lion follows a float64 implementation.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import bf16opt
from oracles import lion_f64

STEPS = 100
RTOL = 1e-6


def small_network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32),
                         nn.Tanh(), nn.Linear(32, 4))


def data(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, 64, 16, generator=generator)
    teacher = torch.randn(16, 4, generator=generator)
    return x, torch.sin(x @ teacher)


def train(model, opt, scheduler, x, y, max_steps=STEPS):
    for i in range(max_steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[i]), y[i])
        loss.backward()
        opt.step()
        scheduler.step()
    return loss.item()


def assert_params_close(ours: nn.Module, theirs: nn.Module):
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        scale = b.detach().abs().max().item()
        error = (a.detach() - b.detach()).abs()
        assert torch.all(error <= RTOL * scale), f"{name}: max difference {error.max() / scale:.3g} x max|w|"


ADAM_CASES = [
    dict(),
    dict(amsgrad=True),
    dict(maximize=True),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, amsgrad=True, betas=(0.8, 0.99), eps=1e-6),
]


def case_id(value) -> str:
    if isinstance(value, bool):
        return "cycled-momentum" if value else "fixed-momentum"
    return value if isinstance(value, str) else ",".join(value) or "defaults"


# OneCycleLR cycles momentum (Adam's beta1, SGD's momentum) unless told not to, which would
# overwrite each case's own value: every case runs with it fixed, one case with it cycled.
@pytest.mark.parametrize("kwargs,cycle_momentum", [(kw, False) for kw in ADAM_CASES] + [(ADAM_CASES[0], True)],
                         ids=case_id)
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_follows_torch(name, kwargs, cycle_momentum):
    x, y = data()
    if kwargs.get("maximize"):
        y = -y  # maximizing the negated loss is the same training problem
    theirs_model = small_network()
    ours_model = copy.deepcopy(theirs_model)
    theirs = getattr(torch.optim, name)(theirs_model.parameters(), lr=3e-3, foreach=False, **kwargs)
    ours = getattr(bf16opt, name)(ours_model.parameters(), lr=3e-3, precision="fp32",
                                  backend="reference", **kwargs)
    sched_theirs, sched_ours = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=STEPS,
                                                                   cycle_momentum=cycle_momentum)
                                for o in (theirs, ours))
    if kwargs.get("maximize"):
        loss_fn = nn.functional.mse_loss
        for i in range(STEPS):
            for model, opt, sched in ((theirs_model, theirs, sched_theirs), (ours_model, ours, sched_ours)):
                opt.zero_grad()
                (-loss_fn(model(x[i]), y[i])).backward()
                opt.step()
                sched.step()
    else:
        first = nn.functional.mse_loss(theirs_model(x[0]), y[0]).item()
        last_theirs = train(theirs_model, theirs, sched_theirs, x, y)
        train(ours_model, ours, sched_ours, x, y)
        assert last_theirs < first  # the comparison is over real training, not a stalled model
    assert_params_close(ours_model, theirs_model)
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"]
    assert (ours.param_groups[0]["betas"][0] == kwargs.get("betas", (0.9,))[0]) is not cycle_momentum


SGD_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.5),
    dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    dict(momentum=0.5, maximize=True),
]


@pytest.mark.parametrize("kwargs,backend,cycle_momentum",
                         [(kw, "numba", False) for kw in SGD_CASES] + [(SGD_CASES[3], "reference", False),
                                                                       (SGD_CASES[1], "numba", True)],
                         ids=case_id)
def test_sgd_follows_torch(kwargs, backend, cycle_momentum):
    x, y = data()
    if kwargs.get("maximize"):
        y = -y
    theirs_model = small_network()
    ours_model = copy.deepcopy(theirs_model)
    theirs = torch.optim.SGD(theirs_model.parameters(), lr=0.05, foreach=False, **kwargs)
    ours = bf16opt.SGD(ours_model.parameters(), lr=0.05, precision="fp32", backend=backend, **kwargs)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS,
                                                      cycle_momentum=cycle_momentum) for o in (theirs, ours)]
    sign = -1.0 if kwargs.get("maximize") else 1.0
    for i in range(STEPS):
        for model, opt, scheduler in zip((theirs_model, ours_model), (theirs, ours), schedulers):
            opt.zero_grad()
            (sign * nn.functional.mse_loss(model(x[i]), y[i])).backward()
            opt.step()
            scheduler.step()
    assert_params_close(ours_model, theirs_model)
    assert (ours.param_groups[0]["momentum"] == kwargs.get("momentum", 0)) is not cycle_momentum
    if ours.param_groups[0]["momentum"]:
        for p, q in zip(theirs_model.parameters(), ours_model.parameters()):
            scale = theirs.state[p]["momentum_buffer"].abs().max()
            assert torch.all((theirs.state[p]["momentum_buffer"] - ours.state[q]["momentum_buffer"]).abs()
                             <= 1e-5 * scale)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_a_gradient_whose_square_overflows_float32_does_not_freeze_its_element(name, backend):
    """|g| = 1e20: g * g overflows float32, (1 - beta2) * g * g does not.  torch multiplies by
    1 - beta2 first, so exp_avg_sq stays finite, decays and the element moves again; with the
    square first it would be +inf for ever and the element never move again."""
    params = {}
    for cls in (getattr(torch.optim, name), getattr(bf16opt, name)):
        p = nn.Parameter(torch.ones(4))
        kwargs = {"backend": backend} if cls is getattr(bf16opt, name) else {}
        opt = cls([p], lr=1e-3, **kwargs)
        for step in range(10):
            p.grad = torch.full((4,), 1e20 if step == 0 else 1.0)
            opt.step()
        assert torch.isfinite(opt.state[p]["exp_avg_sq"]).all(), cls
        params[cls] = p.detach()
    expected, actual = params.values()
    assert (actual < 1.0).all()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=0.0)


def test_lion_follows_float64_formula():
    x, y = data()
    model = small_network()
    lr, betas, wd = 1e-3, (0.9, 0.99), 0.1
    opt = bf16opt.Lion(model.parameters(), lr=lr, betas=betas, weight_decay=wd, backend="reference")
    reference = {name: (p.detach().double().numpy().copy(), np.zeros(p.shape))
                 for name, p in model.named_parameters()}
    for i in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[i]), y[i]).backward()
        for name, p in model.named_parameters():
            w, m = reference[name]
            # float64 formula fed the float32 weights the model actually used for this gradient
            w_prev = p.detach().double().numpy()
            reference[name] = lion_f64(w_prev, p.grad.double().numpy(), m, lr, *betas, wd, maximize=False)
        opt.step()
        for name, p in model.named_parameters():
            w64 = reference[name][0]
            np.testing.assert_allclose(p.detach().double().numpy(), w64, rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {i}, {name}")


# ---------------------------------------------------------------- views torch marks with a bit
def _complex_run(backend: str, offload, update_in_backward: bool, resolve_by_hand: bool):
    """A complex param trained through ``w.conj()``, whose grad autograd leaves as a conjugate
    view (``is_conj()``); with ``resolve_by_hand`` a tensor hook resolves it before it lands."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    c = torch.randn(4, 3, dtype=torch.complex64)
    if resolve_by_hand:
        w.register_hook(lambda grad: grad.resolve_conj())
    opt = bf16opt.AdamW([w], lr=0.1, backend=backend, offload=offload, update_in_backward=update_in_backward)
    conjugated = []
    for _ in range(3):
        (w.conj() * c).real.sum().backward()
        conjugated.append(w.grad is not None and w.grad.is_conj())
        opt.step()
        opt.zero_grad()
    return w.detach().clone(), conjugated


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("offload, update_in_backward", [(None, False), ("cpu", False), (None, True), ("cpu", True)])
def test_a_conjugated_complex_grad_steps_as_its_resolved_values(backend, offload, update_in_backward):
    """Autograd can leave a complex grad as a conjugate view, which has no real view
    (torch.optim's own for-loop AdamW raises there): the step reads its values resolved, with
    the bits of the same run whose grads were resolved by hand."""
    if backend == "numba":
        pytest.importorskip("numba")
    ours, conjugated = _complex_run(backend, offload, update_in_backward, resolve_by_hand=False)
    expected, resolved = _complex_run(backend, offload, update_in_backward, resolve_by_hand=True)
    assert all(conjugated) if not update_in_backward else not any(resolved)
    assert torch.equal(torch.view_as_real(ours), torch.view_as_real(expected))


def test_a_param_made_a_conjugate_view_is_refused_by_name_and_nothing_changes():
    """A ``.data`` assignment can make a complex param a conjugate view after it was added:
    its memory holds the conjugates, so the step refuses it by name before writing."""
    w = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    v = nn.Parameter(torch.randn(2, dtype=torch.complex64))
    opt = bf16opt.AdamW([v, w], lr=0.1, backend="reference")
    v.grad, w.grad = torch.ones_like(v), torch.ones_like(w)
    opt.step()
    w.data = w.data.conj()
    before = (v.detach().clone(), copy.deepcopy(opt.state_dict()))
    with pytest.raises(ValueError, match=r"params\[1\] is a conjugate view"):
        opt.step()
    assert torch.equal(v.detach(), before[0])
    after = opt.state_dict()
    assert all(torch.equal(after["state"][k][key], before[1]["state"][k][key])
               for k in before[1]["state"] for key in before[1]["state"][k])


@pytest.mark.parametrize("cls", [bf16opt.AdamW, bf16opt.Lion])
def test_tensor_betas_under_a_momentum_cycling_scheduler_step_as_torch_lets_them(cls):
    """OneCycleLR with cycle_momentum writes a float beta1 beside a tensor beta2; torch's
    constructor refuses that mix, its step does not, and neither does bf16opt's."""
    p = nn.Parameter(torch.ones(4))
    opt = cls([p], lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.99)), backend="reference")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    beta1, beta2 = opt.param_groups[0]["betas"]
    assert isinstance(beta1, float) and isinstance(beta2, torch.Tensor)
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.ones(4)
        opt.step()
        scheduler.step()
        assert not torch.equal(p.detach(), before)
    with pytest.raises(ValueError, match="both floats or both Tensors"):
        cls([nn.Parameter(torch.ones(2))], betas=(0.9, torch.tensor(0.99)))


@pytest.mark.parametrize("cls", [torch.optim.AdamW, bf16opt.AdamW])
def test_state_dict_post_hooks_see_and_return_the_finished_dict(cls):
    """As torch.optim: a post-hook's result is state_dict()'s, whatever its layout; it sees
    the dict as saved (bf16opt: plain precision entries and the format tag)."""
    p = nn.Parameter(torch.ones(3))
    opt = cls([p])
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(copy.deepcopy(sd)))
    opt.register_state_dict_post_hook(lambda o, sd: {"lr": sd["param_groups"][0]["lr"]})
    assert opt.state_dict() == {"lr": 1e-3}
    if cls is bf16opt.AdamW:
        assert seen[0] == bf16opt.AdamW([p]).state_dict()
        assert isinstance(seen[0]["param_groups"][0]["precision"], dict) and "bf16opt" in seen[0]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, bf16opt.AdamW])
def test_load_state_dict_pre_hooks_edit_a_copy_of_the_callers_dict(cls):
    p = nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1)
    saved = opt.state_dict()

    def halve(o, sd):
        sd["param_groups"] = [{**g, "lr": g["lr"] / 2} for g in sd["param_groups"]]
    opt.register_load_state_dict_pre_hook(halve)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.05 and saved["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_a_momentum_buffer_set_to_none_restarts_as_torch_sgd_does(backend, dampening):
    """torch.optim.SGD reads a None momentum buffer as none yet: the next step starts it
    from the grad (a momentum reset).  bf16opt: the bits of the buffer deleted, torch's values."""
    def reset(state):
        state["momentum_buffer"] = None

    def delete(state):
        del state["momentum_buffer"]
    def ours(params):
        return bf16opt.SGD(params, lr=0.1, momentum=0.9, dampening=dampening, backend=backend)

    def theirs(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=dampening)
    runs = []
    for make, forget in [(theirs, reset), (ours, reset), (ours, delete)]:
        p = nn.Parameter(torch.linspace(-1, 1, 5))
        opt = make([p])
        for step in range(4):
            p.grad = torch.linspace(0.5, -2, 5) * (step + 1)
            opt.step()
            if step == 1:
                forget(opt.state[p])
        runs.append((p.detach().clone(), opt.state[p]["momentum_buffer"].clone()))
    (torch_p, torch_buffer), (p_reset, buffer_reset), (p_deleted, buffer_deleted) = runs
    assert torch.equal(p_reset, p_deleted) and torch.equal(buffer_reset, buffer_deleted)
    torch.testing.assert_close(p_reset, torch_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buffer_reset, torch_buffer, rtol=1e-6, atol=1e-6)
