"""The numba backend (``cpu_src/`` kernels) against the reference backend, bit for bit.

Every comparison is on stored bits (``view`` as integers): every role of the bucket
(params, master copies, Kahan buffers, remainders, moments, amsgrad's maximum, SGD's
momentum buffer, and the read-only grads) and the telemetry counts, after several
consecutive steps.  Buckets come from ``tests/buckets.py``, one generator for every
algorithm.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bf16opt
from bf16opt.algorithms import ADAM, LION, SGD, kernel_config
from bf16opt.backends import Bucket, resolve_backend
from bf16opt.backends import numba as numba_backend
from bf16opt.backends import staging
from bf16opt._cpu import vector_blocks
from bf16opt.precision import PRESETS, StoragePlan, all_plans, plan_for
from bf16opt.storage import Q8, encode, split_remainder

pytest.importorskip("numba")

from buckets import (ADAM_GROUPS, INT_VIEW, SMALL_CONTIGUOUS, SMALL_LAYOUTS_4D,  # noqa: E402
                     SMALL_SHAPES, SMALL_SHAPES_4D, adam_flags, adam_plan_cases, bits, make_bucket,
                     one_variant, plan_id, run_both, sgd_flags, sgd_group, sgd_plan_cases, variant)
from buckets import small_chunks  # noqa: E402, F401  (a fixture)
from sweeps import todays_plans  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = all_plans()
#: the plans this run sweeps (every preset's and a part of the others: ``tests/sweeps.py``)
SWEPT_PLANS = todays_plans(PLANS, plan_id)
SWEPT_QUALITY_PLANS = todays_plans(all_plans(quality=True), plan_id)  # (quality ones included)


# ---------------------------------------------------------------- storage helpers
def _njit_codec():
    from numba import njit

    from bf16opt._cpu.storage import load, store

    @njit
    def decode_all(bits, out):
        for i in range(bits.size):
            out[i] = load(bits, i)

    @njit
    def encode_all(values, out):
        for i in range(values.size):
            store(out, i, values[i])

    return decode_all, encode_all


@pytest.fixture(scope="module")
def codec():
    return _njit_codec()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_every_16_bit_pattern(codec, dtype):
    decode_all, _ = codec
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    view = bits.numpy() if dtype == torch.bfloat16 else bits.numpy().view(np.uint16)
    out = np.empty(bits.numel(), dtype=np.float32)
    decode_all(view, out)
    expected = bits.view(dtype).float()
    assert np.array_equal(out.view(np.int32), expected.view(torch.int32).numpy())


def _interesting_f32_bits() -> np.ndarray:
    """Dense fp32 bit patterns: every upper half with tie/near-tie lows, fp16 rounding
    boundaries at every exponent (normal and subnormal), NaNs, infs, overflow, random."""
    rng = np.random.default_rng(2024)
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    parts = [(upper[:, None] | lows[None, :]).ravel(),
             upper | rng.integers(0, 1 << 16, upper.size, dtype=np.uint32)]
    # float16: at each exponent, fields around the rounding position (bit 13 for normal
    # results, higher for subnormal results: the 24-bit significand shifts by 126 - e)
    for exponent in range(90, 145):
        shift = 13 if exponent >= 113 else 126 - exponent
        for sign in (0, 1):
            high = rng.integers(0, 1 << 23, 4096, dtype=np.uint32)
            if shift <= 23:
                half = 1 << (shift - 1)
                fields = [(high & np.uint32(~((1 << shift) - 1) & 0x7FFFFF)) | np.uint32(low)
                          for low in (0, half - 1, half, half + 1)]
            else:
                fields = [np.full(4, f, dtype=np.uint32) for f in (0, 1, 0x7FFFFF)] + [high]
            for field in fields:
                parts.append(np.uint32(sign << 31) | np.uint32(exponent << 23) | field)
    specials = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
                0x7FBFFFFF, 0x00000001, 0x807FFFFF, 0x477FE000, 0x477FEFFF, 0x477FF000,
                0x477FF001, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x33000000,
                0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000]
    nans = rng.integers(0x7F800001, 0x80000000, 4096, dtype=np.uint32)
    parts += [np.array(specials, dtype=np.uint32), nans, nans | np.uint32(0x80000000),
              rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)]
    return np.concatenate(parts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_encode_matches_reference(codec, dtype):
    _, encode_all = codec
    values = _interesting_f32_bits().view(np.float32)
    view = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}[dtype]
    out = np.empty(values.size, dtype=view)
    encode_all(values, out)
    expected = encode(torch.from_numpy(values), dtype).view(INT_VIEW[dtype]).numpy()
    got = out.view(expected.dtype)
    bad = np.nonzero(got != expected)[0]
    assert bad.size == 0, [(hex(values.view(np.uint32)[i]), hex(got[i]), hex(expected[i]))
                           for i in bad[:5]]


def test_encode_canonical_nan_bits(codec):
    _, encode_all = codec
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA00000],
                    dtype=np.uint32).view(np.float32)
    for view, canonical in ((np.float32, 0x7FC00000), (np.int16, 0x7FC0), (np.uint16, 0x7E00)):
        out = np.empty(nans.size, dtype=view)
        encode_all(nans, out)
        width = np.uint32 if view == np.float32 else np.uint16
        assert (out.view(width) == canonical).all()


# ---------------------------------------------------------------- every configuration
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("plan, amsgrad, weight_decay, track", adam_plan_cases(SWEPT_PLANS))
def test_adam_every_plan(plan, amsgrad, weight_decay, track):
    """Three steps, of one of the configuration's two kernels (``one_variant``); telemetry
    counted in the ``track`` cases."""
    group = ADAM_GROUPS[weight_decay]
    bucket = make_bucket(ADAM, plan, SMALL_SHAPES, flags=adam_flags(group, amsgrad),
                         seed=sum(map(ord, plan_id(plan))), layouts=SMALL_CONTIGUOUS, track=track)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} {amsgrad} {weight_decay} track={track}",
             **one_variant(bucket))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
@pytest.mark.parametrize("plan", SWEPT_PLANS, ids=plan_id)
def test_lion_every_configuration(plan, weight_decay):
    bucket = make_bucket(LION, plan, SMALL_SHAPES, flags=dict(maximize=True), seed=7,
                         layouts=SMALL_CONTIGUOUS)
    group = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} {weight_decay}",
             **one_variant(bucket))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("plan, group, first, track", sgd_plan_cases(SWEPT_PLANS))
def test_sgd_every_configuration(plan, group, first, track):
    """Three steps (``one_variant``); with momentum, step 1 is the buffer's first step.  A
    channels_last tensor joins the transposed and strided ones."""
    bucket = make_bucket(SGD, plan, SMALL_SHAPES_4D, flags=sgd_flags(group, first=first), track=track,
                         seed=29, layouts=SMALL_LAYOUTS_4D)
    run_both(bucket, group, steps=3, where=f"{plan_id(plan)} {group} track={track}",
             **one_variant(bucket))


@pytest.mark.parametrize("preset", ["bf16", "fp32"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_vector_tail_sizes_large(preset, param_dtype):
    """1048577 = 2^20 + 1 elements: many chunks, a one-element tail chunk."""
    plan = plan_for(PRESETS[preset], param_dtype)
    bucket = make_bucket(ADAM, plan, [(1048577,), (22,)], flags=dict(amsgrad=True), seed=3)
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decoupled_weight_decay=True)
    run_both(bucket, group, steps=2, where=f"{preset} {param_dtype}")


VECTORISED = [  # (algorithm, preset, param dtype, grad dtype, weight decay, unit): each master
    # form vector_blocks.py writes, Adam's L2 and decoupled decay, with and without the
    # unscaling multiplication (one compile a case)
    (ADAM, "fp32", torch.float32, torch.float32, "l2", False),          # float32 param, its own master
    (ADAM, "bf16-master", torch.bfloat16, torch.bfloat16, "decoupled", False),  # bfloat16 param, its own
    (ADAM, "bf16-master", torch.bfloat16, torch.float32, "l2", True),   # ... float32-accumulated grads
    (ADAM, "fp32", torch.bfloat16, torch.bfloat16, "decoupled", True),  # bfloat16 param, float32 copy
    (LION, "fp32", torch.float32, torch.float32, "decoupled", True),
    (LION, "bf16-master", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (LION, "fp32", torch.bfloat16, torch.float32, "decoupled", False),
    # the exact master as a bfloat16 param and its int16 remainder
    (ADAM, "fp32-remainder", torch.bfloat16, torch.bfloat16, "decoupled", True),
    (ADAM, "fp32-remainder", torch.bfloat16, torch.float32, "l2", False),
    (LION, "fp32-remainder", torch.bfloat16, torch.bfloat16, "decoupled", False),
    # SGD with a momentum buffer: Nesterov with L2, dampening, plain
    (SGD, "fp32-remainder", torch.bfloat16, torch.bfloat16, "nesterov-l2", False),
    (SGD, "fp32-remainder", torch.bfloat16, torch.float32, "plain", True),
    (SGD, "bf16-master", torch.bfloat16, torch.bfloat16, "dampening", False),
    (SGD, "fp32", torch.float32, torch.float32, "nesterov-l2", True),
    (SGD, "fp32", torch.bfloat16, torch.bfloat16, "plain", True),
    # bfloat16 moments; the bfloat16 param with a Kahan compensation (bfloat16 or float32)
    (ADAM, "bf16", torch.bfloat16, torch.bfloat16, "decoupled", True),
    (ADAM, "bf16-states", torch.float32, torch.float32, "decoupled", False),  # float32 param, its own
    (ADAM, "bf16-states", torch.bfloat16, torch.float32, "l2", False),       # float32 copy
    (ADAM, "fp32-remainder-bf16-states", torch.bfloat16, torch.bfloat16, "decoupled", True),
    (ADAM, "bf16-kahan", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (ADAM, "bf16-kahan", torch.bfloat16, torch.float32, "l2", True),
    (ADAM, "kahan-fp32", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (LION, "bf16", torch.bfloat16, torch.bfloat16, "decoupled", True),
    (LION, "bf16-kahan", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (SGD, "bf16-kahan", torch.bfloat16, torch.bfloat16, "nesterov-l2", False),
    (SGD, "bf16", torch.bfloat16, torch.bfloat16, "dampening", True),
    # stochastic rounding: the bfloat16 param and moments, the param alone, the moments alone (Adam's
    # only where the blocks prefetch: vector_blocks.prefetching)
    (ADAM, "bf16-sr", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (ADAM, "sr-param", torch.bfloat16, torch.float32, "l2", True),
    (ADAM, "sr-states", torch.bfloat16, torch.bfloat16, "decoupled", True),
    (LION, "bf16-sr", torch.bfloat16, torch.bfloat16, "decoupled", False),
    (LION, "sr-param", torch.bfloat16, torch.float32, "decoupled", True),
    (SGD, "bf16-sr", torch.bfloat16, torch.bfloat16, "nesterov-l2", False),
    (SGD, "sr-states", torch.bfloat16, torch.bfloat16, "plain", True),
]
# the presets, a Kahan compensation in float32, stochastic rounding of the param or the moments alone
VECTORISED_PRECISIONS = dict(PRESETS, **{
    "kahan-fp32": bf16opt.Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16, compensation="kahan",
                                    compensation_dtype=torch.float32),
    "sr-param": bf16opt.Precision(torch.bfloat16, torch.float32, torch.float32, rounding="stochastic"),
    "sr-states": bf16opt.Precision(torch.float32, torch.bfloat16, torch.bfloat16, rounding="stochastic")})
LION_GROUP = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
SGD_GROUPS = {"nesterov-l2": sgd_group(momentum=0.9, weight_decay=0.01, nesterov=True),
              "dampening": sgd_group(momentum=0.9, dampening=0.1), "plain": sgd_group(momentum=0.9)}

needs_avx512 = pytest.mark.skipif(not vector_blocks.available(),
                                  reason="needs a CPU with AVX-512 (the hand-vectorised blocks)")


@needs_avx512
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("algorithm, preset, dtype, grad, wd_mode, unit", VECTORISED,
                         ids=[f"{a.name}-{p}-{str(d)[6:]}-grad-{str(g)[6:]}-{w}-{'unit' if u else 'scaled'}"
                              for a, p, d, g, w, u in VECTORISED])
def test_vectorised_blocks_match_the_reference(algorithm, preset, dtype, grad, wd_mode, unit, request):
    """``vector_blocks.py``'s blocks (Adam 128 elements, Lion and SGD 64), then
    the element loop -- whole and partial blocks, tensors placed off their alignment, rows of
    256 elements (stochastic rounding's element counters from each row's start), NaN,
    infinities, subnormals and ties in the grads -- against the reference bit for bit;
    ``unit``: without the unscaling multiplication, else with a grad scale and maximize
    flipped each step.  Adam's stochastic rounding has blocks only where they prefetch: on a
    CPU where they do not, prefetching is switched on for its cases."""
    if algorithm is ADAM and VECTORISED_PRECISIONS[preset].rounding == "stochastic" \
            and not vector_blocks.prefetching():
        request.getfixturevalue("prefetching_blocks")
    group, flags = (ADAM_GROUPS[wd_mode], adam_flags(ADAM_GROUPS[wd_mode], amsgrad=False)) if algorithm is ADAM \
        else (SGD_GROUPS[wd_mode], sgd_flags(SGD_GROUPS[wd_mode])) if algorithm is SGD \
        else (LION_GROUP, dict(maximize=False))
    bucket = make_bucket(algorithm, plan_for(VECTORISED_PRECISIONS[preset], dtype),
                         [(1000,), (128,), (255,), (3, 129), (7,)],
                         flags=flags, seed=41, misalign=0.5, grad=grad)
    assert numba_backend.chunk_function(bucket.config, unit).vectorised
    run_both(bucket, group, steps=3, where=f"{algorithm.name} {preset} {dtype} grad {grad} {wd_mode} unit={unit}",
             **variant(unit))


@pytest.fixture
def integer_rounding(monkeypatch):
    """The blocks built as for an AVX-512 CPU without AVX512-BF16 (every bfloat16 value rounded
    on the integer lanes)."""
    yield from _blocks_built_with(monkeypatch, "native_bf16", lambda: False)


@pytest.fixture
def prefetching_blocks(monkeypatch):
    """The blocks built prefetching."""
    yield from _blocks_built_with(monkeypatch, "PREFETCH_ON", True)


def _blocks_built_with(monkeypatch, name: str, value):
    """A fixture's body: ``vector_blocks.<name>`` set to ``value``, the chunk functions memoised
    in this process forgotten before and after (their memo keys do not hold the blocks' form)."""
    from bf16opt._cpu import adam, lion, sgd

    def forget():
        for module in (adam, lion, sgd):
            module.chunk_function.cache_clear()

    monkeypatch.setattr(vector_blocks, name, value)
    forget()
    yield
    forget()


INTEGER_ROUNDED = [case for case in VECTORISED if case[1] in ("bf16", "bf16-kahan", "bf16-states")][::2]


@needs_avx512
@pytest.mark.usefixtures("small_chunks", "integer_rounding")
@pytest.mark.parametrize("algorithm, preset, dtype, grad, wd_mode, unit", INTEGER_ROUNDED,
                         ids=[f"{a.name}-{p}-{str(d)[6:]}-grad-{str(g)[6:]}-{w}-{'unit' if u else 'scaled'}"
                              for a, p, d, g, w, u in INTEGER_ROUNDED])
def test_vectorised_blocks_with_integer_rounding_match_the_reference(algorithm, preset, dtype, grad, wd_mode,
                                                                     unit, request):
    """Cases of the test above with bfloat16 moments or a Kahan compensation, their blocks built
    as for a CPU without AVX512-BF16 (every bfloat16 value rounded on the integer lanes)."""
    assert not vector_blocks.native_bf16()
    test_vectorised_blocks_match_the_reference(algorithm, preset, dtype, grad, wd_mode, unit, request)


@needs_avx512
def test_vectorised_adam_blocks_round_ties_to_even():
    """The bfloat16 param of a float32 master copy is the master rounded to nearest even: with a
    learning rate of 0 the master keeps its value, and masters exactly halfway between two
    bfloat16 values (even and odd below) must round like the reference (VECTORISED's fourth
    case: the same kernel)."""
    _, preset, dtype, grad, wd_mode, unit = VECTORISED[3]
    group = dict(ADAM_GROUPS[wd_mode], lr=0.0)
    bucket = make_bucket(ADAM, plan_for(PRESETS[preset], dtype), [(1000,), (300,)],
                         flags=adam_flags(group, amsgrad=False), seed=43, specials=False, grad=grad)
    for param, master in zip(bucket.params, bucket["companion"]):
        halfway = torch.arange(master.numel(), dtype=torch.int32) * 0x10000 % 0x3F800000 + 0x3C008000
        master.copy_(halfway.view(torch.float32).reshape(master.shape))  # 2^-7 .. 1, lower half 0x8000
        param.copy_(encode(master, param.dtype))  # as the last step wrote it (else it reads as edited)
    assert numba_backend.chunk_function(bucket.config, unit).vectorised
    run_both(bucket, group, steps=1, where="ties", unit=unit)


def _adam_master_blocks(form: int):
    """A loop of ``vector_blocks.adam_block`` of ``form`` (a bfloat16 param and its float32
    master copy or int16 remainder, the companion) over whole arrays: with a learning rate of
    0 and zero grads and moments, the blocks store each master as it is, encoded."""
    from numba import njit

    from bf16opt._cpu.storage import pointer_to

    block, companion_size = vector_blocks.ADAM_BLOCK, 2 if form & vector_blocks.REMAINDER else 4

    @njit
    def run(param, grad, companion, exp_avg, exp_avg_sq, scalars):
        values = pointer_to(scalars.ctypes.data, np.float32)
        keys = pointer_to(scalars.ctypes.data, np.uint32)  # (not read: no stochastic rounding)
        for j in range(0, param.size, block):
            vector_blocks.adam_block(form, param.ctypes.data + 2 * j, grad.ctypes.data + 2 * j,
                                     companion.ctypes.data + companion_size * j, exp_avg.ctypes.data + 4 * j,
                                     exp_avg_sq.ctypes.data + 4 * j, values, np.float32(1.0), keys, j,
                                     vector_blocks.prefetch_ahead(j, param.size, block))

    return run


def _blocks_masters() -> np.ndarray:
    """float32 bits for the blocks' storing of masters: :func:`_interesting_f32_bits` and every
    subnormal of random high fields, in whole blocks."""
    rng = np.random.default_rng(7)
    subnormals = np.arange(1 << 23, dtype=np.uint32)[rng.integers(0, 1 << 23, 1 << 16)]
    masters = np.concatenate([_interesting_f32_bits(), subnormals, subnormals | np.uint32(0x80000000)])
    return np.concatenate([masters, np.zeros(-masters.size % vector_blocks.ADAM_BLOCK, np.uint32)])


# beta1, beta2, 1 - beta1, 1 - beta2, step size 0, 1 / sqrt(bias correction 2), eps, weight decay, decay 1
_STILL_ADAM = np.array([0.9, 0.999, 0.1, 0.001, 0.0, 1.0, 1e-8, 0.0, 1.0], dtype=np.float32)


@needs_avx512
@pytest.mark.parametrize("native", [False, True], ids=["integer-rounding", "avx512-bf16"])
def test_vectorised_blocks_round_every_interesting_pattern_as_the_reference(native):
    """The blocks' bfloat16 rounding of a master -- on the integer lanes, or by the CPU's
    conversion with its subnormal correction (``NATIVE16``) -- against the reference's
    encoding, and the master's float32 store, on every upper half with ties and near-ties
    below it (zeros, subnormals and the carry into the smallest normal among them), every
    subnormal of a few random high fields, NaNs with payloads, infinities and overflow."""
    if native and not vector_blocks.native_bf16():
        pytest.skip("needs a CPU with AVX512-BF16 (the blocks' native rounding)")
    masters = _blocks_masters()
    form = vector_blocks.COPY | vector_blocks.PARAM16 | vector_blocks.GRAD16 | vector_blocks.UNIT \
        | (vector_blocks.NATIVE16 if native else 0)
    master = masters.view(np.float32).copy()
    values = torch.from_numpy(masters.view(np.float32))
    # the param the last step wrote (else it reads as edited, storage.join_copy), its bits
    # inverted where the masters are NaN: an edit to another NaN leaves the master NaN
    param = encode(values, torch.bfloat16).view(torch.int16).numpy().copy()
    param[np.isnan(master)] ^= np.int16(0x0001)
    zeros = np.zeros(master.size, dtype=np.float32)
    _adam_master_blocks(form)(param, np.zeros_like(param), master, zeros, zeros.copy(), _STILL_ADAM)
    for got, dtype in ((param, torch.bfloat16), (master, torch.float32)):
        expected = encode(values, dtype).view(INT_VIEW[dtype]).numpy()
        bad = np.nonzero(got.view(expected.dtype) != expected)[0]
        assert bad.size == 0, (dtype, [(hex(masters[i]), hex(got.view(expected.dtype)[i]), hex(expected[i]))
                                       for i in bad[:5]])


@needs_avx512
def test_vectorised_blocks_split_every_interesting_master_as_the_reference():
    """The blocks' exact master as a bfloat16 param and its int16 remainder (``REMAINDER``):
    read back joined and stored split as ``storage.split_remainder`` splits it, for the
    patterns of the test above (every upper half with the remainder's sign boundary, 0x8000,
    and its neighbours below it; NaNs made canonical)."""
    bits = _blocks_masters()
    param, remainder = (t.view(torch.int16).numpy().copy()
                        for t in split_remainder(torch.from_numpy(bits.view(np.float32))))
    expected = [param.copy(), remainder.copy()]
    form = vector_blocks.REMAINDER | vector_blocks.PARAM16 | vector_blocks.GRAD16 | vector_blocks.UNIT
    zeros = np.zeros(param.size, dtype=np.float32)
    _adam_master_blocks(form)(param, np.zeros_like(param), remainder, zeros, zeros.copy(), _STILL_ADAM)
    for got, want in zip((param, remainder), expected):
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, [(hex(bits[i]), int(got[i]), int(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("cpu, on", [("rocketlake", True), ("sapphirerapids", True), ("znver4", False),
                                     ("znver5", False)])
def test_blocks_prefetch_by_target_cpu(monkeypatch, cpu, on):
    """The blocks prefetch on CPUs where it was measured to pay (Intel's), not on AMD's
    (``znver*``: unmeasured); ``PREFETCH_ON`` overrides the choice; ``form`` carries it."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", cpu)
    assert vector_blocks.prefetching() is on
    monkeypatch.setattr(vector_blocks, "available", lambda: True)
    form = vector_blocks.form("param", np.float32, np.float32, None, (np.float32, np.float32), "nearest",
                              False, True)
    assert bool(form & vector_blocks.PREFETCH) is on
    for forced in (True, False):
        monkeypatch.setattr(vector_blocks, "PREFETCH_ON", forced)
        assert vector_blocks.prefetching() is forced


@pytest.mark.parametrize("features, native", [("+avx512f,+avx512dq,+avx512bf16", True),
                                               ("+avx512f,-avx512dq,+avx512bf16", False),
                                               ("+avx512f,+avx512dq,-avx512bf16", False)])
def test_native_rounding_needs_the_conversion_and_the_classification(monkeypatch, features, native):
    """The blocks round bfloat16 through the CPU's conversion only where the target has it
    (AVX512-BF16) and the classification its fast path runs first (AVX512DQ's vfpclassps)."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert vector_blocks.native_bf16() is native


@given(st.integers(0, 1 << 16), st.sampled_from([vector_blocks.ADAM_BLOCK, vector_blocks.SGD_BLOCK]))
@settings(max_examples=200)
def test_prefetches_stop_short_of_a_short_rows_end(n, block):
    """A block's prefetches ask for lines ``PREFETCH_DISTANCE`` bytes on, except in a row shorter
    than a chunk (its tensor's last), where none reaches past the row's end -- for the
    narrowest, 2-byte arrays: ``ahead + (2 * block bytes) <= 2 * n`` counted from the block."""
    from bf16opt._cpu.chunks import CHUNK

    distance = vector_blocks.PREFETCH_DISTANCE
    for j in range(0, n - n % block, block):
        ahead = vector_blocks.prefetch_ahead(j, n, block)
        assert ahead in (0, distance)
        if n < CHUNK:
            assert ahead == 0 or 2 * j + distance + 2 * block <= 2 * n
            # the last blocks that can prefetch do
            assert ahead == distance or j + distance // 2 + block > n
        else:
            assert ahead == distance


@needs_avx512
def test_block_prefetches_come_before_its_loads():
    """In the machine code of a block with ``PREFETCH``, every prefetch comes before the block's
    first vector instruction: LLVM, left to itself, sinks them among the arithmetic, where they
    gained nothing (the fence after them keeps them first).  fp32 Adam: four arrays of eight
    cache lines each."""
    from numba import njit

    from bf16opt._cpu.storage import pointer_to

    block = vector_blocks.ADAM_BLOCK
    form = vector_blocks.UNIT | vector_blocks.PREFETCH

    @njit
    def run(param, grad, exp_avg, exp_avg_sq, scalars):
        values = pointer_to(scalars.ctypes.data, np.float32)
        keys = pointer_to(scalars.ctypes.data, np.uint32)
        for j in range(0, param.size, block):
            vector_blocks.adam_block(form, param.ctypes.data + 4 * j, grad.ctypes.data + 4 * j, 0,
                                     exp_avg.ctypes.data + 4 * j, exp_avg_sq.ctypes.data + 4 * j, values,
                                     np.float32(1.0), keys, j,
                                     vector_blocks.prefetch_ahead(j, param.size, block))

    arrays = [np.zeros(4 * block, np.float32) for _ in range(4)]
    run(*arrays, _STILL_ADAM)
    lines = [line.strip() for line in next(iter(run.inspect_asm().values())).splitlines()]
    prefetches = [k for k, line in enumerate(lines) if line.startswith("prefetcht0")]
    assert len(prefetches) == 4 * 8
    loop = max(k for k in range(prefetches[0]) if lines[k].endswith(":") and lines[k].startswith("."))
    assert not any("zmm" in line for line in lines[loop:prefetches[-1]]), lines[loop:prefetches[-1] + 1]


@needs_avx512
def test_native_rounding_converts_alone_unless_a_lane_is_nan_or_subnormal():
    """In the machine code of a block with ``NATIVE16``, each bfloat16 vector stored is
    classified once (``vfpclassps``: NaN or subnormal) and converted on two paths: by the
    conversion alone, nearly always, and with the canonical NaN and the subnormal correction
    (the bits of both: the rounding tests above).  A bfloat16 param with a float32 master."""
    if not vector_blocks.native_bf16():
        pytest.skip("needs a CPU with AVX512-BF16 (the blocks' native rounding)")
    form = vector_blocks.COPY | vector_blocks.PARAM16 | vector_blocks.GRAD16 | vector_blocks.UNIT \
        | vector_blocks.NATIVE16
    run = _adam_master_blocks(form)
    param = np.zeros(2 * vector_blocks.ADAM_BLOCK, dtype=np.int16)
    zeros = np.zeros(param.size, dtype=np.float32)
    run(param, np.zeros_like(param), zeros.copy(), zeros.copy(), zeros.copy(), _STILL_ADAM)
    code = next(iter(run.inspect_asm().values()))
    vectors = vector_blocks.ADAM_BLOCK // vector_blocks.LANES
    assert code.count("vfpclassps") == vectors and code.count("vcvtneps2bf16") == 2 * vectors


# ---------------------------------------------------------------- property tests
# Random sizes, layouts, scalars, non-finite grads and step counts on the kernels the sweeps
# above compile (their cases and ``one_variant``): a flag drawn freely would compile a
# configuration of its own, about a second each, for what the sweeps already check.
shape_strategy = st.one_of(
    st.sampled_from([(), (1,), (7,), (22,), (64,), (0,)]),
    st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
)
ADAM_KERNELS = [case.values for case in adam_plan_cases(SWEPT_PLANS)]  # (plan, amsgrad, weight_decay, track)
SGD_KERNELS = [case.values for case in sgd_plan_cases(SWEPT_QUALITY_PLANS)]  # (plan, group, first, track)


def _bucket_and_variant(algorithm, plan, shapes, flags, case, **options) -> tuple:
    """The case's bucket and ``run_both``'s arguments for the kernel the sweeps run on it."""
    bucket = make_bucket(algorithm, plan, shapes, flags=flags, seed=case["seed"], specials=case["specials"],
                         **options)
    return bucket, one_variant(bucket)


@st.composite
def adam_cases(draw):
    plan, amsgrad, wd_mode, track = draw(st.sampled_from(ADAM_KERNELS))
    shapes = draw(st.lists(shape_strategy, min_size=1, max_size=4))
    contiguous = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    group = dict(lr=draw(st.sampled_from([1e-4, 1e-3, 0.1, 3.0])),
                 betas=(draw(st.sampled_from([0.0, 0.5, 0.9])),
                        draw(st.sampled_from([0.0, 0.99, 0.999]))),
                 eps=draw(st.sampled_from([0.0, 1e-8, 1e-3])),
                 weight_decay=0.0 if wd_mode == "none" else draw(st.sampled_from([1e-2, 0.3])),
                 decoupled_weight_decay=wd_mode == "decoupled")
    return dict(plan=plan, shapes=shapes, contiguous=contiguous, group=group, amsgrad=amsgrad, track=track,
                specials=draw(st.booleans()), steps=draw(st.integers(1, 4)),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=40)
@given(adam_cases())
def test_adam_matches_reference_property(case):
    group = case["group"]
    bucket, variant_arguments = _bucket_and_variant(ADAM, case["plan"], case["shapes"],
                                                    adam_flags(group, case["amsgrad"]), case,
                                                    layouts=case["contiguous"], track=case["track"])
    run_both(bucket, group, case["steps"], where=str(case), **variant_arguments)


@st.composite
def lion_cases(draw):
    plan = draw(st.sampled_from(SWEPT_PLANS))
    shapes = draw(st.lists(shape_strategy, min_size=1, max_size=4))
    contiguous = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    group = dict(lr=draw(st.sampled_from([1e-5, 1e-4, 0.1])),
                 betas=(draw(st.sampled_from([0.0, 0.9, 0.95])),
                        draw(st.sampled_from([0.0, 0.99]))),
                 weight_decay=draw(st.sampled_from([0.0, 0.1, 1.0])))
    return dict(plan=plan, shapes=shapes, contiguous=contiguous, group=group, specials=draw(st.booleans()),
                steps=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=30)
@given(lion_cases())
def test_lion_matches_reference_property(case):
    bucket, variant_arguments = _bucket_and_variant(LION, case["plan"], case["shapes"], {}, case,
                                                    layouts=case["contiguous"])
    run_both(bucket, case["group"], case["steps"], where=str(case), **variant_arguments)


# a 4-d shape may be laid out channels_last
sgd_shape_strategy = st.one_of(shape_strategy,
                               st.lists(st.integers(1, 6), min_size=4, max_size=4).map(tuple))
unit_interval = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.99]), st.floats(0.0, 1.0, exclude_max=True))
positive_unit_interval = st.one_of(st.sampled_from([0.5, 0.9, 0.99]),
                                   st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))


@st.composite
def sgd_cases(draw):
    """A swept kernel (this run's plans, quality ones included: ``tests/sweeps.py``; momentum
    or not, nesterov, L2, telemetry as its case), its scalars drawn, the buffer's first step
    first; contiguous / transposed / strided / channels_last."""
    plan, kernel_group, first, track = draw(st.sampled_from(SGD_KERNELS))
    shapes = draw(st.lists(sgd_shape_strategy, min_size=1, max_size=4))
    layouts = [draw(st.sampled_from(["contiguous", "transposed"]
                                    + (["channels_last"] if len(shape) == 4 else [])))
               for shape in shapes]
    momentum = draw(positive_unit_interval) if kernel_group["momentum"] else 0.0
    weight_decay = draw(st.sampled_from([1e-2, 0.3])) if kernel_group["weight_decay"] else 0.0
    group = sgd_group(lr=draw(st.sampled_from([1e-4, 1e-3, 0.1, 3.0])), momentum=momentum,
                      dampening=draw(unit_interval), weight_decay=weight_decay, nesterov=kernel_group["nesterov"])
    return dict(plan=plan, shapes=shapes, layouts=layouts, group=group, first=first, track=track,
                specials=draw(st.booleans()), steps=draw(st.integers(1, 4)),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=30)
@given(sgd_cases())
def test_sgd_matches_reference_property(case):
    group = case["group"]
    bucket, variant_arguments = _bucket_and_variant(SGD, case["plan"], case["shapes"],
                                                    sgd_flags(group, first=case["first"]), case,
                                                    track=case["track"], layouts=case["layouts"])
    if group["nesterov"] or variant_arguments.get("unit"):  # (nesterov, and the unit kernel, need none)
        group["dampening"] = 0.0
    run_both(bucket, group, case["steps"], where=str(case), **variant_arguments)


# ---------------------------------------------------------------- through the optimizers
def _model_params(dtype_list, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 6), (6,), (), (3, 5, 2), (130,)]
    params = []
    for shape, dtype in zip(shapes, dtype_list):
        params.append(torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)))
    return params


