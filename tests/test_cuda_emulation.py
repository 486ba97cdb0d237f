"""The CUDA kernels, run on the CPU, equal the reference backend bit for bit.

The .cu sources are compiled by the host C++ compiler with tests/cuda_emulation/
emulation.h (grid/block loops, bit-cast intrinsics, atomicAdd) and driven through the
CuPy adapter's own ``run``/``prepare_launch``: same kernel names, same chunk table,
same scalars, seed and step; only the launch itself is swapped for the CPU loop over
blocks and threads.  The oracle is ``bf16opt.backends.reference`` itself.

Every instantiation the adapter can request (``cupy.kernel_configs``) is exercised: all
storage plans of ``all_plans(quality=True)`` (stochastic rounding, Kahan with bf16/fp32
buffers, bf16 + int16 remainder included) x the algorithm's template flags (Adam's
amsgrad, SGD's momentum) x precision telemetry on/off, crossed with run-time flags:
maximize and L2/decoupled decay for Adam, maximize for Lion, maximize, L2, nesterov and
the momentum buffer's first step for SGD, and with float32 grads of bfloat16/float16 params
(the kFloat32Grad bit) for half of those combinations; the scalars' inv_grad_scale (GradScaler's
folded unscale) is 1, a power of two or 1/3.  Buckets hold many tensors of odd sizes, views
at odd offsets (so chunks take the 16-byte vector path, its scalar tail, or the
all-scalar misaligned path), a non-contiguous tensor (staged through a contiguous
copy), NaN/inf/subnormal/tie values, optimizer indices past 2**32 (the random streams
hash them modulo 2**32), steps across 2**32 (the step's high word is folded into the
seed's), and several consecutive steps (stochastic rounding draws new bits every step).
Every role -- the Kahan buffers and the remainders included -- and the telemetry counts
are compared.  The storage helpers themselves (stochastic encoders, stream keys, the
remainder split) are compared with bf16opt/storage.py on edge values.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bf16opt import storage
from bf16opt.algorithms import ALGORITHMS, KernelConfig, kernel_config
from bf16opt.backends import Bucket, reference
from bf16opt.backends import cupy as cuda_backend
from bf16opt.backends.cuda_compile import KINDS
import buckets  # noqa: E402  (tests/ is on sys.path, as for cuda_emulation)
from cuda_emulation import emulator

pytestmark = pytest.mark.skipif(emulator.compiler_problem() is not None,
                                reason=f"CUDA emulation needs a host C++ compiler: "
                                       f"{emulator.compiler_problem()}")


# ---------------------------------------------------------------- configurations
def with_flags(config: KernelConfig, float32_grad: bool = None, **flags) -> KernelConfig:
    """``config`` with ``flags`` changed (configurations are memoised values: a new one is
    asked for, never edited); ``float32_grad``: float32 grads (16-bit params only)."""
    grad = config.grad if float32_grad is None else \
        (torch.float32 if float32_grad else config.plan.param)
    return kernel_config(config.algorithm, config.plan,
                         tuple({**dict(config.flags), **flags}.items()), config.track, grad)


def sgd_runtime_flags(config: KernelConfig) -> list:
    """SGD's run-time flag combinations the optimizer can ask for: nesterov and the
    buffer's first step only exist with a momentum buffer."""
    extra = [dict(nesterov=n, first=f) for n in (False, True) for f in (False, True)] \
        if config.flag("momentum") else [{}]
    return [dict(maximize=m, l2=l2, **e) for m in (False, True) for l2 in (False, True) for e in extra]


# (kernel name, KernelConfig) of every instantiation the adapter can request, crossed with
# the run-time flags (which never change the instantiation)
# (16-bit params read float32 grads in half the combinations: the grad's dtype is a run-time
# bit of the same instantiation)
def float32_grad(config: KernelConfig, k: int) -> bool:
    return config.plan.param != torch.float32 and k % 2 == 1


ADAM_CONFIGS = [(name, with_flags(config, maximize=maximize, l2=l2,
                                  float32_grad=float32_grad(config, maximize + l2)))
                for name, config in cuda_backend.kernel_configs("adam").items()
                for maximize in (False, True) for l2 in (False, True)]
