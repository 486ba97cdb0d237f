"""The step cache (bf16opt/step_cache.py): a numba group's launch reused while nothing it was
built from changed, rebuilt as soon as anything did.

Every test runs twins: the same params, grads and edits given to a numba optimizer and to a
reference one (the specification), compared bit for bit after every step.  A spy counts the
numba twin's reused and refused launches and the launches built, so each test also shows
that the cache was used (an unchanged step reuses) or dropped (a change refuses, and the full
step builds again).  Nothing here is timed.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bf16opt
from bf16opt import step_cache, torch_internals
from bf16opt.backends import numba as numba_backend
from snapshots import assert_unchanged, same_bits, snapshot

pytest.importorskip("numba")

SHAPES = [(6, 6), (5,), (3, 4), (1,), (7,)]


class Spy:
    """Counts of the kept launches' answers (reused / refused: GroupLaunch.prepare's, and
    step_in_one_call's, a step of an optimizer whose only group it is) and of launches built."""

    def __init__(self, monkeypatch):
        self.reused = self.refused = self.built = 0
        prepare, step_in_one_call = step_cache.GroupLaunch.prepare, step_cache.GroupLaunch.step_in_one_call
        build = step_cache.build
        self.alone = 0  # (how many of the reused ran through step_in_one_call)

        def spied_step_alone(launch, *args, **kwargs):
            ran = step_in_one_call(launch, *args, **kwargs)
            self.reused += ran
            self.refused += not ran
            self.alone += ran
            return ran

        def spied_prepare(launch, *args, **kwargs):
            run = prepare(launch, *args, **kwargs)
            if run is None:
                self.refused += 1
            else:
                self.reused += 1
            return run

        def spied_build(*args, **kwargs):
            launch = build(*args, **kwargs)
            self.built += launch is not None
            return launch

        monkeypatch.setattr(step_cache.GroupLaunch, "prepare", spied_prepare)
        monkeypatch.setattr(step_cache.GroupLaunch, "step_in_one_call", spied_step_alone)
        monkeypatch.setattr(step_cache, "build", spied_build)

    def counts(self) -> tuple:
        return self.reused, self.refused, self.built


@pytest.fixture
def spy(monkeypatch):
    return Spy(monkeypatch)


@pytest.fixture(autouse=True, params=["compiled checks", "torch checks", "python checks"])
def form_checks(request, monkeypatch):
    """Every test three times: with the forms read in compiled code through torch's C shim
    (tensor_shim), where this torch has it, and the state dicts' versions read there too
    (dict_version_word); without them, with torch's private helpers (params' and grads' forms
    in one check, TensorGuards; addresses read in compiled code,
    _torchinductor_pyobject_tensor_data_ptr); and with the Python fallback.  dicts' versions
    (dict_version) in the first two."""
    if request.param == "python checks":
        monkeypatch.setitem(torch_internals.ANSWERS, "dict_versions", None)
        monkeypatch.setitem(torch_internals.ANSWERS, "dict_version_word", None)
        monkeypatch.setitem(torch_internals.ANSWERS, "address_reader", None)
    if request.param != "compiled checks":
        monkeypatch.setitem(torch_internals.ANSWERS, "tensor_shim", None)
        if request.param == "python checks":
            monkeypatch.setitem(torch_internals.ANSWERS, "tensor_guards", None)
    if request.param == "compiled checks" and (torch_internals.tensor_shim() is None
                                               or torch_internals.dict_versions() is None):
        pytest.skip("this torch's C shim getters (aoti_torch_get_*), tensor layout or dict_version "
                    "did not pass torch_internals' probes")
    if request.param == "torch checks" and (torch_internals.tensor_guards() is None
                                            or torch_internals.dict_versions() is None
                                            or torch_internals.address_reader() is None):
        pytest.skip("this torch lacks TensorGuards, dict_version or _torchinductor_pyobject_tensor_data_ptr "
                    "(or they failed their probes)")
    return request.param


class Twins:
    """A numba optimizer and a reference one on identical params; every action goes to both."""

    def __init__(self, cls=bf16opt.AdamW, dtype=torch.bfloat16, shapes=SHAPES, named=False, ours="numba",
                 **options):
        options.setdefault("lr", 1e-2)
        options.setdefault("seed", 7)
        self.gen = torch.Generator().manual_seed(0)
        values = [torch.randn(shape, generator=self.gen).to(dtype) for shape in shapes]
        self.params, self.opts = {}, {}
        for backend in ("numba", "reference"):
            params = [torch.nn.Parameter(v.clone()) for v in values]
            given = [(f"layer{i}.weight", p) for i, p in enumerate(params)] if named else params
            self.params[backend] = params
            self.opts[backend] = cls(given, backend=ours if backend == "numba" else backend, **options)

    @property
    def opt(self):
        return self.opts["numba"]

    def each(self, action) -> None:
        """``action(opt, params)`` on both twins."""
        for backend in ("numba", "reference"):
            action(self.opts[backend], self.params[backend])

    def grads(self, dtype=None) -> None:
        """New random grads (new tensors, as after zero_grad(set_to_none=True)), the same for both."""
        grads = [torch.randn(p.shape, generator=self.gen).to(dtype or p.dtype) for p in self.params["numba"]]
        for backend in ("numba", "reference"):
            for p, g in zip(self.params[backend], grads):
                if dtype is not None:  # (torch refuses a grad of another dtype otherwise)
                    p.grad = None
                    p.grad_dtype = dtype
                p.grad = g.clone()

    def step(self, **kwargs) -> None:
        for backend in ("numba", "reference"):
            self.opts[backend].step(**{k: v.clone() for k, v in kwargs.items()})
        self.assert_same()

    def grads_and_step(self, **kwargs) -> None:
        self.grads()
        self.step(**kwargs)

    def assert_same(self) -> None:
        ours, theirs = self.opts["numba"], self.opts["reference"]
        for p, q in zip(self.params["numba"], self.params["reference"]):
            assert same_bits(p.detach(), q.detach())
            assert ours.state[p].keys() == theirs.state[q].keys()
            for key, value in ours.state[p].items():
                assert same_bits(value, theirs.state[q][key]), key


def warm(twins: Twins, spy: Spy, steps: int = 3) -> None:
    """Steps until the numba twin reuses its launch (the first step makes state, the second
    builds the launch, the third reuses it)."""
    for _ in range(steps):
        twins.grads_and_step()
    assert spy.reused >= 1


