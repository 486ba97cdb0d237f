"""Bad input raises ValueError/TypeError naming the argument, and nothing is mutated."""

from __future__ import annotations

import copy

import pytest
import torch

import bf16opt
from snapshots import assert_unchanged, snapshot


def p32(*shape):
    return torch.randn(*shape or (3,))


def bf16_param():
    return torch.randn(3).to(torch.bfloat16)


CONSTRUCTION = [
    # (id, factory, exception, text the message must contain)
    ("negative lr", lambda: bf16opt.Adam([p32()], lr=-1e-3), ValueError, "lr"),
    ("nan lr", lambda: bf16opt.AdamW([p32()], lr=float("nan")), ValueError, "lr"),
    ("string lr", lambda: bf16opt.Adam([p32()], lr="0.1"), TypeError, "lr"),
    ("negative eps", lambda: bf16opt.Adam([p32()], eps=-1e-8), ValueError, "eps"),
    ("negative weight_decay", lambda: bf16opt.AdamW([p32()], weight_decay=-0.1), ValueError, "weight_decay"),
    ("beta1 = 1", lambda: bf16opt.Adam([p32()], betas=(1.0, 0.999)), ValueError, "betas[0]"),
    ("beta2 < 0", lambda: bf16opt.Adam([p32()], betas=(0.9, -0.1)), ValueError, "betas[1]"),
    ("one beta", lambda: bf16opt.Adam([p32()], betas=(0.9,)), TypeError, "betas"),
    ("amsgrad not bool", lambda: bf16opt.Adam([p32()], amsgrad="yes"), TypeError, "amsgrad"),
    ("capturable and offload", lambda: bf16opt.Adam([p32()], capturable=True, offload="cpu"), ValueError,
     "capturable"),
    ("differentiable", lambda: bf16opt.AdamW([p32()], differentiable=True), ValueError, "differentiable"),
    ("fused and foreach", lambda: bf16opt.Adam([p32()], fused=True, foreach=True), ValueError, "fused"),
    ("lion negative lr", lambda: bf16opt.Lion([p32()], lr=-1.0), ValueError, "lr"),
    ("lion beta 1.5", lambda: bf16opt.Lion([p32()], betas=(0.9, 1.5)), ValueError, "betas[1]"),
    ("lion negative wd", lambda: bf16opt.Lion([p32()], weight_decay=-1.0), ValueError, "weight_decay"),
    ("unknown preset", lambda: bf16opt.AdamW([p32()], precision="bf17"), ValueError, "precision"),
    ("precision of wrong type", lambda: bf16opt.AdamW([p32()], precision=3), TypeError, "precision"),
    ("fp16 master for bf16 params",
     lambda: bf16opt.AdamW([bf16_param()], precision=bf16opt.Precision(master="fp16")), ValueError, "master"),
    ("fp16 moments", lambda: bf16opt.Precision(exp_avg_sq="fp16"), ValueError, "exp_avg_sq"),
    ("unknown dtype name", lambda: bf16opt.Precision(master="fp8"), ValueError, "master"),
    ("a dtype argument of another type", lambda: bf16opt.Precision(master=3), TypeError, "master"),
    ("unknown rounding", lambda: bf16opt.Precision(rounding="up"), ValueError, "rounding"),
    ("unknown compensation", lambda: bf16opt.Precision(compensation="neumaier"), ValueError, "compensation"),
    ("remainder without fp32 master",
     lambda: bf16opt.Precision(master="bf16", compensation="remainder"), ValueError, "master"),
    ("stochastic rounding with kahan",
     lambda: bf16opt.Precision(rounding="stochastic", compensation="kahan"), ValueError, "stochastic"),
    ("fp16 kahan buffer", lambda: bf16opt.Precision(compensation="kahan", compensation_dtype="fp16"),
     ValueError, "compensation_dtype"),
    ("negative seed", lambda: bf16opt.AdamW([p32()], seed=-1), ValueError, "seed"),
    ("float seed", lambda: bf16opt.Lion([p32()], seed=1.5), TypeError, "seed"),
    ("track_precision not bool", lambda: bf16opt.AdamW([p32()], track_precision=1), TypeError,
     "track_precision"),
    ("unknown backend", lambda: bf16opt.AdamW([p32()], backend="tpu"), ValueError, "backend"),
    ("integer params", lambda: bf16opt.AdamW([torch.zeros(3, dtype=torch.int32)]), TypeError, "params[0]"),
    ("complex32 params", lambda: bf16opt.AdamW([torch.zeros(3, dtype=torch.complex32)]), TypeError, "params[0]"),
    ("float64 params on the numba backend",
     lambda: bf16opt.AdamW([torch.zeros(3, dtype=torch.float64)], backend="numba"), ValueError, "float64"),
    ("sparse params", lambda: bf16opt.AdamW([torch.zeros(3).to_sparse()]), TypeError, "params[0]"),
    ("param in two groups",
     lambda: (lambda p: bf16opt.AdamW([{"params": [p]}, {"params": [p]}]))(p32()), ValueError, "more than one"),
    ("two devices in one group",
     lambda: bf16opt.AdamW([p32(), torch.empty(3, device="meta")]), ValueError, "device"),
    ("bad group lr", lambda: bf16opt.AdamW([{"params": [p32()], "lr": -1}]), ValueError, "lr"),
    ("bad group precision", lambda: bf16opt.AdamW([{"params": [p32()], "precision": "x"}]), ValueError,
     "precision"),
]