PLAIN_PRESETS = sorted(name for name, precision in PRESETS.items()
                       if precision.rounding == "nearest" and precision.compensation is None)

# per optimizer: (its options, the second param group's)
OPTIMIZER_OPTIONS = {
    "Adam": (dict(amsgrad=True), dict(maximize=True)),
    "AdamW": (dict(amsgrad=True), dict(maximize=True)),
    "Lion": ({}, dict(maximize=True)),
    "SGD": (dict(momentum=0.9, dampening=0.1), dict(maximize=True)),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZER_OPTIONS))
@pytest.mark.parametrize("precision", PLAIN_PRESETS)
def test_optimizer_numba_equals_reference(optimizer, precision):
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32]  # float16: 30 elements
    options, second_group = OPTIMIZER_OPTIONS[optimizer]
    results = {}
    for backend in ("reference", "numba"):
        params = _model_params(dtypes, 0)
        cls = getattr(bf16opt, optimizer)
        opt = cls([{"params": params[:2]}, {"params": params[2:], **second_group}],
                  weight_decay=0.1, precision=precision, backend=backend, **options)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        results[backend] = ([p.detach().clone() for p in params], state)
    (ref_params, ref_state), (nb_params, nb_state) = results["reference"], results["numba"]
    for a, b in zip(ref_params, nb_params):
        assert torch.equal(bits(a), bits(b))
    for sa, sb in zip(ref_state, nb_state):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(bits(sa[key]), bits(sb[key])), key


