"""Random buckets for the backend-equality tests, and their bit-for-bit comparison.

Shared by ``test_numba_backend.py``, ``test_numba_quality.py``, ``test_cupy_adapter.py``
and ``test_cupy_gpu.py``.  One generator serves every algorithm: it reads the
algorithm's roles from its :class:`~bf16opt.algorithms.KernelConfig`, so Adam, Lion and
SGD buckets (and any later algorithm's) are built and compared by the same code.

* :func:`make_bucket`: random tensors for every role a (algorithm, plan, flags)
  configuration has -- params with exact bf16 ties, gradients with NaN/inf/subnormal
  values, master copies, Kahan buffers, int16 remainders, moments -- in a chosen memory
  layout per param (contiguous, transposed / strided, channels_last) and optionally at odd
  element offsets (misaligned for vector loads);
* :func:`clone_bucket`: an exact copy (same strides and storage offsets);
* :func:`assert_same_bits`: every role (the read-only grad too) and the telemetry counts,
  compared on stored bits;
* :func:`run_both`: consecutive steps of the reference and another backend, compared
  after each step.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

from bf16opt.adam import adam_scalars
from bf16opt.algorithms import ALGORITHMS, SGD, kernel_config
from bf16opt.backends import Bucket, f32, reference
from bf16opt.lion import lion_scalars
from bf16opt.precision import all_plans
from bf16opt.sgd import sgd_scalars
from bf16opt.storage import Q8, encode, q8_encode, q8_signed

INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16, torch.int16: torch.int16}
SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", Q8: "q8"}

LAYOUTS = ("contiguous", "transposed", "channels_last")

# per moment role: (scale, non-negative) of its random values
MOMENT_VALUES = {"exp_avg": (0.01, False), "exp_avg_sq": (1e-4, True),
                 "max_exp_avg_sq": (1e-4, True), "momentum_buffer": (0.01, False)}


# ---------------------------------------------------------------- the deterministic cases
# (several chunks per tensor with ``small_chunks``; the 4-d shape is laid out channels_last)
SMALL_SHAPES = [(), (1,), (7,), (22,), (64,), (5, 13), (0,), (3, 0, 2), (1000,)]
SMALL_CONTIGUOUS = [True, True, True, False, True, False, True, True, True]
SMALL_SHAPES_4D = SMALL_SHAPES + [(2, 3, 4, 5)]
SMALL_LAYOUTS_4D = SMALL_CONTIGUOUS + ["channels_last"]

# Adam's weight decay: (weight_decay, decoupled)
WEIGHT_DECAY = {"none": (0.0, False), "l2": (0.1, False), "decoupled": (0.1, True)}
ADAM_GROUPS = {name: dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd,
                          decoupled_weight_decay=decoupled)
               for name, (wd, decoupled) in WEIGHT_DECAY.items()}


def adam_flags(group: dict, amsgrad: bool, maximize: bool = False) -> dict:
    l2 = group["weight_decay"] != 0.0 and not group["decoupled_weight_decay"]
    return {"amsgrad": amsgrad, "maximize": maximize, "l2": l2}


def sgd_flags(group: dict, *, first: bool = False, maximize: bool = False) -> dict:
    """SGD's flags for ``group`` as the optimizer sets them; ``first``: the momentum
    buffer's first step."""
    momentum = group["momentum"] != 0.0
    return {"momentum": momentum, "l2": group["weight_decay"] != 0.0, "maximize": maximize,
            "nesterov": group.get("nesterov", False), "first": first and momentum}


def sgd_group(lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False) -> dict:
    return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov)


def _signatures(configs) -> list:
    """Each configuration's position among the distinct (dtypes, weights, rounding) in
    ``configs``: plans that differ only in buffers SGD lacks run the same kernel."""
    keys = [(c.dtypes, c.weights, c.plan.rounding) for c in configs]
    first = {}
    for key in keys:
        first.setdefault(key, len(first))
    return [first[key] for key in keys]