# ---------------------------------------------------------------- unchanged steps reuse
@pytest.mark.parametrize("preset", ["bf16", "fp32", "bf16-sr", "bf16-kahan", "fp32-remainder"])
@pytest.mark.parametrize("cls, options", [(bf16opt.AdamW, {}), (bf16opt.Adam, dict(amsgrad=True, weight_decay=0.1)),
                                          (bf16opt.Lion, {}), (bf16opt.SGD, dict(momentum=0.9, nesterov=True))],
                         ids=["AdamW", "Adam-amsgrad-L2", "Lion", "SGD-nesterov"])
def test_unchanged_steps_reuse_the_launch(spy, preset, cls, options):
    """New grads every step (as after zero_grad), the same everything else: one launch is
    built (at the step after the state was made) and reused from then on, bit-identical."""
    twins = Twins(cls, precision=preset, **options)
    for _ in range(6):
        twins.grads_and_step()
    assert spy.counts() == (4, 0, 1)


@pytest.mark.parametrize("preset", ["bf16", "fp32-remainder"])
@pytest.mark.parametrize("cls, options", [(bf16opt.AdamW, {}), (bf16opt.SGD, dict(momentum=0.9))],
                         ids=["AdamW", "SGD-momentum"])
def test_reused_steps_bump_autograd_versions_as_full_steps_do(spy, preset, cls, options):
    """The kernels write through addresses; autograd must still see every param and state
    tensor a step writes, the step counters included, as torch.optim's in-place ops show
    them: each step, full or reused, bumps the same tensors' version counters."""
    twins = Twins(cls, precision=preset, **options)

    def versions() -> dict:
        params = twins.params["numba"]
        return {(i, key): tensor._version for i, p in enumerate(params)
                for key, tensor in [("param", p), *twins.opt.state[p].items()]}

    twins.grads_and_step()  # (makes the state)
    bumped_by = []
    for _ in range(4):  # a full step that builds the launch, then reused ones
        before = versions()
        twins.grads_and_step()
        bumped_by.append({key: version - before[key] for key, version in versions().items()})
    assert spy.counts() == (3, 0, 1)
    assert sorted(bumped_by[0]) == sorted(versions()) and all(bumped_by[0].values())  # every tensor
    assert bumped_by[1:] == bumped_by[:1] * 3  # by as much as a full step


def test_reused_steps_bump_every_bucket_and_group_as_full_steps_do(spy):
    """Two groups, the first of float32 and bfloat16 params (two buckets, two kernel calls;
    the group's first call bumps the versions of both buckets' tensors): every tensor's
    version rises by as much in a reused step as in a full one."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
              for shape, dtype in [((5, 3), torch.float32), ((7,), torch.bfloat16), ((4,), torch.float32),
                                   ((6, 2), torch.bfloat16)]]
    opt = bf16opt.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 1e-3}], lr=1e-2,
                        precision="bf16-master", backend="numba")

    def versions() -> dict:
        return {(i, key): tensor._version for i, p in enumerate(params)
                for key, tensor in [("param", p), *opt.state[p].items()]}

    bumped_by = []
    for step in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        before = versions() if step else None
        opt.step()
        if before is not None:
            bumped_by.append({key: version - before[key] for key, version in versions().items()})
    assert spy.reused == 6  # (two groups, from the third step on)
    assert all(bumped_by[0].values()) and bumped_by[1:] == bumped_by[:1] * 3


def test_autograd_sees_a_reused_step_write_a_tensor_saved_for_backward(spy):
    """A product saved the param for its backward: after a reused step wrote the param (and,
    through the same counter, its view), backward refuses, as after torch.optim's step."""
    twins = Twins()
    warm(twins, spy)
    p = twins.params["numba"][0]
    twins.grads()
    loss = (p[:2] * p[:2]).sum()  # (saves a view of p)
    reused = spy.reused
    twins.opt.step()
    assert spy.reused == reused + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_reused_step_bumps_the_counter_a_swapped_param_holds_now(spy):
    """``torch.utils.swap_tensors`` with a Parameter over the same memory (another version
    counter, same form and address): the launch is reused and the counter the param object
    holds now is bumped, not the one it held when the launch was built."""
    twins = Twins()
    warm(twins, spy)
    p = twins.params["numba"][0]
    other = torch.nn.Parameter(p.detach().data)  # (p's memory, a counter of its own)
    torch.utils.swap_tensors(p, other)
    twins.grads()
    versions = p._version, other._version
    reused = spy.reused
    twins.opt.step()
    assert spy.reused == reused + 1
    assert (p._version, other._version) == (versions[0] + 1, versions[1])


# torch releases whose layouts the probes were checked on: there the compiled checks must be on
# (a probe that stops matching a known release would silently slow every step)
PROBED_RELEASES = ("2.11", "2.13")


@pytest.mark.skipif(".".join(torch.__version__.split(".")[:2]) not in PROBED_RELEASES,
                    reason=f"the probes were checked on torch {', '.join(PROBED_RELEASES)} only")
def test_the_probes_pass_on_the_torch_releases_they_were_checked_on(monkeypatch):
    monkeypatch.setattr(torch_internals, "ANSWERS", {})  # probe again: the fixture hides some answers
    answers = (torch_internals.tensor_shim(), torch_internals.version_places(), torch_internals.tensor_guards(),
               torch_internals.dict_versions(), torch_internals.dict_version_word(), torch_internals.address_reader())
    assert all(answer is not None for answer in answers)


def test_probing_refuses_version_counters_torch_does_not_bump(monkeypatch):
    """Where torch's bump is not seen in the word found, no compiled bump (torch's instead)."""
    shim = torch_internals._probe_shim()
    if shim is None:
        pytest.skip("this torch's C shim getters (aoti_torch_get_*) or tensor layout did not pass the probe")
    assert torch_internals._probe_version_places(int(shim[1])) is not None
    monkeypatch.setattr(torch.autograd.graph, "increment_version", lambda tensor: None)
    assert torch_internals._probe_version_places(int(shim[1])) is None


def test_the_same_grads_again_reuse_the_launch(spy):
    twins = Twins()
    twins.grads()
    for _ in range(4):
        twins.step()
    assert spy.counts() == (2, 0, 1)


def test_lr_from_a_scheduler_and_a_grad_scale_reuse_the_launch(spy):
    """Scalars are computed every step: an lr schedule and GradScaler's loss scale change no launch."""
    twins = Twins(precision="bf16-sr")
    schedulers = [torch.optim.lr_scheduler.StepLR(twins.opts[b], step_size=1, gamma=0.5)
                  for b in ("numba", "reference")]
    for k in range(5):
        twins.grads_and_step(grad_scale=torch.tensor(2.0 ** k))
        for scheduler in schedulers:
            scheduler.step()
    assert spy.counts() == (3, 0, 1)