def test_every_configuration_has_a_chunk_function(monkeypatch):
    """Every backend runs every plan: each (algorithm, plan, flags, telemetry)
    configuration maps to a chunk function call the Numba kernels accept (its
    arguments checked against the real signature; nothing is compiled here)."""
    import importlib
    import inspect
    import itertools

    from bf16opt._cpu.storage import MOMENT_ROUNDINGS, WEIGHT_POLICIES

    plans = all_plans(quality=True)
    assert len(plans) == 57
    for algorithm in (ADAM, LION, SGD):
        module = importlib.import_module(f"bf16opt._cpu.{algorithm.name}")
        signature = inspect.signature(module.chunk_function.__wrapped__)
        calls = []
        monkeypatch.setattr(module, "chunk_function",
                            lambda *args, **kwargs: calls.append(signature.bind(*args, **kwargs)))
        for plan in plans:
            for values in itertools.product((False, True), repeat=len(algorithm.flags) + 1):
                config = kernel_config(algorithm, plan, tuple(zip(algorithm.flags, values)), values[-1])
                numba_backend.chunk_function(config)
        assert len(calls) == len(plans) * 2 ** (len(algorithm.flags) + 1)
        for call in calls:
            formats, weights, rounding, track = call.args[:4]
            assert len(formats) == len(algorithm.roles), algorithm.name
            assert set(formats) <= {np.float32, np.int16, np.uint16}
            assert weights in WEIGHT_POLICIES and rounding in MOMENT_ROUNDINGS
            assert isinstance(track, bool)