LION_CONFIGS = [(name, with_flags(config, maximize=maximize, float32_grad=float32_grad(config, maximize)))
                for name, config in cuda_backend.kernel_configs("lion").items()
                for maximize in (False, True)]
SGD_CONFIGS = [(name, with_flags(config, **flags, float32_grad=float32_grad(config, k)))
               for name, config in cuda_backend.kernel_configs("sgd").items()
               for k, flags in enumerate(sgd_runtime_flags(config))]
CONFIGS = {"adam": ADAM_CONFIGS, "lion": LION_CONFIGS, "sgd": SGD_CONFIGS}

# SGD's four run-time flags give 16 combinations per momentum instantiation; the
# every-instantiation test runs each momentum instantiation with five of them, a covering
# array of strength 2 (every value pair of every two flags occurs), alternating with its
# complement from one instantiation to the next, so each flag is on and off for every
# instantiation and 10 of the 16 combinations run on each.  Instantiations without
# momentum run every (maximize, l2).  The random tests draw from the full cross.
SGD_COVERING = ((0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0))


def sgd_instantiation_cases() -> list:
    cases = []
    for k, (name, config) in enumerate(cuda_backend.kernel_configs("sgd").items()):
        if not config.flag("momentum"):
            cases += [(name, with_flags(config, **flags, float32_grad=float32_grad(config, j)))
                      for j, flags in enumerate(sgd_runtime_flags(config))]
            continue
        for j, row in enumerate(SGD_COVERING):
            flags = {flag: bool(v) != bool(k % 2)
                     for flag, v in zip(("maximize", "l2", "nesterov", "first"), row)}
            cases.append((name, with_flags(config, **flags, float32_grad=float32_grad(config, j))))
    return cases


SGD_INSTANTIATION_CASES = sgd_instantiation_cases()


def config_id(case) -> str:
    name, config = case
    extra = "".join(f",{flag}" for flag in config.algorithm.runtime_flags if config.flag(flag))
    extra += ",float32_grad" if config.float32_grad else ""
    return name.replace("bf16opt::", "").replace(" ", "") + extra


def test_every_kind_is_covered():
    assert set(CONFIGS) == set(KINDS) == set(ALGORITHMS)
    for kind, cases in CONFIGS.items():
        assert {name for name, _ in cases} == set(cuda_backend.all_kernel_names(kind))
    assert {name for name, _ in SGD_INSTANTIATION_CASES} == set(cuda_backend.all_kernel_names("sgd"))
    for name in cuda_backend.all_kernel_names("sgd"):  # every flag on and off for every instantiation
        configs = [config for n, config in SGD_INSTANTIATION_CASES if n == name]
        flags = [f for f in configs[0].algorithm.runtime_flags
                 if configs[0].flag("momentum") or f in ("maximize", "l2")]
        for flag in flags:
            assert {config.flag(flag) for config in configs} == {False, True}, (name, flag)
    for kind, cases in (*CONFIGS.items(), ("sgd", SGD_INSTANTIATION_CASES)):  # and both grad dtypes
        for name, config in cuda_backend.kernel_configs(kind).items():
            grads = {c.grad for n, c in cases if n == name}
            assert grads == ({config.plan.param} if config.plan.param == torch.float32
                             else {config.plan.param, torch.float32}), (name, grads)


# ---------------------------------------------------------------- values and tensors
INT_VIEW = {torch.float32: (torch.int32, np.uint32), torch.bfloat16: (torch.int16, np.uint16),
            torch.float16: (torch.int16, np.uint16), torch.int16: (torch.int16, np.uint16)}

# float32 bit patterns that stress the encoders: bf16 and fp16 ties (to even and odd),
# fp16 overflow boundary, fp16 subnormals and their ties, fp32 subnormals, zeros,
# infinities, NaNs with sign and payload.
SPECIAL_F32 = np.array([
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001,      # bf16 ties / near ties
    0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,                              # round up to inf in bf16
    0x3F801000, 0x3F803000, 0xBF801000, 0x3F800FFF,                  # fp16 ties (normal)
    0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x47800000,      # fp16 max, 65520, 2^16
    0x38800000, 0x387FFFFF, 0x38000000, 0x33800000, 0x33000000,      # fp16 normal/subnormal edges
    0x33000001, 0x33C00000, 0x34400000, 0x37FFE000, 0x37FFF000,      # fp16 subnormal ties
    0x00000001, 0x00400000, 0x807FFFFF, 0x00800000,                  # fp32 subnormals, min normal
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,                  # zeros, infinities
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF,                  # NaNs
], dtype=np.uint32)