def test_a_single_group_step_runs_in_one_compiled_call(spy, form_checks):
    """An optimizer of one group whose kept launch is one kernel call runs its reused steps
    whole in one compiled call (step_in_one_call) where the checks are compiled (the C shim); with
    two groups, or the checks made elsewhere, each group's prepare and run; the bits the same."""
    twins = Twins(precision="bf16-sr")
    for _ in range(5):
        twins.grads_and_step()
    compiled = form_checks == "compiled checks" and torch_internals.version_places() is not None
    assert spy.counts() == (3, 0, 1) and spy.alone == (3 if compiled else 0)
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = bf16opt.AdamW([{"params": params[:1]}, {"params": params[1:]}], precision="bf16", backend="numba")
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(4)
        opt.step()
    assert spy.counts() == (3 + 4, 0, 1 + 2) and spy.alone == (3 if compiled else 0)


def _record_readers():
    """(array facts, integer) readers of a record as compiled code reads it by name: each
    array's (data address, size, item size, first element), and an integer slot."""
    from numba import literally, njit  # noqa: PLC0415

    record_array, record_integer = numba_backend.helpers().record_array, numba_backend.helpers().record_integer

    @njit
    def array_facts(record, name):
        array = record_array(record, literally(name))
        out = np.zeros(4)
        out[0], out[1], out[2], out[3] = array.ctypes.data, array.size, array.itemsize, array.ravel()[0]
        return out

    @njit
    def integer_value(record, name):
        return record_integer(record, literally(name))

    return array_facts, integer_value


def test_the_one_calls_record_reads_back_each_array_and_integer():
    """checked_relaunch's records (step_helpers.pack_record, each layout), read in compiled code
    by name (``_record_readers``): each array at its own data address with
    its size, item size and first element (a float read as an integer would differ), then the
    integers; an array of another dtype, dimension count or layout, a read-only one, or a name
    missing is refused."""
    helpers = numba_backend.helpers()
    array_facts, integer_value = _record_readers()
    for kind, (layout, integer_names) in helpers.RECORD_LAYOUTS.items():
        arrays = {name: np.full((k + 2, 3) if dims == 2 else k + 1, True if dtype == np.bool_ else k + 1.5,
                                dtype=dtype)
                  for k, (name, dtype, dims) in enumerate(layout)}
        integers = {name: 100 + k for k, name in enumerate(integer_names)}
        record = helpers.pack_record(kind, **arrays, **integers)
        for name, array in arrays.items():
            assert array_facts(record, name).tolist() == \
                [array.ctypes.data, array.size, array.itemsize, float(array.flat[0])], name
        for name, value in integers.items():
            assert integer_value(record, name) == value, name
        name, dtype, dims = layout[0]
        other = np.zeros((2, 2) if dims == 1 else 4, dtype=np.int32 if dtype != np.int32 else np.int64)
        with pytest.raises(TypeError, match=name):
            helpers.pack_record(kind, **{**arrays, name: other}, **integers)
        frozen = arrays[layout[1][0]].copy()
        frozen.flags.writeable = False
        with pytest.raises(TypeError, match=layout[1][0]):
            helpers.pack_record(kind, **{**arrays, layout[1][0]: frozen}, **integers)
        with pytest.raises(TypeError, match=integer_names[0]):
            helpers.pack_record(kind, **arrays, **{k: v for k, v in integers.items() if k != integer_names[0]})
    arrays = {name: np.zeros((1, 1) if dims == 2 else 1, dtype=dtype)
              for name, dtype, dims in helpers.RECORD_LAYOUTS["checks"][0]}
    arrays["forms"] = np.zeros(6, dtype=np.int64)[::2]  # not contiguous
    with pytest.raises(TypeError, match="record's forms must be"):
        helpers.pack_record("checks", **arrays, dict_word=0, threads=1)


