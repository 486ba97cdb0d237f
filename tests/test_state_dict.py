"""state_dict / load_state_dict: bit-exact round trips, conversions, clear errors."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt.precision import PRESETS, plan_for
from bf16opt.storage import encode, join_remainder, split_remainder
from oracles import bits, encode_bits, to_numpy_f32
from snapshots import assert_unchanged, same_bits, snapshot

PRESET_NAMES = sorted(PRESETS)


def model_and_batches(dtype=torch.bfloat16, seed=0, steps=4):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(9, 6), torch.nn.GELU(), torch.nn.Linear(6, 2)).to(dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randn(4, 9, generator=generator).to(dtype) for _ in range(steps)]
    return model, batches


def train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def save_and_load(state_dict):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


OPTIMIZERS = [(bf16opt.AdamW, {}), (bf16opt.Adam, {"amsgrad": True, "weight_decay": 0.1}), (bf16opt.Lion, {}),
              (bf16opt.SGD, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01})]


@pytest.mark.parametrize("opt_class,kwargs", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact_and_resumes_identically(opt_class, kwargs, preset, dtype):
    model, batches = model_and_batches(dtype)
    opt = opt_class(model.parameters(), lr=1e-2, precision=preset, **kwargs)
    train(model, opt, batches[:2])

    resumed_model = copy.deepcopy(model)
    resumed = opt_class(resumed_model.parameters(), lr=1e-2, precision=preset, **kwargs)
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        original, loaded = opt.state[p], resumed.state[q]
        assert set(original) == set(loaded)
        for key in original:
            assert same_bits(original[key], loaded[key]), key
            assert loaded[key] is not original[key]
    train(model, opt, batches[2:])
    train(resumed_model, resumed, batches[2:])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert same_bits(p.detach(), q.detach())


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _resumed(model, preset, saved):
    resumed_model = copy.deepcopy(model)
    resumed = bf16opt.AdamW(resumed_model.parameters(), lr=1e-2, precision=preset, backend="numba")
    resumed.load_state_dict(saved)
    return resumed_model, resumed


@pytest.mark.parametrize("preset", ["fp32", "bf16-sr", "bf16-kahan", "fp32-remainder-q8"])
def test_a_loaded_state_that_needs_no_conversion_is_kept_not_copied(preset):
    """As torch.optim does, loaded tensors that are already what the state holds (dtype,
    device, layout) become the state, so a resumed run holds its state once; it resumes bit
    for bit.  (A remainder is split again from the joined master: a new tensor.)"""
    model, batches = model_and_batches()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision=preset, backend="numba")
    train(model, opt, batches[:2])
    saved = save_and_load(opt.state_dict())
    loaded = {(index, key): value for index, state in saved["state"].items()
              for key, value in state.items() if key not in ("step", "remainder")}  # (split again)
    resumed_model, resumed = _resumed(model, preset, saved)
    params = list(resumed_model.parameters())
    for (index, key), value in loaded.items():
        assert _address(resumed.state[params[index]][key]) == _address(value), (index, key)
    train(model, opt, batches[2:])
    train(resumed_model, resumed, batches[2:])
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), params))


def test_a_live_optimizers_own_state_dict_is_copied_into_another():
    """``twin.load_state_dict(opt.state_dict())`` hands over opt's own tensors: the twin copies
    them, so the two optimizers step apart (bit for bit the same run, not a shared state)."""
    model, batches = model_and_batches()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16-sr", backend="numba")
    train(model, opt, batches[:2])
    twin_model, twin = _resumed(model, "bf16-sr", opt.state_dict())
    params, twin_params = list(model.parameters()), list(twin_model.parameters())
    assert _address(twin.state[twin_params[0]]["exp_avg"]) != _address(opt.state[params[0]]["exp_avg"])
    train(model, opt, batches[2:])
    train(twin_model, twin, batches[2:])
    assert all(same_bits(p, q) for p, q in zip(params, twin_params))


@pytest.mark.parametrize("form", ["negative view", "inference tensor"])
def test_a_loaded_negative_view_or_inference_tensor_is_copied_as_its_values(form):
    """A negative view holds its values negated in memory, and an inference tensor cannot be
    written outside inference mode: both are copied, and the run steps from their values."""
    model, batches = model_and_batches(torch.float32)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="fp32", backend="reference")
    train(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    reference_model, reference = _resumed(model, "fp32", copy.deepcopy(saved))
    moment = saved["state"][0]["exp_avg"]
    if form == "negative view":
        saved["state"][0]["exp_avg"] = torch._neg_view(moment.neg())
    else:
        with torch.inference_mode():
            saved["state"][0]["exp_avg"] = moment.clone()
    resumed_model, resumed = _resumed(model, "fp32", saved)
    assert _address(resumed.state[next(resumed_model.parameters())]["exp_avg"]) != \
        _address(saved["state"][0]["exp_avg"])
    train(resumed_model, resumed, batches[2:])
    train(reference_model, reference, batches[2:])
    assert all(same_bits(a, b) for a, b in zip(resumed_model.parameters(), reference_model.parameters()))


def test_a_loaded_tensor_given_twice_or_holding_a_nan_is_copied():
    """A storage two saved tensors share, and a tensor holding a NaN (a copy stores it
    canonical), are copied; the run then steps as from a dict of separate copies."""
    model, batches = model_and_batches(torch.float32)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="fp32", backend="numba")
    train(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    state = saved["state"]
    state[3]["exp_avg_sq"] = state[1]["exp_avg_sq"][:2]  # a view of another param's state (2 of 6)
    state[0]["exp_avg"].view(-1)[0] = float("-nan")
    resumed_model, resumed = _resumed(model, "fp32", saved)
    reference_model, reference = _resumed(model, "fp32", copy.deepcopy(saved))
    q = list(resumed_model.parameters())
    assert _address(resumed.state[q[1]]["exp_avg_sq"]) == _address(state[1]["exp_avg_sq"])
    assert _address(resumed.state[q[3]]["exp_avg_sq"]) != _address(state[1]["exp_avg_sq"])
    assert _address(resumed.state[q[0]]["exp_avg"]) != _address(state[0]["exp_avg"])
    assert int(resumed.state[q[0]]["exp_avg"].view(torch.int32).view(-1)[0]) == 0x7FC00000  # canonical
    train(resumed_model, resumed, batches[2:])
    train(reference_model, reference, batches[2:])
    assert all(same_bits(a, b) for a, b in zip(resumed_model.parameters(), reference_model.parameters()))


def test_state_dict_keeps_configured_dtypes_and_plain_precision():
    model, batches = model_and_batches(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision="bf16-states")
    train(model, opt, batches[:1])
    state_dict = opt.state_dict()
    for state in state_dict["state"].values():
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["master"].dtype == torch.float32
    assert state_dict["param_groups"][0]["precision"]["exp_avg"] == "bf16"
    assert state_dict["bf16opt"]["family"] == "adam"


@pytest.mark.parametrize("saved_format", [1, 2, 3])
@pytest.mark.parametrize("preset", ["bf16-sr", "bf16"])
def test_state_dicts_of_older_formats_warn_only_under_stochastic_rounding(saved_format, preset):
    """Formats 1 and 2 drew a hash per buffer: loading one into groups that round
    stochastically warns (the run goes on with this version's bits); nearest rounding, and a
    format-3 state dict, load silently.  Either way the state loads and the step runs."""
    model, batches = model_and_batches(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision=preset)
    train(model, opt, batches[:1])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["bf16opt"]["format"] == 3
    saved["bf16opt"]["format"] = saved_format
    loaded = bf16opt.AdamW(model.parameters(), precision=preset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_state_dict(saved)
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    older_sr = saved_format < 3 and preset == "bf16-sr"
    assert len(texts) == older_sr
    if older_sr:
        assert f"state-dict format {saved_format}" in texts[0] and "two buffers per hash" in texts[0]
    for p in model.parameters():
        assert same_bits(loaded.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    train(model, loaded, batches[1:2])


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_torch_state_dict_converts_with_round_to_nearest_even(name, preset):
    model, batches = model_and_batches(torch.float32)
    theirs = getattr(torch.optim, name)(model.parameters(), lr=1e-2, amsgrad=True)
    train(model, theirs, batches)
    saved = save_and_load(theirs.state_dict())

    ours_model = copy.deepcopy(model).to(torch.bfloat16)
    ours = getattr(bf16opt, name)(ours_model.parameters(), lr=0.5, precision=preset)
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["amsgrad"]
    assert ours.param_groups[0]["precision"] == PRESETS[preset]  # precision stays ours
    for p, q in zip(model.parameters(), ours_model.parameters()):
        plan = plan_for(PRESETS[preset], q.dtype, q.numel())
        torch_state, state = theirs.state[p], ours.state[q]
        assert float(state["step"]) == float(torch_state["step"])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            dtype = plan.exp_avg if key == "exp_avg" else plan.exp_avg_sq
            assert state[key].dtype == dtype
            np.testing.assert_array_equal(bits(state[key]), encode_bits(to_numpy_f32(torch_state[key]), dtype))
        if plan.master is not None:  # torch has no master: it is taken from the param
            assert torch.equal(state["master"], q.detach().float())
    train(ours_model, ours, [x.to(torch.bfloat16) for x in batches])  # and training goes on


def master_value(opt, param):
    """The float32 master an optimizer holds for ``param``: its copy, param + remainder, or the param."""
    state = opt.state[param]
    if "master" in state:
        return state["master"].clone()
    if "remainder" in state:
        return join_remainder(param.detach(), state["remainder"])
    return param.detach().float().clone()


@pytest.mark.parametrize("source", PRESET_NAMES)
@pytest.mark.parametrize("target", PRESET_NAMES)
def test_state_dict_of_one_preset_loads_into_another(source, target):
    model, batches = model_and_batches(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision=source)
    train(model, opt, batches[:2])
    saved_masters = {p: master_value(opt, p) for p in model.parameters()}
    other = bf16opt.AdamW(model.parameters(), precision=target)
    other.load_state_dict(opt.state_dict())
    for p in model.parameters():
        plan = plan_for(PRESETS[target], p.dtype, p.numel())
        for key, dtype in (("exp_avg", plan.exp_avg), ("exp_avg_sq", plan.exp_avg_sq)):
            np.testing.assert_array_equal(bits(other.state[p][key]),
                                          encode_bits(to_numpy_f32(opt.state[p][key]), dtype))
        assert ("master" in other.state[p]) == (plan.master is not None)
        assert ("remainder" in other.state[p]) == (plan.compensation == "remainder")
        if plan.master_dtype == torch.float32:  # the saved master carries over exactly
            assert same_bits(master_value(other, p), saved_masters[p])
        if plan.weights == "copy":  # its param is the master's rounding (else it reads as edited)
            assert same_bits(p.detach(), encode(other.state[p]["master"], p.dtype))
        else:  # a bf16 master: the param itself, untouched
            assert same_bits(p.detach(), encode(saved_masters[p], torch.bfloat16)) or "remainder" in opt.state[p]
    train(model, other, batches[2:])


def test_a_remainder_state_with_tied_masters_loads_into_a_master_copy_exactly():
    """A remainder plan's param is its master's ties-away rounding: loaded into a float32 copy
    plan, the param is rewritten as the round to nearest even (it differs on ties with an even
    upper half), so the next step starts from the loaded master, not from the param as if it
    had been edited (storage.join_copy)."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=torch.bfloat16))
    opt = bf16opt.SGD([p], lr=0.0, precision="fp32-remainder")
    p.grad = torch.zeros_like(p)
    opt.step()
    # 1 + 2**-8, 2 + 2**-7, -(3 + 2**-7): halfway between two bf16 values; 4 is not a tie
    tie = torch.tensor([0x3F808000, 0x40008000, 0xC0408000 - 2 ** 32, 0x40800000], dtype=torch.int32)
    tie = tie.view(torch.float32)
    param, remainder = split_remainder(tie)
    with torch.no_grad():
        p.copy_(param)
    opt.state[p]["remainder"].copy_(remainder)
    q = torch.nn.Parameter(p.detach().clone())
    other = bf16opt.SGD([q], lr=0.0, precision="fp32")
    other.load_state_dict(opt.state_dict())
    assert same_bits(other.state[q]["master"], tie)
    assert same_bits(q.detach(), encode(tie, torch.bfloat16)) and not same_bits(q.detach(), p.detach())
    q.grad = torch.zeros_like(q)
    other.step()
    assert same_bits(other.state[q]["master"], tie)


def test_a_torch_state_dict_leaves_the_params_of_a_master_copy_alone():
    """A state without a master (torch.optim's) gives the copy the param's value: the param
    is its rounding already and is not written (its version stays)."""
    p = torch.nn.Parameter(torch.randn(40).to(torch.bfloat16))
    theirs = torch.optim.AdamW([torch.nn.Parameter(p.detach().float())], lr=1e-3)
    theirs.param_groups[0]["params"][0].grad = torch.ones(40)
    theirs.step()
    ours = bf16opt.AdamW([p], lr=1e-3, precision="fp32")
    version = p._version
    ours.load_state_dict(theirs.state_dict())
    assert p._version == version and same_bits(ours.state[p]["master"], p.detach().float())


def test_scheduler_entries_survive_a_load():
    model, batches = model_and_batches()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, batches[:2])
    scheduler.step()
    other = bf16opt.AdamW(model.parameters(), lr=1e-2)
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["initial_lr"] == 1e-2
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3