@pytest.mark.parametrize("factory,exception,text", [c[1:] for c in CONSTRUCTION],
                         ids=[c[0] for c in CONSTRUCTION])
def test_bad_construction_arguments(factory, exception, text):
    with pytest.raises(exception) as info:
        factory()
    assert text in str(info.value)


def test_bad_add_param_group_leaves_groups_unchanged():
    opt = bf16opt.AdamW([p32()])
    groups = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [p32()], "lr": -5.0})
    with pytest.raises(TypeError, match="params"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int64)]})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == groups[0]["lr"]


# ------------------------------------------------------------- failed steps mutate nothing
def two_group_optimizer(opt_class=bf16opt.AdamW, preset="bf16"):
    a, b = bf16_param(), bf16_param()
    opt = opt_class([{"params": [a]}, {"params": [b], "precision": "fp32"}], lr=0.1, precision=preset)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()  # state exists, so "nothing mutated" covers state too
    return opt, a, b


@pytest.mark.parametrize("opt_class", [bf16opt.AdamW, bf16opt.Lion])
def test_sparse_grad_fails_before_any_update(opt_class):
    opt, a, b = two_group_optimizer(opt_class)
    b.grad = torch.ones(3).to_sparse().to(torch.bfloat16)
    before = snapshot(opt)
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("key,value,exception", [("lr", -1.0, ValueError), ("betas", (0.9, 2.0), ValueError),
                                                 ("weight_decay", "big", TypeError)])
def test_hyperparameter_broken_after_construction_fails_step_without_mutation(key, value, exception):
    opt, a, b = two_group_optimizer()
    opt.param_groups[1][key] = value  # the second group: the first must not be updated either
    before = snapshot(opt)
    with pytest.raises(exception, match=key if key != "betas" else "betas"):
        opt.step()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("key,value,exception,text", [
    ("backend", "tpu", ValueError, "backend"),
    ("precision", "bf17", ValueError, "precision"),
    ("precision", 3, TypeError, "precision"),
    ("seed", -1, ValueError, "seed"),
    ("capturable", True, ValueError, "capturable"),
    ("track_precision", "yes", TypeError, "track_precision"),
])
def test_implementation_setting_broken_after_construction_fails_step_without_mutation(key, value, exception,
                                                                                      text):
    opt, a, b = two_group_optimizer()
    opt.param_groups[1][key] = value
    before = snapshot(opt)
    with pytest.raises(exception, match=text):
        opt.step()
    assert_unchanged(opt, before)