def adam_plan_cases(plans) -> list:
    """Adam's cases per plan, (plan, amsgrad, weight_decay, track) as pytest params: four
    kernels each.  The kernels a training run uses most, without amsgrad or telemetry, with
    L2 and without (decoupled weight decay and none: two cases, one kernel); then one amsgrad
    kernel and one telemetry kernel, whose L2 (and the telemetry kernel's amsgrad) rotate
    with the plan, so across neighbouring plans each combination runs.  Why not every
    combination per plan: each kernel is a compile of about a second, and the 57 plans' six
    to eight kernels each were over a third of the suite's time; amsgrad changes only the
    maximum's read and store, L2 only the grad (adding the master, read as every update reads
    it), telemetry only counts.  Where two meet, a test of its own pins it (telemetry with
    amsgrad: test_amsgrad_telemetry_counts_the_second_moment_not_its_maximum)."""
    every = all_plans(quality=True)
    cases = []
    for plan in plans:
        k = every.index(plan)
        rotating_l2, track_amsgrad = k % 2 == 0, (k // 2) % 2 == 1
        for amsgrad, weight_decay, track in ((False, "none", False), (False, "decoupled", False),
                                             (False, "l2", False),
                                             (True, "l2" if rotating_l2 else "decoupled", False),
                                             (track_amsgrad, "decoupled" if rotating_l2 else "l2", True)):
            cases.append(pytest.param(plan, amsgrad, weight_decay, track,
                                      id=f"{plan_id(plan)}-{'amsgrad' if amsgrad else 'adam'}-{weight_decay}"
                                         f"{'-track' * track}"))
    return cases


def sgd_plan_cases(plans) -> list:
    """Two SGD cases per plan, (plan, group, first, track) as pytest params: without
    momentum, and with momentum from the buffer's first step on (step 1 ``first``, then
    not).  The other flags rotate with the plan's SGD kernel (plans that differ only in
    ``exp_avg_sq``, or in the moments when there is no momentum buffer, share one), so
    every kernel runs with and without telemetry (one case each), nesterov and L2 are on
    for about half of them, and the cases compile few kernels (each configuration is a
    compiled Numba function): about as many as Lion's."""
    every = all_plans(quality=True)
    plain = _signatures([kernel_config(SGD, plan) for plan in every])
    buffered = _signatures([kernel_config(SGD, plan, (("momentum", True),)) for plan in every])
    cases = []
    for plan in plans:
        k = every.index(plan)
        s0, s = plain[k], buffered[k]
        l2, track = (s0 // 2) % 2 == 0, s0 % 2 == 1
        cases.append(pytest.param(plan, sgd_group(weight_decay=0.1 if l2 else 0.0), False, track,
                                  id=f"{plan_id(plan)}{'-l2' * l2}{'-track' * track}"))
        nesterov, l2, track = s % 2 == 1, (s // 2) % 2 == 0, not track
        group = sgd_group(momentum=0.9, dampening=0.0 if nesterov else 0.1,
                          weight_decay=0.1 if l2 else 0.0, nesterov=nesterov)
        cases.append(pytest.param(plan, group, True, track,
                                  id=f"{plan_id(plan)}-momentum{'-nesterov' * nesterov}"
                                     f"{'-l2' * l2}{'-track' * track}"))
    return cases


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 256 elements: the (1000,) tensor spans four table rows (three full vector
    loops and a tail) as a large tensor spans many; results must not depend on it."""
    from bf16opt._cpu import chunks  # noqa: PLC0415  (imports numba)
    monkeypatch.setattr(chunks, "CHUNK", 256)


def scalars(algorithm: str, group: dict, step: int, inv_grad_scale: float = 1.0):
    """The step's float32 scalars, as the optimizer computes them (``inv_grad_scale``:
    GradScaler's folded unscale)."""
    values = {"adam": lambda: adam_scalars(group, step), "lion": lambda: lion_scalars(group),
              "sgd": lambda: sgd_scalars(group)}[algorithm]()  # a new algorithm needs its entry
    return values._replace(inv_grad_scale=inv_grad_scale)


def plan_id(plan) -> str:
    master = SHORT[plan.master] if plan.master is not None else "none"
    extra = {None: "", "kahan": f"-kahan{SHORT.get(plan.compensation_dtype, '')}",
             "remainder": "-remainder"}[plan.compensation]
    rounding = ("-sr" if plan.rounding == "stochastic" else "") + ("-q8sr" if plan.q8_rounding == "stochastic" else "")
    return (f"p{SHORT[plan.param]}-w{master}-m{SHORT[plan.exp_avg]}-v{SHORT[plan.exp_avg_sq]}"
            f"{rounding}{extra}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits as integers (row-major)."""
    return t.contiguous().view(INT_VIEW.get(t.dtype, t.dtype))


# ---------------------------------------------------------------- tensors
def special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaN, +-inf, zeros, fp32/bf16/fp16 subnormals and exact bf16 ties (as fp32 bits)."""
    raw = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000, 0x00000000,
                        0x80000000, 0x00000001, 0x807FFFFF, 0x00400000, 0x3F808000,
                        0xBF818000, 0x3C018000, 0x00018000, 0x33800000, 0x387FC000],
                       dtype=torch.int64).to(torch.int32).view(torch.float32)
    return raw.to(dtype)


def _layout(layout, shape) -> str:
    if layout is True or layout is None:
        return "contiguous"
    if layout is False:
        return "transposed"
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    if layout == "channels_last" and len(shape) != 4:
        raise ValueError(f"channels_last needs a 4-d shape, got {shape}")
    return layout


def _reversed_dims(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, -1) if t.dim() == 2 else t.permute(*reversed(range(t.dim())))


def random_tensor(shape, dtype, gen, *, scale=1.0, layout="contiguous", nonneg=False) -> torch.Tensor:
    """A random tensor in ``dtype``.  ``"transposed"``: dims reversed (a dense permuted
    layout) for 2-d and more, every other element of a wider buffer (not dense) for 1-d."""
    layout = _layout(layout, shape)
    if layout == "transposed" and len(shape) >= 2:
        out = _reversed_dims(torch.randn(tuple(reversed(shape)), generator=gen, dtype=torch.float32))
    elif layout == "transposed" and len(shape) == 1:
        out = torch.randn((shape[0], 2), generator=gen, dtype=torch.float32)[:, 1]
    else:
        out = torch.randn(shape, generator=gen, dtype=torch.float32)
    out.mul_(scale)
    if nonneg:
        out.abs_()
    encoded = encode(out.contiguous(), dtype)
    if layout == "channels_last":
        return encoded.contiguous(memory_format=torch.channels_last)
    if layout == "contiguous" or len(shape) == 0:
        return encoded
    holder = torch.empty_like(out, dtype=dtype) if out.dim() != 1 else \
        torch.empty((shape[0], 2), dtype=dtype)[:, 1]
    holder.copy_(encoded)
    return holder


def random_remainder(shape, gen, layout="contiguous") -> torch.Tensor:
    """Random int16 remainders (every int16 completes a bf16 param to a float32 master)."""
    layout = _layout(layout, shape)
    values = torch.randint(-32768, 32768, shape, generator=gen, dtype=torch.int32).to(torch.int16)
    if layout == "channels_last":
        return values.contiguous(memory_format=torch.channels_last)
    if layout == "contiguous" or len(shape) < 2:
        return values
    holder = _reversed_dims(torch.empty(tuple(reversed(shape)), dtype=torch.int16))
    holder.copy_(values)
    return holder


def master_from(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    master = torch.empty_like(param, dtype=dtype)  # keeps a permuted / channels_last layout
    master.copy_(param.to(dtype))
    return master


#: bits of edits a copy-policy param may get between steps (``edited_copy``), per format: a
#: non-canonical NaN and its float32 widening as a master, the largest finite value
_EDGE_16 = {torch.bfloat16: (0xFFC1 - 0x10000, 0x7F7F), torch.float16: (0xFE01 - 0x10000, 0x7BFF)}


def edited_copy(param: torch.Tensor, gen, edited: float) -> torch.Tensor:
    """A float32 master copy of ``param`` with bits below the param's (ties, NaN, values
    that round to inf or to -0 among them), ``param`` rewritten in place as its round to
    nearest even -- but for a fraction ``edited`` of the elements, where the param was
    written since (``storage.join_copy``): another value, +0, -0, the neighbouring bits, the
    sign flipped, +-inf, a non-canonical NaN; returns the master in the param's layout."""
    n, dtype = param.numel(), param.dtype
    flat = param.contiguous().view(-1).float()
    step = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    master = flat + torch.randn(n, generator=gen) * flat.abs() * step
    nan_bits, largest = _EDGE_16[dtype]
    special = torch.randint(0, 8, (n,), generator=gen)
    special = torch.where(torch.rand(n, generator=gen) < 0.15, special, torch.full_like(special, -1))
    wide = torch.tensor([nan_bits], dtype=torch.int16).view(dtype).float()  # a non-canonical NaN
    big = torch.tensor([largest], dtype=torch.int16).view(dtype).float() * 1.00390625  # rounds to inf
    # a tie between two neighbours of the param's grid (normal values): RNE picks the even one
    tie = (flat.view(torch.int32) | (0x8000 if dtype == torch.bfloat16 else 0x1000)).view(torch.float32)
    for k, value in enumerate([torch.full_like(master, float("nan")), wide.expand(n), big.expand(n),
                               -big.expand(n), torch.full_like(master, -1e-45), torch.full_like(master, -0.0),
                               tie, torch.full_like(master, float("inf"))]):
        master = torch.where(special == k, value, master)
    rounded = encode(master, dtype)
    rounded = torch.where(special == 1, torch.tensor([nan_bits], dtype=torch.int16).view(dtype), rounded)
    bits16 = rounded.view(torch.int16)
    kind = torch.randint(0, 8, (n,), generator=gen)
    kind = torch.where(torch.rand(n, generator=gen) < edited, kind, torch.full_like(kind, -1))
    other = encode(torch.randn(n, generator=gen), dtype).view(torch.int16)
    edits = [other, torch.zeros_like(bits16), torch.full_like(bits16, -0x8000), bits16 ^ 1, bits16 ^ -0x8000,
             torch.full_like(bits16, 0x7F80 if dtype == torch.bfloat16 else 0x7C00),
             torch.full_like(bits16, nan_bits), bits16 + 1]
    for k, value in enumerate(edits):
        bits16 = torch.where(kind == k, value, bits16)
    param.copy_(bits16.view(dtype).view(param.shape))
    copy = torch.empty_like(param, dtype=torch.float32)
    copy.copy_(master.view(param.shape))
    return copy


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values and strides, ``offset`` elements into a fresh buffer (a misaligned
    address for offsets that are not a multiple of 16 bytes)."""
    if offset == 0 or t.numel() == 0:
        return t
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    base = torch.zeros(offset + span, dtype=t.dtype)
    view = base.as_strided(t.shape, t.stride(), offset)
    view.copy_(t)
    return view


def make_bucket(algorithm, plan, shapes, *, seed: int, flags=(), track: bool = False,
                specials: bool = True, layouts=None, misalign: float = 0.0, grad=None,
                edited: float = None) -> Bucket:
    """Random tensors for every role of ``kernel_config(algorithm, plan, flags, track)``.

    ``algorithm``: an :class:`~bf16opt.algorithms.Algorithm` or its name; ``flags``: a
    dict or (name, value) pairs; ``layouts[i]``: param i's memory layout (a name of
    ``LAYOUTS``, True for contiguous, False for transposed); every role of a param has
    its layout.  ``misalign``: the fraction of tensors placed 1..8 elements into their
    buffer.  ``specials`` puts NaN, infinities, zeros, subnormals and ties into the
    gradients.  Params get optimizer indices 1, 4, 7, ...; ``track`` allocates telemetry
    counts.  ``grad``: the grads' dtype (default the param's; float32 for 16-bit params).
    ``edited``: a float32 master copy gets bits below the param's and that fraction of its
    params edited since the last step (:func:`edited_copy`); None: the copy is the param.
    """
    if isinstance(algorithm, str):
        algorithm = ALGORITHMS[algorithm]
    config = kernel_config(algorithm, plan, tuple(dict(flags).items()), track, grad)
    gen = torch.Generator().manual_seed(seed)
    bucket = Bucket(config, seed=seed * 0x9E3779B97F4A7C15 % 2**64)
    for index, shape in enumerate(shapes):
        layout = _layout(None if layouts is None else layouts[index], shape)
        param = random_tensor(shape, plan.param, gen, layout=layout)
        grad = random_tensor(shape, config.grad, gen, scale=0.1, layout=layout)
        numel = grad.numel()
        if specials and numel > 0:
            values = special_values(config.grad)
            flat_positions = torch.randperm(numel, generator=gen)[:min(numel, values.numel())]
            flat = grad.contiguous().view(-1).clone()
            flat[flat_positions] = values[:flat_positions.numel()]
            grad.copy_(flat.view(grad.shape))
        row = []
        for role, dtype in zip(algorithm.roles, config.dtypes):
            if dtype is None:
                tensor = None
            elif role.name == "param":
                tensor = param
            elif role.name == "grad":
                tensor = grad
            elif role.name == "companion" and config.weights == "copy" and edited is not None:
                tensor = edited_copy(param, gen, edited)
            elif role.name == "companion" and config.weights == "copy":
                tensor = master_from(param, dtype)
            elif role.name == "companion" and config.weights == "kahan":
                tensor = random_tensor(shape, dtype, gen, scale=1e-3, layout=layout)
            elif role.name == "companion":  # the int16 remainder
                tensor = random_remainder(shape, gen, layout)
            elif dtype == Q8:  # a q8 moment: its own (blocks, 260) layout, of random values
                scale, nonneg = MOMENT_VALUES[role.name]
                values = random_tensor((param.numel(),), torch.float32, gen, scale=scale, nonneg=nonneg)
                tensor = q8_encode(values, q8_signed(role.name))
            else:
                scale, nonneg = MOMENT_VALUES[role.name]
                tensor = random_tensor(shape, dtype, gen, scale=scale, layout=layout, nonneg=nonneg)
            row.append(tensor)
        if misalign:
            row = [None if t is None else at_offset(t, _offset(gen, misalign)) for t in row]
        bucket.append(row, 3 * index + 1)
    if track:
        bucket.counts = torch.zeros(len(shapes), 3, dtype=torch.int64)
    return bucket


def _offset(gen, misalign: float) -> int:
    if float(torch.rand((), generator=gen)) >= misalign:
        return 0
    return int(torch.randint(1, 9, (), generator=gen))


def clone_tensor(t):
    """An exact copy: same values, shape, strides and storage offset (so the same
    alignment and the same staging decisions)."""
    return None if t is None else copy.deepcopy(t)


def relocate(t, device):
    """``t`` copied to ``device`` with the same shape, strides and storage offset (``.to``
    would make strided views contiguous and drop the offset, i.e. the alignment)."""
    if t is None:
        return None
    span = t.storage_offset() + (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
                                 if t.numel() else 0)
    base = torch.zeros(span, dtype=t.dtype, device=device)
    view = base.as_strided(t.shape, t.stride(), t.storage_offset())
    view.copy_(t)
    return view


def bucket_to(bucket: Bucket, device) -> Bucket:
    """A copy of ``bucket`` on ``device`` (telemetry counts stay on the CPU, as the
    optimizer keeps them)."""
    return Bucket(bucket.config, [[relocate(t, device) for t in column] for column in bucket.tensors],
                  indices=list(bucket.indices), seed=bucket.seed, step=bucket.step,
                  counts=clone_tensor(bucket.counts))


def clone_bucket(bucket: Bucket) -> Bucket:
    return Bucket(bucket.config, [[clone_tensor(t) for t in column] for column in bucket.tensors],
                  indices=list(bucket.indices), seed=bucket.seed, step=bucket.step,
                  counts=clone_tensor(bucket.counts))


def with_flags(bucket: Bucket, **flags) -> None:
    """Give ``bucket`` the configuration with ``flags`` changed (configurations are
    memoised values: a new one is asked for, never edited)."""
    config = bucket.config
    changed = {**dict(config.flags), **flags}
    bucket.config = kernel_config(config.algorithm, config.plan, tuple(changed.items()), config.track,
                                  config.grad)


# ---------------------------------------------------------------- comparing
def assert_same_bits(expected: Bucket, got: Bucket, where: str, other: str = "numba") -> None:
    """Telemetry counts and every role's tensors (dtype, shape, strides, bits) equal."""
    assert expected.config == got.config, where
    if expected.counts is None:
        assert got.counts is None, where
    else:
        assert torch.equal(expected.counts, got.counts.cpu()), (
            f"{where}: telemetry counts differ: reference {expected.counts.tolist()}, "
            f"{other} {got.counts.tolist()}")
    for role, column_a, column_b in zip(expected.config.algorithm.roles, expected.tensors, got.tensors):
        assert len(column_a) == len(column_b), (where, role.name)
        for index, (a, b) in enumerate(zip(column_a, column_b)):
            if a is None:
                assert b is None, (where, role.name, index)
                continue
            b = b.cpu()
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), (
                f"{where}: {role.name}[{index}] is {a.dtype} {tuple(a.shape)} strides {a.stride()} "
                f"in the reference, {b.dtype} {tuple(b.shape)} strides {b.stride()} in {other}")
            a_bits, b_bits = bits(a).view(-1), bits(b).view(-1)
            bad = (a_bits != b_bits).nonzero().view(-1)
            assert bad.numel() == 0, (
                f"{where}: {role.name}[{index}] differs at {bad.numel()} of {a_bits.numel()} "
                f"elements, flat indices {bad[:4].tolist()}: reference bits "
                f"{a_bits[bad[:4]].tolist()}, {other} bits {b_bits[bad[:4]].tolist()}")