def random_values(rng: np.random.Generator, n: int, dtype: torch.dtype, special: float) -> torch.Tensor:
    """``n`` values of ``dtype``: mostly ordinary, a fraction ``special`` of edge bit patterns."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 4, n))).astype(np.float32)
    pick = rng.random(n) < special
    count = int(pick.sum())
    if count:
        kind = rng.integers(0, 3, count)
        if dtype == torch.float32:
            raw = rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32)
        else:
            raw = (rng.integers(0, 2 ** 16, count, dtype=np.uint64).astype(np.uint32) << 16)
        specials = SPECIAL_F32[rng.integers(0, len(SPECIAL_F32), count)]
        zeros = np.zeros(count, dtype=np.uint32)
        x[pick] = np.where(kind == 0, raw, np.where(kind == 1, specials, zeros)).view(np.float32)
    if dtype == torch.float16:  # use fp16 bit patterns directly for fp16 storage
        bits16 = rng.integers(0, 2 ** 16, n, dtype=np.uint64).astype(np.uint16)
        t = torch.from_numpy(x).to(torch.float16)
        raw16 = torch.from_numpy(bits16.view(np.int16)).view(torch.float16)
        mask = torch.from_numpy(pick & (rng.random(n) < 0.5))
        return torch.where(mask, raw16, t)
    t = torch.from_numpy(x)
    if dtype == torch.bfloat16:
        return torch.from_numpy((x.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return t


def placed(values: torch.Tensor, offset: int, layout: str) -> torch.Tensor:
    """``values`` copied into fresh memory, as a view ``offset`` elements into its buffer
    (offset 0: 64-byte aligned) or, for layout "transposed", as a non-contiguous view."""
    n = values.numel()
    if layout == "transposed" and n % 2 == 0 and n >= 4:
        rows = 2
        base = torch.empty(n // rows, rows, dtype=values.dtype)
        view = base.t()  # shape (rows, n // rows), not contiguous
        view.copy_(values.reshape(rows, n // rows))
        return view
    base = torch.empty(n + offset, dtype=values.dtype)
    view = base[offset:offset + n]
    view.copy_(values)
    return view


def same_shape_as(reference_tensor: torch.Tensor, values: torch.Tensor, offset: int) -> torch.Tensor:
    view = placed(values, offset, "flat")
    return view.reshape(reference_tensor.shape)


def make_bucket(config: KernelConfig, sizes: list, rng: np.random.Generator, special: float,
                misalign: float, transposed: bool, first_step: int = 1) -> Bucket:
    """Random tensors for every role of ``config``, one param per entry of ``sizes``."""
    plan = config.plan
    roles = config.algorithm.roles
    dtype = dict(zip((role.name for role in roles), config.dtypes))
    seed = int(rng.integers(0, 2 ** 64, dtype=np.uint64))
    indices = ([int(i) for i in rng.integers(0, 2 ** 34, len(sizes))] if rng.random() < 0.3
               else list(range(len(sizes))))
    columns = {role.name: [] for role in roles if dtype[role.name] is not None}
    for index, n in enumerate(sizes):
        def offset():
            # 1..8 elements: misaligned for every dtype, and 16-byte aligned but not at the
            # start of the buffer (8 x 16-bit, 4 x 32-bit)
            return int(rng.integers(1, 9)) if rng.random() < misalign else 0
        layout = "transposed" if transposed and index == 0 else "flat"
        param_values = random_values(rng, n, plan.param, special)
        if config.weights == "copy":
            master = random_values(rng, n, plan.master, special)
            if plan.master == torch.float32:
                # master values the param encoding must round: ties and edges from SPECIAL_F32
                ties = torch.from_numpy(SPECIAL_F32[rng.integers(0, len(SPECIAL_F32), n)].view(np.float32))
                master = torch.where(torch.from_numpy(rng.random(n) < special), ties, master)
            # the param the last step wrote (the master's round to nearest even), but for some
            # elements edited since (the random param: then the param is the master, join_copy)
            written = torch.from_numpy(rng.random(n) >= 0.3)
            param_values = torch.where(written, storage.encode(master.float(), plan.param), param_values)
        param = placed(param_values, offset(), layout)
        columns["param"].append(param)
        columns["grad"].append(same_shape_as(param, random_values(rng, n, dtype["grad"], special), offset()))
        if config.weights == "copy":
            columns["companion"].append(same_shape_as(param, master, offset()))
        elif config.weights == "kahan":
            # carried rounding errors: mostly small against the param, some edge values
            values = random_values(rng, n, plan.compensation_dtype, special)
            values = values if rng.random() < 0.3 else (values.float() * 2.0 ** -10).to(values.dtype)
            columns["companion"].append(same_shape_as(param, values, offset()))
        elif config.weights == "remainder":
            raw = rng.integers(-2 ** 15, 2 ** 15, n).astype(np.int16)
            raw[rng.random(n) < 0.2] = 0  # a fresh remainder plan: the param is the master
            columns["companion"].append(same_shape_as(param, torch.from_numpy(raw), offset()))
        for role in config.algorithm.moment_roles:
            if dtype[role.name] is None:
                continue
            if dtype[role.name] == storage.Q8:  # codes and scales of random values (own layout)
                values = random_values(rng, n, torch.float32, special)
                signed = storage.q8_signed(role.name)
                columns[role.name].append(storage.q8_encode(values if signed else values.abs(), signed))
                continue
            values = random_values(rng, n, dtype[role.name], special)
            if role.name == "exp_avg_sq":
                values = values.abs()
            elif role.name == "max_exp_avg_sq":
                values = values.abs()
                if special and n:
                    # ties with v (+-0 after abs: +0 only, NaN) exercise max's tie rule
                    values.view(-1)[: n // 4] = columns["exp_avg_sq"][-1].reshape(-1)[: n // 4]
            columns[role.name].append(same_shape_as(param, values, offset()))
    if special and sizes:
        # a zero update where the master is a tie: param = encode(master) exactly
        n = sizes[-1]
        columns["grad"][-1].view(-1)[: n // 3] = 0
        first_moment = config.algorithm.moment_roles[0].name
        if first_moment in columns and dtype[first_moment] != storage.Q8:
            columns[first_moment][-1].view(-1)[: n // 3] = 0
    counts = None
    if config.track:
        counts = torch.full((len(sizes), 3), -1, dtype=torch.int64)  # must be overwritten
    # sometimes a DTensor shard's view: its elements' global indices start past 0 (past 2**32
    # too) and a name hash names its streams
    offsets = ([int(o) for o in rng.integers(0, 2 ** 34, len(sizes))] if rng.random() < 0.3 else [])
    streams = ([int(i) for i in rng.integers(0, 2 ** 32, len(sizes))] if rng.random() < 0.3 else [])
    return Bucket.of(config, columns, indices=indices, offsets=offsets, stream_ids=streams, seed=seed,
                     step=first_step, counts=counts)


def clone_bucket(bucket: Bucket) -> Bucket:
    """Plain copies (for the reference; the original keeps its odd offsets for the kernel)."""
    def copy(t):
        return None if t is None else t.clone()
    return Bucket(bucket.config, [[copy(t) for t in column] for column in bucket.tensors],
                  indices=list(bucket.indices), offsets=list(bucket.offsets),
                  stream_ids=list(bucket.stream_ids), seed=bucket.seed, step=bucket.step,
                  counts=copy(bucket.counts))


def bits(t: torch.Tensor) -> np.ndarray:
    view = INT_VIEW[t.dtype]
    return t.detach().contiguous().view(view[0]).numpy().view(view[1]).reshape(-1)


def assert_same_bits(expected: Bucket, actual: Bucket, context: str) -> None:
    """Every role of every param (the read-only grad too) and the telemetry counts, as
    tests/buckets.py compares them; and every counter column was written."""
    buckets.assert_same_bits(expected, actual, context, "emulated kernel")
    if expected.counts is not None:
        columns = len(expected.config.algorithm.counters)
        assert bool((actual.counts[:, :columns] >= 0).all()), f"{context}: a counter was not written"


# ---------------------------------------------------------------- hyper-parameters
def adam_group(rng: np.random.Generator, l2: bool) -> dict:
    weight_decay = float(rng.choice([0.0, 0.01, 0.3])) if not l2 else float(rng.choice([0.01, 0.3]))
    return dict(lr=float(rng.choice([1e-3, 0.1, 3e-5])), betas=(float(rng.choice([0.9, 0.5, 0.0])),
                float(rng.choice([0.999, 0.9]))), eps=float(rng.choice([1e-8, 1e-3, 0.0])),
                weight_decay=weight_decay, decoupled_weight_decay=not l2)


def lion_group(rng: np.random.Generator) -> dict:
    return dict(lr=float(rng.choice([1e-4, 0.1])), betas=(float(rng.choice([0.9, 0.0])),
                float(rng.choice([0.99, 0.5]))), weight_decay=float(rng.choice([0.0, 0.1])))


def sgd_group(rng: np.random.Generator, momentum: bool, nesterov: bool, l2: bool) -> dict:
    """An SGD group for the flags.  Without ``l2`` the kernels must ignore ``weight_decay``
    (it may be non-zero here), without a momentum buffer ``momentum`` is 0 (as the flag is
    set by the optimizer); nesterov has no dampening, as torch requires."""
    return dict(lr=float(rng.choice([1e-3, 0.1, 3e-5])),
                momentum=float(rng.choice([0.9, 0.5, 1.0])) if momentum else 0.0,
                dampening=0.0 if nesterov else float(rng.choice([0.0, 0.1, -0.5])),
                weight_decay=float(rng.choice([0.01, 0.3])) if l2 else float(rng.choice([0.0, 0.3])))


# GradScaler's folded unscale: none, powers of two (its default scales), and 1/3 in float32
# (a scale of 3 whose reciprocal is inexact)
INV_GRAD_SCALES = (1.0, 1.0, 2.0 ** -16, 2.0 ** 7, float(np.float32(1 / 3)))


def group_for(config: KernelConfig, rng: np.random.Generator) -> dict:
    kind = config.algorithm.name
    if kind == "adam":
        group = adam_group(rng, config.flag("l2"))
    elif kind == "lion":
        group = lion_group(rng)
    elif kind == "sgd":
        group = sgd_group(rng, config.flag("momentum"), config.flag("nesterov"), config.flag("l2"))
    else:
        raise KeyError(f"no test group for algorithm {kind!r}")
    return dict(group, inv_grad_scale=float(rng.choice(INV_GRAD_SCALES)))


def scalars_for(config: KernelConfig, group: dict, step: int):
    return buckets.scalars(config.algorithm.name, group, step, group.get("inv_grad_scale", 1.0))


# ---------------------------------------------------------------- the comparison
def step_both(expected: Bucket, actual: Bucket, step: int, scalars, plan_options: dict, context: str) -> None:
    """One step of the reference (``expected``) and the emulated kernel (``actual``), compared."""
    expected.step = actual.step = step
    if expected.counts is not None:  # every counter must be written again
        expected.counts.fill_(-1)
        actual.counts.fill_(-1)
    reference.run(expected, scalars)
    cuda_backend.run(actual, scalars, execute=emulator.execute, **plan_options)
    assert_same_bits(expected, actual, f"{context} step {step}")


def run_and_compare(config: KernelConfig, *, seed: int, sizes: list, steps: int, special: float,
                    misalign: float, transposed: bool, plan_options: dict, first_step: int = 1) -> None:
    """``steps`` consecutive steps from ``first_step``, fresh gradients each step.  SGD's
    ``first`` flag (the momentum buffer's first step) holds for the first step only."""
    rng = np.random.default_rng(seed)
    actual = make_bucket(config, sizes, rng, special, misalign, transposed, first_step)
    expected = clone_bucket(actual)
    group = group_for(config, rng)
    for step in range(first_step, first_step + steps):
        if step > first_step:  # fresh gradients, the same in both buckets
            for e, a in zip(expected["grad"], actual["grad"]):
                e.copy_(random_values(rng, e.numel(), e.dtype, special).reshape(e.shape))
                a.copy_(e)
            if dict(config.flags).get("first"):
                expected.config = actual.config = with_flags(config, first=False)
        flags = ",".join(name for name, value in expected.config.flags if value)
        context = (f"{config.algorithm.name} {config.plan} [{flags}] track={config.track} "
                   f"sizes={sizes} seed={seed} {plan_options}")
        step_both(expected, actual, step, scalars_for(config, group, step), plan_options, context)


@pytest.fixture(scope="module", autouse=True)
def emulation_library():
    emulator.library()  # build once (cached on disk by source hash)


SIZES = [1, 7, 22, 64, 129, 1000, 3, 513]
SMALL_CHUNKS = dict(chunk_size=64, block=8, max_grid=5)


def every_instantiation(case) -> None:
    name, config = case
    assert cuda_backend.kernel_name(config) == name
    run_and_compare(config, seed=zlib.crc32(config_id(case).encode()), sizes=SIZES, steps=2,
                    special=0.1, misalign=0.4, transposed=True, plan_options=SMALL_CHUNKS)


@pytest.mark.parametrize("case", ADAM_CONFIGS, ids=config_id)
def test_adam_every_instantiation(case):
    every_instantiation(case)


@pytest.mark.parametrize("case", LION_CONFIGS, ids=config_id)
def test_lion_every_instantiation(case):
    every_instantiation(case)


@pytest.mark.parametrize("case", SGD_INSTANTIATION_CASES, ids=config_id)
def test_sgd_every_instantiation(case):
    every_instantiation(case)


plan_options = st.sampled_from([
    {},  # exactly what the adapter uses on a GPU
    dict(chunk_size=8, block=1, max_grid=1),  # one thread walks every chunk
    dict(chunk_size=64, block=8, max_grid=3),
    dict(chunk_size=136, block=32, max_grid=10 ** 6),
])
# steps from 1, or across 2**32 (the step's high word enters the random streams there)
first_steps = st.sampled_from([1, 1, 1, 2 ** 32 - 2])


def random_case(cases, max_examples: int):
    """A hypothesis test over ``cases`` with random buckets, launch shapes and steps."""
    def decorate(test):
        @settings(max_examples=max_examples)
        @given(case=st.sampled_from(cases), seed=st.integers(0, 2 ** 32 - 1),
               sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), steps=st.integers(1, 4),
               special=st.sampled_from([0.0, 0.05, 0.5]), misalign=st.sampled_from([0.0, 0.5, 1.0]),
               transposed=st.booleans(), options=plan_options, first_step=first_steps)
        def run(case, seed, sizes, steps, special, misalign, transposed, options, first_step):
            run_and_compare(case[1], seed=seed, sizes=sizes, steps=steps, special=special,
                            misalign=misalign, transposed=transposed, plan_options=options,
                            first_step=first_step)
        run.__name__ = test.__name__
        run.__doc__ = test.__doc__
        return run
    return decorate


