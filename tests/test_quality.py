"""Low-precision quality features: stochastic rounding, Kahan, exact fp32 master, telemetry."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bf16opt
from bf16opt.storage import (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, STREAMS, WEIGHTS, buffer_bits, encode,
                             encode_stochastic, join_remainder, random_bits, split_remainder, stream_key,
                             stream_of)
from oracles import bits
from snapshots import same_bits

SIXTEEN_BIT = [torch.bfloat16, torch.float16]
BUFFERS = [WEIGHTS, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ]


# ------------------------------------------------------------------ stochastic rounding
def neighbours(value: float, dtype: torch.dtype) -> tuple:
    """The two values of ``dtype`` around ``value`` (lower, upper), from the bit patterns."""
    nearest = torch.tensor([value], dtype=torch.float32).to(dtype)
    step = torch.tensor([1], dtype=torch.int16)
    below = (nearest.view(torch.int16) - step).view(dtype) if value > 0 else (nearest.view(torch.int16) + step).view(dtype)
    above = (nearest.view(torch.int16) + step).view(dtype) if value > 0 else (nearest.view(torch.int16) - step).view(dtype)
    pair = (below, nearest) if nearest.item() > value else (nearest, above)
    return tuple(float(t.item()) for t in pair)


def buffer_random(seed: int, step: int, tensor: int, buffer: int, shape, offset: int = 0) -> torch.Tensor:
    """The random words ``buffer`` of a tensor rounds with (storage.py's contract)."""
    stream = random_bits(stream_key(seed, step, tensor, stream_of(buffer)), shape, offset=offset)
    return buffer_bits(stream, buffer)


@pytest.mark.parametrize("buffer", BUFFERS)
@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("value", [1.0 + 2.0 ** -10, -3.14159, 1e-3, 7e-6, 3e-7, 1e-30, 60000.0])
def test_stochastic_rounding_is_unbiased(dtype, value, buffer):
    """Each buffer's half of its stream's bits rounds up with probability equal to the dropped
    fraction: exactly for bfloat16 and float16 normals (the fraction has at most 16 bits), to
    within 2**-16 on float16's subnormal grid (7e-6, 3e-7, 1e-30: 16 random bits against a
    longer fraction, the probability ``ceil(fraction * 2**16) / 2**16``)."""
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    exact = x[0].item()
    rounded = encode_stochastic(x, dtype, buffer_random(7, 1, 0, buffer, x.shape)).double()
    lower, upper = neighbours(exact, dtype)
    assert set(rounded.unique().tolist()) <= {lower, upper}  # only the two neighbours
    p = (exact - lower) / (upper - lower)
    if dtype == torch.float16 and abs(exact) < 2.0 ** -14:
        p_up = math.ceil(p * 2 ** 16) / 2 ** 16
        assert abs(p_up - p) <= 2.0 ** -16
    else:
        p_up = p
    sigma = (upper - lower) * np.sqrt(p_up * (1 - p_up) / n)
    assert abs(rounded.mean().item() - (lower + p_up * (upper - lower))) <= 4 * sigma


@given(seed=st.integers(0, 2 ** 63), step=st.integers(1, 10 ** 6), index=st.integers(0, 10 ** 4),
       dtype=st.sampled_from(SIXTEEN_BIT))
def test_stochastic_rounding_keeps_representable_values(seed, step, index, dtype):
    generator = torch.Generator().manual_seed(seed % 2 ** 32)
    exact = (torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-6, 4, (4096,), generator=generator))
    exact = torch.cat([exact.to(dtype).float(), torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    random = buffer_random(seed, step, index, EXP_AVG, exact.shape)
    np.testing.assert_array_equal(bits(encode_stochastic(exact, dtype, random)), bits(encode(exact, dtype)))


def test_random_streams_differ_by_seed_step_tensor_and_stream():
    keys = {stream_key(s, t, i, k) for s in (0, 1) for t in (1, 2) for i in (0, 1) for k in range(STREAMS)}
    assert len(keys) == 16
    r = random_bits(stream_key(0, 1, 0, 0), (100_000,)).double()
    assert abs(r.mean().item() / 2 ** 32 - 0.5) < 0.005  # roughly uniform


def test_buffers_take_the_halves_of_their_streams():
    """WEIGHTS and EXP_AVG share stream 0, EXP_AVG_SQ and MAX_EXP_AVG_SQ stream 1: the even
    buffer the upper 16 bits, the odd one the lower, each as the upper half of its word."""
    assert [stream_of(b) for b in BUFFERS] == [0, 0, 1, 1]
    r = random_bits(stream_key(3, 4, 5, 0), (4096,))
    upper, lower = buffer_bits(r, WEIGHTS), buffer_bits(r, EXP_AVG)
    assert torch.equal(upper >> 16, r >> 16) and torch.equal(lower >> 16, r & 0xFFFF)
    assert not bool(((upper | lower) & 0xFFFF).any()) and int(max(upper.max(), lower.max())) < 2 ** 32


def _chi_square_uniform(first: torch.Tensor, second: torch.Tensor, bins: int = 16) -> float:
    """Pearson's chi-square of the joint histogram of two uint32 word tensors' top 4 bits
    against independent uniform draws (bins**2 - 1 = 255 degrees of freedom)."""
    cell = (first >> 28) * bins + (second >> 28)
    counts = torch.bincount(cell.flatten(), minlength=bins * bins).double()
    expected = first.numel() / bins ** 2
    return float(((counts - expected) ** 2 / expected).sum())


# 255 degrees of freedom: mean 255, standard deviation 22.6; the bound is mean + 6 sd
CHI_SQUARE_BOUND = 255 + 6 * 22.6


@pytest.mark.parametrize("pair", [(WEIGHTS, EXP_AVG), (EXP_AVG_SQ, MAX_EXP_AVG_SQ), (WEIGHTS, EXP_AVG_SQ),
                                  (EXP_AVG, MAX_EXP_AVG_SQ)])
def test_buffers_of_one_element_draw_independent_bits(pair):
    """The two halves of one hash (and the buffers of different streams) are independent:
    the joint histogram of the two buffers' words is uniform, and so is the joint frequency of
    their rounding decisions at two different probabilities."""
    n = 1 << 20
    first, second = (buffer_random(11, 3, 42, buffer, (n,)) for buffer in pair)
    assert _chi_square_uniform(first, second) < CHI_SQUARE_BOUND
    up_first = (first >> 16).double() < 0.3 * 2 ** 16  # rounds up with probability 0.3
    up_second = (second >> 16).double() < 0.6 * 2 ** 16
    both = (up_first & up_second).double().mean().item()
    p = 0.3 * 0.6
    assert abs(both - p) <= 5 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("buffer", BUFFERS)
def test_a_buffers_bits_are_independent_across_steps_tensors_and_elements(buffer):
    """One buffer's words at consecutive steps, of two tensors, and of neighbouring elements
    (the counter's i and i + 1) show no joint structure."""
    n = 1 << 20
    now = buffer_random(11, 3, 42, buffer, (n + 1,))
    for other in (buffer_random(11, 4, 42, buffer, (n,)), buffer_random(11, 3, 43, buffer, (n,)), now[1:]):
        assert _chi_square_uniform(now[:n], other) < CHI_SQUARE_BOUND


# ------------------------------------------------------------------ Kahan compensation
def test_kahan_accumulates_updates_far_below_a_bf16_ulp():
    """lr = 1e-5 is ~1/800 of a bf16 ulp at 1.0: plain bf16 loses every step, Kahan tracks fp32."""
    start = torch.linspace(1.0, 1.9, 257).to(torch.bfloat16).float()
    steps, lr = 300, 1e-5
    final = {}
    for preset in ("fp32", "bf16", "bf16-kahan"):
        param = start.clone().to(torch.float32 if preset == "fp32" else torch.bfloat16)
        opt = bf16opt.Lion([param], lr=lr, precision=preset, backend="reference")
        for _ in range(steps):
            param.grad = torch.ones_like(param)
            opt.step()
        final[preset] = param.detach().float()
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    moved = final["fp32"] - start.to(torch.bfloat16).float()
    # fp32 itself rounds each step by up to half its ulp (2^-24 in [1, 2))
    assert torch.all((moved + steps * lr).abs() <= steps * 2.0 ** -24)
    assert torch.equal(final["bf16"], start.to(torch.bfloat16).float())  # all swallowed
    assert torch.all((final["bf16-kahan"] - final["fp32"]).abs() <= ulp / 2)


# ------------------------------------------------------------------ exact fp32 master
@pytest.mark.parametrize("opt_name", ["AdamW", "Lion"])
@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_remainder_reconstructs_the_fp32_master_bit_for_bit(opt_name, states):
    torch.manual_seed(0)
    shape = (64, 33)
    start = torch.randn(shape).to(torch.bfloat16)
    a, b = start.clone(), start.clone()
    kwargs = dict(lr=3e-3, backend="reference")
    opt_a = getattr(bf16opt, opt_name)([a], precision="fp32" if states == "fp32" else "bf16-states", **kwargs)
    opt_b = getattr(bf16opt, opt_name)([b], precision="fp32-remainder" if states == "fp32"
                                       else "fp32-remainder-bf16-states", **kwargs)
    ties_seen = 0
    for _ in range(25):
        grad = torch.randn(shape).to(torch.bfloat16)
        a.grad, b.grad = grad, grad.clone()
        opt_a.step()
        opt_b.step()
        master = opt_a.state[a]["master"]
        assert same_bits(join_remainder(b, opt_b.state[b]["remainder"]), master)
        for key in opt_a.state[a]:
            if key not in ("master", "step"):
                assert same_bits(opt_a.state[a][key], opt_b.state[b][key]), key
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        ties_seen += int(tie.sum())
        assert torch.equal(a.view(torch.int16)[~tie], b.view(torch.int16)[~tie])
        # on ties the remainder param rounds away from zero
        assert torch.all(b.float()[tie].abs() > master[tie].abs())
    assert opt_b.state[b].keys() == {"step", "exp_avg", "remainder"} | ({"exp_avg_sq"} if opt_name == "AdamW" else set())


# exact ties (low 16 bits 0x8000): smallest subnormals, around 1.0 and next to overflow, upper
# half even and odd; each also with the sign bit set
EDGE_TIES = [0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x7F7E8000, 0x7F7F8000]


def float32_from_bits(words) -> torch.Tensor:
    signed = [w - 2 ** 32 if w >= 2 ** 31 else w for w in words]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


@given(words=st.lists(st.integers(0, 2 ** 32 - 1), max_size=64),
       tie_uppers=st.lists(st.integers(0, 0xFFFF), max_size=32))
def test_split_remainder_is_nearest_even_except_on_exact_ties(words, tie_uppers):
    """For any float32 bits: the param is storage.encode's RNE bfloat16 except on exact ties, where
    it is rounded away from zero (so it differs exactly on ties with an even upper half), and
    join_remainder gives the bits back (NaN canonical)."""
    words = words + [(upper << 16) | 0x8000 for upper in tie_uppers]
    words += EDGE_TIES + [w | 0x80000000 for w in EDGE_TIES]
    x = float32_from_bits(words)
    word = np.array(words, dtype=np.int64)
    nan = torch.isnan(x).numpy()
    tie = ((word & 0xFFFF) == 0x8000) & ~nan
    param, remainder = split_remainder(x)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    got = bits(param).astype(np.int64)
    nearest_even = bits(encode(x, torch.bfloat16)).astype(np.int64)
    np.testing.assert_array_equal(got[~tie], nearest_even[~tie])
    np.testing.assert_array_equal(got[tie], ((word[tie] >> 16) + 1) & 0xFFFF)  # magnitude up
    assert torch.all(param.float()[torch.from_numpy(tie)].abs() > x[torch.from_numpy(tie)].abs())
    np.testing.assert_array_equal(got != nearest_even, tie & ((word >> 16) % 2 == 0))
    np.testing.assert_array_equal(bits(join_remainder(param, remainder)).astype(np.int64),
                                  np.where(nan, 0x7FC00000, word))


def test_join_is_nan_only_where_the_param_is_nan():
    """Every bfloat16 param beside remainders no split of its master gives (a param edited
    between steps: zeroed beside a negative remainder, made inf beside a positive one): the
    master is NaN only where the param is, and where the join would be a stray NaN it is the
    param itself; elsewhere the join is the formula's."""
    params = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    rng = np.random.default_rng(11)
    for r in [-32768, -1, 0, 1, 32767, *rng.integers(-32768, 32768, 16).tolist()]:
        remainder = torch.full_like(params, r)
        master = join_remainder(params.view(torch.bfloat16), remainder)
        param_values = params.view(torch.bfloat16).float()
        assert torch.equal(torch.isnan(master), torch.isnan(param_values))
        low = params.to(torch.int64) & 0xFFFF
        formula = ((((low - int(r < 0)) & 0xFFFF) << 16) | (r & 0xFFFF))
        formula_nan = ((formula & 0x7FFFFFFF) > 0x7F800000) & ~torch.isnan(param_values)
        stray = formula_nan.numpy()
        got = bits(master).astype(np.int64)
        np.testing.assert_array_equal(got[stray], bits(param_values)[stray].astype(np.int64))
        np.testing.assert_array_equal(got[~stray & ~torch.isnan(param_values).numpy()],
                                      formula.numpy()[~stray & ~torch.isnan(param_values).numpy()])


def check_remainder_against_fp32(a, opt_a, b, opt_b) -> tuple:
    """Asserts b's ("fp32-remainder") master and moments equal a's ("fp32") bit for bit and the
    params differ exactly at ties with an even upper half; returns (ties, differing params)."""
    master = opt_a.state[a]["master"]
    assert same_bits(join_remainder(b, opt_b.state[b]["remainder"]), master)
    for key in ("exp_avg", "exp_avg_sq"):
        assert same_bits(opt_a.state[a][key], opt_b.state[b][key]), key
    word = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    tie = ((word & 0xFFFF) == 0x8000) & ~torch.isnan(master)
    differ = a.view(torch.int16) != b.view(torch.int16)
    assert torch.equal(differ, tie & ((word >> 16) % 2 == 0))
    assert torch.equal(b.view(torch.int16)[tie].to(torch.int64) & 0xFFFF, ((word[tie] >> 16) + 1) & 0xFFFF)
    return int(tie.sum()), int(differ.sum())


@given(seed=st.integers(0, 2 ** 31 - 1), exponent=st.integers(-120, 127), n=st.integers(2, 40),
       steps=st.integers(1, 4), lr=st.sampled_from([1e-4, 1e-3, 3e-2]),
       betas=st.sampled_from([(0.9, 0.999), (0.5, 0.75), (0.0, 0.99)]),
       weight_decay=st.sampled_from([0.0, 1e-2, 0.3]))
def test_fp32_remainder_param_differs_from_fp32_only_on_exact_ties(seed, exponent, n, steps, lr, betas,
                                                                  weight_decay):
    """AdamW on bf16 params with identical grads, "fp32-remainder" vs "fp32": same master bits, and
    params that differ only on exact ties.  Step 1 forces ties: params (1 + k/128) * 2^e, betas
    (0.5, 0.75), tiny eps and lr = 2^(e-8) (half a bf16 ulp) make the update exactly -lr*sign(g)."""
    generator = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 128, (n,), generator=generator)
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    k[0] = 2  # even, and moved away from zero below: RNE rounds it back, the remainder split up
    start = (sign * (1 + k / 128) * 2.0 ** exponent).to(torch.bfloat16)
    assert torch.equal(start.float(), sign * (1 + k / 128) * 2.0 ** exponent)
    a, b = start.clone(), start.clone()
    kwargs = dict(lr=2.0 ** (exponent - 8), betas=(0.5, 0.75), eps=1e-30, weight_decay=0.0,
                  backend="reference")
    opt_a = bf16opt.AdamW([a], precision="fp32", **kwargs)
    opt_b = bf16opt.AdamW([b], precision="fp32-remainder", **kwargs)
    for step in range(1 + steps):
        grad = torch.randn(n, generator=generator)
        grad[grad.abs() < 1e-3] = 1.0
        if step == 0:
            grad[0] = -sign[0] * grad[0].abs()
        a.grad, b.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16)
        opt_a.step()
        opt_b.step()
        ties, differ = check_remainder_against_fp32(a, opt_a, b, opt_b)
        if step == 0:
            assert ties == n and differ >= 1  # every element moved by half an ulp: all ties
            for opt in (opt_a, opt_b):  # then ordinary steps
                opt.param_groups[0].update(lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)