def test_a_buffers_first_step_runs_the_later_steps_chunk_function():
    """A momentum buffer's first SGD step compiles nothing more than its later steps: it
    runs their chunk function (on a buffer of -0.0; its bits are the reference's in
    test_sgd_every_configuration), except with a q8 buffer."""
    plans = all_plans(quality=True) + [plan_for(PRESETS["bf16-sr-q8"], torch.bfloat16)]
    for plan in plans:
        for nesterov in (False, True):
            flags = {"momentum": True, "l2": False, "maximize": False, "nesterov": nesterov}
            first, later = (kernel_config(SGD, plan, tuple({**flags, "first": f}.items())) for f in (True, False))
            quantized = plan.exp_avg == Q8
            assert (numba_backend.chunk_arguments(first) == numba_backend.chunk_arguments(later)) != quantized
            assert numba_backend.first_as_later(first) != quantized
            assert not numba_backend.first_as_later(later)


def test_step_bumps_the_autograd_version_counter():
    param = torch.nn.Parameter(torch.randn(10))
    param.grad = torch.randn(10)
    opt = bf16opt.AdamW([param], backend="numba")
    before = param._version
    opt.step()
    assert param._version > before


def test_chunk_table_layout():
    from bf16opt._cpu.chunks import build_chunk_table
    # columns: buffer addresses, chunk length, first element in the tensor, tensor index
    table = build_chunk_table(np.array([[1000, 5000], [20000, 0]]), np.array([2, 4]),
                              np.array([10, 0]), chunk=4)
    assert table.tolist() == [[1000, 5000, 4, 0, 0], [1008, 5016, 4, 4, 0], [1016, 5032, 2, 8, 0]]
    table = build_chunk_table(np.array([[0, 0], [100, 200]]), np.array([4, 0]),
                              np.array([0, 5]), chunk=4)
    assert table.tolist() == [[100, 200, 4, 0, 1], [116, 200, 1, 4, 1]]


