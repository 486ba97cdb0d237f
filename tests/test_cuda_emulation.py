"""The CUDA kernels, run on the CPU, equal the reference backend bit for bit.

The .cu sources are compiled by the host C++ compiler with tests/cuda_emulation/
emulation.h (grid/block loops, bit-cast intrinsics, atomicAdd) and driven through the
CuPy adapter's own ``run_bucket``/``prepare_launch``: same kernel names, same chunk
table, same scalars, seed and step; only the launch itself is swapped for the CPU loop
over blocks and threads.  The oracle is ``bf16opt.backends.reference`` itself.

Every instantiation the adapter can request is exercised: all storage plans of
``all_plans(quality=True)`` (stochastic rounding, Kahan with bf16/fp32 buffers, bf16 +
int16 remainder included) x amsgrad x maximize x L2/decoupled decay for Adam (x
maximize for Lion) x precision telemetry on/off, with many tensors of odd sizes per
bucket, views at odd offsets (so chunks take the 16-byte vector path, its scalar tail,
or the all-scalar misaligned path), a non-contiguous tensor (staged through a
contiguous copy), NaN/inf/subnormal/tie values, optimizer indices and steps past
2**32 (the random streams hash them modulo 2**32), and several consecutive steps
(stochastic rounding draws new bits every step).  The telemetry counts, the Kahan
buffers and the remainders are compared too.  The storage helpers themselves
(stochastic encoders, stream keys, the remainder split) are compared with
bf16opt/storage.py on edge values.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bf16opt.adam import adam_scalars
from bf16opt.backends import Bucket, reference
from bf16opt.backends import cupy as cuda_backend
from bf16opt.lion import lion_scalars
from bf16opt import storage
from cuda_emulation import emulator

pytestmark = pytest.mark.skipif(emulator.compiler_problem() is not None,
                                reason=f"CUDA emulation needs a host C++ compiler: "
                                       f"{emulator.compiler_problem()}")

# (kernel name, plan, flags) of every instantiation the adapter can request, crossed
# with the run-time flags (maximize; Adam's L2 decay)
ADAM_CONFIGS = [(name, plan, dict(flags, maximize=maximize, l2=l2))
                for name, (plan, flags) in cuda_backend.kernel_configs("adam").items()
                for maximize in (False, True) for l2 in (False, True)]
LION_CONFIGS = [(name, plan, dict(flags, maximize=maximize))
                for name, (plan, flags) in cuda_backend.kernel_configs("lion").items()
                for maximize in (False, True)]


def config_id(config) -> str:
    name, _, flags = config
    extra = "".join(f",{flag}" for flag in ("maximize", "l2") if flags.get(flag))
    return name.replace("bf16opt::", "").replace(" ", "") + extra

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


def make_bucket(kind: str, plan, flags: dict, sizes: list, rng: np.random.Generator,
                special: float, misalign: float, transposed: bool, first_step: int = 1) -> Bucket:
    bucket = Bucket(plan=plan, maximize=flags["maximize"], amsgrad=flags.get("amsgrad", False),
                    l2=flags.get("l2", False), seed=int(rng.integers(0, 2 ** 64, dtype=np.uint64)),
                    step=first_step)
    bucket.indices = ([int(i) for i in rng.integers(0, 2 ** 34, len(sizes))] if rng.random() < 0.3
                      else list(range(len(sizes))))
    if flags.get("track"):
        bucket.counts = torch.full((len(sizes), 3), -1, dtype=torch.int64)  # must be overwritten
    for index, n in enumerate(sizes):
        def offset():
            # 1..8 elements: misaligned for every dtype, and 16-byte aligned but not at the
            # start of the buffer (8 x 16-bit, 4 x 32-bit)
            return int(rng.integers(1, 9)) if rng.random() < misalign else 0
        layout = "transposed" if transposed and index == 0 else "flat"
        param = placed(random_values(rng, n, plan.param, special), offset(), layout)
        bucket.params.append(param)
        bucket.grads.append(same_shape_as(param, random_values(rng, n, plan.param, special), offset()))
        if plan.master is not None:
            master = random_values(rng, n, plan.master, special)
            if plan.master == torch.float32:
                # master values the param encoding must round: ties and edges from SPECIAL_F32
                ties = torch.from_numpy(SPECIAL_F32[rng.integers(0, len(SPECIAL_F32), n)].view(np.float32))
                master = torch.where(torch.from_numpy(rng.random(n) < special), ties, master)
            bucket.masters.append(same_shape_as(param, master, offset()))
        else:
            bucket.masters.append(None)
        compensation = remainder = None
        if plan.compensation == "kahan":
            # carried rounding errors: mostly small against the param, some edge values
            values = random_values(rng, n, plan.compensation_dtype, special)
            values = values if rng.random() < 0.3 else (values.float() * 2.0 ** -10).to(values.dtype)
            compensation = same_shape_as(param, values, offset())
        elif plan.compensation == "remainder":
            raw = rng.integers(-2 ** 15, 2 ** 15, n).astype(np.int16)
            raw[rng.random(n) < 0.2] = 0  # a fresh remainder plan: the param is the master
            remainder = same_shape_as(param, torch.from_numpy(raw), offset())
        bucket.compensations.append(compensation)
        bucket.remainders.append(remainder)
        bucket.exp_avgs.append(same_shape_as(param, random_values(rng, n, plan.exp_avg, special), offset()))
        if kind == "adam":
            sq = random_values(rng, n, plan.exp_avg_sq, special).abs()
            bucket.exp_avg_sqs.append(same_shape_as(param, sq, offset()))
            if bucket.amsgrad:
                mx = random_values(rng, n, plan.exp_avg_sq, special).abs()
                if special and n:
                    # ties with v (+-0 after abs: +0 only, NaN) exercise max's tie rule
                    mx.view(-1)[: n // 4] = sq.view(-1)[: n // 4]
                bucket.max_exp_avg_sqs.append(same_shape_as(param, mx, offset()))
    if special and sizes:
        # a zero update where the master is a tie: param = encode(master) exactly
        n = sizes[-1]
        bucket.grads[-1].view(-1)[: n // 3] = 0
        bucket.exp_avgs[-1].view(-1)[: n // 3] = 0
    return bucket


def clone_bucket(bucket: Bucket) -> Bucket:
    """Plain copies (for the reference; the original keeps its odd offsets for the kernel)."""
    def copy(t):
        return None if t is None else t.clone()

    def copies(field):
        return [copy(t) for t in getattr(bucket, field)]
    return Bucket(plan=bucket.plan, params=copies("params"), grads=copies("grads"),
                  masters=copies("masters"), exp_avgs=copies("exp_avgs"),
                  exp_avg_sqs=copies("exp_avg_sqs"), max_exp_avg_sqs=copies("max_exp_avg_sqs"),
                  compensations=copies("compensations"), remainders=copies("remainders"),
                  indices=list(bucket.indices), maximize=bucket.maximize, amsgrad=bucket.amsgrad,
                  l2=bucket.l2, seed=bucket.seed, step=bucket.step, counts=copy(bucket.counts))


def bits(t: torch.Tensor) -> np.ndarray:
    view = INT_VIEW[t.dtype]
    return t.detach().contiguous().view(view[0]).numpy().view(view[1]).reshape(-1)


BUFFERS = ("params", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "compensations",
           "remainders", "grads")


def assert_same_bits(expected: Bucket, actual: Bucket, context: str) -> None:
    for field in BUFFERS:
        assert len(getattr(expected, field)) == len(getattr(actual, field)), field
        for index, (e, a) in enumerate(zip(getattr(expected, field), getattr(actual, field))):
            if e is None:
                assert a is None
                continue
            eb, ab = bits(e), bits(a)
            bad = np.flatnonzero(eb != ab)
            assert bad.size == 0, (
                f"{context}: {field}[{index}] (size {eb.size}) differs at {bad.size} elements, first "
                f"at {bad[0]}: reference {eb[bad[0]]:#x}, emulated kernel {ab[bad[0]]:#x}")
    if expected.counts is None:
        assert actual.counts is None
    else:
        assert torch.equal(expected.counts, actual.counts), (
            f"{context}: telemetry counts differ:\nreference\n{expected.counts}\nkernel\n{actual.counts}")


def adam_group(rng: np.random.Generator, l2: bool) -> dict:
    weight_decay = float(rng.choice([0.0, 0.01, 0.3])) if not l2 else float(rng.choice([0.01, 0.3]))
    return dict(lr=float(rng.choice([1e-3, 0.1, 3e-5])), betas=(float(rng.choice([0.9, 0.5, 0.0])),
                float(rng.choice([0.999, 0.9]))), eps=float(rng.choice([1e-8, 1e-3, 0.0])),
                weight_decay=weight_decay, decoupled_weight_decay=not l2)


def lion_group(rng: np.random.Generator) -> dict:
    return dict(lr=float(rng.choice([1e-4, 0.1])), betas=(float(rng.choice([0.9, 0.0])),
                float(rng.choice([0.99, 0.5]))), weight_decay=float(rng.choice([0.0, 0.1])))


def run_and_compare(kind: str, plan, flags: dict, *, seed: int, sizes: list, steps: int,
                    special: float, misalign: float, transposed: bool, plan_options: dict,
                    first_step: int = 1) -> None:
    rng = np.random.default_rng(seed)
    actual = make_bucket(kind, plan, flags, sizes, rng, special, misalign, transposed, first_step)
    expected = clone_bucket(actual)
    group = adam_group(rng, flags.get("l2", False)) if kind == "adam" else lion_group(rng)
    context = f"{kind} {plan} {flags} sizes={sizes} seed={seed} {plan_options}"
    for step in range(first_step, first_step + steps):
        if step > first_step:  # fresh gradients, the same in both buckets
            for e, a in zip(expected.grads, actual.grads):
                e.copy_(random_values(rng, e.numel(), e.dtype, special).reshape(e.shape))
                a.copy_(e)
        expected.step = actual.step = step
        scalars = adam_scalars(group, step) if kind == "adam" else lion_scalars(group)
        getattr(reference, kind)(expected, scalars)
        cuda_backend.run_bucket(kind, actual, scalars, execute=emulator.execute, **plan_options)
        assert_same_bits(expected, actual, f"{context} step {step}")


@pytest.fixture(scope="module", autouse=True)
def emulation_library():
    emulator.library()  # build once (cached on disk by source hash)


SIZES = [1, 7, 22, 64, 129, 1000, 3, 513]
SMALL_CHUNKS = dict(chunk_size=64, block=8, max_grid=5)


@pytest.mark.parametrize("name, plan, flags", ADAM_CONFIGS, ids=[config_id(c) for c in ADAM_CONFIGS])
def test_adam_every_instantiation(name, plan, flags):
    assert cuda_backend.kernel_name("adam", plan, amsgrad=flags["amsgrad"], track=flags["track"]) == name
    run_and_compare("adam", plan, flags, seed=zlib.crc32(config_id((name, plan, flags)).encode()),
                    sizes=SIZES, steps=2, special=0.1, misalign=0.4, transposed=True,
                    plan_options=SMALL_CHUNKS)


@pytest.mark.parametrize("name, plan, flags", LION_CONFIGS, ids=[config_id(c) for c in LION_CONFIGS])
def test_lion_every_instantiation(name, plan, flags):
    assert cuda_backend.kernel_name("lion", plan, track=flags["track"]) == name
    run_and_compare("lion", plan, flags, seed=zlib.crc32(config_id((name, plan, flags)).encode()),
                    sizes=SIZES, steps=2, special=0.1, misalign=0.4, transposed=True,
                    plan_options=SMALL_CHUNKS)


plan_options = st.sampled_from([
    {},  # exactly what the adapter uses on a GPU
    dict(chunk_size=8, block=1, max_grid=1),  # one thread walks every chunk
    dict(chunk_size=64, block=8, max_grid=3),
    dict(chunk_size=136, block=32, max_grid=10 ** 6),
])
# steps from 1, or across the 2**32 wrap of the random streams' step word
first_steps = st.sampled_from([1, 1, 1, 2 ** 32 - 2])


@settings(max_examples=200)
@given(config=st.sampled_from(ADAM_CONFIGS), seed=st.integers(0, 2 ** 32 - 1),
       sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), steps=st.integers(1, 4),
       special=st.sampled_from([0.0, 0.05, 0.5]), misalign=st.sampled_from([0.0, 0.5, 1.0]),
       transposed=st.booleans(), options=plan_options, first_step=first_steps)
def test_adam_matches_reference(config, seed, sizes, steps, special, misalign, transposed, options,
                                first_step):
    _, plan, flags = config
    run_and_compare("adam", plan, flags, seed=seed, sizes=sizes, steps=steps, special=special,
                    misalign=misalign, transposed=transposed, plan_options=options,
                    first_step=first_step)


@settings(max_examples=100)
@given(config=st.sampled_from(LION_CONFIGS), seed=st.integers(0, 2 ** 32 - 1),
       sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), steps=st.integers(1, 4),
       special=st.sampled_from([0.0, 0.05, 0.5]), misalign=st.sampled_from([0.0, 0.5, 1.0]),
       transposed=st.booleans(), options=plan_options, first_step=first_steps)
def test_lion_matches_reference(config, seed, sizes, steps, special, misalign, transposed, options,
                                first_step):
    _, plan, flags = config
    run_and_compare("lion", plan, flags, seed=seed, sizes=sizes, steps=steps, special=special,
                    misalign=misalign, transposed=transposed, plan_options=options,
                    first_step=first_step)


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
    for key in (0, 0x9E3779B9, int(rng.integers(0, 2 ** 32))):
        random = storage.random_bits(key, x.shape)
        expected = bits(storage.encode_stochastic(torch.from_numpy(x), dtype, random))
        actual = emulator.encode(f"{name}-stochastic", x, key)
        bad = np.flatnonzero(expected != actual)
        assert bad.size == 0, (f"{name} stochastic, key {key:#x}: {bad.size} differ, first x bits "
                               f"{x.view(np.uint32)[bad[0]]:#x}: spec {expected[bad[0]]:#x}, "
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
    for seed, step, index, buffer in cases:
        assert emulator.stream_key(seed, step, index, buffer) == storage.stream_key(seed, step, index, buffer)


def test_remainder_split_matches_storage_spec():
    x = edge_values(np.random.default_rng(8))
    param, remainder, joined = emulator.remainder_split_join(x)
    expected_param, expected_remainder = storage.split_remainder(torch.from_numpy(x))
    assert np.array_equal(param, bits(expected_param))
    assert np.array_equal(remainder, bits(expected_remainder))
    canonical = bits(storage.encode(torch.from_numpy(x), torch.float32))
    assert np.array_equal(joined.view(np.uint32), canonical)  # exact, NaN canonical
    assert np.array_equal(joined.view(np.uint32), bits(storage.join_remainder(expected_param, expected_remainder)))