@random_case(ADAM_CONFIGS, max_examples=200)
def test_adam_matches_reference():
    """Random Adam buckets, launch shapes and steps."""


@random_case(LION_CONFIGS, max_examples=100)
def test_lion_matches_reference():
    """Random Lion buckets, launch shapes and steps."""


@random_case(SGD_CONFIGS, max_examples=200)
def test_sgd_matches_reference():
    """Random SGD buckets, launch shapes and steps."""


def edited_copy_cases() -> list:
    """An instantiation per algorithm, 16-bit param, moment dtype and telemetry of a float32
    master copy (the fp32 and bf16-states presets on bfloat16 and float16 params)."""
    chosen = {}
    for cases in CONFIGS.values():
        for name, config in cases:
            plan = config.plan
            sgd = config.algorithm.name == "sgd"
            momentum = not sgd or (config.flag("momentum") and not config.flag("first"))
            if config.weights == "copy" and plan.rounding == "nearest" and momentum:
                key = (config.algorithm.name, plan.param, plan.exp_avg, config.track)
                chosen.setdefault(key, (name, config))
    return list(chosen.values())


@pytest.mark.parametrize("case", edited_copy_cases(), ids=config_id)
def test_params_edited_beside_a_master_copy(case):
    """A float32 master copy whose param was edited since the last step in some elements (the
    buckets' params: the master's rounding but for 30% random values, special values among
    both): the kernel reads the edited param as the master there (storage.join_copy), as the
    reference does, over several steps, in the vector path and its tails."""
    _, config = case
    for seed in range(3):
        run_and_compare(config, seed=seed, sizes=[300, 257, 64, 5], steps=3, special=0.3, misalign=0.3,
                        transposed=True, plan_options=SMALL_CHUNKS)


