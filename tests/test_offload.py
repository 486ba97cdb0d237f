"""CPU offload (``offload="cpu"``, bf16opt/offload.py): an offloaded group's state lives in host
RAM and is updated there in chunks while new params are copied back.  Whatever the copy engine,
chunk size, precision or training-loop habit, an offloaded run must give the same bits as the
same run with ``offload=None``.

CPU params are used throughout (no GPU here): their copy engine is a plain copy, or a
``ThreadedCopyEngine`` with random delays and out-of-order completion swapped in with
``use_copy_engine``.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import time
import weakref

import pytest
import torch
from torch import nn

import bf16opt
import bf16opt.backends.numba as numba_backend
from bf16opt.backends.numba_rows import RowLaunch
from bf16opt.offload import DEFAULT_CHUNK_ELEMENTS, fingerprint, use_copy_engine
from bf16opt.offload_copies import ThreadedCopyEngine
from bf16opt.precision import PRESETS, plan_for
from snapshots import assert_unchanged, snapshot

PRESET_NAMES = sorted(PRESETS)
PARAM_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: presets whose master is the bf16 param itself (the update reads the param)
PARAM_IS_MASTER = ["bf16", "bf16-sr", "bf16-kahan", "fp32-remainder"]

OPTIMIZERS = {
    "AdamW": (bf16opt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad-L2": (bf16opt.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.05)),
    "Lion": (bf16opt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "SGD-nesterov": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "SGD-momentum": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
}
MATRIX_OPTIMIZERS = ["AdamW", "Adam-amsgrad-L2", "Lion", "SGD-nesterov"]


def valid(preset, dtype):
    try:
        plan_for(PRESETS[preset], dtype)
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------- a tiny model and its training


class Net(nn.Module):
    """Contiguous, transposed (non-contiguous, unless ``transposed=False``) and empty params;
    computes in float32 (or the param dtype when wider / complex), so autograd rounds the
    grads to the param dtype."""

    def __init__(self, dtype, seed=0, transposed=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(12, 9, generator=g).div(3).to(dtype))
        self.b1 = nn.Parameter(torch.randn(12, generator=g).to(dtype))
        w2 = torch.randn(12, 4, generator=g).div(3).to(dtype).t()  # strides (1, 4)
        self.w2 = nn.Parameter(w2 if transposed else w2.contiguous())
        self.empty = nn.Parameter(torch.zeros(0, dtype=dtype))
        self.compute = torch.promote_types(dtype, torch.float32)

    def forward(self, x):
        c = self.compute
        h = torch.tanh(x.to(c) @ self.w1.to(c).t() + self.b1.to(c))
        return h @ self.w2.to(c).t() + self.empty.to(c).sum()


def batches(dtype, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    compute = torch.promote_types(dtype, torch.float32)
    if compute.is_complex:
        return [torch.randn(5, 9, generator=g, dtype=compute) for _ in range(n)]
    return [torch.randn(5, 9, generator=g).to(compute) for _ in range(n)]


def loss_of(model, x):
    out = model(x)
    return (out.abs() if out.is_complex() else out).pow(2).sum() * 10


def make(opt_name, dtype, offload=None, seed=0, transposed=True, **overrides):
    cls, kwargs = OPTIMIZERS[opt_name]
    model = Net(dtype, seed, transposed)
    opt = cls(model.parameters(), **{**kwargs, "seed": 1234, **overrides}, offload=offload)
    return model, opt


def train(model, opt, data, clip=0.1, scheduler=True):
    """Real training: backward, clip_grad_norm_ between backward and step, an LR scheduler.
    Returns the grad norms clip saw (so a test can tell the clip really rescaled)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s)) if scheduler else None
    norms = []
    for x in data:
        opt.zero_grad()
        loss_of(model, x).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
    return norms


def bits(t):
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_run(model_a, opt_a, model_b, opt_b):
    """Params and every state tensor equal bit for bit (state compared on the CPU)."""
    params_a, params_b = list(model_a.parameters()), list(model_b.parameters())
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert same(p, q), f"param {i} differs"
    assert len(opt_a.state) == len(opt_b.state)
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sorted(sa) == sorted(sb), f"param {i}: state keys {sorted(sa)} != {sorted(sb)}"
        for key in sa:
            assert same(sa[key], sb[key]), f"param {i}: state[{key!r}] differs"


def assert_host_state(model, opt):
    """Offloaded state is on the CPU, in buffers of its own (not the param's or grad's memory)."""
    for p in model.parameters():
        for key, value in opt.state.get(p, {}).items():
            assert value.device.type == "cpu", key
            if key != "step" and value.numel() and p.numel():
                assert not overlaps(value, p), f"state[{key!r}] shares the param's memory"
                if p.grad is not None:
                    assert not overlaps(value, p.grad), f"state[{key!r}] shares the grad's memory"


def span(t):
    t = torch.view_as_real(t) if t.is_complex() else t
    if t.numel() == 0:
        return (0, 0)
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def overlaps(a, b):
    (s1, e1), (s2, e2) = span(a), span(b)
    return s1 < e2 and s2 < e1


def run_pair(opt_name, dtype, steps=3, chunk=None, engine=None, clip=0.1, **overrides):
    """(model, opt) trained with offload=None and the same with offload='cpu'."""
    data = batches(dtype, steps)
    ref_model, ref_opt = make(opt_name, dtype, None, **overrides)
    ref_norms = train(ref_model, ref_opt, data, clip)
    model, opt = make(opt_name, dtype, "cpu", **overrides)
    if chunk is not None:
        opt._offloader.chunk_elements = chunk
    if engine is not None:
        use_copy_engine(opt, engine)
    norms = train(model, opt, data, clip)
    assert norms == ref_norms
    if clip is not None:
        assert any(n > clip for n in norms), "clip_grad_norm_ never rescaled: the test proves nothing"
    return ref_model, ref_opt, model, opt


# ---------------------------------------------------------------- 1. bit identity with offload=None

MATRIX = [pytest.param(o, p, d, id=f"{o}-{p}-{str(d)[6:]}")
          for o in MATRIX_OPTIMIZERS for p in PRESET_NAMES for d in PARAM_DTYPES if valid(p, d)]


@pytest.mark.parametrize("opt_name,preset,dtype", MATRIX)
def test_bit_identical_to_no_offload_numba_small_chunks(opt_name, preset, dtype):
    """Every optimizer x preset x param dtype; 40-element chunks split w1 and w2 and merge the
    pieces of neighbouring params into one kernel call."""
    ref_model, ref_opt, model, opt = run_pair(opt_name, dtype, chunk=40, precision=preset, backend="numba")
    assert_same_run(ref_model, ref_opt, model, opt)
    assert_host_state(model, opt)