def test_remainder_memory_is_two_bytes_per_param():
    param = torch.randn(1000).to(torch.bfloat16)
    opt = bf16opt.AdamW([param], precision="fp32-remainder")
    param.grad = torch.randn_like(param)
    opt.step()
    report = bf16opt.memory_report(opt)
    assert report.bytes_per_param["remainder"] == 2 and report.bytes_per_param["master"] == 0


# ------------------------------------------------------------------ checkpoint resume
@pytest.mark.parametrize("preset", ["bf16-sr", "bf16-kahan", "fp32-remainder"])
def test_resume_from_checkpoint_is_bit_identical(preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(torch.bfloat16)
    batches = [torch.randn(8, 12).to(torch.bfloat16) for _ in range(6)]

    def train(model, opt, batches):
        for x in batches:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()

    straight = copy.deepcopy(model)
    opt = bf16opt.AdamW(straight.parameters(), lr=1e-2, precision=preset, seed=1234)
    train(straight, opt, batches)

    first = copy.deepcopy(model)
    opt1 = bf16opt.AdamW(first.parameters(), lr=1e-2, precision=preset, seed=1234)
    train(first, opt1, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = bf16opt.AdamW(resumed.parameters(), lr=1e-2, precision=preset, seed=999)  # seed comes from the checkpoint
    opt2.load_state_dict(checkpoint["opt"])
    train(resumed, opt2, batches[3:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert same_bits(p.detach(), q.detach())


def test_stochastic_rounding_depends_on_the_seed():
    results = []
    for seed in (1, 2):
        param = torch.ones(1000).to(torch.bfloat16)
        opt = bf16opt.Lion([param], lr=1e-3, precision="bf16-sr", seed=seed)
        param.grad = torch.ones_like(param)
        opt.step()
        results.append(param.clone())
    assert not torch.equal(results[0], results[1])
    assert 0 < (results[0] != 1).float().mean() < 1  # some moved by an ulp, some stayed


# ------------------------------------------------------------------ telemetry
def bf16_round_f64(x: np.ndarray) -> np.ndarray:
    """Round float64 values to bfloat16 (nearest, ties to even) exactly, via float64 arithmetic."""
    out = np.empty_like(x)
    for i, v in enumerate(x):
        if v == 0:
            out[i] = v
            continue
        e = np.floor(np.log2(abs(v)))
        ulp = 2.0 ** (max(e, -126) - 7)
        q = v / ulp
        r = np.round(q)  # numpy rounds halves to even
        out[i] = r * ulp
    return out


def test_swallowed_update_count_equals_a_float64_count():
    generator = torch.Generator().manual_seed(3)
    w0 = (torch.rand(4000, generator=generator) * 3 + 0.25).to(torch.bfloat16)
    param = w0.clone()
    lr = 3e-3
    opt = bf16opt.Lion([param], lr=lr, precision="bf16", track_precision=True)
    param.grad = torch.randn(4000, generator=generator).to(torch.bfloat16)
    opt.step()
    stats = opt.precision_stats()
    w = w0.double().numpy()
    moved = w - lr * np.sign(param.grad.double().numpy())
    expected = np.mean(bf16_round_f64(moved) == w)
    assert 0.1 < expected < 0.9  # the case exercises both outcomes
    assert stats[0]["swallowed"] == pytest.approx(expected, abs=0.5 / 4000)
    assert stats["total"]["swallowed"] == stats[0]["swallowed"]


def test_underflow_count_equals_a_float64_count():
    # squares and their 1e-3 multiples stay normal or subnormal float32 (non-zero), some below bf16's range
    grads = torch.tensor([1e-20, 3e-21, 3e-19, 1.0, 1e-3, 0.0] * 50)
    param = torch.zeros(grads.numel()).to(torch.bfloat16)
    opt = bf16opt.Adam([param], betas=(0.9, 0.999), precision="bf16", track_precision=True)
    param.grad = grads.to(torch.bfloat16)
    opt.step()
    g = param.grad.double().numpy()
    smallest_half = 2.0 ** -134  # half of bf16's smallest subnormal
    v = 0.001 * g * g
    m = 0.1 * g
    stats = opt.precision_stats()[0]
    assert stats["exp_avg_sq_underflow"] == pytest.approx(np.mean((v != 0) & (np.abs(v) <= smallest_half)))
    assert stats["exp_avg_underflow"] == pytest.approx(np.mean((m != 0) & (np.abs(m) <= smallest_half)))
    assert stats["exp_avg_sq_underflow"] > 0


def test_precision_stats_requires_tracking():
    param = torch.randn(3)
    opt = bf16opt.AdamW([param])
    with pytest.raises(RuntimeError, match="track_precision"):
        opt.precision_stats()


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_precision_stats_count_offloaded_and_complex_params(offload):
    """The kernels update a host mirror (offload) or a real view (complex): the counts are
    kept under the user's param all the same. lr 1e-9 on weights of 1.0 is under half an fp32
    ulp, so every non-zero update is swallowed (the complex param's imaginary parts get none)."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))
    r = torch.nn.Parameter(torch.ones(8))
    opt = bf16opt.AdamW([w, r], lr=1e-9, weight_decay=0.0, precision="fp32", track_precision=True,
                        offload=offload)
    w.grad, r.grad = torch.ones_like(w), torch.ones_like(r)
    opt.step()
    stats = opt.precision_stats()
    assert stats[0]["swallowed"] == 0.5 and stats[1]["swallowed"] == 1.0
    assert stats["total"]["swallowed"] == 12 / 16  # (of the real elements: 8 each)


@pytest.mark.parametrize("mode", ["numba", "reference", "offload", "update_in_backward"])
def test_precision_stats_hold_only_the_last_steps_params(mode):
    """A param without a grad at the last step drops out of the stats and of their total,
    rather than bringing an older step's counts back."""
    a = torch.nn.Parameter(torch.ones(8))
    b = torch.nn.Parameter(torch.ones(8))
    options = {"offload": {"offload": "cpu"}, "update_in_backward": {"update_in_backward": True}}
    opt = bf16opt.AdamW([a, b], lr=1e-9, weight_decay=0.0, precision="fp32", track_precision=True,
                        backend="reference" if mode == "reference" else "numba", **options.get(mode, {}))
    for both in [True, False]:
        opt.zero_grad()
        opt.param_groups[0]["lr"] = 1e-9 if both else 1.0  # swallowed, then not
        ((a * a).sum() + (b * b).sum() if both else (a * a).sum()).backward()
        opt.step()
    stats = opt.precision_stats()
    assert sorted(stats, key=str) == [0, "total"]
    assert stats[0]["swallowed"] == 0.0 and stats["total"]["swallowed"] == 0.0


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_swallowed_counts_an_edited_param_from_its_edit(backend):
    """Under a float32 master copy, an element edited since the last step updates from the
    edit; telemetry counts its update against that value (as the exact remainder master does),
    not against the stale copy."""
    counts = {}
    for preset in ("fp32", "fp32-remainder"):
        for edit in (1.0, 2.0 ** 30):
            param = torch.nn.Parameter(torch.full((16,), 1.01).to(torch.bfloat16))
            opt = bf16opt.Lion([param], lr=1e-2, weight_decay=0.0, precision=preset, track_precision=True,
                               backend=backend)
            param.grad = torch.ones_like(param)
            opt.step()
            with torch.no_grad():
                param.fill_(edit)
            param.grad = -torch.ones_like(param)
            opt.step()
            counts[preset, edit] = opt.precision_stats()[0]["swallowed"]
    assert counts["fp32", 1.0] == counts["fp32-remainder", 1.0] == 0.0
    assert counts["fp32", 2.0 ** 30] == counts["fp32-remainder", 2.0 ** 30] == 1.0