@pytest.mark.parametrize("zeros_beside", [False, True], ids=["in-a-block-of-values", "in-a-block-of-zeros"])
def test_an_overflowing_second_moment_is_stored_as_inf(zeros_beside):
    """A grad whose (1 - beta2) * g * g overflows float32 in a q8 exp_avg_sq block, beside zeros or values:
    the kernel stores the reference's bits (a block of zeros then has the least float32 as
    its scale), and the element's exp_avg_sq decodes to +inf."""
    name, config = next(case for case in ADAM_CONFIGS if case[1].plan.exp_avg_sq == storage.Q8
                        and case[1].weights == "remainder" and not any(case[1].template_flags)
                        and not case[1].track and not case[1].flag("maximize") and not case[1].flag("l2"))
    rng = np.random.default_rng(5)
    actual = make_bucket(config, [300], rng, 0.0, 0.0, False, 1)
    for moment in ("exp_avg", "exp_avg_sq"):
        actual[moment][0].zero_()  # fresh state
    grad = actual["grad"][0].view(-1)
    if zeros_beside:
        grad.zero_()
    grad[5] = 1e30
    expected = clone_bucket(actual)
    group = group_for(config, rng)
    step_both(expected, actual, 1, scalars_for(config, group, 1), SMALL_CHUNKS, config_id((name, config)))
    v = actual["exp_avg_sq"][0]
    assert storage.q8_decode(v, (300,), False)[5] == math.inf
    assert (storage.q8_scale_values(v)[0] == 2.0 ** -149) == zeros_beside


