"""The q8 moment format (bf16opt/storage.py, "q8"): maps, encode/decode and their error bound."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bf16opt
from bf16opt import Precision
from bf16opt.precision import PRESETS, plan_for
from bf16opt.storage import (Q8, Q8_BLOCK, q8_boundaries, q8_decode, q8_encode, q8_map, q8_nan_code,
                             q8_nearest_index, q8_scale_values, q8_shape)

KINDS = ("dynamic", "companded")


def blocks_of(draw_values: list, scale_exponent: int) -> torch.Tensor:
    return torch.tensor(draw_values, dtype=torch.float32) * 2.0 ** scale_exponent


finite_values = st.lists(st.floats(-1.0, 1.0, width=32, allow_subnormal=True), min_size=1, max_size=700)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_maps_are_ascending_with_exact_ends(signed, kind):
    values = np.array(q8_map(signed, kind), dtype=np.float64)
    assert len(values) == 255 and np.all(np.diff(values) > 0)
    assert values[-1] == 1.0 and (values[0] == -1.0 if signed else values[0] == 0.0)
    if signed:
        np.testing.assert_array_equal(values, -values[::-1])  # symmetric around an exact 0
        assert values[127] == 0.0
    bounds = np.array(q8_boundaries(signed, kind))
    assert np.all(values[:-1] <= bounds[:-1]) and np.all(bounds[:-1] <= values[1:]) and bounds[-1] == math.inf


def _neighbour_gap(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    below = table[index] - table[np.maximum(index - 1, 0)]
    above = table[np.minimum(index + 1, len(table) - 1)] - table[index]
    return np.maximum(below, above)


@given(finite_values, st.integers(-140, 120), st.booleans())
def test_round_trip_error_within_half_a_map_step_of_the_block_scale(values, exponent, signed):
    """Per element: |decode(encode(x)) - x| <= scale * (the larger map step beside its code) / 2,
    plus float32 rounding of the division, the boundary and the product (a few 2**-24 of scale)."""
    x = blocks_of(values, exponent)
    if not signed:
        x = x.abs()
    q = q8_encode(x, signed)
    decoded = q8_decode(q, x.shape, signed).double()
    scales = q8_scale_values(q).double()
    assert q.shape == q8_shape(x.numel()) and q.dtype == Q8
    scale = scales.repeat_interleave(Q8_BLOCK)[:x.numel()]
    table = np.array(q8_map(signed, "dynamic"))
    y = (x.double() / torch.where(scale > 0, scale, torch.ones_like(scale))).numpy()
    index = np.searchsorted(table, np.clip(y, table[0], 1.0))
    gap = torch.from_numpy(_neighbour_gap(table, np.clip(index, 0, 254)))
    bound = scale * (gap / 2 + 2.0 ** -21) + 2.0 ** -149
    assert torch.all((decoded - x.double()).abs() <= bound)


@given(finite_values, st.integers(-140, 120), st.booleans())
def test_the_largest_magnitude_of_a_block_is_exact(values, exponent, signed):
    x = blocks_of(values, exponent)
    x = x if signed else x.abs()
    decoded = q8_decode(q8_encode(x, signed), x.shape, signed)
    padded = torch.zeros(q8_shape(x.numel())[0] * Q8_BLOCK)
    padded[:x.numel()] = x
    for block, values_of_block in enumerate(padded.view(-1, Q8_BLOCK)):
        at = int(values_of_block.abs().argmax()) + block * Q8_BLOCK
        if at < x.numel():
            assert decoded[at] == x[at]


@given(finite_values, st.lists(st.integers(0, 699), min_size=1, max_size=5),
       st.sampled_from([math.nan, math.inf, -math.inf]), st.booleans())
def test_a_non_finite_element_gets_its_code_and_leaves_its_block_alone(values, where, special, signed):
    """A non-finite element gets the non-finite code (decoding to NaN signed, +inf unsigned);
    the other elements keep their codes and values, and the scale is the block's without it,
    but where that is 0: then the least float32, so that inf decodes as inf, not inf * 0."""
    x = torch.tensor(values, dtype=torch.float32)
    x = x if signed else x.abs()
    at = sorted({w % x.numel() for w in where})
    poisoned = x.clone()
    poisoned[at] = special
    clean = x.clone()
    clean[at] = 0.0
    q, expected = q8_encode(poisoned, signed), q8_encode(clean, signed)
    codes = expected[:, :Q8_BLOCK].reshape(-1).clone()
    codes[at] = q8_nan_code(signed)
    assert torch.equal(q[:, :Q8_BLOCK].reshape(-1), codes)
    blocks_hit = torch.zeros(len(q), dtype=torch.bool)
    blocks_hit[[a // Q8_BLOCK for a in at]] = True
    clean_scales = q8_scale_values(expected)
    scales = torch.where(blocks_hit & (clean_scales == 0), torch.tensor(2.0 ** -149), clean_scales)
    assert torch.equal(q8_scale_values(q), scales)
    decoded = q8_decode(q, x.shape, signed)
    if signed:
        assert torch.isnan(decoded[at]).all()
    else:
        assert (decoded[at] == math.inf).all()
    others = torch.ones(x.numel(), dtype=torch.bool)
    others[at] = False
    assert torch.equal(decoded[others], q8_decode(expected, x.shape, signed)[others])


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("zeros_beside", [False, True], ids=["in-a-block-of-values", "in-a-block-of-zeros"])
def test_a_second_moment_that_overflows_stops_the_update_as_float32_moments_do(backend, zeros_beside):
    """A finite grad whose (1 - beta2) * g * g overflows float32: exp_avg_sq is +inf, in q8 as in float32,
    so the element's update m / (sqrt(inf) + eps) is 0 and its weight stays finite."""
    results = {}
    for preset in ("fp32-remainder", "fp32-remainder-q8"):
        precision = dataclasses.replace(PRESETS[preset], q8_min_numel=1)
        p = torch.nn.Parameter(torch.ones(300))
        opt = bf16opt.AdamW([p], lr=1e-3, precision=precision, backend=backend)
        for step in range(3):
            g = torch.zeros(300) if zeros_beside else torch.full((300,), 1e-3)
            if step == 0:
                g[5] = 1e30
            p.grad = g
            opt.step()
        results[preset] = (p.detach().clone(), opt.state[p]["exp_avg_sq"])
    weights, v = results["fp32-remainder-q8"]
    assert torch.isfinite(weights).all() and weights[5] == results["fp32-remainder"][0][5]
    assert q8_decode(v, (300,), False)[5] == math.inf