def _sampled():
    """Other axes sampled: each preset once per (chunk size, backend), rotating optimizer and dtype."""
    cases = []
    names = list(OPTIMIZERS)
    axes = [(7, "numba"), (64, "numba"), (DEFAULT_CHUNK_ELEMENTS, "numba"), (7, "reference")]
    for chunk_index, (chunk, backend) in enumerate(axes):
        for i, preset in enumerate(PRESET_NAMES):
            k = i + chunk_index
            dtype = next(d for d in PARAM_DTYPES[k % 3:] + PARAM_DTYPES if valid(preset, d))
            opt_name = names[k % len(names)]
            cases.append(pytest.param(opt_name, preset, dtype, chunk, backend,
                                      id=f"{opt_name}-{preset}-{str(dtype)[6:]}-{chunk}-{backend}"))
    return cases


@pytest.mark.parametrize("opt_name,preset,dtype,chunk,backend", _sampled())
def test_bit_identical_to_no_offload_sampled(opt_name, preset, dtype, chunk, backend):
    ref_model, ref_opt, model, opt = run_pair(opt_name, dtype, chunk=chunk, precision=preset, backend=backend)
    assert_same_run(ref_model, ref_opt, model, opt)
    assert_host_state(model, opt)


@pytest.mark.parametrize("dtype,backend,preset,opt_name", [
    (torch.float64, "reference", "fp32", "AdamW"),
    (torch.float64, "auto", "bf16", "SGD-momentum"),
    (torch.float64, "auto", "bf16-sr", "Lion"),
    (torch.complex64, "reference", "bf16-sr", "Adam-amsgrad-L2"),
    (torch.complex64, "auto", "fp32", "AdamW"),
    (torch.complex64, "numba", "bf16-states", "SGD-nesterov"),
], ids=lambda v: str(v).replace("torch.", ""))
def test_bit_identical_float64_and_complex(dtype, backend, preset, opt_name):
    ref_model, ref_opt, model, opt = run_pair(opt_name, dtype, chunk=7, precision=preset, backend=backend)
    assert_same_run(ref_model, ref_opt, model, opt)
    assert_host_state(model, opt)


# ---------------------------------------------------------------- 2. a delaying, reordering engine