# ------------------------------------------------------------- settings changed between steps
def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("old,new", [("fp32", "bf16"), ("bf16", "fp32"), ("bf16-kahan", "fp32-remainder"),
                                     ("fp32-remainder", "bf16-states")])
def test_precision_changed_between_steps_converts_the_state(backend, old, new):
    """Setting a group's precision (a preset name, as users write it) between steps converts
    the state like loading a state dict into an optimizer of the new precision does."""
    def run(switch):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)) for _ in range(2)]
        opt = bf16opt.AdamW(params, lr=0.05, precision=old, backend=backend)
        for step in range(4):
            if step == 2:
                opt = switch(opt, params)
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (-1) ** step)
            opt.step()
        return params, opt

    def set_precision(opt, params):
        opt.param_groups[0]["precision"] = new
        return opt

    def reload(opt, params):
        fresh = bf16opt.AdamW(params, lr=0.05, precision=new, backend=backend)
        fresh.load_state_dict(opt.state_dict())
        return fresh

    params, opt = run(set_precision)
    expected_params, expected = run(reload)
    assert opt.param_groups[0]["precision"] == bf16opt.PRESETS[new]
    for p, q in zip(params, expected_params):
        assert torch.equal(_bits(p), _bits(q))
        assert set(opt.state[p]) == set(expected.state[q])
        for key, value in opt.state[p].items():
            assert value.dtype == expected.state[q][key].dtype, key
            assert torch.equal(_bits(value), _bits(expected.state[q][key])), key


def test_param_dtype_changed_between_steps_converts_the_state():
    """``model.float()`` after some steps: the bf16 params' fp32 master copy goes (fp32
    params are their own master) and the next step updates the fp32 weights."""
    param = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], lr=0.1, precision="fp32")
    param.grad = torch.ones_like(param)
    opt.step()
    assert "master" in opt.state[param]
    master = opt.state[param]["master"].clone()
    param.data = master.clone()  # what Module.float() does to a bf16 param
    param.grad = torch.ones_like(param)
    opt.step()
    state = opt.state[param]
    assert "master" not in state and state["step"].item() == 2.0
    assert param.dtype == torch.float32 and torch.all(param < master)


def _twin(**options):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5).to(torch.bfloat16)) for _ in range(3)]
    opt = bf16opt.AdamW([{"params": [p]} for p in params], lr=0.1, **options)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        p.grad = torch.full_like(p, -0.5)
    return opt, params


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_step_stopped_between_launches_leaves_each_group_stepped_or_untouched(backend, monkeypatch):
    """An interrupt (Ctrl-C in a notebook) at the second group's launch: the first group is
    stepped, counter and all; the others keep their params and their step counters."""
    opt, params = _twin(backend=backend)
    alone, twins = _twin(backend=backend)
    alone.param_groups[:] = alone.param_groups[:1]
    alone.step()  # the first group's step alone
    kept = [({k: v.clone() for k, v in opt.state[p].items()}, p.detach().clone()) for p in params[1:]]
    module = bf16opt.backends.numba if backend == "numba" else bf16opt.backends.reference
    prepare, launched = module.prepare, []

    def interrupted_at_the_second(bucket, scalars):
        launch = prepare(bucket, scalars)

        def run():
            launched.append(bucket)
            if len(launched) == 2:
                raise KeyboardInterrupt
            launch()
        return run

    monkeypatch.setattr(module, "prepare", interrupted_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert torch.equal(params[0], twins[0])
    assert {k: v.tolist() for k, v in opt.state[params[0]].items()} == \
        {k: v.tolist() for k, v in alone.state[twins[0]].items()}
    for (state, value), param in zip(kept, params[1:]):
        assert torch.equal(param, value)
        assert all(torch.equal(v, state[k]) for k, v in opt.state[param].items())


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_state_made_or_loaded_under_inference_mode_stays_writable(offload):
    """torch.inference_mode() around load_state_dict() or step() (an evaluation loop's habit)
    must not leave inference tensors in the state, which no later step could update."""
    param = torch.nn.Parameter(torch.randn(6).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], offload=offload)
    param.grad = torch.ones_like(param)
    with torch.inference_mode():
        opt.step()
    assert not any(t.is_inference() for t in opt.state[param].values())
    saved = copy.deepcopy(opt.state_dict())
    with torch.inference_mode():
        opt.load_state_dict(saved)
    assert not any(t.is_inference() for t in opt.state[param].values())
    opt.step()
    assert opt.state[param]["step"].item() == 2