@settings(max_examples=60)
@given(numels=st.lists(st.integers(0, 5000), min_size=1, max_size=40), parts=st.integers(1, 9))
def test_balanced_bounds_give_each_thread_about_equal_elements(numels, parts):
    """Rows of unequal length (small tensors) are split by elements, not by row count: each
    thread's contiguous range holds the total / threads elements within one chunk."""
    from bf16opt._cpu.chunks import balanced_bounds, build_chunk_table
    chunk = 512
    addresses = np.zeros((len(numels), 1), dtype=np.int64)
    table = build_chunk_table(addresses, np.array([4]), np.array(numels), chunk=chunk)
    bounds = balanced_bounds(table, parts)
    assert bounds.dtype == np.int64 and bounds.size == parts + 1
    assert bounds[0] == 0 and bounds[-1] == table.shape[0] and np.all(np.diff(bounds) >= 0)
    done = np.concatenate(([0], np.cumsum(table[:, -3])))
    per_part = done[bounds[1:]] - done[bounds[:-1]]
    assert per_part.sum() == sum(numels)
    assert np.all(np.abs(per_part - sum(numels) / parts) < chunk + 1)  # +1: targets are floored


def test_balanced_bounds_refuse_more_rows_than_the_driver_counts():
    from bf16opt._cpu.chunks import balanced_bounds
    huge = np.lib.stride_tricks.as_strided(np.zeros(4, dtype=np.int64), shape=(1 << 31, 4), strides=(0, 8))
    with pytest.raises(ValueError, match="rows"):
        balanced_bounds(huge, 2)