def test_a_single_group_step_releases_the_gil_while_its_kernel_runs(spy, form_checks, monkeypatch):
    """The one compiled call of a single group's reused step (step_in_one_call) holds the GIL for its
    checks and releases it for its kernel, as the kernel calls of the full path do: another
    Python thread runs meanwhile -- on the serial driver (a fork child's) too, where no parallel
    region releases it.  Held, that thread would run only in the step's Python, a few percent of
    its time (0.09 of its pace alone, measured); released, 1.1-2.3 alone, 0.47-0.49 in the full
    suite, whose earlier kernels leave Numba's threads busy beside it: a quarter, in the best of
    four steps (a VM may stop a thread for milliseconds).  (With the checks made elsewhere, the
    step's kernel call releases it likewise.)"""
    monkeypatch.setattr(numba_backend, "_FORKED", True)
    param = torch.nn.Parameter(torch.zeros(1 << 25, dtype=torch.bfloat16))
    opt = bf16opt.SGD([param], lr=1e-3, momentum=0.9, precision="bf16", backend="numba")
    param.grad = torch.ones_like(param)
    for _ in range(3):  # state made, launch built, reused once
        opt.step()
    alone = int(form_checks == "compiled checks" and torch_internals.version_places() is not None)
    assert spy.alone == alone
    ticks, done = [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    def ticks_within(start: float, end: float) -> int:
        return sum(start <= t <= end for t in ticks)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # (Python code hands the GIL over within 0.1 ms when asked)
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        time.sleep(0.05)  # the thread's pace alone
        end = time.perf_counter()
        pace = ticks_within(start, end) / (end - start)
        windows = []
        for _ in range(4):
            start = time.perf_counter()
            opt.step()
            windows.append((start, time.perf_counter()))
    finally:
        done.set()
        ticker.join()
        sys.setswitchinterval(interval)
    shares = [ticks_within(start, end) / (pace * (end - start)) for start, end in windows]
    assert spy.alone == 5 * alone and max(shares) > 0.25, shares


def test_the_other_chunk_function_variant_is_compiled_for_a_reused_launch(spy):
    """SGD without dampening and with grad scale 1 runs the chunk function for unit scalars; a
    dampening set later (no new launch: it chooses no configuration) needs the other variant,
    which the reused launch compiles or loads then, the bits as the reference's."""
    twins = Twins(bf16opt.SGD, momentum=0.9, precision="bf16")
    warm(twins, spy)
    twins.each(lambda opt, params: opt.param_groups[0].__setitem__("dampening", 0.5))
    for _ in range(2):
        twins.grads_and_step()
    twins.each(lambda opt, params: opt.param_groups[0].__setitem__("dampening", 0.0))
    twins.grads_and_step()
    assert spy.counts() == (4, 0, 1)


def test_an_lr_schedule_rechecks_lr_alone_and_still_refuses_a_bad_lr(spy, monkeypatch):
    """A scheduler sets a new float lr every step: the group's other settings are not checked
    again, the new lr is, with the message the full checks give."""
    twins = Twins()
    warm(twins, spy)
    full_checks = []
    checked = bf16opt.AdamW._checked_precision
    monkeypatch.setattr(bf16opt.AdamW, "_checked_precision",
                        lambda opt, group: full_checks.append(opt) or checked(opt, group))
    for lr in (5e-3, 2e-3, 1e-3):
        twins.each(lambda opt, params: opt.param_groups[0].__setitem__("lr", lr))
        twins.grads_and_step()
    assert full_checks == []
    for bad, error, message in [(-1.0, ValueError, "Invalid learning rate: -1.0"),
                                (float("nan"), ValueError, "learning rate"), (True, TypeError, "lr")]:
        twins.opt.param_groups[0]["lr"] = bad
        before = snapshot(twins.opt)
        with pytest.raises(error, match=message):
            twins.opt.step()
        assert_unchanged(twins.opt, before)
    twins.each(lambda opt, params: opt.param_groups[0].__setitem__("lr", 1e-3))
    twins.grads_and_step()


@pytest.mark.parametrize("options", [dict(track_precision=True), dict(offload="cpu"),
                                     dict(dtype=torch.float64, ours="auto")],
                         ids=["telemetry", "offload", "float64"])
def test_groups_the_cache_does_not_keep_take_the_full_path(spy, options):
    twins = Twins(**options)
    for _ in range(4):
        twins.grads_and_step()
    assert spy.counts() == (0, 0, 0)


def test_the_bulk_check_is_used_where_available(spy, form_checks):
    twins = Twins()
    warm(twins, spy)
    launch = twins.opt._group_launches[0]
    assert (launch.shim is not None, launch.guards is not None) == (form_checks == "compiled checks",
                                                                   form_checks == "torch checks")
    assert (launch.dict_word is not None) == (form_checks == "compiled checks"
                                              and torch_internals.dict_version_word() is not None)


def test_a_refusal_of_the_bulk_check_falls_back_to_the_python_checks(spy):
    """torch's check compares more than the cache needs (requires_grad): a param whose
    requires_grad was switched off fails it, passes the Python checks, and reuses."""
    twins = Twins()
    warm(twins, spy)
    twins.each(lambda opt, params: params[1].requires_grad_(False))
    reused = spy.reused
    for _ in range(2):
        twins.grads_and_step()
    assert spy.counts()[:2] == (reused + 2, 0)


def test_a_grad_given_to_two_params_is_checked_in_python(spy):
    """torch's check refuses a tensor passed twice; the same grad object on two params of one
    shape is still a valid step, checked by the Python fallback."""
    twins = Twins(shapes=[(5,), (5,), (3,)])
    warm(twins, spy)
    reused = spy.reused
    for _ in range(2):
        twins.grads()
        twins.each(lambda opt, params: setattr(params[1], "grad", params[0].grad))
        twins.step()
    assert spy.counts()[:2] == (reused + 2, 0)


@pytest.mark.parametrize("blind_to", range(11))
def test_probing_refuses_dict_versions_that_miss_a_change(monkeypatch, blind_to):
    """A dict_version that misses one of the probe's changes (its call after change
    ``blind_to`` answers the version before it) is refused, or one that reads as a change."""
    real = torch_internals._probe_versions()
    if real is None:
        pytest.skip("this torch has no usable dict_version")
    calls = []

    def blind(d):
        calls.append(real(d))
        return calls[-2] if len(calls) == blind_to + 2 else calls[-1]

    monkeypatch.setattr(torch._C._dynamo.guards, "dict_version", blind)
    assert torch_internals._probe_versions() is None
    monkeypatch.setattr(torch._C._dynamo.guards, "dict_version", lambda d: len(calls.append(0) or calls))
    assert torch_internals._probe_versions() is None  # (changes at every read)


def test_probing_finds_no_version_word_where_dict_versions_answer_otherwise(monkeypatch):
    """The dicts' versions are read in compiled code only at a word that equals dict_version's
    answers, all different, through every change the probe makes: a dict_version answering
    something else (a dict's length, always 0, a new number at each call) leaves the versions
    to it."""
    real = torch_internals._probe_versions()
    monkeypatch.setitem(torch_internals.ANSWERS, "dict_versions", real)  # (whatever the fixture set)
    if real is None or torch_internals._probe_version_word() is None:
        pytest.skip("this torch or Python has no dict_version, or no word of a dict that matches it")
    numbers = iter(range(10 ** 6, 2 * 10 ** 6))
    for other in (len, lambda d: 0, lambda d: next(numbers)):
        monkeypatch.setitem(torch_internals.ANSWERS, "dict_versions", other)
        assert torch_internals._probe_version_word() is None


def test_probing_refuses_a_bulk_check_that_misses_a_change(monkeypatch):
    """The probe tries the kinds of change the cache relies on torch's check to see."""
    real = torch_internals._probe_guards()
    if real is None:
        pytest.skip("this torch has no usable TensorGuards")

    class Blind:  # a check that only compares dtypes
        def __init__(self, *tensors, **kwargs):
            self.dtypes = [t.dtype for t in tensors]

        def check(self, *tensors):
            return [t.dtype for t in tensors] == self.dtypes

    monkeypatch.setattr(torch._C._dynamo.guards, "TensorGuards", Blind)
    assert torch_internals._probe_guards() is None


def test_probing_refuses_a_reader_of_other_addresses(monkeypatch):
    """The probe compares the function's answers with data_ptr's: a C function of the same
    signature that answers the object's own address, or not a function address, is refused."""
    if torch_internals._probe_reader() is None:
        pytest.skip("this torch has no usable _torchinductor_pyobject_tensor_data_ptr")
    own_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda tensor: tensor)
    for reader in (ctypes.cast(own_address, ctypes.c_void_p).value, "not an address", 0):
        monkeypatch.setattr(torch._C._dynamo.guards, "_torchinductor_pyobject_tensor_data_ptr", reader)
        assert torch_internals._probe_reader() is None