def test_a_failed_add_param_group_releases_the_new_params_offload_records(monkeypatch):
    opt = bf16opt.AdamW([torch.nn.Parameter(torch.randn(3))], offload="cpu")
    new = torch.nn.Parameter(torch.randn(4))

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(opt, "_sync_release_hooks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.add_param_group({"params": [new], "offload": "cpu"})
    assert len(opt.param_groups) == 1
    assert new not in opt._offloader._records
    assert not new._post_accumulate_grad_hooks


@pytest.mark.parametrize("reloaded", [False, True])
def test_a_state_tensor_replaced_by_hand_is_converted_whether_or_not_a_load_came_first(reloaded):
    """The same edit gives the same result: the step converts a moment the user replaced with
    another dtype (as load_state_dict would), rather than trusting what it checked last step."""
    param = torch.nn.Parameter(torch.randn(6).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], precision="bf16", backend="numba")
    param.grad = torch.ones_like(param)
    opt.step()
    if reloaded:
        opt.load_state_dict(opt.state_dict())
    opt.state[param]["exp_avg"] = opt.state[param]["exp_avg"].float()
    opt.step()
    assert opt.state[param]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_interleaved_views_of_one_buffer_are_params_like_any_other(backend):
    """A matrix's column blocks (or its even and odd elements) share a buffer but no element:
    torch.optim updates them, and so does bf16opt, as it would separate tensors."""
    torch.manual_seed(0)
    buffer = torch.randn(4, 6).to(torch.bfloat16)
    flat = torch.randn(20).to(torch.bfloat16)
    views = [buffer[:, :3], buffer[:, 3:], flat[0::2], flat[1::2]]
    separate = [v.clone() for v in views]
    runs = []
    for params in (views, separate):
        params = [torch.nn.Parameter(p) for p in params]
        opt = bf16opt.AdamW(params, lr=1e-2, precision="bf16-sr", backend=backend)
        for step in range(3):
            for k, p in enumerate(params):
                p.grad = torch.full_like(p, (k + 1) * (step - 1.5))
            opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(ValueError, match="share memory"):
        bf16opt.AdamW([torch.nn.Parameter(buffer[:, :4]), torch.nn.Parameter(buffer[:, 3:])])


@pytest.mark.parametrize("preset", ["fp32-remainder", "fp32", "bf16"])
def test_negative_view_params_step_and_load_alike_on_both_backends(preset):
    """A param that is a negative view (its memory holds the values negated) is updated by its
    values, on the reference as on the kernels, and its state dict loads back; offloaded, it is
    refused before anything changes (the pipeline copies memory, not values)."""
    values = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    runs = {}
    for backend in ("reference", "numba"):
        param = torch.nn.Parameter(values.neg()._neg_view())
        opt = bf16opt.AdamW([param], lr=1e-2, precision=preset, backend=backend)
        for step in range(3):
            param.grad = torch.full_like(param, step - 1.0)
            opt.step()
        opt.load_state_dict(opt.state_dict())
        runs[backend] = param.detach().resolve_neg(), {k: v.clone() for k, v in opt.state[param].items()}
    assert torch.equal(runs["reference"][0].view(torch.int16), runs["numba"][0].view(torch.int16))
    assert all(torch.equal(v, runs["numba"][1][k]) for k, v in runs["reference"][1].items())
    param = torch.nn.Parameter(values.neg()._neg_view())
    opt = bf16opt.AdamW([param], precision=preset, offload="cpu")
    param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match="negative view"):
        opt.step()
    assert not opt.state