@functools.lru_cache(maxsize=None)
def _row_work():
    """A chunk function marking its row: counts[0] += 1, counts[1] = the Numba thread that ran
    it, after ``scalars[0]`` rounds of xorshift (work the compiler cannot fold)."""
    import numba
    from bf16opt._cpu.chunks import CHUNK_SIGNATURE

    @numba.cfunc(CHUNK_SIGNATURE)
    def row_work(row, scalars, keys, counts):
        x = np.uint32(row[1] + 1)
        for _ in range(np.int64(scalars[0])):
            x ^= x << np.uint32(13)
            x ^= x >> np.uint32(17)
            x ^= x << np.uint32(5)
        counts[0] += 1
        counts[1] = numba.get_thread_id()
        counts[2] = x

    return row_work


def _drive(rows: int, bounds, rounds: int) -> np.ndarray:
    from bf16opt._cpu.chunks import COUNTERS, KEYS, run_chunks
    table = np.zeros((rows, 4), dtype=np.int64)
    table[:, 1] = np.arange(rows)
    row_counts = np.zeros((rows, COUNTERS), dtype=np.int64)
    run_chunks(_row_work().address, table, np.array([rounds], dtype=np.float32),
               np.zeros((1, KEYS), dtype=np.uint32), row_counts, np.asarray(bounds, dtype=np.int64))
    return row_counts


@settings(max_examples=40)
@given(rows=st.integers(0, 80), cuts=st.lists(st.integers(0, 80), max_size=5))
def test_parallel_driver_runs_every_row_once_however_the_ranges_are_cut(rows, cuts):
    """Threads done with their own range take rows from the others': still each row exactly
    once, for ranges of any sizes (empty ones, all rows in one range, more ranges than threads)."""
    bounds = [0, *sorted(min(c, rows) for c in cuts), rows]
    row_counts = _drive(rows, bounds, rounds=50)
    assert row_counts[:, 0].tolist() == [1] * rows


def test_parallel_driver_shares_a_range_left_to_one_thread():
    """All rows in thread 0's range: the other threads take rows from its back (work stealing),
    so a thread slowed by other work on its core does not hold up the step."""
    import numba
    if numba.get_num_threads() < 2:
        pytest.skip("needs 2 Numba threads (this process has one core)")
    rows = 200
    for _ in range(5):  # (a thread the OS keeps off its core for the whole call takes nothing)
        row_counts = _drive(rows, [0, rows] + [rows] * (numba.get_num_threads() - 1), rounds=100_000)
        assert row_counts[:, 0].tolist() == [1] * rows
        if np.unique(row_counts[:, 1]).size > 1:
            break
    assert np.unique(row_counts[:, 1]).size > 1


@settings(max_examples=40)
@given(rows_per_chunk=st.lists(st.integers(1, 6), max_size=30),
       cut=st.tuples(st.integers(0, 30), st.integers(0, 30)), parts=st.integers(1, 5), serial=st.booleans())
def test_ordered_driver_runs_each_row_of_its_chunks_once_and_counts_them(rows_per_chunk, cut, parts, serial):
    """The offload pipeline's driver: rows of chunks first:end each exactly once, no other row,
    and each chunk's count of finished rows is its row count (what the pipeline waits for)."""
    from bf16opt._cpu.chunks import (COUNTERS, KEYS, rows_done, run_rows_in_order,
                                     run_rows_in_order_serial)
    chunks = len(rows_per_chunk)
    first, end = sorted(min(c, chunks) for c in cut)
    chunk_of_row = np.repeat(np.arange(chunks, dtype=np.int64), rows_per_chunk)
    first_rows = np.concatenate(([0], np.cumsum(rows_per_chunk, dtype=np.int64)))
    rows = chunk_of_row.size
    table = np.zeros((rows, 4), dtype=np.int64)
    table[:, 1] = np.arange(rows)
    row_counts = np.zeros((rows, COUNTERS), dtype=np.int64)
    done = np.zeros(chunks, dtype=np.int64)
    driver = run_rows_in_order_serial if serial else run_rows_in_order
    driver(_row_work().address, table, np.array([20], dtype=np.float32),
           np.zeros((1, KEYS), dtype=np.uint32), row_counts, first_rows[first], first_rows[end],
           chunk_of_row, done, parts)
    inside = (chunk_of_row >= first) & (chunk_of_row < end)
    assert row_counts[:, 0].tolist() == inside.astype(np.int64).tolist()
    expected = [rows_per_chunk[k] if first <= k < end else 0 for k in range(chunks)]
    assert [rows_done(done, k) for k in range(chunks)] == expected


def test_ordered_driver_releases_the_gil():
    """The driving thread runs Python (enqueues uploads) while the host update runs."""
    from bf16opt._cpu.chunks import rows_done, run_rows_in_order, run_rows_in_order_serial
    for driver in (run_rows_in_order, run_rows_in_order_serial, rows_done):
        assert driver.targetoptions.get("nogil") is True


# ---------------------------------------------------------------- backend selection
def test_resolve_backend_numba_and_auto_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend("numba", cpu).name == "numba"
    assert resolve_backend("auto", cpu).name == "numba"
    assert resolve_backend("reference", cpu).name == "reference"


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta"])
def test_numba_rejects_non_cpu_devices(device):
    with pytest.raises(ValueError, match="CPU"):
        resolve_backend("numba", torch.device(device))