# ---------------------------------------------------------------- steps past 2**32
# bf16 params that are their own master, bf16 moments, stochastic rounding, every template
# flag (amsgrad, momentum) and telemetry on; hyper-parameters whose updates are rarely
# representable, so different random bits give different results
STOCHASTIC_CASES = {
    kind: (next(config for config in cuda_backend.kernel_configs(kind).values()
                if config.weights == "param-stochastic" and config.plan.param == torch.bfloat16
                and config.plan.exp_avg == torch.bfloat16 and config.plan.exp_avg_sq == torch.bfloat16
                and all(config.template_flags) and config.track), group)
    for kind, group in (
        ("adam", dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)),
        ("lion", dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)),
        ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.0)))}


@pytest.mark.parametrize("kind", sorted(STOCHASTIC_CASES))
def test_stochastic_rounding_past_step_2_32(kind):
    """At step 2**32 + 5 the kernels draw the reference's bits, and not step 5's: the
    step's high word enters the stream key (folded into the seed's high word)."""
    config, group = STOCHASTIC_CASES[kind]
    assert config.stochastic
    scalars = scalars_for(config, group, 5)  # the same scalars: only the random bits differ
    results = {}
    for step in (5, 2 ** 32 + 5):
        # the same bucket (values, offsets, a transposed tensor, indices past 2**32 or not)
        actual = make_bucket(config, [1000, 33, 256, 7], np.random.default_rng(32), 0.05, 0.5, True)
        expected = clone_bucket(actual)
        step_both(expected, actual, step, scalars, SMALL_CHUNKS,
                  f"{kind} {config.plan} seed={actual.seed:#x}")
        results[step] = expected
    low, high = results[5], results[2 ** 32 + 5]
    for role, column_low, column_high in zip(config.algorithm.roles, low.tensors, high.tensors):
        if role.buffer is None or column_low[0] is None:
            continue
        a = np.concatenate([bits(t) for t in column_low])
        b = np.concatenate([bits(t) for t in column_high])
        assert np.count_nonzero(a != b) > a.size // 20, (
            f"{kind}: {role.name} rounded alike at steps 5 and 2**32 + 5 "
            f"({np.count_nonzero(a != b)} of {a.size} differ)")


