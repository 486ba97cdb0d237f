"""q8 moments in the Numba kernels: the same bits as the reference (bf16opt/storage.py's "q8"),
whole blocks and partial ones, several chunk-table rows per tensor, NaN and inf in the grads,
stochastic rounding, telemetry; the maps equal the spec's."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bf16opt.precision import Precision, plan_for
from bf16opt.storage import Q8, q8_boundaries, q8_map
from buckets import ADAM_GROUPS, adam_flags, make_bucket, run_both, sgd_flags, sgd_group, small_chunks  # noqa: F401
from sweeps import todays_part

pytest.importorskip("numba", reason="the Numba kernels need numba")

LION_GROUP = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
# shapes: partial blocks, a block exactly, several blocks, and more than one 256-element chunk row
SHAPES = [(7,), (256,), (3, 100), (1000,), (2, 2, 129)]


def q8_plan(param=torch.bfloat16, *, master="fp32", compensation="remainder", rounding="nearest",
            q8_rounding="nearest", exp_avg="q8", exp_avg_sq="q8"):
    precision = Precision(master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, compensation=compensation,
                          rounding=rounding, q8_rounding=q8_rounding, q8_min_numel=0)
    return plan_for(precision, param, 1 << 20)


# fp32-remainder-q8's and bf16-sr-q8's plans (q8 from any size), an fp32 param with stochastically
# rounded q8 moments, and a float32 copy with one q8 moment (the element loops, not the blocks)
PLANS = {
    "remainder": q8_plan(),
    "bf16-sr": q8_plan(master="bf16", compensation=None, rounding="stochastic", q8_rounding="stochastic"),
    "fp32-q8sr": q8_plan(torch.float32, compensation=None, q8_rounding="stochastic"),
    "copy-mixed": q8_plan(compensation=None, exp_avg_sq="bf16"),
}


def _cuda_tables() -> dict:
    """cuda_src/q8_maps.cuh's tables by name, as uint32 arrays."""
    text = (pathlib.Path(__file__).parents[1] / "cuda_src" / "q8_maps.cuh").read_text(encoding="utf-8")
    return {name: np.array([int(word, 16) for word in re.findall(r"0x([0-9A-F]{8})u", body)], dtype=np.uint32)
            for name, body in re.findall(r"(kQ8\w+)\[256\] = \{(.*?)\};", text, re.S)}


def test_maps_equal_the_spec():
    """The Numba tables and the CUDA header's literals, bit for bit, are the spec's maps and
    boundaries, then the non-finite code's value: NaN signed, +inf unsigned."""
    from bf16opt._cpu import q8  # noqa: PLC0415
    cuda = _cuda_tables()
    for signed, name in ((True, "Signed"), (False, "Unsigned")):
        values, bounds = q8.maps(signed)
        np.testing.assert_array_equal(values[:255], np.array(q8_map(signed, "dynamic"), dtype=np.float32))
        assert np.isnan(values[255]) if signed else values[255] == np.inf
        np.testing.assert_array_equal(bounds[:255], np.array(q8_boundaries(signed, "dynamic"), dtype=np.float32))
        assert np.array_equal(cuda[f"kQ8{name}Values"], values.view(np.uint32))
        assert np.array_equal(cuda[f"kQ8{name}Bounds"], bounds.view(np.uint32))


# (plan, amsgrad): the preset's plan (fp32-remainder-q8's) on every run, the others a part per
# run (tests/sweeps.py; q8 configurations are the slowest of all to compile)
ADAM_CASES = todays_part([(name, amsgrad) for name in PLANS for amsgrad in (False, True)],
                         key=lambda case: f"{case[0]}-{case[1]}", always=lambda case: case[0] == "remainder")


@pytest.mark.parametrize("name, amsgrad", ADAM_CASES,
                         ids=[f"{name}-{'amsgrad' if amsgrad else 'adam'}" for name, amsgrad in ADAM_CASES])
def test_adam_q8_matches_the_reference(name, amsgrad, small_chunks):  # noqa: F811
    plan = PLANS[name]
    group = ADAM_GROUPS["decoupled"]
    bucket = make_bucket("adam", plan, SHAPES, seed=3, flags=adam_flags(group, amsgrad), track=True)
    run_both(bucket, group, 3, f"adam q8 amsgrad={amsgrad}")


def test_lion_and_sgd_q8_match_the_reference(small_chunks):  # noqa: F811
    """With telemetry (the element loops; test_lion_and_sgd_q8_blocks_match_the_reference runs
    the blocks, with stochastically rounded q8 moments)."""
    plan = PLANS["remainder"]
    run_both(make_bucket("lion", plan, SHAPES, seed=4, track=True), LION_GROUP, 3, "lion q8")
    group = sgd_group(momentum=0.9, nesterov=True, weight_decay=0.01)
    bucket = make_bucket("sgd", plan, SHAPES, seed=5, flags=sgd_flags(group, first=True), track=True)
    run_both(bucket, group, 3, "sgd q8")