THIRD = f32(1 / 3)  # the float32 reciprocal of a scale of 3: inexact, so multiply != divide


def variant(unit: bool) -> dict:
    """``run_both``'s arguments for one of the two kernels the numba backend compiles for a
    configuration: ``unit`` steps (minimize, no grad scale: the kernel without the
    multiplication by the unscaling factor), else a grad scale with ``maximize`` flipped
    each step."""
    return dict(unit=True) if unit else dict(alternate_maximize=True, inv_grad_scale=THIRD)


def one_variant(bucket: Bucket) -> dict:
    """``run_both``'s arguments exercising one of the two kernels the numba backend compiles
    for ``bucket``'s configuration: with or without the multiplication of every grad by the
    unscaling factor (``inv_grad_scale * sign``), chosen per call (``unit_scalars``).  Half of
    the configurations, by a hash of what names the compiled kernel (the configuration but its
    run-time ``maximize``: cases that differ only in scalars, e.g. decoupled weight decay or
    none, share one compilation), run unit steps (minimize, no grad scale); the others and
    every tracked one (telemetry kernels always multiply) run with a grad scale and
    ``maximize`` flipped each step.  Why not both for every configuration: each compile costs
    about a second, and compiling both was a third of the suite's time; the two differ in that
    one multiplication, compared in both forms for each algorithm by
    ``test_kernels_without_multiplications_by_one_have_the_same_bits`` (fp32 master, nearest,
    stochastic and Kahan), and the hash gives each storage policy both."""
    config = bucket.config
    kernel = " ".join([config.algorithm.name, plan_id(config.plan), str(config.grad),
                       *(f"{name}={value}" for name, value in config.flags if name != "maximize")])
    return variant(not (config.track or zlib.crc32(kernel.encode()) % 2))