# ---------------------------------------------------------------- storage helpers
def edge_values(rng: np.random.Generator) -> np.ndarray:
    """float32 inputs for the encoders: every SPECIAL_F32 pattern, random bit patterns,
    the float16 subnormal range and its boundary, values next to bf16/fp16 overflow."""
    fp16_sub = rng.integers(0x33000000, 0x38800100, 4096, dtype=np.uint64).astype(np.uint32)
    near_max = np.concatenate([rng.integers(0x7F7F0000, 0x7F800000, 512, dtype=np.uint64),
                               rng.integers(0x477F0000, 0x47800100, 512, dtype=np.uint64)]).astype(np.uint32)
    random = rng.integers(0, 2 ** 32, 8192, dtype=np.uint64).astype(np.uint32)
    exact = (rng.integers(0, 2 ** 16, 1024, dtype=np.uint64).astype(np.uint32) << 16)  # bf16 values
    bits32 = np.concatenate([SPECIAL_F32, fp16_sub, near_max, random, exact])
    bits32 = np.concatenate([bits32, bits32 ^ 0x80000000])
    return bits32.view(np.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoders_match_storage_spec(dtype):
    rng = np.random.default_rng(5)
    x = edge_values(rng)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    expected = bits(storage.encode(torch.from_numpy(x), dtype))
    assert np.array_equal(emulator.encode(name, x), expected)
    for key, buffer in ((0, storage.WEIGHTS), (0x9E3779B9, storage.EXP_AVG),
                        (int(rng.integers(0, 2 ** 32)), storage.EXP_AVG_SQ),
                        (int(rng.integers(0, 2 ** 32)), storage.MAX_EXP_AVG_SQ)):
        random = storage.buffer_bits(storage.random_bits(key, x.shape), buffer)
        expected = bits(storage.encode_stochastic(torch.from_numpy(x), dtype, random))
        actual = emulator.encode(f"{name}-stochastic", x, key, buffer)
        bad = np.flatnonzero(expected != actual)
        assert bad.size == 0, (f"{name} stochastic, key {key:#x}, buffer {buffer}: {bad.size} differ, "
                               f"first x bits {x.view(np.uint32)[bad[0]]:#x}: spec {expected[bad[0]]:#x}, "
                               f"CUDA {actual[bad[0]]:#x}")


def test_stochastic_rounding_equals_nearest_on_representable_values():
    rng = np.random.default_rng(6)
    bf16_values = (rng.integers(0, 2 ** 16, 4096, dtype=np.uint64).astype(np.uint32) << 16).view(np.float32)
    fp16_values = torch.from_numpy(rng.integers(0, 2 ** 16, 4096, dtype=np.uint64).astype(np.uint16)
                                   .view(np.int16)).view(torch.float16).float().numpy()
    for name, values in (("bf16", bf16_values), ("fp16", fp16_values)):
        assert np.array_equal(emulator.encode(f"{name}-stochastic", values, 12345),
                              emulator.encode(name, values))


def test_stream_keys_match_storage_spec():
    rng = np.random.default_rng(7)
    cases = [(0, 0, 0, 0), (2 ** 64 - 1, 2 ** 32, 2 ** 32 + 5, 3), (2 ** 63, 2 ** 40 + 1, 1, 1)]
    cases += [(int(rng.integers(0, 2 ** 64, dtype=np.uint64)), int(rng.integers(0, 2 ** 40)),
               int(rng.integers(0, 2 ** 36)), int(rng.integers(0, 4))) for _ in range(200)]
    for seed, step, index, stream in cases:
        assert emulator.stream_key(seed, step, index, stream) == storage.stream_key(seed, step, index, stream)


def test_remainder_split_matches_storage_spec():
    x = edge_values(np.random.default_rng(8))
    param, remainder, joined = emulator.remainder_split_join(x)
    expected_param, expected_remainder = storage.split_remainder(torch.from_numpy(x))
    assert np.array_equal(param, bits(expected_param))
    assert np.array_equal(remainder, bits(expected_remainder))
    canonical = bits(storage.encode(torch.from_numpy(x), torch.float32))
    assert np.array_equal(joined.view(np.uint32), canonical)  # exact, NaN canonical
    assert np.array_equal(joined.view(np.uint32), bits(storage.join_remainder(expected_param, expected_remainder)))