def test_a_large_tensor_spans_many_rows():
    """The default chunk (32768 elements): rows start on blocks, the last one partial."""
    group = ADAM_GROUPS["decoupled"]
    bucket = make_bucket("adam", PLANS["remainder"], [(70_001,)], seed=9, flags=adam_flags(group, False))
    run_both(bucket, group, 2, "adam q8 70001", unit=True)
    assert bucket["exp_avg"][0].dtype == Q8


def test_offloaded_q8_state_matches_the_reference():
    """offload='cpu' cuts the update into pieces (here of 1000 elements, rounded up to whole
    blocks: 1024): params and q8 state equal the reference's, bit for bit."""
    import bf16opt  # noqa: PLC0415

    def run(backend, offload):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 130), torch.nn.ReLU(),
                                    torch.nn.Linear(130, 70)).to(torch.bfloat16)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="fp32-remainder-q8", backend=backend,
                            offload=offload)
        if offload:
            opt._offloader.chunk_elements = 1000
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(8, 100, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt.state_dict()["state"]

    (expected, expected_state), (got, got_state) = run("reference", None), run("numba", "cpu")
    assert all(torch.equal(p.view(torch.int16), q.view(torch.int16))
               for p, q in zip(expected.parameters(), got.parameters()))
    assert expected_state[0]["exp_avg"].dtype == Q8
    for index, state in expected_state.items():
        for key, value in state.items():
            assert torch.equal(value, got_state[index][key]), (index, key)


# ---------------------------------------------------------------- the hand-vectorised q8 blocks
def _q8_blocks_or_skip():
    from bf16opt._cpu import vector_blocks  # noqa: PLC0415
    if not vector_blocks.available():
        pytest.skip("needs a CPU with AVX-512 (the hand-vectorised q8 blocks)")
    from bf16opt._cpu import q8_blocks  # noqa: PLC0415
    return q8_blocks


def _interesting_normalized(signed: bool) -> np.ndarray:
    """Every map value and boundary with its neighbours 1 and 2 ulps away, the zeros, the ends,
    tiny and subnormal values and random values of [-1, 1] (or [0, 1])."""
    from bf16opt._cpu import q8  # noqa: PLC0415
    values, bounds = q8.maps(signed)
    entries = np.concatenate((values[:255], bounds[:254])).astype(np.float32)
    around = [entries]
    for direction in (np.inf, -np.inf):
        step = entries
        for _ in range(2):
            step = np.nextafter(step, np.float32(direction)).astype(np.float32)
            around.append(step)
    rng = np.random.default_rng(7)
    special = np.array([0.0, -0.0, 1.0, 1e-45, 1e-38, 1e-30, 1e-9], dtype=np.float32)
    ys = np.concatenate(around + [special, -special, rng.uniform(-1, 1, 4096).astype(np.float32)])
    ys = ys[(ys >= (-1 if signed else 0)) & (ys <= 1)]
    return np.concatenate((ys, np.zeros(-ys.size % 16, dtype=np.float32)))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_q8_block_lookup_counts_as_a_search(signed, stochastic):
    """The blocks' bucket lookup (one gather per 16 values, no search) gives the spec's counts:
    round to nearest the code of #{boundaries < y}, stochastic #{values <= y}, at every map
    value and boundary and their neighbours."""
    from numba import njit  # noqa: PLC0415
    q8_blocks = _q8_blocks_or_skip()

    @njit
    def counts(ys, out):
        for i in range(0, ys.size, 16):
            q8_blocks.count_vector(signed, stochastic, ys[i:].ctypes.data, out[i:].ctypes.data)

    ys = _interesting_normalized(signed)
    got = np.empty(ys.size, dtype=np.int32)
    counts(ys, got)
    spec = torch.from_numpy(ys)
    if stochastic:
        table = torch.tensor(q8_map(signed, "dynamic"), dtype=torch.float32)
        expected = torch.searchsorted(table, spec, right=True).numpy()
        np.testing.assert_array_equal(got & 0xFF, expected)
    else:
        bounds = torch.tensor(q8_boundaries(signed, "dynamic"), dtype=torch.float32)
        index = torch.searchsorted(bounds, spec, right=False).numpy()
        np.testing.assert_array_equal(got & 0xFF, (index - 127) & 0xFF if signed else index)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("by_bytes", [False, True], ids=["gathers", "byte-permutes"])
def test_q8_block_decoding_equals_the_spec(signed, by_bytes):
    """Both forms of the blocks' decoding (gathers; byte permutes where the CPU has AVX512-VBMI)
    give the spec's values of every code, the non-finite code included, for several scales."""
    from numba import njit  # noqa: PLC0415
    from bf16opt.storage import q8_decode  # noqa: PLC0415
    q8_blocks = _q8_blocks_or_skip()
    if by_bytes and not q8_blocks._byte_permutes():
        pytest.skip("needs a CPU with AVX512-VBMI (the byte-permute decoding)")

    @njit
    def decode(rows, out):
        for b in range(rows.shape[0]):
            q8_blocks.decode_row(signed, by_bytes, rows[b:].ctypes.data, out[b:].ctypes.data)

    rng = np.random.default_rng(5)
    scales = np.array([1.0, 3e-4, 7e-30, 2.5e30], dtype=np.float32)
    rows = np.zeros((scales.size * 2, 260), dtype=np.uint8)
    rows[0::2, :256] = np.arange(256, dtype=np.uint8)          # every code, in order
    rows[1::2, :256] = rng.permutation(256).astype(np.uint8)   # and shuffled
    rows[:, 256:] = np.repeat(scales, 2)[:, None].view(np.uint8)
    got = np.empty((rows.shape[0], 256), dtype=np.float32)
    decode(rows, got)
    expected = q8_decode(torch.from_numpy(rows), (rows.shape[0] * 256,), signed).numpy()
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint32), expected.view(np.uint32))