def run_both(bucket: Bucket, group: dict, steps: int, where: str, *, run=None, other: Bucket = None,
             fetch=None, name: str = "numba", alternate_maximize: bool = False,
             inv_grad_scale: float = 1.0, unit: bool = False) -> Bucket:
    """``steps`` consecutive steps of the reference (on ``bucket``) and of ``run`` (numba's
    by default) on ``other`` (default: a clone), every role compared after each step (on
    ``fetch(other)`` when given, e.g. a copy back from the GPU); returns ``other``.

    ``alternate_maximize`` flips ``maximize`` every step after the first (a run-time sign
    in the kernels); ``unit``: every step minimizes (with ``inv_grad_scale`` 1, the kernel
    without the multiplication by the unscaling factor).  A ``first`` flag (SGD: the
    momentum buffer's first step) holds for step 1 only, as in the optimizer.  Telemetry
    counts start at -1 each step: every counter the reference writes must be written by the
    backend too.
    """
    if run is None:
        from bf16opt.backends import numba as numba_backend  # noqa: PLC0415
        run = numba_backend.run
    if unit and (alternate_maximize or inv_grad_scale != 1.0):
        raise ValueError("unit steps neither maximize nor carry a grad scale")
    expected = bucket
    if unit and expected.config.flag("maximize"):
        with_flags(expected, maximize=False)
        if other is not None:
            other.config = expected.config
    got = clone_bucket(bucket) if other is None else other
    kind = bucket.config.algorithm.name
    for step in range(1, steps + 1):
        expected.step = got.step = step  # stochastic rounding draws a new stream each step
        if step > 1:
            changes = {}
            if alternate_maximize:
                changes["maximize"] = not expected.config.flag("maximize")
            if dict(expected.config.flags).get("first"):
                changes["first"] = False
            if changes:
                with_flags(expected, **changes)
                got.config = expected.config
        if expected.counts is not None:
            expected.counts.fill_(-1)
            got.counts.copy_(expected.counts)
        step_scalars = scalars(kind, group, step, inv_grad_scale)
        reference.run(expected, step_scalars)
        run(got, step_scalars)
        flags = ",".join(flag for flag, value in expected.config.flags if value)
        assert_same_bits(expected, got if fetch is None else fetch(got),
                         f"{where}, step {step}, flags [{flags}]", other=name)
    return got
