"""capturable=True (bf16opt/capture.py): live steps, whose step and lr the kernels read when
they run, have the bits of eager steps; a captured step replayed N times equals N eager steps;
what cannot be captured is refused before anything changes.

No GPU needed: the CUDA kernels run in the CPU emulation (tests/cuda_emulation), the "device"
is the CPU, and a capture is simulated by recording the step's device work (the kernel
launches and the counters' add) instead of running it, then replaying the record.  The real
torch.cuda.graph test is in test_cupy_gpu.py.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bf16opt
import bf16opt.step_plan as step_plan
from bf16opt import capture
from bf16opt.adam import adam_scalars
from cuda_emulation import emulator
from snapshots import assert_unchanged, same_bits, snapshot

pytestmark = pytest.mark.skipif(emulator.compiler_problem() is not None,
                                reason=f"the CUDA emulation needs a host C++ compiler: "
                                       f"{emulator.compiler_problem()}")

CASES = [
    (bf16opt.AdamW, dict(precision="bf16-sr", weight_decay=0.1)),
    (bf16opt.AdamW, dict(precision="fp32-remainder-q8", weight_decay=0.01)),
    (bf16opt.Adam, dict(precision="bf16-kahan", weight_decay=0.01, amsgrad=True, maximize=True)),
    (bf16opt.Adam, dict(precision="fp32", betas=(0.5, 0.6))),
    (bf16opt.Lion, dict(precision="bf16-sr", weight_decay=0.1)),
    (bf16opt.SGD, dict(precision="bf16-kahan", momentum=0.9, nesterov=True, weight_decay=0.01)),
]
LRS = {"float": lambda lr: lr, "float32 tensor": lambda lr: torch.tensor(lr, dtype=torch.float32),
       "float64 tensor": lambda lr: torch.tensor(lr, dtype=torch.float64)}


def make_params(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (5,), (300,), (4096 + 3,)]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]


@pytest.fixture(scope="module", autouse=True)
def live_kernels():
    """The emulated live kernels these tests launch, built together (one library, not one each)."""
    from bf16opt.backends import cupy as cuda_backend
    from bf16opt.tensors import real_view

    kernels = set()
    for optimizer, options in CASES + [(bf16opt.AdamW, dict(precision="bf16"))]:
        params = make_params()
        opt = optimizer(params, capturable=True, **options)
        kernels |= {(opt.algorithm.name, cuda_backend.kernel_name(opt._state_config(group, real_view(p), p.numel()),
                                                                  live=True))
                    for group in opt.param_groups for p in group["params"]}
    emulator.build_live(kernels)


@pytest.fixture
def emulated(monkeypatch):
    """Every group's kernels run in the CPU emulation of the CuPy backend."""
    backend = emulator.backend()
    monkeypatch.setattr(step_plan, "resolve_backend", lambda name, device: backend)
    return backend


@contextlib.contextmanager
def reference_backend():
    """The reference backend (the specification) for the steps inside."""
    emulated = step_plan.resolve_backend
    step_plan.resolve_backend = lambda name, device: bf16opt.backends.reference
    try:
        yield
    finally:
        step_plan.resolve_backend = emulated


