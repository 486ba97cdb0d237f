"""State dicts of q8 moments: compact save, conversion to and from other presets and torch.optim,
resume bit-identical (reference backend: the kernels give the same bits, test_q8_kernels.py)."""

from __future__ import annotations

import io

import pytest
import torch

import bf16opt
from bf16opt.storage import Q8, q8_decode, q8_encode, q8_shape

BACKEND = "reference"


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)).to(torch.bfloat16)


def train(net, opt, steps, first=0):
    for step in range(first, first + steps):
        torch.manual_seed(100 + step)
        net(torch.randn(8, 96, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def roundtrip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def bits_of(net):
    return [p.detach().view(torch.int16).clone() for p in net.parameters()]


@pytest.mark.parametrize("preset", ["fp32-remainder-q8", "bf16-sr-q8"])
def test_save_is_compact_codes_and_scales(preset):
    net = model()
    opt = bf16opt.AdamW(net.parameters(), lr=1e-2, precision=preset, backend=BACKEND)
    train(net, opt, 2)
    state = roundtrip(opt.state_dict())["state"]
    weight = state[0]  # 96 * 64 = 6144 elements: q8
    for key in ("exp_avg", "exp_avg_sq"):
        assert weight[key].dtype == Q8 and tuple(weight[key].shape) == q8_shape(96 * 64)
    small = torch.float32 if preset == "fp32-remainder-q8" else torch.bfloat16
    assert state[1]["exp_avg"].dtype == small and state[1]["exp_avg"].shape == (64,)  # a bias: under 4096


@pytest.mark.parametrize("preset", ["fp32-remainder-q8", "bf16-sr-q8"])
def test_resume_is_bit_identical(preset):
    net, again = model(), model()
    opt = bf16opt.AdamW(net.parameters(), lr=1e-2, precision=preset, backend=BACKEND, seed=7)
    train(net, opt, 2)
    saved = roundtrip(opt.state_dict())
    again.load_state_dict(net.state_dict())
    resumed = bf16opt.AdamW(again.parameters(), lr=1e-2, precision=preset, backend=BACKEND, seed=7)
    resumed.load_state_dict(saved)
    train(net, opt, 3, first=2)
    train(again, resumed, 3, first=2)
    assert all(torch.equal(a, b) for a, b in zip(bits_of(net), bits_of(again)))
    for param, twin in zip(net.parameters(), again.parameters()):
        state, other = opt.state[param], resumed.state[twin]
        for key, value in state.items():
            assert torch.equal(value.view(torch.uint8) if value.dtype != torch.float64 else value,
                               other[key].view(torch.uint8) if value.dtype != torch.float64 else other[key]), key


def test_q8_loads_into_fp32_by_decoding_and_back_by_encoding():
    net = model()
    opt = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32-remainder-q8", backend=BACKEND)
    train(net, opt, 2)
    saved = roundtrip(opt.state_dict())
    fp32 = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32-remainder", backend=BACKEND)
    fp32.load_state_dict(saved)
    weight = list(net.parameters())[0]
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        decoded = q8_decode(saved["state"][0][key], weight.shape, signed)
        assert torch.equal(fp32.state[weight][key], decoded)
    back = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32-remainder-q8", backend=BACKEND)
    back.load_state_dict(roundtrip(fp32.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):  # decode then encode gives the codes back
        assert torch.equal(back.state[weight][key], saved["state"][0][key])


def test_a_torch_adamw_state_dict_goes_into_q8_and_back():
    net = model().float()
    reference = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_float = [(torch.randn(8, 96), None) for _ in range(2)]
    for inputs, _ in train_float:
        net(inputs).pow(2).mean().backward()
        reference.step()
        reference.zero_grad()
    q8 = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32-remainder-q8", backend=BACKEND)
    q8.load_state_dict(roundtrip(reference.state_dict()))
    weight = list(net.parameters())[0]
    expected = q8_encode(reference.state[weight]["exp_avg"].reshape(-1), True)
    assert torch.equal(q8.state[weight]["exp_avg"], expected)
    # back: through an fp32 preset (which decodes), then into torch.optim.AdamW, which steps
    fp32 = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32", backend=BACKEND)
    fp32.load_state_dict(roundtrip(q8.state_dict()))
    restored = torch.optim.AdamW(net.parameters(), lr=1e-2)
    restored.load_state_dict(roundtrip(fp32.state_dict()))
    assert torch.equal(restored.state[weight]["exp_avg"], q8_decode(expected, weight.shape, True))
    net(torch.randn(8, 96)).pow(2).mean().backward()
    restored.step()


def test_a_wrong_q8_tensor_is_refused_before_anything_changes():
    net = model()
    opt = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="fp32-remainder-q8", backend=BACKEND)
    train(net, opt, 1)
    saved = roundtrip(opt.state_dict())
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"][:-1]  # one block short
    before = {k: v.clone() for k, v in opt.state[list(net.parameters())[0]].items()}
    with pytest.raises(ValueError, match="exp_avg of param 0"):
        opt.load_state_dict(saved)
    after = opt.state[list(net.parameters())[0]]
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("saved_numel, numel, refused", [(4200, 4100, True), (4352, 4300, True),
                                                         (4100, 4100, False)])
def test_a_q8_moment_of_a_longer_param_with_as_many_blocks_is_refused(saved_numel, numel, refused):
    """The codes past a param's last element are never written: a q8 moment saved for a param
    of more elements in as many blocks (a padded vocabulary's bias) has codes there."""
    def stepped(n):
        torch.manual_seed(n)
        p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
        opt = bf16opt.AdamW([p], lr=1e-3, precision="bf16-sr-q8", backend=BACKEND)
        p.grad = torch.randn(n).to(torch.bfloat16)
        opt.step()
        return p, opt

    saved = roundtrip(stepped(saved_numel)[1].state_dict())
    p, opt = stepped(numel)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    if refused:
        with pytest.raises(ValueError, match=f"exp_avg of param 0 holds codes past the param's {numel}"):
            opt.load_state_dict(saved)
        assert all(torch.equal(before[k], opt.state[p][k]) for k in before)
    else:
        opt.load_state_dict(saved)
        assert torch.equal(opt.state[p]["exp_avg"], saved["state"][0]["exp_avg"])
