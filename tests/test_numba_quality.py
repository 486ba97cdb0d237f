"""The numba backend's quality features against the reference backend, bit for bit.

Stochastic rounding, Kahan compensation, the int16 remainder (exact float32 master) and
precision telemetry (``bucket.counts``): the storage helpers against ``bf16opt/storage.py``
on dense bit patterns, then every quality plan x flags over several consecutive steps
(stochastic rounding draws a new stream each step), telemetry for every plan, and the
optimizers end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt.algorithms import ADAM, ALGORITHMS, LION, SGD
from bf16opt.backends import numba as numba_backend
from bf16opt.precision import PRESETS, all_plans, plan_for
from bf16opt.storage import (EXP_AVG, EXP_AVG_SQ, STREAMS, buffer_bits, encode, encode_stochastic, fmix32_int,
                             join_remainder, random_bits, split_remainder, stream_key)

pytest.importorskip("numba")

from buckets import (ADAM_GROUPS, INT_VIEW, SMALL_CONTIGUOUS, SMALL_LAYOUTS_4D,  # noqa: E402
                     SMALL_SHAPES, SMALL_SHAPES_4D, adam_flags, adam_plan_cases, bits, make_bucket,
                     one_variant, plan_id, run_both, sgd_flags, sgd_group, sgd_plan_cases)
from buckets import small_chunks  # noqa: E402, F401  (a fixture)
from sweeps import todays_plans  # noqa: E402
from test_numba_backend import OPTIMIZER_OPTIONS, _interesting_f32_bits  # noqa: E402

PLAIN_PLANS = all_plans()
QUALITY_PLANS = all_plans(quality=True)[len(PLAIN_PLANS):]
#: the plans this run sweeps (every preset's and a part of the others: ``tests/sweeps.py``)
SWEPT_QUALITY_PLANS, SWEPT_PLAIN_PLANS = todays_plans(QUALITY_PLANS, plan_id), todays_plans(PLAIN_PLANS, plan_id)

def test_quality_plans_cover_every_feature():
    assert len(QUALITY_PLANS) == 37
    assert {p.rounding for p in QUALITY_PLANS} == {"nearest", "stochastic"}
    assert {p.compensation for p in QUALITY_PLANS} == {None, "kahan", "remainder"}
    assert {p.compensation_dtype for p in QUALITY_PLANS if p.compensation == "kahan"} == \
        {torch.bfloat16, torch.float32}


# ---------------------------------------------------------------- storage helpers
@pytest.fixture(scope="module")
def helpers():
    from numba import njit

    from bf16opt._cpu import storage

    @njit
    def random_all(key, elements, out):
        for i in range(elements.size):
            out[i] = storage.random_bits(key, elements[i])

    even_buffer, odd_buffer = storage.EXP_AVG_SQ, storage.EXP_AVG  # (closure constants: literals)

    @njit
    def buffer_bits_all(randoms, even, odd):
        for i in range(randoms.size):
            even[i] = storage.buffer_bits(randoms[i], even_buffer)
            odd[i] = storage.buffer_bits(randoms[i], odd_buffer)

    @njit
    def encode_stochastic_all(values, randoms, out):
        for i in range(values.size):
            out[i] = storage.encode_stochastic_for(out, values[i], randoms[i])

    @njit
    def split_all(values, params, remainders):
        for i in range(values.size):
            params[i] = storage.split_param(values[i])
            remainders[i] = storage.split_remainder(values[i])

    @njit
    def join_all(params, remainders, out):
        for i in range(params.size):
            out[i] = storage.join_remainder(params[i], remainders[i])

    return random_all, encode_stochastic_all, split_all, join_all, buffer_bits_all


def test_random_bits_match_reference(helpers):
    random_all = helpers[0]
    small = np.arange(100000, dtype=np.int64)
    big = np.array([2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3], dtype=np.int64)
    for key in (0, 1, 0x9E3779B9, 0xFFFFFFFF, stream_key(2**63 + 5, 7, 3, 2)):
        out = np.empty(small.size, dtype=np.uint32)
        random_all(np.uint32(key), small, out)
        assert np.array_equal(out, random_bits(key, (small.size,)).numpy().astype(np.uint32))
        # element counters beyond 2**32 wrap: fmix32(key ^ (i * 0x9E3779B9 mod 2**32))
        out = np.empty(big.size, dtype=np.uint32)
        random_all(np.uint32(key), big, out)
        assert out.tolist() == [fmix32_int(key ^ (int(i) * 0x9E3779B9 % 2**32)) for i in big]


def test_buffer_bits_match_reference(helpers):
    randoms = np.random.default_rng(9).integers(0, 1 << 32, 10000, dtype=np.uint64).astype(np.uint32)
    randoms[:4] = (0, 0xFFFFFFFF, 0xFFFF0000, 0x0000FFFF)
    even, odd = np.empty_like(randoms), np.empty_like(randoms)
    helpers[4](randoms, even, odd)
    wide = torch.from_numpy(randoms.astype(np.int64))
    assert np.array_equal(even, buffer_bits(wide, EXP_AVG_SQ).numpy().astype(np.uint32))
    assert np.array_equal(odd, buffer_bits(wide, EXP_AVG).numpy().astype(np.uint32))


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 7, 2**64 - 1, 123456789123])
def test_stream_keys_match_reference(seed):
    indices = [0, 1, 5, 149, 2**31, 2**32 + 3]
    for step in (1, 2, 1000, 2**32 + 1):
        keys = numba_backend.stream_keys(seed, step, indices)
        expected = [[stream_key(seed, step, t, k) for k in range(STREAMS)] for t in indices]
        assert keys.dtype == np.uint32 and keys.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_encode_stochastic_matches_reference(helpers, dtype):
    encode_stochastic_all = helpers[1]
    values = _interesting_f32_bits().view(np.float32)
    rng = np.random.default_rng(5)
    randoms = rng.integers(0, 1 << 32, values.size, dtype=np.uint64).astype(np.uint32)
    # the extremes of the random bits: never / always round up (ties included)
    randoms[:2000] = 0
    randoms[2000:4000] = 0xFFFFFFFF
    view = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}[dtype]
    out = np.empty(values.size, dtype=view)
    encode_stochastic_all(values, randoms, out)
    expected = encode_stochastic(torch.from_numpy(values), dtype,
                                 torch.from_numpy(randoms.astype(np.int64)))
    expected = expected.view(INT_VIEW[dtype]).numpy()
    got = out.view(expected.dtype)
    bad = np.nonzero(got != expected)[0]
    assert bad.size == 0, [(hex(values.view(np.uint32)[i]), hex(randoms[i]), hex(got[i]),
                            hex(expected[i])) for i in bad[:5]]


def test_remainder_split_and_join_match_reference(helpers):
    _, _, split_all, join_all, _ = helpers
    values = _interesting_f32_bits().view(np.float32)
    params = np.empty(values.size, dtype=np.int16)
    remainders = np.empty(values.size, dtype=np.int16)
    split_all(values, params, remainders)
    ref_param, ref_remainder = split_remainder(torch.from_numpy(values))
    assert np.array_equal(params, ref_param.view(torch.int16).numpy())
    assert np.array_equal(remainders, ref_remainder.numpy())
    # join every (param, remainder) pair of a dense sample, including those no split makes
    rng = np.random.default_rng(9)
    p = rng.integers(-32768, 32768, 1 << 20).astype(np.int16)
    r = rng.integers(-32768, 32768, 1 << 20).astype(np.int16)
    out = np.empty(p.size, dtype=np.float32)
    join_all(p, r, out)
    expected = join_remainder(torch.from_numpy(p).view(torch.bfloat16), torch.from_numpy(r))
    assert np.array_equal(out.view(np.int32), expected.view(torch.int32).numpy())


# ---------------------------------------------------------------- every quality configuration
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("plan, amsgrad, weight_decay, track", adam_plan_cases(SWEPT_QUALITY_PLANS))
def test_adam_quality_every_plan(plan, amsgrad, weight_decay, track):
    group = ADAM_GROUPS[weight_decay]
    bucket = make_bucket(ADAM, plan, SMALL_SHAPES, flags=adam_flags(group, amsgrad), seed=11,
                         layouts=SMALL_CONTIGUOUS, track=track)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} amsgrad={amsgrad} {weight_decay} track={track}",
             **one_variant(bucket))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("track", [False, True], ids=["plain", "track"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
@pytest.mark.parametrize("plan", SWEPT_QUALITY_PLANS, ids=plan_id)
def test_lion_quality_every_configuration(plan, weight_decay, track):
    bucket = make_bucket(LION, plan, SMALL_SHAPES, flags=dict(maximize=True), seed=13,
                         layouts=SMALL_CONTIGUOUS, track=track)
    group = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} wd={weight_decay} track={track}",
             **one_variant(bucket))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("plan, group, first, track", sgd_plan_cases(SWEPT_QUALITY_PLANS))
def test_sgd_quality_every_configuration(plan, group, first, track):
    """Three steps (``one_variant``), transposed, strided and channels_last
    tensors among contiguous ones; stochastic rounding draws a new stream each step."""
    bucket = make_bucket(SGD, plan, SMALL_SHAPES_4D, flags=sgd_flags(group, first=first, maximize=True),
                         track=track, seed=31, layouts=SMALL_LAYOUTS_4D)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} {group} first={first} track={track}",
             **one_variant(bucket))


# ---------------------------------------------------------------- telemetry on the plain plans
# (Adam's: test_numba_backend.py's test_adam_every_plan)
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
@pytest.mark.parametrize("plan", SWEPT_PLAIN_PLANS, ids=plan_id)
def test_lion_telemetry_plain_plans(plan, weight_decay):
    bucket = make_bucket(LION, plan, SMALL_SHAPES, seed=19, layouts=SMALL_CONTIGUOUS, track=True)
    group = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    run_both(bucket, group, steps=3, alternate_maximize=True, where=plan_id(plan))


# the algorithm, its flags and a group whose updates are far below a bf16 ulp
VACUOUS_CASES = {
    "adam": (dict(amsgrad=True), dict(lr=1e-7, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                      decoupled_weight_decay=True)),
    "lion": ({}, dict(lr=1e-7, betas=(0.9, 0.99), weight_decay=0.0)),
    # a zero buffer (not its first step) and dampening 0.9: it takes 0.1 * g, as exp_avg does
    "sgd": (dict(momentum=True), sgd_group(lr=1e-7, momentum=0.9, dampening=0.9)),
}


@pytest.mark.parametrize("preset", ["bf16", "bf16-sr", "bf16-kahan", "fp32-remainder-bf16-states",
                                    "bf16-states"])
@pytest.mark.parametrize("algorithm", list(VACUOUS_CASES))
def test_telemetry_counts_are_not_vacuous(preset, algorithm):
    """Updates far below a bf16 ulp and gradients that underflow bf16 moments: the counts
    are large, and equal the reference's."""
    plan = plan_for(PRESETS[preset], torch.bfloat16)
    flags, group = VACUOUS_CASES[algorithm]
    bucket = make_bucket(ALGORITHMS[algorithm], plan, [(4096,), (3, 1000)], flags=flags, seed=23,
                         specials=True, track=True)
    for i, grad in enumerate(bucket["grad"]):
        # zero moments and tiny gradients: ~2e-40 * 0.1 underflows a bf16 exp_avg (not the
        # float32 value), 1e-20 * g a bf16 exp_avg_sq (g * g ~ 1e-40)
        scale = torch.tensor([1e-20, 2e-39]).repeat(grad.numel() // 2).view(grad.shape)
        grad.copy_(encode(grad.float() * scale, grad.dtype))
        for role in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if role in [r.name for r in bucket.config.algorithm.roles]:
                bucket[role][i].zero_()
    run_both(bucket, group, steps=2, where=preset)
    counts = bucket.counts
    if plan.master is None and plan.compensation != "remainder" and plan.rounding == "nearest":
        assert (counts[:, 0] > 0).all(), counts  # round to nearest swallows tiny updates
    if plan.exp_avg == torch.bfloat16:  # exp_avg, or SGD's momentum buffer
        assert (counts[:, 1] > 0).all(), counts
    if algorithm == "adam" and plan.exp_avg_sq == torch.bfloat16:
        assert (counts[:, 2] > 0).all(), counts


@pytest.mark.parametrize("preset", ["bf16", "bf16-sr"])
def test_amsgrad_telemetry_counts_the_second_moment_not_its_maximum(preset):
    """exp_avg_sq underflow is counted on the new second moment, not on the maximum the step
    divides by: zero grads with beta2 = 0 make exp_avg_sq exactly zero (no underflow) while
    the stored maximum stays positive.  (Random grads never give an exact zero, so the
    every-plan cases alone let a kernel counting on the maximum pass.)"""
    plan = plan_for(PRESETS[preset], torch.bfloat16)
    group = dict(lr=1e-3, betas=(0.9, 0.0), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True)
    bucket = make_bucket(ADAM, plan, [(300,), (7,)], flags=dict(amsgrad=True), seed=29, specials=False,
                         track=True)
    for grad, maximum in zip(bucket["grad"], bucket["max_exp_avg_sq"]):
        grad.zero_()
        maximum.copy_(encode(torch.full(maximum.shape, 1e-3), maximum.dtype))
    run_both(bucket, group, steps=1, where=preset)
    assert (bucket.counts[:, 2] == 0).all(), bucket.counts
    assert all((m.float() > 0).all() for m in bucket["max_exp_avg_sq"])  # (the maximum kept)


@pytest.mark.parametrize("preset", ["bf16-sr", "bf16-kahan", "fp32-remainder"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_quality_vector_tail_sizes_large(preset, param_dtype):
    """1048577 = 2^20 + 1 elements: many chunks (random streams continue across chunks)."""
    plan = plan_for(PRESETS[preset], param_dtype)
    bucket = make_bucket(ADAM, plan, [(1048577,), (22,)], flags=dict(amsgrad=True), seed=3, track=True)
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decoupled_weight_decay=True)
    run_both(bucket, group, steps=2, where=f"{preset} {param_dtype}")


# ---------------------------------------------------------------- through the optimizers
QUALITY_PRESETS = sorted(name for name, precision in PRESETS.items()
                         if precision.rounding != "nearest" or precision.compensation is not None)


@pytest.mark.parametrize("optimizer", list(OPTIMIZER_OPTIONS))
@pytest.mark.parametrize("precision", QUALITY_PRESETS)
def test_optimizer_quality_numba_equals_reference(optimizer, precision):
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32]  # float16: 30 elements
    shapes = [(4, 6), (6,), (), (3, 5, 2), (130,)]
    options, second_group = OPTIMIZER_OPTIONS[optimizer]
    results = {}
    for backend in ("reference", "numba"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dtypes)]
        opt = getattr(bf16opt, optimizer)([{"params": params[:2]}, {"params": params[2:], **second_group}],
                                          weight_decay=0.1, precision=precision, backend=backend,
                                          seed=1234, track_precision=True, **options)
        stats = []
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(p.dtype)
            opt.step()
            stats.append(opt.precision_stats())
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        results[backend] = ([p.detach().clone() for p in params], state, stats)
    (ref_params, ref_state, ref_stats), (nb_params, nb_state, nb_stats) = \
        results["reference"], results["numba"]
    assert ref_stats == nb_stats
    for a, b in zip(ref_params, nb_params):
        assert torch.equal(bits(a), bits(b))
    for sa, sb in zip(ref_state, nb_state):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(bits(sa[key]), bits(sb[key])), key