def test_numba_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(numba_backend, "available", lambda: False)
    with pytest.raises(ValueError, match="numba"):
        resolve_backend("numba", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")).name == "reference"


# ---------------------------------------------------------------- processes
def _run_python(code: str, env_extra: dict | None = None, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.update(env_extra or {})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, env=env, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_import_compiles_nothing_and_is_fast():
    out = _run_python("""
        import sys, time
        import torch
        start = time.perf_counter()
        import bf16opt
        elapsed = time.perf_counter() - start
        print(elapsed, "numba" in sys.modules, "bf16opt._cpu.adam" in sys.modules)
    """)
    elapsed, numba_loaded, kernels_loaded = out.split()
    assert float(elapsed) < 1.0
    assert numba_loaded == "False" and kernels_loaded == "False"




_THREAD_COUNT_SCRIPT = """
    import hashlib, numba, torch, bf16opt
    assert numba.get_num_threads() == {threads}
    gen = torch.Generator().manual_seed(0)
    shapes = [(1048577,), (300, 700), (22,), ()]
    out = hashlib.sha256()
    # (one preset per master policy that splits work across threads differently: random
    # streams, a compensation buffer, a remainder; the plainer presets share their drivers)
    for precision, dtype in (("bf16-sr", torch.bfloat16), ("bf16-kahan", torch.bfloat16),
                             ("fp32-remainder", torch.bfloat16)):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        opt = bf16opt.AdamW(params, precision=precision, backend="numba", amsgrad=True, seed=5,
                            track_precision=True)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
            out.update(repr(sorted(opt.precision_stats().items(), key=str)).encode())
        for p in params:
            for t in [p.detach(), *opt.state[p].values()]:  # (the step count is a 0-d tensor)
                out.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    print(out.hexdigest())
"""


def test_results_independent_of_thread_count():
    digests = {threads: _run_python(_THREAD_COUNT_SCRIPT.format(threads=threads),
                                    {"NUMBA_NUM_THREADS": str(threads)}).strip()
               for threads in (1, 2)}
    assert len(digests[1]) == 64 and digests[1] == digests[2]


def test_a_one_row_call_runs_on_the_calling_thread(monkeypatch):
    """A kernel call over one chunk row takes the serial driver (one thread would run it
    anyway), over two rows the parallel one; the bits are the reference's either way."""
    from bf16opt._cpu import chunks as compiled_chunks
    from bf16opt.backends import numba as numba_backend

    calls = []
    for name in ("run_chunks", "run_chunks_serial"):
        driver = getattr(compiled_chunks, name)
        monkeypatch.setattr(compiled_chunks, name,
                            lambda *args, _driver=driver, _name=name: (calls.append(_name), _driver(*args)))
    for numel, driver in ((compiled_chunks.CHUNK, "run_chunks_serial"), (compiled_chunks.CHUNK + 1, "run_chunks")):
        params = {}
        for backend in ("numba", "reference"):
            torch.manual_seed(0)
            param = torch.nn.Parameter(torch.randn(numel).bfloat16())
            param.grad = torch.randn(numel).bfloat16()
            bf16opt.AdamW([param], precision="bf16-sr", backend=backend, seed=3).step()
            params[backend] = param
        assert calls[-1] == driver and not numba_backend._FORKED
        assert torch.equal(bits(params["numba"].detach()), bits(params["reference"].detach()))


def test_second_process_loads_kernels_from_disk_cache(tmp_path):
    script = """
        import torch, bf16opt
        from bf16opt._cpu.chunks import run_chunks
        from bf16opt.algorithms import LION, kernel_config
        from bf16opt.backends import numba as numba_backend
        from bf16opt.precision import PRESETS, plan_for
        from bf16opt._cpu.chunks import CHUNK
        p = torch.nn.Parameter(torch.randn(2 * CHUNK).bfloat16())  # (two rows: the parallel driver)
        p.grad = torch.randn(2 * CHUNK).bfloat16()
        bf16opt.Lion([p], precision="bf16", backend="numba", maximize=True).step()
        config = kernel_config(LION, plan_for(PRESETS["bf16"], torch.bfloat16), (("maximize", True),))
        chunk = numba_backend.chunk_function(config)  # memoised: the one the step used
        stats = run_chunks.stats
        print(sum(stats.cache_hits.values()) + chunk.cache_hits,
              sum(stats.cache_misses.values()) + 1 - chunk.cache_hits)
    """
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba_cache")}
    # the parallel driver and the configuration's chunk function: compiled, then loaded
    hits, misses = map(int, _run_python(script, env).split())
    assert (hits, misses) == (0, 2)
    hits, misses = map(int, _run_python(script, env).split())
    assert (hits, misses) == (2, 0)


_TRAINING_SCRIPT = """
    import torch, bf16opt
    from torch.utils.data import DataLoader, TensorDataset

    def train(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1)).to(torch.bfloat16)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16-states",
                            backend=backend)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        x = torch.randn(64, 8)
        data = TensorDataset(x.to(torch.bfloat16), x.sum(1, keepdim=True).to(torch.bfloat16))

        def one_step(xb, yb):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            return loss.item()

        losses = [one_step(*data[:16])]
        # fork the DataLoader workers after a numba step, then keep training
        for xb, yb in DataLoader(data, batch_size=16, num_workers=2,
                                 multiprocessing_context="fork"):
            losses.append(one_step(xb, yb))
        return losses, [p.detach().clone() for p in model.parameters()], opt.param_groups[0]["lr"]

    losses, params, lr = train("numba")
    ref_losses, ref_params, ref_lr = train("reference")
    assert len(losses) == 5 and lr == ref_lr == 1e-2 * 0.25, (losses, lr)
    print(losses == ref_losses, all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                    for a, b in zip(params, ref_params)))
"""


def test_dataloader_fork_clip_grad_norm_and_scheduler():
    """A real loop: numba step, then DataLoader(num_workers=2) forks and training goes on
    (clip_grad_norm_, StepLR); losses and params equal the reference backend's."""
    same_losses, same_params = _run_python(_TRAINING_SCRIPT, timeout=300).split()
    assert same_losses == "True" and same_params == "True"


_TWO_THREADS_SCRIPT = """
    import threading, torch, bf16opt

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(1 << 16, generator=g).bfloat16()) for _ in range(3)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        return params, bf16opt.AdamW(params, precision="bf16", backend="numba")

    def run(opt, steps=100):
        for _ in range(steps):
            opt.step()

    together, apart = [make(0), make(1)], [make(0), make(1)]
    threads = [threading.Thread(target=run, args=(opt,)) for _, opt in together]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, opt in apart:
        run(opt)
    print(all(torch.equal(a.view(torch.int16), b.view(torch.int16))
              for (pa, _), (pb, _) in zip(together, apart) for a, b in zip(pa, pb)))
"""


def test_steps_from_two_python_threads_under_workqueue():
    """Two optimizers stepped from two Python threads at once: no abort under Numba's
    workqueue layer (which kills the process on concurrent parallel calls unless the
    backend serialises them), and the same bits as stepping them one after the other."""
    out = _run_python(_TWO_THREADS_SCRIPT, {"NUMBA_THREADING_LAYER": "workqueue"}, timeout=300)
    assert out.split() == ["True"]


# ---------------------------------------------------------------- memory layouts
@pytest.mark.parametrize("preset", ["bf16", "fp32", "bf16-kahan", "fp32-remainder", "bf16-sr"])
def test_channels_last_conv_training_matches_reference(preset):
    """channels_last conv weights (states keep the layout): bit-identical to the reference,
    whether the kernel walks them in memory order in place or through copies (SR)."""
    def train(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        model = model.to(torch.bfloat16, memory_format=torch.channels_last)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision=preset, backend=backend, seed=3)
        x = torch.randn(4, 3, 9, 9).to(torch.bfloat16, memory_format=torch.channels_last)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        return list(model.parameters()), opt

    params, opt = train("numba")
    ref_params, ref_opt = train("reference")
    assert params[0].is_contiguous(memory_format=torch.channels_last) and not params[0].is_contiguous()
    for p, q in zip(params, ref_params):
        assert torch.equal(bits(p), bits(q))
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert torch.equal(bits(value), bits(ref_opt.state[q][key])), key


def test_dense_permuted_buffers_are_updated_in_place_unless_stochastic():
    """Same-layout dense buffers go to the kernel as they are (no copies); a strided view,
    a mixed layout, or stochastic rounding (index-dependent bits) goes through copies."""
    cl = dict(memory_format=torch.channels_last)
    param = torch.zeros(2, 3, 4, 5, dtype=torch.bfloat16).to(**cl)
    grad, moment = torch.zeros_like(param), torch.zeros_like(param, dtype=torch.float32)
    nearest = StoragePlan(torch.bfloat16, None, torch.float32, torch.float32)
    stochastic = StoragePlan(torch.bfloat16, None, torch.float32, torch.float32, rounding="stochastic")

    def stage(plan, param, grad, moment):
        bucket = Bucket.of(kernel_config(LION, plan), {"param": [param], "grad": [grad], "exp_avg": [moment]},
                           indices=[0])
        return staging.stage(bucket, "numba")

    launch = stage(nearest, param, grad, moment)
    assert launch.write_back == [] and launch.tensors[0][0] is param
    assert launch.pointers[0].tolist() == [param.data_ptr(), grad.data_ptr(), 0, moment.data_ptr()]
    launch = stage(stochastic, param, grad, moment)
    assert [t for t, _ in launch.write_back] == [param, moment]
    launch = stage(nearest, param, grad.contiguous(), moment)
    assert [t for t, _ in launch.write_back] == [param, moment]
    strided = torch.zeros(2, 8, dtype=torch.bfloat16)[:, ::2]
    launch = stage(nearest, strided, strided.clone(), torch.zeros(2, 4))
    assert [t for t, _ in launch.write_back] == [strided]


# ---------------------------------------------------------------- memory: no model-sized temporaries
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="measuring peak RSS needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("optimizer", ["AdamW", "Lion"])
@pytest.mark.parametrize("preset", ["fp32", "bf16", "bf16-sr", "bf16-kahan", "fp32-remainder"])
def test_step_allocates_nothing_the_size_of_the_params(optimizer, preset):
    """The kernels update the tensors' own memory: a warm step's peak resident memory grows by
    far less than one bf16 copy of the params.  Warm means after the steps that compile or load
    code (the first makes the state, the second keeps the launch, the third first reuses it and
    loads the step cache's helpers), which a fresh Numba cache compiles on the spot.  The bound
    allows each Numba thread a little stack; the params are sized to stay 4x above it."""
    from bf16opt.compare import StepPeakMemory

    bound = (1 << 20) + numba_backend.threads() * (64 << 10)
    n = max(1 << 23, 4 * bound // 2)  # bf16: 2 bytes per element
    params = [torch.nn.Parameter(torch.full((n // 2,), 0.5, dtype=torch.bfloat16)) for _ in range(2)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = getattr(bf16opt, optimizer)(params, precision=preset, backend="numba")
    for _ in range(3):
        opt.step()
    for _ in range(2):  # a one-off at the first measured step would be a warm-up missed
        peak = StepPeakMemory()
        if not peak.available:
            pytest.skip("this kernel does not let the process reset its peak RSS (/proc/self/clear_refs)")
        with peak:
            opt.step()
        assert peak.peak < bound, (f"a step grew resident memory by {peak.mib:.1f} MiB, a copy of the "
                                   f"params is {2 * n / 2 ** 20:.0f} MiB")


@pytest.mark.parametrize("algorithm, change", [("SGD", "dampening"), ("SGD", "grad scale"), ("SGD", "maximize"),
                                               ("AdamW", "grad scale"), ("AdamW", "maximize"),
                                               ("Lion", "grad scale"), ("Lion", "maximize")])
@pytest.mark.parametrize("preset", ["bf16", "fp32", "bf16-kahan", "bf16-sr"])
def test_kernels_without_multiplications_by_one_have_the_same_bits(monkeypatch, preset, algorithm, change):
    """The kernels leave out their multiplications by 1 (the unscaling factor; SGD's
    1 - dampening) at the steps whose scalars make them 1, and only there -- also when a kept
    launch is reused and the scalars change under it -- with the reference's bits at every
    step, NaN and infinite grads included."""
    used = []
    chunk_function = numba_backend.chunk_function
    monkeypatch.setattr(numba_backend, "chunk_function",
                        lambda config, unit=False: used.append(unit) or chunk_function(config, unit))
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(shape, generator=gen).bfloat16() for shape in [(6, 6), (5,), (130,)]]
    params = {backend: [torch.nn.Parameter(v.clone()) for v in values] for backend in ("numba", "reference")}
    cls, options = {"SGD": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)),
                    "AdamW": (bf16opt.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
                    "Lion": (bf16opt.Lion, dict(lr=1e-3, weight_decay=1e-2))}[algorithm]
    opts = {backend: cls(ps, precision=preset, backend=backend, **options) for backend, ps in params.items()}

    def step(changed: bool) -> None:
        grads = [torch.randn(v.shape, generator=gen).bfloat16() for v in values]
        # special values, in the paired loop's words and the element loop alike (130 is even, 5 odd)
        grads[2][:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        grads[1][-1] = float("nan")
        for backend, opt in opts.items():
            for p, g in zip(params[backend], grads):
                p.grad = g.clone()
            if algorithm == "SGD":
                opt.param_groups[0]["dampening"] = 0.25 if changed and change == "dampening" else 0.0
            opt.param_groups[0]["maximize"] = changed and change == "maximize"
            scale = torch.tensor([4.0 if changed and change == "grad scale" else 1.0])
            opt.step(grad_scale=scale, found_inf=torch.zeros(1))
        for p, q in zip(params["numba"], params["reference"]):
            assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
        for p, q in zip(params["numba"], params["reference"]):
            for key, value in opts["numba"].state[p].items():
                other = opts["reference"].state[q][key]
                assert torch.equal(value.view(-1).view(torch.uint8), other.view(-1).view(torch.uint8)), key

    seen = set()
    for changed in (False, False, False, True, True, False):
        used.clear()
        step(changed)
        assert set(used) <= {not changed}  # (a reused launch asks for its variant once: memoised)
        seen.update(used)
    assert seen == {True, False}


@pytest.mark.parametrize("algorithm", [ADAM, LION, SGD])
def test_the_variant_without_multiplications_by_one_is_for_untracked_steps(algorithm):
    """Chosen when the unscaling factor is exactly 1 (and SGD's 1 - dampening), not with a
    grad scale, maximizing, or telemetry (a diagnostic run: one compilation per configuration)."""
    plan = plan_for(PRESETS["bf16"], torch.bfloat16)
    flags = tuple((name, False) for name in algorithm.flags)
    ones = np.ones(len(algorithm.scalars._fields) + 1, dtype=np.float32)  # (every scalar 1, sign +1)
    for track, inv_grad_scale, sign, unit in [(False, 1.0, 1.0, True), (False, 0.25, 1.0, False),
                                              (False, 1.0, -1.0, False), (True, 1.0, 1.0, False)]:
        values = ones.copy()
        values[-2:] = inv_grad_scale, sign
        assert numba_backend.unit_scalars(kernel_config(algorithm, plan, flags, track), values) is unit


@pytest.mark.parametrize("preset", ["fp32-remainder", "fp32-remainder-q8"])
def test_a_param_zeroed_or_made_inf_between_steps_keeps_a_number_master(preset):
    """A remainder preset's param edited between steps (pruned to +-0, set to +-inf) beside
    its old remainder: the master is the edited param, not a NaN join, on the vectorised
    kernels as in the reference (storage.join_remainder)."""
    runs = {}
    for backend in ("reference", "numba"):
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8192, generator=g).to(torch.bfloat16))
        opt = bf16opt.AdamW([p], lr=1e-3, precision=preset, backend=backend)
        p.grad = torch.randn(8192, generator=g).to(torch.bfloat16)
        opt.step()
        with torch.no_grad():
            p[:4096].mul_(0)  # +0 and -0
            p[4096:4100] = torch.tensor([float("inf"), -float("inf")] * 2)
        p.grad = torch.randn(8192, generator=g).to(torch.bfloat16) * 1e-3
        opt.step()
        runs[backend] = (p.detach().clone(), opt.state[p]["remainder"].clone())
    (ours, our_remainder), (theirs, their_remainder) = runs["numba"], runs["reference"]
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert torch.equal(our_remainder, their_remainder)
    assert not ours.isnan().any()


EDITED_COPY_CASES = [(algorithm, preset, dtype) for algorithm in (ADAM, LION, SGD)
                     for preset in ("fp32", "bf16-states") for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("algorithm, preset, dtype", EDITED_COPY_CASES,
                         ids=[f"{a.name}-{p}-{str(d)[6:]}" for a, p, d in EDITED_COPY_CASES])
def test_params_edited_beside_a_master_copy_match_the_reference(algorithm, preset, dtype):
    """A float32 master copy whose param was edited between steps in some elements (another
    value, +-0, one ulp off, the sign flipped, +-inf, a non-canonical NaN; ``buckets.edited_copy``)
    beside masters with ties, NaN and values rounding to inf or -0: the update starts from the
    edited param there (storage.join_copy), in the element loop and in the hand-vectorised
    blocks (bfloat16 params on an AVX-512 CPU), as in the reference, bit for bit, over steps."""
    group, flags = (ADAM_GROUPS["decoupled"], adam_flags(ADAM_GROUPS["decoupled"], amsgrad=False)) \
        if algorithm is ADAM else (SGD_GROUPS["plain"], sgd_flags(SGD_GROUPS["plain"])) if algorithm is SGD \
        else (LION_GROUP, dict(maximize=False))
    bucket = make_bucket(algorithm, plan_for(PRESETS[preset], dtype), [(1000,), (256,), (3, 129), (7,)],
                         flags=flags, seed=47, misalign=0.3, edited=0.3)
    written = [encode(m, p.dtype).view(torch.int16) == p.view(torch.int16)
               for p, m in zip(bucket.params, bucket["companion"])]
    assert not all(bool(w.all()) for w in written) and any(bool(w.any()) for w in written)
    if dtype == torch.bfloat16 and vector_blocks.available():
        assert numba_backend.chunk_function(bucket.config, True).vectorised
    run_both(bucket, group, steps=3, where=f"{algorithm.name} {preset} {dtype} edited", **one_variant(bucket))