def test_probing_refuses_a_shim_getter_of_another_answer(monkeypatch):
    """The probe compares the forms read in compiled code with Python's: a library whose sizes
    getter answers the strides is refused."""
    if torch_internals._probe_shim() is None:
        pytest.skip("this torch's C shim getters (aoti_torch_get_*) or tensor layout did not pass the probe")
    library = torch_internals._shim_library()

    class Crossed:
        def __getattr__(self, name):
            return getattr(library, "aoti_torch_get_strides" if name == "aoti_torch_get_sizes" else name)

    monkeypatch.setattr(torch_internals, "_shim_library", Crossed)
    assert torch_internals._probe_shim() is None


def test_the_compiled_form_check_refuses_a_negative_view(monkeypatch):
    """A negative view has a plain tensor's type, form and address (the shim has no getter for
    the bit): the compiled check reads the bit itself, and the probe refuses a shim whose
    bit is another (a word the view leaves alone)."""
    shim = torch_internals._probe_shim()
    if shim is None:
        pytest.skip("this torch's C shim getters (aoti_torch_get_*) or tensor layout did not pass the probe")
    helpers = numba_backend.helpers()
    for tensor in (torch.zeros(3), torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))):
        starts = np.array([0, helpers.FORM_HEAD + 2 * tensor.dim()])
        forms = np.zeros(starts[-1], dtype=np.int64)
        assert helpers.read_forms(shim, np.array([id(tensor)]), starts, forms)
        negative = tensor.detach()._neg_view()
        addresses = np.zeros(1, dtype=np.int64)
        assert helpers.forms_hold(shim, np.array([id(tensor)]), starts, forms, addresses, True)
        assert not helpers.forms_hold(shim, np.array([id(negative)]), starts, forms, addresses, True)
        assert not helpers.read_forms(shim, np.array([id(negative)]), starts, forms.copy())
    offset, bit = shim[helpers.SHIM_NEGATIVE:]
    monkeypatch.setattr(torch_internals, "_negative_bit", lambda *args: [int(offset) - 8, int(bit)])
    assert torch_internals._probe_shim() is None


def test_the_shim_library_is_the_loaded_one_wherever_it_lives(monkeypatch, tmp_path):
    """The shim's library is the libtorch_cpu the process has mapped (a conda environment keeps
    it in its own lib), read from /proc/self/maps; torch/lib's only when none is listed."""
    real = torch_internals._shim_library()
    if real is None:
        pytest.skip("this torch has no libtorch_cpu in torch/lib nor among the mapped libraries")
    probed = torch_internals._probe_shim() is not None  # (None where the layout probes refuse)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /opt/env/lib/libtorch_cpu.so\n"
                    "7f01-7f02 r--p 00000000 08:01 13 /opt/env/lib/libc10.so\n"
                    "7f02-7f03 rw-p 00000000 00:00 0 \n"
                    "7f03-7f04 r-xp 00000000 08:01 14 /opt/my env/lib/libgomp.so\n")
    assert torch_internals._loaded_libraries(str(maps)) == [
        "/opt/env/lib/libc10.so", "/opt/env/lib/libtorch_cpu.so", "/opt/my env/lib/libgomp.so"]
    assert torch_internals._loaded_libraries(str(tmp_path / "none")) == []
    elsewhere = tmp_path / "lib" / "libtorch_cpu.so"
    elsewhere.parent.mkdir()
    elsewhere.symlink_to(real._name)
    listed = [str(tmp_path / "libc10.so"), str(elsewhere)]
    monkeypatch.setattr(torch_internals, "_loaded_libraries", lambda: listed)
    assert torch_internals._shim_library()._name == str(elsewhere)
    assert (torch_internals._probe_shim() is not None) == probed
    monkeypatch.setattr(torch_internals, "_loaded_libraries", lambda: [])
    assert torch_internals._shim_library()._name == real._name


def test_probing_refuses_a_tensor_object_layout_it_cannot_confirm(monkeypatch):
    """The offset of a tensor object's at::Tensor is taken only where a copy of it made by
    torch holds the same TensorImpl: with copies of another tensor none is found (and no
    getter is called on a guessed one)."""
    if torch_internals._probe_shim() is None:
        pytest.skip("this torch's C shim getters (aoti_torch_get_*) or tensor layout did not pass the probe")
    real = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor
    monkeypatch.setattr(torch._C._aoti, "unsafe_alloc_void_ptr_from_tensor",
                        lambda tensor: real(torch.zeros(1)))
    assert torch_internals._probe_shim() is None


# ---------------------------------------------------------------- a group's settings, checked once
@pytest.mark.parametrize("groups", [1, 2])
def test_a_precision_named_again_is_normalised_by_a_reused_step(spy, groups):
    """A group's precision set again by its preset's name changes nothing the launch was
    built from: the step reuses it, and leaves the group holding the Precision, as a full
    step does.  With two groups, the name set in each in turn."""
    twins = Twins(precision="bf16-sr")
    if groups == 2:
        for backend, opt in twins.opts.items():
            params = twins.params[backend]
            opt.param_groups[0]["params"] = params[:3]
            opt.add_param_group({"params": params[3:], "precision": "bf16-sr"})
    warm(twins, spy)
    for number in range(groups):
        twins.each(lambda opt, params: opt.param_groups[number].__setitem__("precision", "bf16-sr"))
        reused = spy.reused
        twins.grads_and_step()
        assert spy.reused == reused + groups
        for opt in twins.opts.values():
            assert [group["precision"] for group in opt.param_groups] == [bf16opt.PRESETS["bf16-sr"]] * groups


@pytest.mark.parametrize("edit", ["betas in place", "betas", "lr", "new key", "lr tensor in place", "renamed key"])
def test_a_group_edit_is_checked_after_unchanged_steps(spy, edit):
    """A group's settings are checked again only when a value changed (identity), or could
    have changed in place (a list, a tensor or a dict hyper-parameter); every bad edit still
    raises and changes nothing."""
    twins = Twins(bf16opt.Adam)
    twins.each(lambda opt, params: opt.param_groups[0].__setitem__("betas", [0.9, 0.999]) if "in place" in edit
               and edit.startswith("betas") else None)
    twins.each(lambda opt, params: opt.param_groups[0].__setitem__(
        "lr", torch.tensor(0.01)) if edit == "lr tensor in place" else None)
    warm(twins, spy)
    twins.grads()
    for opt in twins.opts.values():
        group = opt.param_groups[0]
        if edit == "betas in place":
            group["betas"][0] = 1.5
        elif edit == "betas":
            group["betas"] = (1.5, 0.999)
        elif edit == "lr":
            group["lr"] = -1.0
        elif edit == "new key":
            group["capturable"] = True
        elif edit == "renamed key":  # the same values in the same order, under other keys
            last = list(group)[-1]
            assert group[last] is None and "sr_streams" not in group
            group["sr_streams"] = group.pop(last)  # (None: not "position")
        else:
            group["lr"].fill_(-1.0)
        before = snapshot(opt)
        with pytest.raises((ValueError, TypeError)):
            opt.step()
        assert_unchanged(opt, before)