def set_lr(optimizer, lr: float) -> None:
    """An LR scheduler's write: in place for a tensor lr (as torch's schedulers do)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def give_grads(params_lists: list, generator: torch.Generator, skip: int = -1) -> None:
    """The same fresh grads for each list of params; param ``skip`` gets none."""
    for k, params in enumerate(zip(*params_lists)):
        grad = torch.randn(params[0].shape, generator=generator).to(params[0].dtype)
        for param in params:
            param.grad = None if k == skip else grad.clone()


def assert_same_bits(expected: list, actual: list, expected_opt, actual_opt) -> None:
    for e, a in zip(expected, actual):
        assert same_bits(e.detach(), a.detach())
        expected_state, actual_state = expected_opt.state[e], actual_opt.state[a]
        assert set(expected_state) == set(actual_state)
        for key, value in expected_state.items():
            assert same_bits(value, actual_state[key]), key


@pytest.mark.parametrize("optimizer, options, lr_kind",
                         [(*case, sorted(LRS)[k % len(LRS)]) for k, case in enumerate(CASES)])
def test_live_steps_have_the_bits_of_eager_steps(emulated, optimizer, options, lr_kind):
    """capturable=True on the emulated kernels (step and lr read from memory when the kernel
    runs) equals the reference backend's eager steps, across an lr schedule and a param that
    misses a step (its counter then differs from the others' in one launch)."""
    expected_params, actual_params = make_params(), make_params()
    expected = optimizer(expected_params, lr=1e-2, backend="reference", seed=7, **options)
    actual = optimizer(actual_params, lr=LRS[lr_kind](1e-2), capturable=True, seed=7, **options)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        give_grads([expected_params, actual_params], g, skip=1 if step == 2 else -1)
        set_lr(actual, 1e-2 * 0.6 ** step)
        set_lr(expected, float(actual.param_groups[0]["lr"]))  # (a float32 tensor holds a rounded lr)
        with reference_backend():
            expected.step()
        actual.step()
    assert_same_bits(expected_params, actual_params, expected, actual)
    assert actual.state[actual_params[1]]["step"].item() == 4.0
    assert actual.state[actual_params[0]]["step"].dtype == torch.float64


class Recorder:
    """A simulated CUDA-graph capture: while ``capturing``, the step's device work (kernel
    launches, the counters' advance) is recorded instead of run; :meth:`replay` runs the record."""

    def __init__(self, monkeypatch):
        self.capturing = False
        self.record = []
        real_advance = capture.advance_counters

        def advance(counters, found_inf=None):
            if not self.capturing:
                return real_advance(counters, found_inf)
            self.record.append(lambda: real_advance(list(counters), found_inf))

        def execute(prepared):
            if not self.capturing:
                return emulator.execute(prepared)
            self.record.append(lambda: emulator.execute(prepared))

        monkeypatch.setattr(capture, "advance_counters", advance)
        monkeypatch.setattr(capture, "capturing", lambda: self.capturing)
        backend = emulator.backend(execute)
        monkeypatch.setattr(step_plan, "resolve_backend", lambda name, device: backend)

    def captured(self, step) -> None:
        self.capturing = True
        try:
            step()
        finally:
            self.capturing = False

    def replay(self) -> None:
        for action in self.record:
            action()


@pytest.mark.parametrize("optimizer, options", CASES)
def test_replays_of_a_captured_step_equal_eager_steps(monkeypatch, optimizer, options):
    """Two eager warm-up steps, one captured step, then replays with new grads copied into the
    captured grads and a tensor lr filled by a schedule: the bits of eager steps throughout."""
    expected_params, actual_params = make_params(), make_params()
    expected = optimizer(expected_params, lr=1e-2, backend="reference", seed=3, **options)
    actual = optimizer(actual_params, lr=torch.tensor(1e-2, dtype=torch.float64), capturable=True, seed=3,
                       **options)
    g = torch.Generator().manual_seed(2)
    recorder = Recorder(monkeypatch)
    for step in range(6):
        give_grads([expected_params], g)
        set_lr(expected, 1e-2 * 0.8 ** step)
        with reference_backend():
            expected.step()
        set_lr(actual, 1e-2 * 0.8 ** step)
        for e, a in zip(expected_params, actual_params):
            if step < 2:
                a.grad = e.grad.clone()
            else:  # new values in the grads the capture recorded
                a.grad.copy_(e.grad)
        if step < 2:  # warm-up
            actual.step()
            continue
        if step == 2:
            before = snapshot(actual)
            recorder.captured(actual.step)
            assert_unchanged(actual, before)  # (recorded, not run)
        recorder.replay()
    assert_same_bits(expected_params, actual_params, expected, actual)
    assert actual.state[actual_params[0]]["step"].item() == 6.0


def test_capture_is_refused_before_warm_up_and_nothing_changes(monkeypatch):
    params = make_params()
    opt = bf16opt.AdamW(params, lr=1e-2, capturable=True, precision="bf16")
    recorder = Recorder(monkeypatch)
    give_grads([params], torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="warm-up"):
        recorder.captured(opt.step)
    assert not opt.state and not recorder.record
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    opt.step()  # eager: the first step makes the state
    assert opt.state[params[0]]["step"].item() == 1.0


def test_capture_refuses_groups_without_capturable(monkeypatch):
    params = make_params()
    opt = bf16opt.AdamW(params, lr=1e-2, precision="bf16")
    recorder = Recorder(monkeypatch)
    give_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="capturable=False"):
        recorder.captured(opt.step)
    assert_unchanged(opt, before)
    assert not recorder.record