@pytest.mark.parametrize("signed", [True, False])
def test_zero_bytes_decode_to_positive_zero_and_padding_stays_zero(signed):
    zeros = torch.zeros(q8_shape(300), dtype=torch.uint8)
    decoded = q8_decode(zeros, (300,), signed)
    assert torch.equal(decoded.view(torch.int32), torch.zeros(300, dtype=torch.int32))
    q = q8_encode(torch.rand(300) * (1 if not signed else torch.randn(300).sign()), signed)
    assert torch.all(q[1, 300 - Q8_BLOCK:Q8_BLOCK] == 0)
    assert torch.equal(q8_encode(torch.zeros(300), signed), zeros)
    assert torch.equal(q8_encode(-torch.zeros(300), True), zeros)  # -0 is the zero code too


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_index_is_the_nearest_map_value(signed):
    y = torch.rand(20_000, dtype=torch.float32) * (2 if signed else 1) - (1 if signed else 0)
    table = torch.tensor(q8_map(signed, "dynamic"), dtype=torch.float64)
    index = q8_nearest_index(y, signed)
    distance = (table[index] - y.double()).abs()
    best = (table[None, :] - y.double()[:, None]).abs().min(dim=1).values
    assert torch.all(distance <= best + 2.0 ** -24)


@given(finite_values, st.integers(-30, 30), st.booleans(), st.integers(0, 2 ** 32 - 1))
def test_stochastic_rounding_picks_a_neighbour(values, exponent, signed, seed):
    x = blocks_of(values, exponent)
    x = x if signed else x.abs()
    random = torch.from_numpy(np.random.default_rng(seed).integers(0, 2 ** 32, x.numel(), dtype=np.int64))
    q = q8_encode(x, signed, random=random & 0xFFFF0000)
    table = torch.tensor(q8_map(signed, "dynamic"), dtype=torch.float64)
    decoded = q8_decode(q, x.shape, signed).double()
    scale = q8_scale_values(q).double().repeat_interleave(Q8_BLOCK)[:x.numel()]
    y = x.double() / torch.where(scale > 0, scale, torch.ones_like(scale))
    lo = torch.clamp(torch.searchsorted(table, y, right=True) - 1, 0, 254)
    hi = torch.clamp(lo + 1, max=254)
    slack = scale * 2.0 ** -22 + 2.0 ** -149
    assert torch.all((decoded >= table[lo] * scale - slack) & (decoded <= table[hi] * scale + slack))


def test_stochastic_rounding_is_unbiased():
    signed = True
    x = torch.full((Q8_BLOCK,), 0.3, dtype=torch.float32)
    x[0] = 1.0  # the scale
    rng = np.random.default_rng(1)
    total = torch.zeros(Q8_BLOCK, dtype=torch.float64)
    draws = 2000
    for _ in range(draws):
        random = torch.from_numpy(rng.integers(0, 2 ** 32, Q8_BLOCK, dtype=np.int64)) & 0xFFFF0000
        total += q8_decode(q8_encode(x, signed, random=random), x.shape, signed).double()
    mean = (total / draws)[1:]
    table = torch.tensor(q8_map(signed, "dynamic"), dtype=torch.float64)
    step = table[torch.searchsorted(table, torch.tensor(0.3, dtype=torch.float64))] - \
        table[torch.searchsorted(table, torch.tensor(0.3, dtype=torch.float64)) - 1]
    # the mean of 255 * 2000 draws of a two-point distribution: well within 5 standard errors
    assert abs(float(mean.mean()) - 0.3) < 5 * float(step) / math.sqrt(255 * draws)


def test_small_params_keep_the_presets_element_moments():
    precision = PRESETS["fp32-remainder-q8"]
    assert plan_for(precision, torch.bfloat16, 4096).exp_avg == Q8
    small = plan_for(precision, torch.bfloat16, 4095)
    assert small.exp_avg == small.exp_avg_sq == torch.float32 and small.weights == "remainder"
    assert plan_for(PRESETS["bf16-sr-q8"], torch.bfloat16, 10).exp_avg == torch.bfloat16
    assert plan_for(PRESETS["bf16-sr-q8"], torch.bfloat16, 1 << 20).rounding == "stochastic"
    assert plan_for(Precision(exp_avg="q8", q8_min_numel=0), torch.float32, 1).exp_avg == Q8
    assert plan_for(Precision(exp_avg="q8", q8_rounding="stochastic"), torch.float32, 1 << 13).q8_rounding == \
        "stochastic"


@pytest.mark.parametrize("bad, message", [
    (dict(master="q8"), "master"), (dict(small_moments="q8"), "small_moments"),
    (dict(small_moments="fp16"), "small_moments"), (dict(q8_min_numel=-1), "q8_min_numel"),
    (dict(q8_min_numel=1.5), "q8_min_numel"), (dict(q8_rounding="up"), "q8_rounding")])
def test_bad_q8_settings_are_refused(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Precision(**bad)