# ------------------------------------------------------------------- mismatches
def trained(opt_class=bf16opt.AdamW, **kwargs):
    model, batches = model_and_batches()
    opt = opt_class(model.parameters(), **kwargs)
    train(model, opt, batches[:1])
    return model, opt


def lion_state_dict():
    return trained(bf16opt.Lion)[1].state_dict()


def sgd_state_dict():
    model, batches = model_and_batches(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, batches[:1])
    return opt.state_dict()


def unstepped_state_dict(opt_class, **kwargs):
    """A state dict with empty state: only its param groups tell which optimizer saved it."""
    model, _ = model_and_batches(torch.float32)
    return opt_class(model.parameters(), **kwargs).state_dict()


def with_state_entry(key, value):
    def corrupt(state_dict):
        state_dict = copy.deepcopy(state_dict)
        state_dict["state"][1][key] = value
        return state_dict
    return corrupt


def without_params_list(state_dict):
    state_dict = copy.deepcopy(state_dict)
    del state_dict["param_groups"][0]["params"]
    return state_dict


def with_extra_group(state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["param_groups"].append(dict(state_dict["param_groups"][0], params=[]))
    return state_dict


def with_param_dropped(state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["param_groups"][0]["params"] = state_dict["param_groups"][0]["params"][:-1]
    return state_dict


def with_wrong_shape(state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["state"][1]["exp_avg"] = torch.zeros(7)
    return state_dict


def with_unknown_index(state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["state"][99] = state_dict["state"][0]
    return state_dict


def with_negative_lr(state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["param_groups"][0]["lr"] = -1.0
    return state_dict


MISMATCHES = [
    ("lion into adamw", lambda sd: lion_state_dict(), ValueError, "Lion"),
    ("torch SGD", lambda sd: sgd_state_dict(), ValueError, "betas"),
    ("unstepped torch SGD", lambda sd: unstepped_state_dict(torch.optim.SGD, lr=0.5), ValueError, "betas"),
    ("unstepped Lion", lambda sd: unstepped_state_dict(bf16opt.Lion), ValueError, "Lion"),
    # buffers this preset (bf16-states: fp32 master copy, bf16 moments) does not all use
    ("wrong master shape", with_state_entry("master", torch.zeros(7)), ValueError, "master"),
    ("wrong unused buffer shape", with_state_entry("max_exp_avg_sq", torch.zeros(7)), ValueError,
     "max_exp_avg_sq"),
    ("non-tensor buffer", with_state_entry("compensation", [0.0]), TypeError, "compensation"),
    ("step of two elements", with_state_entry("step", torch.zeros(2)), ValueError, "step"),
    ("NaN step", with_state_entry("step", torch.tensor(float("nan"))), ValueError, "step"),
    ("negative step", with_state_entry("step", -1.0), ValueError, "step"),
    ("group without params", without_params_list, ValueError, "params"),
    ("extra param group", with_extra_group, ValueError, "parameter groups"),
    ("fewer params", with_param_dropped, ValueError, "params"),
    ("wrong state shape", with_wrong_shape, ValueError, "shape"),
    ("state of unknown param", with_unknown_index, ValueError, "99"),
    ("invalid hyper-parameter", with_negative_lr, ValueError, "lr"),
    ("not a state dict", lambda sd: {"state": {}}, ValueError, "param_groups"),
]


@pytest.mark.parametrize("corrupt,exception,text", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES])
def test_mismatched_state_dict_raises_and_changes_nothing(corrupt, exception, text):
    model, opt = trained(precision="bf16-states")
    bad = corrupt(opt.state_dict())
    before = snapshot(opt)
    with pytest.raises(exception) as info:
        opt.load_state_dict(bad)
    assert text in str(info.value)
    assert_unchanged(opt, before)


def test_unstepped_torch_adam_state_dict_does_not_load_into_lion():
    _, lion = trained(bf16opt.Lion)
    before = snapshot(lion)
    with pytest.raises(ValueError, match="eps"):
        lion.load_state_dict(unstepped_state_dict(torch.optim.Adam))
    assert_unchanged(lion, before)


def test_adam_state_dict_does_not_load_into_lion():
    _, adam = trained(bf16opt.Adam)
    _, lion = trained(bf16opt.Lion)
    before = snapshot(lion)
    with pytest.raises(ValueError, match="Adam"):
        lion.load_state_dict(adam.state_dict())
    assert_unchanged(lion, before)


SGD_KWARGS = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_torch_sgd_state_dict_loads_into_sgd(preset):
    """torch.optim.SGD's momentum buffers convert with round to nearest even; the loaded
    buffer is continued (not re-initialised from the next gradient)."""
    model, batches = model_and_batches(torch.float32)
    theirs = torch.optim.SGD(model.parameters(), **SGD_KWARGS)
    train(model, theirs, batches[:2])
    ours_model = copy.deepcopy(model).to(torch.bfloat16)
    ours = bf16opt.SGD(ours_model.parameters(), lr=0.5, precision=preset)
    ours.load_state_dict(save_and_load(theirs.state_dict()))
    assert ours.param_groups[0]["nesterov"] and ours.param_groups[0]["momentum"] == 0.9
    for p, q in zip(model.parameters(), ours_model.parameters()):
        dtype = plan_for(PRESETS[preset], q.dtype, q.numel()).exp_avg
        buffer = ours.state[q]["momentum_buffer"]
        np.testing.assert_array_equal(bits(buffer), encode_bits(to_numpy_f32(theirs.state[p]["momentum_buffer"]),
                                                                dtype))
    train(ours_model, ours, [x.to(torch.bfloat16) for x in batches[2:]])


def test_sgd_and_torch_sgd_continue_each_others_state_dicts():
    """fp32 preset on fp32 params: a bf16opt.SGD checkpoint continued by torch.optim.SGD and a
    torch checkpoint continued by bf16opt.SGD both track torch's uninterrupted run (within the
    drop-in tolerance: torch's add(alpha=...) may fuse, the spec rounds each operation)."""
    model, batches = model_and_batches(torch.float32, steps=8)
    reference_model = copy.deepcopy(model)
    reference = torch.optim.SGD(reference_model.parameters(), **SGD_KWARGS)
    train(reference_model, reference, batches)

    ours_model = copy.deepcopy(model)
    ours = bf16opt.SGD(ours_model.parameters(), precision="fp32", **SGD_KWARGS)
    train(ours_model, ours, batches[:4])
    theirs = torch.optim.SGD(ours_model.parameters(), lr=1.0)
    theirs.load_state_dict(save_and_load(ours.state_dict()))
    train(ours_model, theirs, batches[4:])

    torch_model = copy.deepcopy(model)
    torch_first = torch.optim.SGD(torch_model.parameters(), **SGD_KWARGS)
    train(torch_model, torch_first, batches[:4])
    ours_second = bf16opt.SGD(torch_model.parameters(), lr=1.0, precision="fp32")
    ours_second.load_state_dict(save_and_load(torch_first.state_dict()))
    train(torch_model, ours_second, batches[4:])
    for a, b, c in zip(reference_model.parameters(), ours_model.parameters(), torch_model.parameters()):
        scale = a.detach().abs().max()
        assert torch.all((a - b).abs() <= 1e-6 * scale) and torch.all((a - c).abs() <= 1e-6 * scale)


def test_other_optimizers_state_dicts_do_not_load_into_sgd():
    model, batches = model_and_batches(torch.float32)
    sgd = bf16opt.SGD(model.parameters(), momentum=0.9)
    train(model, sgd, batches[:1])
    before = snapshot(sgd)
    for other in (bf16opt.AdamW, bf16opt.Lion):
        with pytest.raises(ValueError, match=other.__name__):
            sgd.load_state_dict(trained(other)[1].state_dict())
        assert_unchanged(sgd, before)
    with pytest.raises(ValueError, match="momentum"):
        sgd.load_state_dict(unstepped_state_dict(torch.optim.Adam))
    assert_unchanged(sgd, before)


@pytest.mark.parametrize("options", [dict(precision="bf16-sr"), dict(precision="fp32-remainder-q8"),
                                     dict(precision="bf16", update_in_backward=True),
                                     dict(precision="fp32", offload="cpu")],
                         ids=["bf16-sr", "fp32-remainder-q8", "update-in-backward", "offload"])
def test_dcp_flattened_state_dict_round_trip_resumes_identically(options):
    """torch.distributed.checkpoint's state dict helpers with flatten_optimizer_state_dict=True
    (no process group needed), as torchtitan saves: set_optimizer_state_dict looks every live
    group key up in the flattened dict, and the resumed run equals the uninterrupted one."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,  # noqa: PLC0415
                                                         set_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def run(seed_model=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)).to(torch.bfloat16)
        return model, bf16opt.AdamW(model.parameters(), lr=1e-2, seed=3, **options)

    def train(model, opt, steps, start):
        for k in range(start, start + steps):
            x = torch.randn(8, 80, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = run()
    train(model, opt, 2, 0)
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=flat))
    assert any(key.startswith("param_groups.") for key in saved)  # (flattened)
    train(model, opt, 2, 2)
    resumed_model, resumed = run()
    resumed_model.load_state_dict(saved_model)
    set_optimizer_state_dict(resumed_model, resumed, saved, options=flat)
    train(resumed_model, resumed, 2, 2)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert same_bits(p.detach(), q.detach())


@pytest.mark.parametrize("cls", [bf16opt.AdamW, bf16opt.Lion, bf16opt.SGD])
def test_an_empty_state_entry_loads_as_no_state(cls):
    """``optimizer.state`` is a defaultdict: reading the state of a param that has none (a
    frozen one, by monitoring code) leaves ``{}``, which state_dict() saves -- bf16opt's and
    torch.optim's alike. It loads as no state, and the run goes on as the one never read."""
    def run(read: bool, reload: bool):
        torch.manual_seed(0)
        a, b = (torch.nn.Parameter(torch.randn(5).to(torch.bfloat16)) for _ in range(2))
        opt = cls([a, b], lr=1e-2, **({"momentum": 0.9} if cls is bf16opt.SGD else {}))
        a.grad = torch.ones_like(a)
        opt.step()
        if read:
            assert opt.state[b].get("step") is None and opt.state_dict()["state"][1] == {}
        if reload:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        for k in range(2):
            a.grad, b.grad = torch.full_like(a, 0.5 + k), torch.full_like(b, -0.25)
            opt.step()
        return a.detach(), b.detach(), opt.state[b]["step"]

    expected = run(read=False, reload=False)
    for got in (run(read=True, reload=True), run(read=False, reload=True)):
        assert all(same_bits(x, y) for x, y in zip(expected, got))


def test_a_torch_state_dict_with_an_empty_state_entry_loads():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    theirs = torch.optim.AdamW([a, b], lr=1e-3)
    a.grad = torch.ones_like(a)
    theirs.step()
    theirs.state[b].get("exp_avg")
    saved = copy.deepcopy(theirs.state_dict())
    assert saved["state"][1] == {}
    ours = bf16opt.AdamW([a, b], lr=1e-3)
    ours.load_state_dict(saved)
    assert b not in ours.state or not ours.state[b]
    assert same_bits(ours.state[a]["exp_avg"], theirs.state[a]["exp_avg"])


def test_an_old_torch_sgd_state_dict_without_momentum_buffers_loads():
    """torch.optim.SGD without momentum saved ``{"momentum_buffer": None}`` before torch 2.2; it
    loads as no buffer, as torch loads it, and the step goes on as torch's."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    q.data.copy_(p.data)
    groups = torch.optim.SGD([p], lr=0.1).state_dict()["param_groups"]
    old = {"state": {0: {"momentum_buffer": None}}, "param_groups": groups}
    theirs, ours = torch.optim.SGD([p], lr=0.1), bf16opt.SGD([q], lr=0.1)
    theirs.load_state_dict(copy.deepcopy(old))
    ours.load_state_dict(copy.deepcopy(old))
    for opt, param in ((theirs, p), (ours, q)):
        param.grad = torch.ones(4)
        opt.step()
    assert torch.equal(p.detach(), q.detach()) and "momentum_buffer" not in ours.state[q]


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_step_counter_of_another_one_element_shape_steps_as_a_scalar_one(backend):
    """A counter of shape (1,) (torch.optim accepts any one-element step) beside 0-dim ones."""
    runs = []
    for shape in [(), (1,)]:
        g = torch.Generator().manual_seed(0)
        a = torch.nn.Parameter(torch.randn(4, generator=g))
        b = torch.nn.Parameter(torch.randn(3, generator=g))
        opt = bf16opt.AdamW([a, b], backend=backend)
        for step in range(3):
            a.grad, b.grad = torch.randn(4, generator=g), torch.randn(3, generator=g)
            opt.step()
            if step == 0:
                opt.state[b]["step"] = opt.state[b]["step"].reshape(shape)
        runs.append((a.detach(), b.detach(), float(opt.state[b]["step"])))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2] == 3.0


@pytest.mark.parametrize("idle", ["no-grad", "skipped-step"])
def test_a_precision_edit_converts_every_params_state_so_a_resume_continues_bit_for_bit(idle):
    """fp32 -> bf16 -> fp32 with a checkpoint after the bf16 step, where that step updated
    not every param (one without a grad) or none (GradScaler skipped it): the step converts
    every param's state, as the load into an optimizer built with bf16 does."""
    def run(resume):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.nn.Parameter(torch.randn(16, generator=g).bfloat16()) for _ in range(2))
        opt = bf16opt.AdamW([a, b], lr=1e-2, precision="fp32", seed=1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for step, precision in enumerate(["fp32", "bf16", "fp32"]):
            opt.param_groups[0]["precision"] = precision
            used = [a] if step == 1 and idle == "no-grad" else [a, b]
            scaler.scale(sum((p.float() * (step + 1)).sin().sum() for p in used)).backward()
            if step == 1 and idle == "skipped-step":
                with torch.no_grad():
                    a.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 1:
                assert "master" not in opt.state[b]  # (converted to bf16: no master copy)
            if resume and step == 1:
                saved = copy.deepcopy(opt.state_dict())
                opt = bf16opt.AdamW([a, b], lr=1e-2, precision="bf16", seed=1)
                opt.load_state_dict(saved)
        return a.detach().clone(), b.detach().clone()

    for ours, theirs in zip(run(False), run(True)):
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_moment_whose_flag_is_off_survives_a_checkpoint(backend):
    """amsgrad switched off keeps max_exp_avg_sq in the state (as torch.optim does) for when it
    is switched on again; a checkpoint taken in between must resume the same way."""
    def grad(seed):
        return torch.randn(7, generator=torch.Generator().manual_seed(seed)) * (10.0 if seed == 0 else 0.01)

    param = torch.nn.Parameter(torch.ones(7))
    opt = bf16opt.Adam([param], lr=0.1, amsgrad=True, precision="bf16-states", backend=backend)
    param.grad = grad(0)
    opt.step()
    opt.param_groups[0]["amsgrad"] = False
    param.grad = grad(1)
    opt.step()
    saved, value = copy.deepcopy(opt.state_dict()), param.detach().clone()
    resumed = torch.nn.Parameter(value)
    again = bf16opt.Adam([resumed], lr=0.1, amsgrad=False, precision="bf16-states", backend=backend)
    again.load_state_dict(saved)
    assert again.state[resumed]["max_exp_avg_sq"].dtype == torch.bfloat16
    for run, p in ((opt, param), (again, resumed)):
        run.param_groups[0]["amsgrad"] = True
        p.grad = grad(2)
        run.step()
    assert torch.equal(param, resumed)


@pytest.mark.parametrize("model_first", [True, False])
def test_a_param_edited_before_a_checkpoint_stays_edited_on_resume(model_first):
    """Under a float32 master copy an edit of the param wins at the next step; a checkpoint
    taken between the edit and that step resumes the same, whichever is loaded first, and a
    precision change between them (to another copy plan) keeps the edit too."""
    def run():
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
        opt = bf16opt.AdamW([param], lr=1e-2, precision="fp32", backend="numba")
        param.grad = torch.randn(64).to(torch.bfloat16)
        opt.step()
        with torch.no_grad():
            param[:32] = 0  # pruned after the step, before the checkpoint
        return param, opt

    live, live_opt = run()
    saved, weights = copy.deepcopy(live_opt.state_dict()), live.detach().clone()
    resumed = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    resumed_opt = bf16opt.AdamW([resumed], lr=1e-2, precision="fp32", backend="numba")
    for load in ([lambda: resumed.data.copy_(weights), lambda: resumed_opt.load_state_dict(saved)]
                 [::1 if model_first else -1]):
        load()
    converted, converted_opt = run()
    converted_opt.param_groups[0]["precision"] = "bf16-states"
    for p in (live, resumed, converted):
        p.grad = torch.full_like(p, 0.5)
    for o in (live_opt, resumed_opt, converted_opt):
        o.step()
    assert torch.equal(live, resumed)
    assert float(converted[:32].abs().max()) < 0.02 and float(live[:32].abs().max()) < 0.02


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("preset", ["fp32-remainder", "fp32-remainder-bf16-states", "bf16"])
def test_a_precision_edit_after_a_param_edit_keeps_the_edit(backend, preset):
    """fp32 (a float32 copy) to another master policy between a param edit and the next step:
    the edited param is the master the conversion starts from, as the step would read it."""
    torch.manual_seed(0)
    param = torch.nn.Parameter((torch.randn(64) * 3).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], lr=1e-3, precision="fp32", backend=backend)
    param.grad = torch.randn(64).to(torch.bfloat16)
    opt.step()
    with torch.no_grad():
        param.fill_(0.5)
    opt.param_groups[0]["precision"] = preset
    param.grad = torch.ones_like(param)
    opt.step()
    assert float((param.float() - 0.5).abs().max()) < 0.01