@pytest.mark.parametrize("optimizer, options", [CASES[0], CASES[2], CASES[4], CASES[5]])
def test_a_captured_step_with_gradscaler_reads_its_scale_and_skips_on_inf(monkeypatch, optimizer, options):
    """GradScaler's protocol in a captured step: the kernels read the loss scale and the inf
    flag when the graph runs; a flagged replay changes nothing, its counters included, as the
    eager step (which reads them on the host) does."""
    expected_params, actual_params = make_params(), make_params()
    expected = optimizer(expected_params, lr=1e-2, backend="reference", seed=3, **options)
    actual = optimizer(actual_params, lr=1e-2, capturable=True, seed=3, **options)
    scale, found_inf = torch.tensor(2.0 ** 12), torch.zeros(())
    g = torch.Generator().manual_seed(4)
    recorder = Recorder(monkeypatch)
    for step in range(7):
        give_grads([expected_params], g)
        scale.fill_(2.0 ** (12 - step % 3))
        found_inf.fill_(1.0 if step in (4, 5) else 0.0)
        with reference_backend():
            expected.step(grad_scale=scale.clone(), found_inf=found_inf.clone())
        for e, a in zip(expected_params, actual_params):
            if step < 2:
                a.grad = e.grad.clone()
            else:
                a.grad.copy_(e.grad)
        if step < 2:  # warm-up, eager (GradScaler.step sets the attributes, as here)
            actual.grad_scale, actual.found_inf = scale, found_inf
            actual.step()
            del actual.grad_scale, actual.found_inf
            continue
        if step == 2:
            actual.grad_scale, actual.found_inf = scale, found_inf
            recorder.captured(actual.step)
            del actual.grad_scale, actual.found_inf
        recorder.replay()
    assert_same_bits(expected_params, actual_params, expected, actual)
    assert actual.state[actual_params[0]]["step"].item() == 5.0


@pytest.mark.parametrize("setting", [dict(offload="cpu"), dict(update_in_backward=True),
                                     dict(track_precision=True), dict(max_grad_norm_per_param=1.0)])
def test_settings_capture_cannot_honour_are_refused(setting):
    key = next(iter(setting))
    with pytest.raises(ValueError, match=f"capturable=True cannot be combined with {key}"):
        bf16opt.AdamW(make_params(), capturable=True, **setting)


def test_capturable_needs_the_cupy_kernels_and_a_usable_lr(emulated):
    params = make_params()
    give_grads([params], torch.Generator().manual_seed(0))
    opt = bf16opt.SGD(params, lr=0.1, capturable=True)
    with reference_backend(), pytest.raises(ValueError, match="capturable=True needs the CuPy kernels"):
        opt.step()
    assert not opt.state
    opt = bf16opt.SGD(params, lr=torch.tensor(1, dtype=torch.int64), capturable=True)
    with pytest.raises(ValueError, match="lr must be a number or a one-element float32/float64 tensor"):
        opt.step()
    assert not opt.state
    wide = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    wide.grad = torch.ones(3, dtype=torch.float64)
    opt = bf16opt.AdamW([wide], capturable=True)
    with pytest.raises(ValueError, match="float64"):
        opt.step()
    assert not opt.state and not wide.any()


def test_switching_capturable_moves_the_counters(emulated):
    params = make_params()
    opt = bf16opt.AdamW(params, lr=1e-2, precision="bf16")
    give_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    opt.param_groups[0]["capturable"] = True
    opt.step()
    opt.param_groups[0]["capturable"] = False
    opt.step()
    assert opt.state[params[0]]["step"].item() == 3.0 and opt.state[params[0]]["step"].is_cpu


@settings(max_examples=200, deadline=None)
@given(beta1=st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99]), beta2=st.sampled_from([0.0, 0.9, 0.99, 0.999]),
       lr=st.floats(1e-6, 1.0), step=st.integers(1, 10 ** 7))
def test_the_bias_table_gives_adam_scalars_at_every_step(beta1, beta2, lr, step):
    """The kernels' step_size = float32(lr / row[0]) and inv_sqrt_bias_correction2 = row[1],
    with row the table's row min(step, last): adam_scalars' values at any step."""
    rows = capture.bias_rows(beta1, beta2)
    row = rows[min(step, len(rows) - 1)]
    group = dict(lr=lr, betas=(beta1, beta2), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True)
    expected = adam_scalars(group, step)
    assert float(np.float32(lr / row[0])) == expected.step_size
    assert row[1] == expected.inv_sqrt_bias_correction2