# ---------------------------------------------------------------- the state view
def test_a_new_state_mapping_with_the_same_items_reuses(spy):
    twins = Twins()
    warm(twins, spy)
    reused = spy.reused
    for _ in range(2):
        twins.each(lambda opt, params: setattr(opt, "state", dict(opt.state)))
        twins.grads_and_step()
    assert spy.counts()[:2] == (reused + 2, 0)


def test_a_state_mapping_of_another_type_is_looked_up(spy):
    """A mapping whose ``get`` answers otherwise than its items: each param's state is looked
    up with ``get``, as the full path does (here: the same states, reused; then ``get``
    gives another state for param 0, refused though the items did not change)."""
    class Mapping(dict):
        other = None

        def get(self, key, default=None):
            return self.other if self.other is not None and key is self.first else super().get(key, default)

    twins = Twins()
    warm(twins, spy)

    def remap(opt, params):
        opt.state = Mapping(opt.state)
        opt.state.first = params[0]

    twins.each(remap)
    reused = spy.reused
    twins.grads_and_step()
    assert spy.counts()[:2] == (reused + 1, 0)
    twins.each(lambda opt, params: setattr(opt.state, "other", copy.deepcopy(opt.state[params[0]])))
    twins.grads()
    for opt in twins.opts.values():
        opt.step()
    assert spy.counts()[:2] == (reused + 1, 1)


def test_a_state_replaced_in_another_group_keeps_this_groups_launch(spy):
    """Two groups: a param of the second gets a new state dict; the first group's params'
    states are looked up (the view changed) and found unchanged, the second rebuilds."""
    twins = Twins()
    for backend, opt in twins.opts.items():
        params = twins.params[backend]
        opt.param_groups[0]["params"] = params[:3]
        opt.add_param_group({"params": params[3:]})
    warm(twins, spy)
    reused, refused, built = spy.counts()
    twins.each(_replace_state)  # params[3]: the second group
    twins.grads_and_step()
    assert spy.counts() == (reused + 1, refused + 1, built + 1)
    twins.grads_and_step()
    assert spy.counts() == (reused + 3, refused + 1, built + 1)


def test_groups_run_in_order_when_a_later_group_reuses_its_launch(spy):
    """Group 0's param made to share group 1's memory after the launches were kept: group 0
    takes the full path, group 1 reuses its launch, and the memory is updated by group 0,
    then group 1, as the reference does."""
    twins = Twins(shapes=[(5,), (3,), (5,)])
    for backend, opt in twins.opts.items():
        params = twins.params[backend]
        opt.param_groups[0]["params"] = params[:1]
        opt.add_param_group({"params": params[1:], "lr": 0.1})
    warm(twins, spy)
    reused = spy.reused
    twins.each(lambda opt, params: setattr(params[0], "data", params[2].data))
    twins.grads_and_step()
    twins.grads_and_step()
    assert spy.reused >= reused + 2  # (group 1 reused while group 0 took the full path)


def test_a_param_appended_to_a_second_group_by_hand_is_refused(spy):
    twins = Twins(shapes=[(5,), (3,)])
    for backend, opt in twins.opts.items():
        params = twins.params[backend]
        opt.param_groups[0]["params"] = params[:1]
        opt.add_param_group({"params": params[1:]})
    warm(twins, spy)
    twins.grads()
    before = snapshot(twins.opt)
    twins.opt.param_groups[1]["params"].append(twins.params["numba"][0])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[1\]"):
        twins.opt.step()
    assert_unchanged(twins.opt, before)


def test_states_swapped_between_params_refuse(spy):
    """The same state dicts, given to other params: the view changed, the lookup sees it."""
    twins = Twins(shapes=[(5,), (5,), (3,)])
    warm(twins, spy)
    refused = spy.refused

    def swap(opt, params):
        opt.state[params[0]], opt.state[params[1]] = opt.state[params[1]], opt.state[params[0]]

    twins.each(swap)
    twins.grads_and_step()
    assert spy.refused == refused + 1


# ---------------------------------------------------------------- every change rebuilds
def _replace_param_list(opt, params):
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:-1]


def _swap_param(opt, params):
    swapped = torch.nn.Parameter(params[1].detach().clone())
    swapped.grad = params[1].grad
    opt.param_groups[0]["params"][1] = swapped


def _move_param(opt, params):
    params[1].data = params[1].data.clone()


def _reinterpret_param(opt, params):
    params[4].data = params[4].data.view(torch.float16)  # same memory, another dtype


def _transpose_param(opt, params):
    params[0].data = params[0].data.t()  # square: the states keep their shape, the layout changes


def _swap_tensors_param(opt, params):  # torch.utils.swap_tensors: the same object holds another tensor
    torch.utils.swap_tensors(params[1], torch.nn.Parameter(params[1].detach().clone()))


def _swap_tensors_param_for_its_transpose(opt, params):  # the same memory and address, another layout
    torch.utils.swap_tensors(params[0], torch.nn.Parameter(params[0].detach().t()))


def _negate_param(opt, params):  # a negative view: the same memory, the values negated
    params[1].data = params[1].data._neg_view()


def _negate_state_tensor(opt, params):
    moment = opt.state[params[2]]["exp_avg"]
    moment.data = moment.data._neg_view()


def _replace_state_tensor(opt, params):
    opt.state[params[2]]["exp_avg"] = opt.state[params[2]]["exp_avg"].clone()


def _move_state_tensor(opt, params):
    moment = opt.state[params[2]]["exp_avg_sq"]
    moment.set_(moment.clone())


def _replace_state(opt, params):
    opt.state[params[3]] = {key: value.clone() for key, value in opt.state[params[3]].items()}


def _rename_state_key(opt, params):
    state = opt.state[params[2]]
    state["renamed"] = state.pop("exp_avg_sq")  # the same tensors in the same order, under another key


def _drop_state(opt, params):
    opt.state[params[0]] = None  # as good as no state: made afresh


def _edit_step_counter(opt, params):
    opt.state[params[1]]["step"].fill_(10.0)  # its own bucket from now on