Q8_BLOCK_SHAPES = [(7,), (256,), (1000,), (3, 700)]  # a partial block alone, whole blocks, both


# (plan, decay) of the block-path tests: each a compiled configuration, kept few (cold compiles);
# the presets' as AdamW runs them (test_offload.py compiles them too), L2 with the fp32 param
BLOCK_CASES = [("remainder", "decoupled"), ("bf16-sr", "decoupled"), ("fp32-q8sr", "l2")]


@pytest.mark.parametrize("plan_name, decay", BLOCK_CASES)
def test_adam_q8_blocks_match_the_reference(plan_name, decay, small_chunks):  # noqa: F811
    """Without telemetry or amsgrad the whole q8 blocks take the hand-vectorised path: the same
    bits as the reference, NaN and inf grads in blocks included (make_bucket's specials), with
    round to nearest (remainder) and stochastic rounding (bf16-sr's param, bf16-sr's and
    fp32-q8sr's q8 moments)."""
    from bf16opt.backends import numba as numba_backend  # noqa: PLC0415
    _q8_blocks_or_skip()
    group = ADAM_GROUPS[decay]
    bucket = make_bucket("adam", PLANS[plan_name], Q8_BLOCK_SHAPES, seed=11, flags=adam_flags(group, False))
    assert numba_backend.chunk_function(bucket.config, True).vectorised
    run_both(bucket, group, 3, f"adam q8 blocks {plan_name} {decay}", unit=True)


def test_lion_and_sgd_q8_blocks_match_the_reference(small_chunks):  # noqa: F811
    """Lion and SGD nesterov (both with stochastically rounded q8) on the block path."""
    from bf16opt.backends import numba as numba_backend  # noqa: PLC0415
    _q8_blocks_or_skip()
    bucket = make_bucket("lion", PLANS["fp32-q8sr"], Q8_BLOCK_SHAPES, seed=12)
    assert numba_backend.chunk_function(bucket.config, True).vectorised
    run_both(bucket, LION_GROUP, 3, "lion q8 blocks", unit=True)
    group = sgd_group(momentum=0.9, nesterov=True, weight_decay=0.01)
    bucket = make_bucket("sgd", PLANS["fp32-q8sr"], Q8_BLOCK_SHAPES, seed=13, flags=sgd_flags(group, first=True))
    run_both(bucket, group, 3, "sgd q8 blocks", unit=True)  # (step 1 writes the buffer, 2 and 3 read it)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 2000), min_size=1, max_size=3), st.integers(0, 2 ** 16),
       st.sampled_from(BLOCK_CASES + [("copy-mixed", "l2")]), st.booleans())
def test_any_sizes_match_the_reference(numels, seed, case, specials):
    """Any sizes (whole and partial blocks), with and without non-finite grads, SR on and off:
    the configurations of test_adam_q8_blocks_match_the_reference (on CPUs without AVX-512
    their element loops) and one q8 moment beside a bfloat16 one."""
    plan_name, decay = case
    group = ADAM_GROUPS[decay]
    bucket = make_bucket("adam", PLANS[plan_name], [(n,) for n in numels], seed=seed,
                         flags=adam_flags(group, False), specials=specials)
    run_both(bucket, group, 2, f"adam q8 {plan_name} {decay} {numels}", unit=True)


def test_padding_codes_written_by_hand_stay_as_the_kernels_leave_them():
    """The codes past a param's last element are never written (docs/numerics.md), by the
    reference as by the kernels: codes put there by hand stay, the same on both backends."""
    import bf16opt

    states = []
    for backend in ("reference", "numba"):
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(70, 70, generator=generator).to(torch.bfloat16))
        opt = bf16opt.AdamW([param], precision="fp32-remainder-q8", backend=backend)
        param.grad = torch.randn(70, 70, generator=generator).to(torch.bfloat16)
        opt.step()
        padding = opt.state[param]["exp_avg_sq"][-1, 4900 % 256:256]
        padding.copy_(torch.arange(padding.numel(), dtype=torch.uint8) | 1)
        opt.step()
        states.append({key: value.clone() for key, value in opt.state[param].items()})
        assert bool((states[-1]["exp_avg_sq"][-1, 4900 % 256:256] != 0).all())
    assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])