class RecordingEngine(ThreadedCopyEngine):
    """Logs every transfer with its host-side byte range and whether it was done when started."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log = []  # (direction, host span, transfer, done when started)

    def to_host(self, dst, src):
        transfer = super().to_host(dst, src)
        self.log.append(("d2h", span(dst), transfer, transfer.done()))
        return transfer

    def to_device(self, dst, src):
        transfer = super().to_device(dst, src)
        self.log.append(("h2d", span(src), transfer, transfer.done()))
        return transfer


def watch_kernels(monkeypatch, engine):
    """Before every kernel call of the offload pipeline (a run of chunks, on the update thread),
    record the host copies still in flight over a piece of a buffer the call reads or writes
    (there must be none), and the chunks it runs: (first, end, chunks of the step)."""
    launches, races = [], []
    real_run = RowLaunch.run

    def run(self, first, end, done):
        spans = [span(column[i].view(-1)[start:start + count]) for pieces in self.pieces[first:end]
                 for i, start, count in pieces for column in self.bucket.tensors
                 if column[i] is not None and count]
        for direction, (start, stop), transfer, _ in list(engine.log):
            if start < stop and not transfer.done() and any(s < stop and start < e for s, e in spans):
                races.append(direction)
        launches.append((first, end, len(self.pieces)))
        real_run(self, first, end, done)

    monkeypatch.setattr(RowLaunch, "run", run)
    return launches, races


def assert_each_chunk_ran_once(launches: list, steps: int) -> None:
    """The calls of each step run its chunks in order, each exactly once."""
    expected_first, ends_of_steps = 0, 0
    for first, end, count in launches:
        assert first == expected_first and first < end <= count
        expected_first = end % count
        ends_of_steps += end == count
    assert expected_first == 0 and ends_of_steps == steps


@pytest.mark.parametrize("opt_name,preset,dtype", [
    ("AdamW", "fp32", torch.bfloat16),
    ("Adam-amsgrad-L2", "bf16-sr", torch.bfloat16),
    ("Lion", "fp32-remainder", torch.bfloat16),
    ("SGD-nesterov", "bf16-kahan", torch.float32),
    ("AdamW", "bf16-states", torch.float16),
], ids=lambda v: str(v).replace("torch.", ""))
def test_jittery_engine_gives_the_same_bits_and_the_pipeline_waits(monkeypatch, opt_name, preset, dtype):
    engine = RecordingEngine(jitter=0.002, seed=1)
    launches, races = watch_kernels(monkeypatch, engine)
    steps = 3
    ref_model, ref_opt, model, opt = run_pair(opt_name, dtype, steps=steps, chunk=12, engine=engine,
                                              precision=preset, backend="numba")
    assert_same_run(ref_model, ref_opt, model, opt)
    # the copies really were asynchronous, and the pipeline waited for each before using its buffer
    assert sum(not done for *_, done in engine.log) > 0
    assert races == []
    assert_each_chunk_ran_once(launches, steps)
    assert launches[0][2] >= sum(p.numel() for p in model.parameters()) // 12
    assert all(transfer.done() for direction, _, transfer, _ in engine.log if direction == "h2d")
    engine.close()


def test_each_chunk_is_uploaded_before_the_next_is_updated(monkeypatch):
    """The driving thread enqueues a chunk's uploads as soon as the update thread wrote it, while
    the kernel call goes on: here the update thread holds back after each chunk until an upload
    of it is enqueued (a pipeline uploading only after the call would keep it waiting)."""
    engine = RecordingEngine()
    real_run, released = RowLaunch.run, []

    def run(self, first, end, done):
        for chunk in range(first, end):
            before = sum(direction == "h2d" for direction, *_ in engine.log)
            real_run(self, chunk, chunk + 1, done)
            deadline = time.monotonic() + 30
            while sum(direction == "h2d" for direction, *_ in engine.log) == before:
                assert time.monotonic() < deadline, f"chunk {chunk}: no upload while the update waits"
                time.sleep(1e-3)
            released.append(chunk)

    monkeypatch.setattr(RowLaunch, "run", run)
    data = batches(torch.bfloat16, 2)
    ref_model, ref_opt = make("AdamW", torch.bfloat16, None, transposed=False, backend="numba")
    model, opt = make("AdamW", torch.bfloat16, "cpu", transposed=False, backend="numba")
    opt._offloader.chunk_elements = 16  # every chunk holds a piece of a contiguous param
    use_copy_engine(opt, engine)
    train(ref_model, ref_opt, data)
    train(model, opt, data)
    assert_same_run(ref_model, ref_opt, model, opt)
    assert len(released) >= 2 * (sum(p.numel() for p in model.parameters()) // 16)
    engine.close()


def test_pieces_of_chunks_written_together_are_uploaded_as_one_copy_per_param():
    from bf16opt.offload import _merged
    chunks = [[(0, 0, 5)], [(0, 5, 5), (1, 0, 2)], [(1, 2, 4), (3, 0, 1)], [(3, 1, 1), (3, 4, 1)]]
    assert _merged(chunks) == [(0, 0, 10), (1, 0, 6), (3, 0, 2), (3, 4, 1)]
    assert _merged(chunks[1:2]) == chunks[1] and _merged([]) == []


def test_throttled_engine_gives_the_same_bits():
    with ThreadedCopyEngine(bandwidth=5e6, latency=1e-4) as engine:
        ref_model, ref_opt, model, opt = run_pair("AdamW", torch.bfloat16, chunk=16, engine=engine,
                                                  precision="bf16-sr", backend="numba")
        assert_same_run(ref_model, ref_opt, model, opt)


def test_uploads_are_complete_when_step_returns():
    """Publish: after step() the params hold the new values (copies with delays up to 5 ms)."""
    engine = ThreadedCopyEngine(jitter=0.005, seed=3)
    model, opt = make("SGD-momentum", torch.float32, "cpu", backend="numba")
    opt._offloader.chunk_elements = 3
    use_copy_engine(opt, engine)
    ref_model, ref_opt = make("SGD-momentum", torch.float32, None, backend="numba")
    for m, o in ((ref_model, ref_opt), (model, opt)):
        loss_of(m, batches(torch.float32, 1)[0]).backward()
        o.step()
    for p, q in zip(ref_model.parameters(), model.parameters()):  # read at once, no synchronize
        assert same(p, q)
    engine.close()


def fingerprint_by_hand(tensor: torch.Tensor) -> int:
    """The fingerprint's definition, in Python: a contiguous tensor starting 8-byte aligned in
    its storage has its bytes summed as little-endian int64 words, then its last bytes (under a
    word) as unsigned bytes; other tensors, their elements' bit patterns as signed ints of their
    size; all sums wrapping at 2**64."""
    real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    size = real.element_size()
    patterns = real.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[size]).reshape(-1).tolist()
    if real.is_contiguous() and real.numel() and real.storage_offset() * size % 8 == 0:
        data = b"".join(pattern.to_bytes(size, "little", signed=True) for pattern in patterns)
        words = len(data) // 8
        total = sum(int.from_bytes(data[8 * k:8 * k + 8], "little", signed=True) for k in range(words))
        total += sum(data[8 * words:])
    else:
        total = sum(patterns)
    return (total + 2 ** 63) % 2 ** 64 - 2 ** 63


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.complex64, torch.int8])
@pytest.mark.parametrize("numel", [0, 1, 3, 4, 8, 13, 64])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_a_fingerprint_sums_the_bit_patterns(dtype, numel, offset):
    base = torch.randn(numel + offset + 2, 3).mul(1e4).to(dtype)
    for tensor in (base[offset:offset + numel, 0], base.view(-1)[offset * 3:offset * 3 + numel],
                   base[offset:offset + numel].t()):
        assert fingerprint(tensor).item() == fingerprint_by_hand(tensor), (tuple(tensor.shape), tensor.stride())


@pytest.mark.parametrize("chunk", [3, 4, 40, DEFAULT_CHUNK_ELEMENTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.complex64])
def test_recorded_param_fingerprint_is_the_uploaded_params(chunk, dtype):
    """The pipeline sums the uploaded params' fingerprints from the mirror's pieces where that
    is the same sum (CPU, aligned, whole words per piece) and takes them from the params
    otherwise: either way, what it records is exactly the param's fingerprint, for contiguous,
    transposed, empty and misaligned (odd storage offset) params."""
    preset = "fp32" if dtype in (torch.float32, torch.complex64) else "bf16"  # the param is its master
    model, opt = make("AdamW", dtype, "cpu", precision=preset, backend="reference" if dtype.is_complex
                      else "numba")
    base = torch.zeros(1 + 4 * 37, dtype=dtype)
    odd = nn.Parameter(base[1:])  # a view at a storage offset of one element
    assert odd.data_ptr() % 8 != 0 or dtype.itemsize >= 8
    opt.add_param_group({"params": [odd]})
    opt._offloader.chunk_elements = chunk
    for x in batches(dtype, 2):
        opt.zero_grad()
        loss_of(model, x).backward()
        odd.grad = torch.full_like(odd, 0.5)
        opt.step()
        records = opt._offloader._records
        checked = [param for param in [*model.parameters(), odd] if param in records and param.numel()]
        assert any(p is odd for p in checked) and len(checked) > 2
        for param in checked:
            assert records[param].mirror_print.item() == fingerprint(param).item()


def test_grads_copied_by_step_are_copied_again_next_step():
    """A grad whose copy step() started carries no fingerprint, so an unchanged grad is copied
    again at the next step (and gives the bits of a run without offload)."""
    with RecordingEngine() as engine:
        ref_model, ref_opt, model, opt = run_pair("AdamW", torch.bfloat16, steps=1, clip=None,
                                                  engine=engine, precision="bf16")
        for p in [*ref_model.parameters(), *model.parameters()]:
            if p.grad is not None:
                p.grad = p.grad.clone()  # set by hand: no hook fires
        before = len(engine.log)
        for _ in range(2):  # the same grads twice
            ref_opt.step()
            opt.step()
            assert all(record.grad_print is None for record in opt._offloader._records.values())
        copies = [entry for entry in engine.log[before:] if entry[0] == "d2h"]
        assert len(copies) == 2 * sum(p.grad is not None for p in model.parameters())
        assert_same_run(ref_model, ref_opt, model, opt)


# ---------------------------------------------------------------- 3. version re-checks


def _clip_foreach(model, opt):
    nn.utils.clip_grad_norm_(model.parameters(), 0.01, foreach=True)


def _clip_loop(model, opt):
    nn.utils.clip_grad_norm_(model.parameters(), 0.01, foreach=False)


def _grad_mul(model, opt):
    for p in model.parameters():
        p.grad.mul_(0.5)


def _unscale_by_hand(model, opt):
    """GradScaler-style: the loss was scaled by 1024; divide the grads in place."""
    grads = [p.grad for p in model.parameters()]
    torch._foreach_mul_(grads, 1.0 / 1024)


def _grad_replaced(model, opt):
    for p in model.parameters():
        p.grad = p.grad * 0.25


GRAD_EDITS = {"clip_grad_norm_-foreach": _clip_foreach, "clip_grad_norm_-loop": _clip_loop,
              "grad.mul_": _grad_mul, "unscale-by-hand": _unscale_by_hand, "grad-replaced": _grad_replaced}


def train_with_grad_edit(offload, edit, preset="fp32", dtype=torch.bfloat16, engine=None):
    model, opt = make("SGD-momentum", dtype, offload, precision=preset, backend="numba")
    if engine is not None:
        use_copy_engine(opt, engine)
    if offload:
        opt._offloader.chunk_elements = 40
    for x in batches(dtype, 3):
        opt.zero_grad()
        (loss_of(model, x) * 1024).backward()  # the staging copies happen here, in the hooks
        edit(model, opt)
        opt.step()
    return model, opt


@pytest.mark.parametrize("engine", [None, "jitter"])
@pytest.mark.parametrize("edit", list(GRAD_EDITS))
def test_grads_edited_after_the_hook_are_copied_again(edit, engine):
    ref = train_with_grad_edit(None, GRAD_EDITS[edit])
    engine = ThreadedCopyEngine(jitter=0.001, seed=2) if engine else None
    off = train_with_grad_edit("cpu", GRAD_EDITS[edit], engine=engine)
    assert_same_run(*ref, *off)
    if engine is not None:
        engine.close()


def train_with_grad_scaler(offload):
    model, opt = make("SGD-momentum", torch.bfloat16, offload, precision="fp32", backend="numba")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x in batches(torch.bfloat16, 3):
        opt.zero_grad()
        scaler.scale(loss_of(model, x)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return model, opt


def test_grad_scaler_unscale_is_seen():
    assert_same_run(*train_with_grad_scaler(None), *train_with_grad_scaler("cpu"))


def test_grad_data_edit_is_seen():
    def edit(model, opt):
        for p in model.parameters():
            p.grad.data.mul_(0.5)

    assert_same_run(*train_with_grad_edit(None, edit), *train_with_grad_edit("cpu", edit))


def test_a_grad_given_other_memory_of_the_same_bits_sum_is_seen():
    """``grad.data = grad.data.flip(0)``: the same grad object, version counter and fingerprint
    (a sum of the bits), other values; the staged copy is not reused."""
    def edit(model, opt):
        for p in model.parameters():
            p.grad.data = p.grad.data.flip(0)

    assert_same_run(*train_with_grad_edit(None, edit), *train_with_grad_edit("cpu", edit))


def _load_other_weights(model):
    model.load_state_dict(Net(next(model.parameters()).dtype, seed=7).state_dict())


def _no_grad_add(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)


class _Ema:
    """Update an EMA of the weights and swap it with the live weights (in-place copies under
    no_grad): training continues from the swapped-in weights."""

    def __init__(self):
        self.shadow = None

    def __call__(self, model):
        params = list(model.parameters())
        with torch.no_grad():
            if self.shadow is None:
                self.shadow = [p.detach().clone() for p in params]
            torch._foreach_mul_(self.shadow, 0.5)
            torch._foreach_add_(self.shadow, params, alpha=0.5)  # the EMA update
            live = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, self.shadow)  # swap in the EMA weights...
            torch._foreach_copy_(self.shadow, live)    # ...and keep the live ones aside


PARAM_EDITS = {"load_state_dict": lambda: _load_other_weights, "no_grad-add_": lambda: _no_grad_add,
               "ema-swap": _Ema}


def train_with_param_edit(offload, edit, preset, dtype=torch.bfloat16, opt_name="AdamW"):
    model, opt = make(opt_name, dtype, offload, precision=preset, backend="numba")
    if offload:
        opt._offloader.chunk_elements = 40
    for i, x in enumerate(batches(dtype, 4)):
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
        if i % 2 == 0:
            edit(model)  # between steps: the next update must start from the edited param
    return model, opt


@pytest.mark.parametrize("edit", list(PARAM_EDITS))
@pytest.mark.parametrize("preset", PARAM_IS_MASTER + ["fp32"])
def test_params_edited_between_steps_are_read_back(preset, edit):
    ref = train_with_param_edit(None, PARAM_EDITS[edit](), preset)
    off = train_with_param_edit("cpu", PARAM_EDITS[edit](), preset)
    assert_same_run(*ref, *off)


def _prune(model):
    with torch.no_grad():
        model.w1[:, :3] = 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-states"])
@pytest.mark.parametrize("opt_name", ["AdamW", "Lion", "SGD-momentum"])
def test_a_param_pruned_beside_a_master_copy_is_read_back_and_the_master_follows(opt_name, preset, dtype):
    """Pruned elements of a param with a float32 master copy (storage.join_copy): the edit is
    read back into the host mirror, the update starts from it and the host master follows, as
    without offload; the pruned elements stay within one update of 0."""
    ref = train_with_param_edit(None, _prune, preset, dtype, opt_name)
    off = train_with_param_edit("cpu", _prune, preset, dtype, opt_name)
    assert_same_run(*ref, *off)
    model, opt = off
    assert_one_update_from_zero(opt_name, opt, model.w1, (slice(None), slice(0, 3)))


def assert_one_update_from_zero(opt_name, opt, param, where) -> None:
    """``param[where]`` (and its master) is one update away from 0: SGD's ``lr * buffer`` (the
    momentum buffer just stored), else at most Lion's lr (1e-3) or a few of AdamW's (1e-2)."""
    state = opt.state[param]
    if opt_name.startswith("SGD"):
        bound = opt.param_groups[0]["lr"] * state["momentum_buffer"][where].float().abs() * 1.01 + 1e-30
    else:
        bound = torch.full(param[where].shape, 0.05 if opt_name != "Lion" else 2e-3)
    assert bool((param[where].detach().float().abs() <= bound).all())
    assert bool((state["master"][where].abs() <= bound).all())


def test_param_edits_seen_for_fp32_params_too():
    ref = train_with_param_edit(None, _no_grad_add, "bf16", torch.float32, "Lion")
    off = train_with_param_edit("cpu", _no_grad_add, "bf16", torch.float32, "Lion")
    assert_same_run(*ref, *off)


def _data_add(model):
    for p in model.parameters():
        p.data.add_(1)


def _data_swap(model):
    for p in model.parameters():
        p.data = p.data * 2 + 1


def _data_permuted(model):  # the same counter and the same sum of the bits: only the address tells
    for p in model.parameters():
        p.data = p.data.flip(0)


@pytest.mark.parametrize("edit", [_data_add, _data_swap, _data_permuted], ids=["p.data.add_", "p.data=", "p.data=flip"])
def test_param_data_edits_are_read_back(edit):
    ref = train_with_param_edit(None, edit, "bf16")
    off = train_with_param_edit("cpu", edit, "bf16")
    assert_same_run(*ref, *off)


def _train_cast_between_steps(offload, preset, start, cast, in_backward):
    """Two steps in ``start``, then the model cast to ``cast`` (``Module.to`` sets each
    param's ``.data``), then two more steps."""
    model, opt = make("AdamW", start, offload, precision=preset, backend="numba",
                      update_in_backward=in_backward)
    for i, x in enumerate(batches(torch.float32, 4)):
        if i == 2:
            model.to(cast)
        opt.zero_grad()
        loss_of(model, x.to(next(model.parameters()).dtype)).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
@pytest.mark.parametrize("preset, start, cast", [
    ("bf16-states", torch.bfloat16, torch.float32),   # the master is read back from the param
    ("fp32", torch.float32, torch.bfloat16),          # the master is the param: not read back
    ("fp32", torch.bfloat16, torch.float32),
    ("bf16-sr", torch.float32, torch.bfloat16),
])
def test_a_model_cast_between_steps_gives_the_same_bits(preset, start, cast, in_backward):
    ref = _train_cast_between_steps(None, preset, start, cast, in_backward)
    off = _train_cast_between_steps("cpu", preset, start, cast, in_backward)
    assert next(off[0].parameters()).dtype == cast
    assert_same_run(*ref, *off)


def _frozen_then_unfrozen(offload, opt_name, preset):
    model = Net(torch.bfloat16)
    model.w1.requires_grad_(False)
    model.b1.requires_grad_(False)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kwargs, precision=preset, offload=offload, seed=5, backend="numba")
    data = batches(torch.bfloat16, 5)
    for i, x in enumerate(data):
        if i == 2:
            model.w1.requires_grad_(True)
            model.b1.requires_grad_(True)
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("preset", ["fp32", "bf16-sr"])
def test_frozen_at_construction_then_unfrozen(preset):
    ref = _frozen_then_unfrozen(None, "AdamW", preset)
    off = _frozen_then_unfrozen("cpu", "AdamW", preset)
    assert_same_run(*ref, *off)
    assert off[0].w1 in off[1].state