def _replace_step_counter(opt, params):
    opt.state[params[1]]["step"] = torch.tensor(opt.state[params[1]]["step"].item())


def _edit(key, value):
    def edit(opt, params):
        opt.param_groups[0][key] = value
    edit.__name__ = f"set {key}={value!r}"
    return edit


def _load_state_dict(opt, params):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


# (change, the full step after it builds a launch at once, the group is kept from then on)
CHANGES = [
    (_replace_param_list, True, True),
    (_swap_param, False, True),  # a new param: new state
    (_move_param, True, True),
    (_reinterpret_param, True, True),
    (_transpose_param, False, False),  # the param no longer shares its states' layout: staged through copies
    (_swap_tensors_param, True, True),
    (_swap_tensors_param_for_its_transpose, False, False),
    (_negate_param, False, False),  # staged through a copy from now on
    (_negate_state_tensor, False, False),
    (_replace_state_tensor, True, True),
    (_move_state_tensor, True, True),
    (_replace_state, True, True),
    (_rename_state_key, False, True),
    (_drop_state, False, True),
    (_edit_step_counter, True, True),
    (_replace_step_counter, False, False),  # a float32 counter
    (_load_state_dict, True, True),
    (_edit("precision", "fp32"), False, True),  # converted state: built at the step after
    (_edit("precision", bf16opt.Precision(master="fp32", exp_avg="bf16")), False, True),
    (_edit("maximize", True), True, True),
    (_edit("weight_decay", 0.1), True, True),  # Adam's L2 flag
    (_edit("amsgrad", True), False, True),  # a new buffer
    (_edit("seed", 8), True, True),
    (_edit("backend", "reference"), False, False),
    (_edit("offload", "cpu"), False, False),
    (_edit("track_precision", True), False, False),
]


@pytest.mark.parametrize("change, built_at_once, kept", CHANGES, ids=[c[0].__name__.strip("_") for c in CHANGES])
@pytest.mark.parametrize("preset", ["bf16", "bf16-sr"])
def test_a_change_drops_the_kept_launch_and_results_stay_right(spy, change, built_at_once, kept, preset):
    """The step after any change does not reuse the kept launch; the full step gives the
    reference's bits and builds the launch again when the group still qualifies."""
    twins = Twins(bf16opt.Adam, precision=preset)
    warm(twins, spy)
    reused, _, built = spy.counts()
    twins.each(change)
    twins.grads_and_step()
    assert (spy.reused, spy.built) == (reused, built + built_at_once)
    for _ in range(3):  # and on from there
        twins.grads_and_step()
    assert (spy.reused > reused) == kept


@pytest.mark.parametrize("change", ["grad dtype", "grad layout", "grad missing", "grad appears", "grad shape",
                                    "grad sparse", "grad without memory", "grad negative view"])
def test_a_change_of_grads_refuses_the_kept_launch(spy, change):
    if change == "grad dtype" and not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("float32 grads of 16-bit params need torch >= 2.10 (Tensor.grad_dtype)")
    twins = Twins()
    for params in twins.params.values():
        params[2].requires_grad_(change != "grad appears")
    for _ in range(3):
        twins.grads()
        for params in twins.params.values():
            params[2].grad = None if change == "grad appears" else params[2].grad
        twins.step()
    before = spy.counts()
    twins.grads(dtype=torch.float32 if change == "grad dtype" else None)
    for params in twins.params.values():
        if change == "grad layout":
            params[0].grad = params[0].grad.t().contiguous().t()
        elif change == "grad missing":
            params[4].grad = None
        elif change == "grad negative view":  # (the same memory and form; its values negated)
            params[3].grad = params[3].grad._neg_view()
        elif change == "grad shape":
            params[4].grad.data = params[4].grad.data.reshape(7, 1)  # (torch refuses it as a new grad)
        elif change == "grad sparse":
            params[4].grad = params[4].grad.to_sparse()
        elif change == "grad without memory":  # (as FSDP frees a tensor: same form, address 0)
            params[4].grad.untyped_storage().resize_(0)
    if change in ("grad shape", "grad sparse", "grad without memory"):
        for opt in twins.opts.values():
            with pytest.raises((ValueError, TypeError), match="param 4"):
                opt.step()
    else:
        twins.step()
    assert spy.refused == before[1] + 1


def test_the_kept_launch_holds_no_grad(spy):
    """Grads are new tensors every step: a kept launch must not keep the last ones alive."""
    twins = Twins()
    warm(twins, spy)
    grads = [weakref.ref(p.grad) for p in twins.params["numba"]]
    twins.opt.zero_grad()
    gc.collect()
    assert all(grad() is None for grad in grads)


@pytest.mark.parametrize("removed", ["group", "param"])
def test_a_param_taken_out_of_the_optimizer_is_released(spy, removed):
    """A param taken out of ``param_groups`` (its group, or it alone) and its state is freed:
    no kept launch or side dict of the optimizer holds it, also when the remaining group
    reuses its launch (a step that builds nothing)."""
    first = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    second = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    groups = [{"params": [first]}, {"params": [second]}] if removed == "group" else [first, second]
    opt = bf16opt.AdamW(groups, backend="numba")
    del groups  # (torch keeps the group dicts given)
    for _ in range(3):
        first.grad, second.grad = torch.randn(2, 8, dtype=torch.bfloat16)
        opt.step()
    reused, built = spy.reused, spy.built
    if removed == "group":
        opt.param_groups.pop()
    else:
        opt.param_groups[0]["params"].pop(1)  # (second)
    del opt.state[second]
    gone = weakref.ref(second)
    del second
    first.grad = torch.randn(8, dtype=torch.bfloat16)
    opt.step()
    gc.collect()
    assert gone() is None and sorted(opt._group_launches) == [0]
    if removed == "group":  # the first group's launch reused
        assert (spy.reused, spy.built) == (reused + 1, built)


def test_named_params_edit_refuses_the_kept_launch(spy):
    """Stochastic rounding's streams follow param names: renaming one builds anew."""
    twins = Twins(precision="bf16-sr", named=True)
    warm(twins, spy)
    before = spy.counts()
    twins.each(lambda opt, params: opt.param_groups[0]["param_names"].__setitem__(0, "renamed.weight"))
    twins.grads_and_step()
    assert spy.refused == before[1] + 1 and spy.built == before[2] + 1