def test_bias_tables_have_a_bound():
    assert len(capture.bias_rows(0.9, 0.999)) < 50_000
    assert capture.bias_rows(0.9, 0.999)[-1].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="betas"):
        capture.bias_rows(0.9, 1 - 1e-7)
    assert math.isfinite(capture.bias_rows(0.0, 0.0)[1][0])


def test_live_launch_plan_puts_each_tensor_counter_after_the_offsets():
    from bf16opt.backends import cupy as cuda_backend

    plan = cuda_backend.build_launch_plan([(1, 2), (3, 4), (5, 6)], [4, 0, 9], counters=[70, 80, 90],
                                          chunk_size=8)
    n = 2  # the empty tensor is left out, its counter too
    assert plan.table.size == (2 + 5) * n + 1
    assert list(plan.table[(2 + 4) * n + 1:]) == [70, 90]
    with pytest.raises(ValueError, match="counters"):
        cuda_backend.build_launch_plan([(1, 2)], [4], counters=[1, 2])


def test_a_live_bucket_with_a_counter_the_kernels_cannot_read_is_refused():
    from bf16opt.algorithms import ADAM, kernel_config
    from bf16opt.backends import Bucket
    from bf16opt.backends import cupy as cuda_backend
    from bf16opt.backends.base import LiveInputs
    from bf16opt.precision import PRESETS, plan_for

    param = torch.zeros(8)
    config = kernel_config(ADAM, plan_for(PRESETS["fp32"], torch.float32))
    bucket = Bucket.of(config, {"param": [param], "grad": [torch.ones(8)], "exp_avg": [torch.zeros(8)],
                                "exp_avg_sq": [torch.zeros(8)]}, indices=[0])
    bucket.live = LiveInputs(None, 1e-3, 0.0, torch.from_numpy(capture.bias_rows(0.9, 0.999)))
    bucket.counters = [torch.zeros((), dtype=torch.float32)]
    with pytest.raises(ValueError, match="float64"):
        cuda_backend.prepare(bucket, adam_scalars(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                       decoupled_weight_decay=True), 1), execute=emulator.execute)
    assert not param.any()


def test_a_device_tensor_beta_is_refused_by_name(emulated, monkeypatch):
    """Adam's betas make a host table, so a tensor beta on a device (here CPU tensors made to
    say they are not, during the step) is refused, not read."""
    params = make_params()
    give_grads([params], torch.Generator().manual_seed(0))
    opt = bf16opt.AdamW(params, capturable=True, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    opt.step()  # (CPU tensors: read on the host)
    before = snapshot(opt)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("meta")))
    with pytest.raises(ValueError, match=r"betas\[0\] is read on the host"):
        opt.step()
    monkeypatch.undo()
    assert_unchanged(opt, before)


def test_warm_up_steps_make_room_for_a_capture_of_all_the_steps_tables(monkeypatch):
    """Twelve live launches of large chunk tables (a group per layer): the eager warm-up
    steps leave room for a capture of all twelve together, and for a second capture, without
    an arena per step.  The CUDA pieces stand in on the CPU (no device here)."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    from bf16opt.backends import cupy as cuda_backend  # noqa: PLC0415

    class HostArena:
        def __init__(self, device, words):
            self.host = torch.empty(words, dtype=torch.int64)
            self.device = torch.empty(words, dtype=torch.int64)
            self.used = 0

        def free(self):
            return self.host.numel() - self.used
    runtime = types.SimpleNamespace(memcpyAsync=lambda *arguments: None, memcpyHostToDevice=1)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cuda_backend, "_CaptureArena", HostArena)
    monkeypatch.setattr(cuda_backend, "_capture_arenas", {})
    monkeypatch.setattr(cuda_backend, "_live_tables", {})
    device, stream = torch.device("cuda", 0), types.SimpleNamespace(cuda_stream=0)
    tables = [cuda_backend.build_launch_plan([[(1 << 40) * (g + 1) + 4096 * (i + 1)] * 6 for i in range(800)],
                                             [1000] * 800, counters=[8 * i for i in range(800)]).table
              for g in range(12)]
    assert sum(t.size for t in tables) > 8 * max(t.size for t in tables) > 1 << 16  # (the old room: 8x one)
    arenas = []
    for _ in range(3):  # eager steps
        for table in tables:
            cuda_backend._reserve_capture_room(device, table)
        arenas.append(len(cuda_backend._capture_arenas[0]))
    for _ in range(2):  # two captures
        for table in tables:
            cuda_backend._captured_table(table, device, stream)
    assert arenas[0] == arenas[-1] == len(cuda_backend._capture_arenas[0])  # (made in the first step only)