def _grads_by_hand(offload, preset):
    model = Net(torch.bfloat16)
    opt = bf16opt.Adam(model.parameters(), lr=1e-2, precision=preset, offload=offload, seed=3)
    g = torch.Generator().manual_seed(9)
    for step in range(4):
        for i, p in enumerate(model.parameters()):
            if step == 2 and i == 0:
                p.grad.copy_(torch.randn(p.shape, generator=g))  # same grad tensor, edited in place
            elif step == 3 and i == 1:
                continue  # keeps last step's grad, unchanged
            else:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return model, opt


@pytest.mark.parametrize("preset", ["fp32", "bf16"])
def test_grads_set_by_hand_without_backward(preset):
    assert_same_run(*_grads_by_hand(None, preset), *_grads_by_hand("cpu", preset))


# ---------------------------------------------------------------- 4. torch.optim's contract


def _contract_run(offload, set_to_none, use_closure, accumulate):
    model = Net(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16-sr", offload=offload, seed=11)
    if offload:
        opt._offloader.chunk_elements = 40
    losses = []
    for i, x in enumerate(batches(torch.bfloat16, 5)):
        def closure():
            opt.zero_grad(set_to_none=set_to_none)
            for _ in range(2 if accumulate else 1):  # gradient accumulation: two backward passes
                if i % 3 == 1:  # only part of the model gets grads in this step
                    loss = model.w1.float().pow(2).sum()
                else:
                    loss = loss_of(model, x)
                loss.backward()
            return loss.detach()

        if use_closure:
            loss = opt.step(closure)
        else:
            loss = closure()
            assert opt.step() is None
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("use_closure", [True, False], ids=["closure", "no-closure"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["", "accumulate"])
def test_zero_grad_closures_and_params_without_grads(set_to_none, use_closure, accumulate):
    *ref, ref_losses = _contract_run(None, set_to_none, use_closure, accumulate)
    *off, losses = _contract_run("cpu", set_to_none, use_closure, accumulate)
    assert losses == ref_losses
    assert_same_run(*ref, *off)


def _two_groups(offloads):
    model = Net(torch.bfloat16)
    opt = bf16opt.AdamW([
        {"params": [model.w1, model.w2], "lr": 2e-2, "weight_decay": 0.3, "precision": "bf16-kahan",
         "offload": offloads[0]},
        {"params": [model.b1, model.empty], "lr": 5e-3, "betas": (0.8, 0.9), "precision": "fp32",
         "offload": offloads[1]},
    ], seed=4, backend="numba")
    return model, opt


@pytest.mark.parametrize("offloads", [("cpu", None), (None, "cpu")])
def test_per_group_hyperparameters_with_one_offloaded_group(offloads):
    ref = _two_groups((None, None))
    off = _two_groups(offloads)
    data = batches(torch.bfloat16, 3)
    train(*ref, data)
    train(*off, data)
    assert_same_run(*ref, *off)
    offloaded = [p for g in off[1].param_groups if g["offload"] == "cpu" for p in g["params"]]
    assert set(off[1]._offloader._records) == set(offloaded)
    assert_host_state(off[0], off[1])


LAYOUTS = [pytest.param(False, id="contiguous"), pytest.param(True, id="transposed")]

PRECISION_SEQUENCE = ["bf16", "fp32", "fp32-remainder", "bf16-sr", "fp32-remainder-bf16-states",
                      "bf16-kahan", "bf16-master", "fp32"]


def _precision_edits(offload, opt_name, sequence, transposed):
    model, opt = make(opt_name, torch.bfloat16, offload, precision=sequence[0], backend="numba",
                      transposed=transposed)
    for preset, x in zip(sequence, batches(torch.bfloat16, len(sequence))):
        opt.param_groups[0]["precision"] = preset
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD-momentum"])
def test_editing_precision_between_steps(opt_name, transposed):
    ref = _precision_edits(None, opt_name, PRECISION_SEQUENCE, transposed)
    off = _precision_edits("cpu", opt_name, PRECISION_SEQUENCE, transposed)
    assert_same_run(*ref, *off)
    assert_host_state(*off)


def _remainder_from_tied_master(offload):
    """fp32 -> fp32-remainder while a master value is an exact bf16 tie: the conversion rewrites
    the param (ties away from zero), and the step must start from the rewritten param."""
    p = nn.Parameter(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=torch.bfloat16))
    opt = bf16opt.SGD([p], lr=0.0, precision="fp32", offload=offload)
    p.grad = torch.zeros_like(p)
    opt.step()
    # 1 + 2**-8, 2 + 2**-7, -(3 + 2**-7): halfway between two bf16 values; 4 is not a tie
    tie = torch.tensor([0x3F808000, 0x40008000, 0xC0408000 - 2 ** 32, 0x40800000], dtype=torch.int32)
    tie = tie.view(torch.float32)
    opt.state[p]["master"].copy_(tie)
    with torch.no_grad():
        p.copy_(tie.to(torch.bfloat16))  # the param a step writes: round to nearest even
    opt.param_groups[0]["precision"] = "fp32-remainder"
    p.grad = torch.zeros_like(p)
    opt.step()
    return p, opt


def test_editing_precision_to_remainder_with_tied_master():
    p, opt = _remainder_from_tied_master(None)
    q, off = _remainder_from_tied_master("cpu")
    assert same(p, q)
    assert same(opt.state[p]["remainder"], off.state[q]["remainder"])


def _offload_edits(offloads, preset, transposed, opt_name="Adam-amsgrad-L2"):
    model, opt = make(opt_name, torch.bfloat16, offloads[0], precision=preset, backend="numba",
                      transposed=transposed)
    records = []
    for offload, x in zip(offloads, batches(torch.bfloat16, len(offloads))):
        opt.param_groups[0]["offload"] = offload
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
        if "_offloader_instance" in opt.__dict__:
            records.append(len(opt._offloader._records))
    return model, opt, records


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("preset", ["bf16", "fp32", "fp32-remainder"])
def test_editing_offload_between_steps(preset, transposed):
    sequence = [None, "cpu", "cpu", None, "cpu", None]
    *ref, _ = _offload_edits([None] * len(sequence), preset, transposed)
    model, opt, records = _offload_edits(sequence, preset, transposed)
    assert_same_run(*ref, model, opt)
    n = len(list(model.parameters()))
    assert records == [n, n, 0, n, 0]  # host buffers exist exactly while the group is offloaded


def test_state_of_offloaded_group_is_in_host_copies():
    model, opt = make("AdamW", torch.bfloat16, "cpu", precision="fp32")
    train(model, opt, batches(torch.bfloat16, 2))
    assert_host_state(model, opt)
    for p in model.parameters():
        record = opt._offloader._records[p]
        assert record.mirror.device.type == "cpu" and record.grad.device.type == "cpu"
        if p.numel():
            assert not overlaps(record.mirror, p) and not overlaps(record.grad, p.grad)
            assert opt.state[p]["master"].dtype == torch.float32


# ---------------------------------------------------------------- 5. state_dict


def save_and_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _describe(state_dict):
    """Everything but the values: keys, dtypes, shapes, group entries (offload aside)."""
    state = {i: {k: (v.dtype, tuple(v.shape), v.device.type) for k, v in s.items()}
             for i, s in state_dict["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "offload"} for g in state_dict["param_groups"]]
    return state, groups, {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")}


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_state_dict_format_is_the_same_with_and_without_offload(preset):
    ref_model, ref_opt, model, opt = run_pair("Adam-amsgrad-L2", torch.bfloat16, steps=2, chunk=40,
                                              precision=preset)
    a, b = ref_opt.state_dict(), opt.state_dict()
    assert _describe(a) == _describe(b)
    assert [g["offload"] for g in a["param_groups"]] == [None]
    assert [g["offload"] for g in b["param_groups"]] == ["cpu"]
    for i in a["state"]:
        for key in a["state"][i]:
            assert same(a["state"][i][key], b["state"][i][key]), (i, key)


def _continue(model, opt, data):
    train(model, opt, data, scheduler=False)
    return model, opt


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp32-remainder"])
def test_state_dict_round_trips_between_offloaded_and_not(preset, transposed):
    data = batches(torch.bfloat16, 4)
    model, off = make("AdamW", torch.bfloat16, "cpu", precision=preset, transposed=transposed)
    train(model, off, data[:2], scheduler=False)

    # offloaded -> non-offloaded: continues with the same bits
    model2 = copy.deepcopy(model)
    plain = bf16opt.AdamW(model2.parameters(), lr=1, precision=preset)  # lr, seed... come from the state dict
    plain.load_state_dict(save_and_load(off.state_dict()))
    assert [g["offload"] for g in plain.param_groups] == [None]
    # non-offloaded -> offloaded
    model3 = copy.deepcopy(model)
    off2 = bf16opt.AdamW(model3.parameters(), lr=1, precision=preset, offload="cpu")
    off2.load_state_dict(save_and_load(plain.state_dict()))
    assert [g["offload"] for g in off2.param_groups] == ["cpu"]
    assert_host_state(model3, off2)

    for m, o in ((model, off), (model2, plain), (model3, off2)):
        _continue(m, o, data[2:])
    assert_same_run(model, off, model2, plain)
    assert_same_run(model, off, model3, off2)


@pytest.mark.parametrize("transposed", LAYOUTS)
def test_state_dict_round_trips_through_torch_adamw(transposed):
    """fp32 params, fp32 preset: bf16opt (offloaded) -> torch.optim.AdamW -> bf16opt (offloaded)."""
    data = batches(torch.float32, 4)
    model, off = make("AdamW", torch.float32, "cpu", precision="fp32", transposed=transposed)
    train(model, off, data[:2], scheduler=False)
    twin = copy.deepcopy(model)
    ref = bf16opt.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, precision="fp32")
    ref.load_state_dict(off.state_dict())

    torch_model = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(save_and_load(off.state_dict()))
    for p, q in zip(model.parameters(), torch_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(off.state[p][key], torch_opt.state[q][key])
    back_model = copy.deepcopy(torch_model)
    back = bf16opt.AdamW(back_model.parameters(), lr=1, precision="fp32", offload="cpu")
    back.load_state_dict(save_and_load(torch_opt.state_dict()))
    assert back.param_groups[0]["lr"] == 1e-2 and back.param_groups[0]["offload"] == "cpu"

    for m, o in ((model, off), (twin, ref), (back_model, back)):
        _continue(m, o, data[2:])
    _continue(torch_model, torch_opt, data[2:])
    assert_same_run(model, off, twin, ref)
    assert_same_run(model, off, back_model, back)
    for p, q in zip(model.parameters(), torch_model.parameters()):  # torch's own math: close, not bits
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved_offload,live_offload", [("cpu", None), (None, "cpu")])
def test_load_state_dict_never_overrides_offload(saved_offload, live_offload):
    model, saved = make("Lion", torch.bfloat16, saved_offload, precision="bf16")
    train(model, saved, batches(torch.bfloat16, 1))
    state_dict = saved.state_dict()
    for bogus in (None, "gpu", True):  # whatever the state dict says, even nonsense
        for group in state_dict["param_groups"]:
            group["offload"] = bogus
        _, live = make("Lion", torch.bfloat16, live_offload, precision="bf16-sr")
        live.load_state_dict(state_dict)
        assert [g["offload"] for g in live.param_groups] == [live_offload]
        assert [g["precision"].name for g in live.param_groups] == ["bf16-sr"]


# ---------------------------------------------------------------- host threads of the update


def _threads_seen(monkeypatch):
    """Numba's thread count at every kernel call of the offload pipeline (on the update
    thread), and at every other kernel launch (``prepare``'s) in ``plain``."""
    numba = pytest.importorskip("numba")
    seen, plain = [], []
    real_prepare, real_run = numba_backend.prepare, RowLaunch.run

    def prepare(bucket, scalars):
        launch = real_prepare(bucket, scalars)

        def spied():
            plain.append(numba.get_num_threads())
            launch()

        return spied

    def run(self, first, end, done):
        seen.append(numba.get_num_threads())
        real_run(self, first, end, done)

    monkeypatch.setattr(numba_backend, "prepare", prepare)
    monkeypatch.setattr(RowLaunch, "run", run)
    return numba, seen, plain


@pytest.mark.parametrize("threads", [None, 1, 2, 10 ** 6])
def test_offload_threads_set_the_host_update_threads_and_are_restored(monkeypatch, threads):
    """The offloaded update runs with ``offload_threads`` Numba threads (default: every core of
    the process's affinity; capped at Numba's pool), the caller's count is restored after each
    step, and the bits do not depend on it."""
    numba, seen, plain = _threads_seen(monkeypatch)
    numba.set_num_threads(1)
    ref_model, ref_opt, model, opt = run_pair("AdamW", torch.bfloat16, steps=2, precision="bf16-sr",
                                              backend="numba", offload_threads=threads)
    expected = min(threads or len(os.sched_getaffinity(0)), numba.config.NUMBA_NUM_THREADS)
    assert seen and set(seen) == {expected}
    assert plain and set(plain) == {1}  # the run without offload: the caller's setting
    assert numba.get_num_threads() == 1
    assert_same_run(ref_model, ref_opt, model, opt)


def test_offload_threads_per_group(monkeypatch):
    numba, seen, _ = _threads_seen(monkeypatch)
    model = Net(torch.bfloat16)
    opt = bf16opt.AdamW([{"params": [model.w1], "offload_threads": 1}, {"params": [model.w2]}],
                        backend="numba", offload="cpu", offload_threads=2)
    loss_of(model, batches(torch.bfloat16, 1)[0]).backward()
    opt.step()
    assert seen == [1, min(2, numba.config.NUMBA_NUM_THREADS)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_default_threads_follow_the_process_affinity(monkeypatch):
    """A process pinned to one core (taskset, a container's cpuset) updates on one thread."""
    numba, seen, _ = _threads_seen(monkeypatch)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        model, opt = make("AdamW", torch.bfloat16, "cpu", backend="numba")
        loss_of(model, batches(torch.bfloat16, 1)[0]).backward()
        opt.step()
    finally:
        os.sched_setaffinity(0, before)
    assert seen and set(seen) == {1}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity (Linux)")
@pytest.mark.parametrize("cores", [1, 2, 16])
def test_default_threads_leave_a_core_to_the_thread_driving_cuda(monkeypatch, cores):
    """CUDA params: one core fewer than the process has (at least one), for the thread that
    enqueues the copies while the update runs; CPU params: every core."""
    from bf16opt.offload import default_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads(torch.device("cuda", 0)) == max(1, cores - 1)
    assert default_threads("cuda") == max(1, cores - 1)
    assert default_threads(torch.device("cpu")) == default_threads() == cores


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_offload_threads_are_rejected(bad):
    model = Net(torch.bfloat16)
    with pytest.raises(ValueError, match="offload_threads"):
        bf16opt.AdamW(model.parameters(), offload="cpu", offload_threads=bad)
    opt = bf16opt.AdamW(model.parameters(), offload="cpu")
    loss_of(model, batches(torch.bfloat16, 1)[0]).backward()
    opt.param_groups[0]["offload_threads"] = bad
    before = snapshot(opt)
    with pytest.raises(ValueError, match="offload_threads"):
        opt.step()
    assert_unchanged(opt, before)


# ---------------------------------------------------------------- 6. bad input


@pytest.mark.parametrize("bad", ["gpu", True, "CPU", "cuda", 1])
def test_bad_offload_values_are_rejected_at_construction(bad):
    model = Net(torch.bfloat16)
    with pytest.raises(ValueError, match="offload"):
        bf16opt.AdamW(model.parameters(), offload=bad)
    with pytest.raises(ValueError, match="offload"):
        bf16opt.SGD([{"params": model.parameters(), "offload": bad}])
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())


@pytest.mark.parametrize("bad", ["gpu", True])
@pytest.mark.parametrize("start", [None, "cpu"])
def test_bad_offload_edited_into_a_group_raises_at_step_and_changes_nothing(bad, start):
    model = Net(torch.bfloat16)
    opt = bf16opt.AdamW([{"params": [model.w1, model.w2]}, {"params": [model.b1, model.empty]}],
                        precision="bf16-sr", offload=start)
    train(model, opt, batches(torch.bfloat16, 1), scheduler=False)
    loss_of(model, batches(torch.bfloat16, 1)[0]).backward()
    opt.param_groups[1]["offload"] = bad
    before = snapshot(opt)
    with pytest.raises(ValueError, match="offload"):
        opt.step()
    assert_unchanged(opt, before)
    # fixing the group lets training continue as if nothing happened
    opt.param_groups[1]["offload"] = start
    ref_model = Net(torch.bfloat16)
    ref = bf16opt.AdamW([{"params": [ref_model.w1, ref_model.w2]},
                         {"params": [ref_model.b1, ref_model.empty]}],
                        precision="bf16-sr", seed=opt.param_groups[0]["seed"])
    train(ref_model, ref, batches(torch.bfloat16, 1), scheduler=False)
    loss_of(ref_model, batches(torch.bfloat16, 1)[0]).backward()
    for o in (ref, opt):
        o.step()
    assert_same_run(ref_model, ref, model, opt)


def test_cupy_backend_with_offload_is_rejected():
    model = Net(torch.float32)
    with pytest.raises(ValueError, match="offload"):
        bf16opt.AdamW(model.parameters(), backend="cupy", offload="cpu")
    opt = bf16opt.AdamW(model.parameters(), backend="numba", offload="cpu")
    loss_of(model, batches(torch.float32, 1)[0]).backward()
    opt.param_groups[0]["backend"] = "cupy"
    before = snapshot(opt)
    with pytest.raises(ValueError, match="offload"):
        opt.step()
    assert_unchanged(opt, before)


def test_sparse_grads_set_by_hand_are_rejected_before_state_exists():
    emb = nn.Embedding(10, 3)
    dense = nn.Parameter(torch.ones(3))
    opt = bf16opt.Adam([dense, emb.weight], offload="cpu")
    dense.grad = torch.ones(3)
    emb.weight.grad = torch.sparse_coo_tensor([[1, 2]], torch.ones(2, 3), (10, 3), check_invariants=True)
    before = snapshot(opt)
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert_unchanged(opt, before)
    assert not opt.state


def test_sparse_grads_from_backward_are_rejected_at_step():
    emb = nn.Embedding(10, 3, sparse=True)
    dense = nn.Parameter(torch.ones(3))
    opt = bf16opt.Adam([dense, emb.weight], offload="cpu")
    (emb(torch.tensor([1, 2])).sum() + dense.sum()).backward()  # the hook must not fail here
    before = snapshot(opt)
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert_unchanged(opt, before)
    assert not opt.state


def test_meta_params_are_rejected_before_anything_is_created():
    good = nn.Parameter(torch.ones(4))
    meta = nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        bf16opt.AdamW([good, meta], offload="cpu")
    assert good._post_accumulate_grad_hooks is None
    # an offloaded group made before the bad one: its hooks go with the half-built optimizer
    with pytest.raises(ValueError, match="meta"):
        bf16opt.AdamW([{"params": [good]}, {"params": [meta]}], offload="cpu")
    gc.collect()
    assert not good._post_accumulate_grad_hooks
    # and add_param_group on a live optimizer changes nothing
    opt = bf16opt.AdamW([good], offload="cpu")
    records = dict(opt._offloader._records)
    with pytest.raises(ValueError, match="meta"):
        opt.add_param_group({"params": [meta]})
    assert len(opt.param_groups) == 1 and opt._offloader._records == records


@pytest.mark.parametrize("bad", [{"offload": "gpu"}, {"lr": -1.0}, {"precision": "fp33"},
                                 {"params": [nn.Parameter(torch.empty(2, device="meta"))]}])
def test_a_failed_constructor_leaves_no_hooks_threads_or_host_buffers(monkeypatch, bad):
    """A constructor that refuses a later group leaves nothing on the params of the groups it
    had accepted: no grad hook, no host buffer, no thread -- at once, without waiting for the
    half-built optimizer to be collected."""
    import threading

    import bf16opt.offload as offload
    made = []
    real = offload._HostParam

    def counting(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(offload, "_HostParam", counting)
    good, other = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3))
    threads = threading.active_count()
    with pytest.raises(ValueError):
        bf16opt.AdamW([{"params": [good]}, {"params": [other], **bad}], offload="cpu")
    assert not good._post_accumulate_grad_hooks and not other._post_accumulate_grad_hooks
    assert made == [] and threading.active_count() == threads


def test_add_param_group_whose_host_buffers_fail_leaves_nothing(monkeypatch):
    """A group whose second param's host buffers cannot be made is not added, and the first
    param's buffers and hook are released again; the earlier group keeps its own."""
    import bf16opt.offload as offload
    first = nn.Parameter(torch.ones(4))
    opt = bf16opt.AdamW([first], offload="cpu")
    records = dict(opt._offloader._records)
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    real = offload._HostParam

    def failing(engine, param):
        if param is b:
            raise RuntimeError("out of host memory")
        return real(engine, param)

    monkeypatch.setattr(offload, "_HostParam", failing)
    with pytest.raises(RuntimeError, match="out of host memory"):
        opt.add_param_group({"params": [a, b]})
    assert len(opt.param_groups) == 1 and opt._offloader._records == records
    assert not a._post_accumulate_grad_hooks and first._post_accumulate_grad_hooks


# ---------------------------------------------------------------- 7. lifetime


def test_deleting_the_optimizer_frees_hooks_and_host_buffers():
    model, opt = make("AdamW", torch.bfloat16, "cpu", precision="bf16")
    engine = ThreadedCopyEngine(jitter=0.001, seed=4)
    use_copy_engine(opt, engine)
    train(model, opt, batches(torch.bfloat16, 2), scheduler=False)
    offloader_ref = weakref.ref(opt._offloader)
    record = opt._offloader._records[model.w1]
    mirror_ref, grad_ref = weakref.ref(record.mirror), weakref.ref(record.grad)
    record_ref = weakref.ref(record)
    state_ref = weakref.ref(opt.state[model.w1]["exp_avg"])
    before = engine.host_bytes().total
    assert before > 0
    del opt, record
    gc.collect()
    for ref in (offloader_ref, record_ref, mirror_ref, grad_ref, state_ref):
        assert ref() is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert engine.host_bytes().total == 0
    loss_of(model, batches(torch.bfloat16, 1)[0]).backward()  # no hook left to touch freed buffers
    assert engine.host_bytes().total == 0
    engine.close()


def test_hooks_hold_no_reference_to_the_optimizer():
    model, opt = make("SGD-momentum", torch.float32, "cpu")
    opt_ref = weakref.ref(opt)
    del opt  # the model's hooks must not keep the optimizer (or its host buffers) alive
    gc.collect()
    assert opt_ref() is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_params_leaving_the_offloaded_groups_release_their_host_buffers():
    model = Net(torch.bfloat16)
    opt = bf16opt.AdamW([{"params": [model.w1, model.b1], "offload": "cpu"},
                         {"params": [model.w2, model.empty], "offload": "cpu"}], precision="fp32")
    data = batches(torch.bfloat16, 3)
    train(model, opt, data[:1], scheduler=False)
    record = opt._offloader._records[model.w2]
    refs = [weakref.ref(record.mirror), weakref.ref(record.grad), weakref.ref(record)]
    del record
    opt.param_groups[1]["offload"] = None
    train(model, opt, data[1:2], scheduler=False)
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert set(opt._offloader._records) == {model.w1, model.b1}
    assert not model.w2._post_accumulate_grad_hooks and model.w1._post_accumulate_grad_hooks
    sizes = opt._offloader.host_bytes()
    assert sizes["param_mirror"] == sizes["grad_staging"] == 2 * (model.w1.numel() + model.b1.numel())
    train(model, opt, data[2:], scheduler=False)  # and the step still runs


# ---------------------------------------------------------------- 8. memory_report


@pytest.mark.parametrize("opt_name,preset,dtype", [
    ("AdamW", "fp32", torch.bfloat16), ("Adam-amsgrad-L2", "bf16-kahan", torch.bfloat16),
    ("Lion", "fp32-remainder", torch.bfloat16), ("SGD-momentum", "bf16-states", torch.float16),
    ("AdamW", "bf16", torch.float32),
], ids=lambda v: str(v).replace("torch.", ""))
def test_memory_report_is_the_same_with_offload(opt_name, preset, dtype):
    ref_model, ref_opt, model, opt = run_pair(opt_name, dtype, steps=1, precision=preset)
    ref, off = bf16opt.memory_report(ref_opt), bf16opt.memory_report(opt)
    assert off.bytes == ref.bytes
    assert off.dtypes == ref.dtypes
    assert off.num_params == ref.num_params
    assert off.optimizer_bytes == ref.optimizer_bytes == ref.device_bytes
    assert (off.host_bytes, off.device_bytes) == (ref.device_bytes, 0)
    assert off.pinned_bytes == 0  # CPU params: pageable host buffers
    param_bytes = ref.bytes["params"]
    assert off.staging == {"param_mirror": param_bytes, "grad_staging": param_bytes}
    assert ref.staging == {}
    assert "offload staging" in str(off)


@pytest.mark.parametrize("preset", ["bf16-sr-q8", "fp32-remainder-q8"])
@pytest.mark.parametrize("chunk,backend", [(300, "numba"), (300, "reference"), (1000, "numba")])
def test_q8_moments_offloaded_in_chunks_that_cut_blocks(preset, chunk, backend):
    """Params above q8's threshold, offloaded in chunks that are no multiple of a 256-element
    block (the pipeline rounds them up to whole blocks): the bits of the step on the device."""
    def run(offload):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 80)).bfloat16()
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision=preset, backend=backend, offload=offload)
        if offload:
            opt._offloader.chunk_elements = chunk
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 128, generator=generator).bfloat16()).float().pow(2).mean().backward()
            opt.step()
        return model, opt

    (ref_model, ref_opt), (model, opt) = run(None), run("cpu")
    assert any(state["exp_avg"].dtype == torch.uint8 for state in opt.state_dict()["state"].values())
    for ours, theirs in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    for ours, theirs in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