def test_add_param_group_keeps_the_first_groups_launch(spy):
    twins = Twins()
    warm(twins, spy)
    extra = {backend: torch.nn.Parameter(torch.ones(9, dtype=torch.bfloat16)) for backend in twins.opts}
    for backend, opt in twins.opts.items():
        opt.add_param_group({"params": [extra[backend]], "lr": 0.5})
        twins.params[backend].append(extra[backend])
    before = spy.counts()
    for _ in range(3):
        twins.grads_and_step()
    reused, refused, built = (now - then for now, then in zip(spy.counts(), before))
    assert (reused, refused, built) == (4, 0, 1)  # group 0 every step; group 1 from its third step


def test_numba_thread_count_change_refuses_the_kept_launch(spy):
    numba = pytest.importorskip("numba")
    threads = numba.get_num_threads()
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two Numba threads")
    twins = Twins()
    warm(twins, spy)
    before = spy.counts()
    numba.set_num_threads(1 if threads > 1 else 2)
    try:
        twins.grads_and_step()
    finally:
        numba.set_num_threads(threads)
    assert spy.refused == before[1] + 1
    twins.grads_and_step()
    assert spy.refused == before[1] + 2  # and back


@pytest.mark.parametrize("edit", ["shrink", "reinterpret", "reshape"])
def test_a_state_tensor_changed_in_place_refuses_the_kept_launch(spy, edit):
    """A state tensor given another form at the same address (identity kept) is not written
    through the kept launch: the full path refuses it by name, as it would without a cache,
    and leaves everything as it was."""
    twins = Twins()
    warm(twins, spy)
    twins.grads()
    opt, params = twins.opt, twins.params["numba"]
    before = snapshot(opt)
    moment = opt.state[params[0]]["exp_avg"]  # (6, 6) bf16
    address, kept = moment.data_ptr(), moment.data
    moment.data = {"shrink": kept.view(-1)[:3], "reinterpret": kept.view(torch.float16),
                   "reshape": kept.view(4, 9)}[edit]
    assert moment.data_ptr() == address
    reused = spy.reused
    with pytest.raises(ValueError, match="exp_avg of param 0"):
        opt.step()
    assert spy.reused == reused
    moment.data = kept
    assert_unchanged(opt, before)


# ---------------------------------------------------------------- a failed step changes nothing
def _bad_grad(opt, params):
    params[-1].grad.data = torch.zeros(3, dtype=params[-1].dtype)  # (torch refuses it as a new grad)


def _bad_lr(opt, params):
    opt.param_groups[-1]["lr"] = -1.0


def _shrink_param(opt, params):
    params[-1].data = params[-1].data[:3]  # same address and strides, fewer elements than its state


def _non_finite_scalars(opt, params):
    opt.param_groups[-1]["lr"] = 1e39  # finite in float64, an infinite float32 step size


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("failure", [_bad_grad, _bad_lr, _non_finite_scalars, _shrink_param],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_failed_step_after_reused_ones_changes_nothing(spy, failure):
    """Two groups, both reusing their launches; the second's step fails: the first group's
    params, state and counters are untouched, and the next good step matches the reference."""
    twins = Twins()
    for backend, opt in twins.opts.items():  # a second group of the last two params
        params = twins.params[backend]
        opt.param_groups[0]["params"] = params[:3]
        opt.add_param_group({"params": params[3:]})
    warm(twins, spy)
    assert spy.reused >= 2
    twins.grads()
    before = {backend: snapshot(opt) for backend, opt in twins.opts.items()}
    lr = twins.opt.param_groups[-1]["lr"]
    twins.each(failure)
    for backend, opt in twins.opts.items():
        with pytest.raises(ValueError):
            opt.step()
        params = twins.params[backend]
        opt.param_groups[-1]["lr"] = lr  # undo the edit (a snapshot compares the groups too)
        params[-1].data = params[-1].data.as_strided((7,), (1,))
        params[-1].grad = torch.zeros_like(params[-1])
        assert_unchanged(opt, before[backend])
    twins.step()
    twins.grads_and_step()


def test_a_smaller_first_group_renumbers_the_next_groups_params(spy):
    """Params are numbered across groups (stochastic rounding's streams, by position here)."""
    twins = Twins(precision="bf16-sr")
    for backend, opt in twins.opts.items():
        params = twins.params[backend]
        opt.param_groups[0]["params"] = params[:3]
        opt.add_param_group({"params": params[3:]})
    warm(twins, spy)
    reused = spy.reused
    twins.each(lambda opt, params: opt.param_groups[0]["params"].pop(0))
    twins.grads_and_step()
    assert spy.reused == reused


def test_the_step_count_limit_is_kept_on_reused_launches(spy):
    """A reused launch refuses at the count the full path refuses (2**53), changing nothing."""
    twins = Twins(shapes=[(4,)])
    warm(twins, spy)
    twins.each(lambda opt, params: opt.state[params[0]]["step"].fill_(2.0 ** 53 - 2))
    twins.grads_and_step()  # a changed counter: built again
    reused = spy.reused
    twins.grads_and_step()  # reused: the count reaches 2**53
    assert spy.reused == reused + 1
    for opt in twins.opts.values():
        before = snapshot(opt)
        with pytest.raises(ValueError, match="2\\*\\*53"):
            opt.step()
        assert_unchanged(opt, before)


# ---------------------------------------------------------------- any sequence of changes
EDITS = {
    "nothing": lambda opt, params: None,
    "lr": lambda opt, params: opt.param_groups[0].__setitem__("lr", opt.param_groups[0]["lr"] * 0.7),
    "maximize": lambda opt, params: opt.param_groups[0].__setitem__("maximize", not opt.param_groups[0]["maximize"]),
    "precision": lambda opt, params: opt.param_groups[0].__setitem__(
        "precision", "bf16-sr" if opt.param_groups[0]["precision"] != bf16opt.PRESETS["bf16-sr"] else "fp32"),
    "seed": lambda opt, params: opt.param_groups[0].__setitem__("seed", opt.param_groups[0]["seed"] + 1),
    "param moved": _move_param,
    "state tensor replaced": _replace_state_tensor,
    "state tensor moved": _move_state_tensor,
    "step counter edited": _edit_step_counter,
    "state dict loaded": _load_state_dict,
}


@given(edits=st.lists(st.sampled_from(sorted(EDITS)), min_size=1, max_size=8),
       same_grads=st.lists(st.booleans(), min_size=8, max_size=8))
def test_any_sequence_of_changes_matches_the_reference(edits, same_grads):
    twins = Twins(bf16opt.Adam, precision="bf16", weight_decay=0.1)
    twins.grads_and_step()
    for edit, same in zip(edits, same_grads):
        twins.each(EDITS[edit])
        if not same:
            twins.grads()
        twins.step()
