"""Update in backward (``update_in_backward=True``, bf16opt/release.py): each param is updated
from its post-accumulate-grad hook and its grad freed; the bits must be the normal step's for
the same grads, for every optimizer, preset and backend, whatever the training loop does
between steps (schedulers, mode switches, accumulation, state dicts).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import bf16opt
from bf16opt.precision import PRESETS
from snapshots import assert_unchanged, same_bits, snapshot

OPTIMIZERS = {
    "AdamW": (bf16opt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad-L2": (bf16opt.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.05)),
    "Lion": (bf16opt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "SGD-nesterov": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "SGD-momentum": (bf16opt.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
}


class Net(nn.Module):
    """Contiguous, transposed (non-contiguous) and empty params, a bias used twice (its grad
    accumulates over two uses in one backward before its hook fires)."""

    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(12, 9, generator=g).div(3).to(dtype))
        self.b1 = nn.Parameter(torch.randn(12, generator=g).to(dtype))
        self.w2 = nn.Parameter(torch.randn(12, 4, generator=g).div(3).to(dtype).t())  # strides (1, 4)
        self.empty = nn.Parameter(torch.zeros(0, dtype=dtype))

    def forward(self, x):
        h = torch.tanh(x @ self.w1.float().t() + self.b1.float())
        h = torch.tanh(h + self.b1.float())
        return h @ self.w2.float().t() + self.empty.float().sum()


def batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 9, generator=g) for _ in range(n)]


def loss_of(model, x):
    return model(x).pow(2).sum() * 10


def make(opt_name="AdamW", dtype=torch.bfloat16, **overrides):
    cls, kwargs = OPTIMIZERS[opt_name]
    model = Net(dtype)
    return model, cls(model.parameters(), **{**kwargs, "seed": 1234, **overrides})


def train(model, opt, data, modes=None, scheduler=True):
    """backward, step, zero_grad and an LR scheduler; ``modes``: update_in_backward per step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s)) if scheduler else None
    for k, x in enumerate(data):
        if modes is not None:
            for group in opt.param_groups:
                group["update_in_backward"] = modes[k]
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def assert_same_run(model_a, opt_a, model_b, opt_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert same_bits(a.detach(), b.detach())
    assert_same_state_dict(opt_a.state_dict(), opt_b.state_dict())


MODE_KEYS = ("update_in_backward", "update_in_backward_bucket")  # (the optimizer's, not the run's)


def assert_same_state_dict(a, b):
    """The same state and groups, but for the groups' update-in-backward settings."""
    def run_of(groups):
        return [{key: value for key, value in group.items() if key not in MODE_KEYS} for group in groups]

    assert run_of(a["param_groups"]) == run_of(b["param_groups"])
    assert a.keys() == b.keys() and a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for key, value in state.items():
            assert same_bits(value, b["state"][index][key]), (index, key)


def hooks_on(param):
    return len(param._post_accumulate_grad_hooks or {})


# ---------------------------------------------------------------- the bits are the normal step's


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_update_in_backward_gives_the_normal_steps_bits(opt_name, preset, backend):
    runs = []
    for release in (False, True):
        model, opt = make(opt_name, precision=preset, backend=backend, update_in_backward=release)
        train(model, opt, batches())
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_param_dtypes_give_the_normal_steps_bits(dtype):
    runs = []
    for release in (False, True):
        model, opt = make("AdamW", dtype, precision="bf16-sr", backend="numba", update_in_backward=release)
        train(model, opt, batches())
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


def test_grads_are_freed_as_soon_as_each_param_is_updated():
    model, opt = make(update_in_backward=True, update_in_backward_bucket=0, backend="reference")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen = []
    # hooks registered after the optimizer's run after its update: the param is updated, its grad gone
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, p.grad is None, not same_bits(p.detach(), before[name]))))
    loss_of(model, batches()[0]).backward()
    assert sorted(seen) == [("b1", True, True), ("empty", True, False), ("w1", True, True),
                            ("w2", True, True)]
    assert all(p.grad is None for p in model.parameters())
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    opt.step()  # nothing pending: the step changes nothing
    opt.zero_grad()
    assert all(int(s["step"]) == 1 for s in opt.state.values())


def spy_on_updates(opt) -> list:
    """The (group, first index, start, stop) of each update in backward ``opt`` runs."""
    calls, update = [], opt._update_in_backward

    def spied(*place):
        calls.append(place)
        update(*place)
    opt._update_in_backward = spied
    return calls


def test_a_bucket_gathers_adjacent_params_up_to_its_size():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).to(torch.bfloat16)  # 64 + 8 a layer
    opt = bf16opt.AdamW(model.parameters(), backend="reference", update_in_backward=True,
                        update_in_backward_bucket=150)
    calls, alive = spy_on_updates(opt), []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(
            lambda p: alive.append(sum(q.grad.numel() for q in model.parameters() if q.grad is not None)))
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    params = list(model.parameters())
    ranges = sorted((start, stop) for _, _, start, stop in calls)
    assert [start for start, _ in ranges] == [0] + [stop for _, stop in ranges[:-1]] and ranges[-1][1] == 12
    assert 2 <= len(ranges) < 12  # (buckets of several params, none over its size but by its last param)
    assert all(sum(p.numel() for p in params[start:stop]) < 150 + 64 for start, stop in ranges)
    assert 64 < max(alive) < 150 + 64


def test_the_bucket_size_is_a_group_setting_a_load_leaves_as_it_is():
    model, opt = make(update_in_backward=True, backend="reference", update_in_backward_bucket=0)
    opt.param_groups[0]["params"] = [model.w1, model.b1]
    opt.add_param_group({"params": [model.w2, model.empty],
                         "update_in_backward_bucket": __import__("numpy").int64(1 << 30)})
    assert [type(g["update_in_backward_bucket"]) for g in opt.param_groups] == [int, int]
    calls = spy_on_updates(opt)
    loss_of(model, batches()[0]).backward()
    assert sorted((number, stop - start) for number, _, start, stop in calls) == [(0, 1), (0, 1), (1, 2)]
    saved = opt.state_dict()
    assert [group["update_in_backward_bucket"] for group in saved["param_groups"]] == [0, 1 << 30]
    for group in saved["param_groups"]:  # (the optimizer's own setting, not the run's)
        group["update_in_backward_bucket"] = 7
    opt.load_state_dict(saved)
    assert [g["update_in_backward_bucket"] for g in opt.param_groups] == [0, 1 << 30]


@pytest.mark.filterwarnings("ignore:update_in_backward. a second backward:UserWarning")  # (by design here)
def test_a_hook_run_after_the_buckets_were_updated_is_updated_in_the_same_backward():
    """FSDP2 runs the last units' hooks from its own end-of-backward callback; one that runs
    after the optimizer's (which updated the buckets) must still be updated in this backward."""
    model, opt = make(update_in_backward=True, backend="reference")
    late = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    opt.add_param_group({"params": [late]})
    engine = torch.autograd.Variable._execution_engine

    def run_late_hook():
        late.grad = torch.ones_like(late)
        opt._release.on_grad(late)  # (what the late param's hook would do)
    # registered after the optimizer's hooks: queued after the callback its first hook queued
    model.w2.register_post_accumulate_grad_hook(lambda p: engine.queue_callback(run_late_hook))
    before = late.detach().clone()
    loss_of(model, batches()[0]).backward()
    assert late.grad is None and not same_bits(late.detach(), before)
    assert all(int(s["step"]) == 1 for s in opt.state.values()) and len(opt.state) == 5


def test_a_bucket_whose_group_was_edited_in_backward_is_left_to_the_step():
    """A hook that reorders the group's params while a bucket waits: the bucket's places now
    hold other params, some of them holding grads of an earlier micro-batch whose hooks have not
    fired yet.  The bucket is left to step() (its grads kept), and each param updates once."""
    model, opt = make(update_in_backward=True, backend="reference")
    with opt.accumulating():
        loss_of(model, batches()[1]).backward()
    edited = []

    def reorder(_param):
        if not edited:
            edited.append(True)
            opt.param_groups[0]["params"] = opt.param_groups[0]["params"][::-1]
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(reorder)
    loss_of(model, batches()[0]).backward()
    assert edited and any(p.grad is not None for p in model.parameters())  # (the dropped bucket's)
    opt.step()
    assert sorted(int(s["step"]) for s in opt.state.values()) == [1, 1, 1, 1]


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_gives_the_normal_steps_bits(reentrant):
    """Reentrant checkpointing runs a nested backward, whose params are updated at step() (the
    backward around it may add to their grads); the non-reentrant kind recomputes inside the
    one backward."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    runs = []
    for release in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).to(torch.bfloat16)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16-sr", backend="numba", seed=3,
                            update_in_backward=release)
        data = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 16, generator=data).to(torch.bfloat16)
            h = checkpoint(lambda t: model[2](model[1](t)), model[0](x), use_reentrant=reentrant)
            model[3](h).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


def _shared_layer_run(release: bool, bucket: int, offload, tied: bool = False):
    """One Linear applied in two reentrant checkpoint segments (weights shared ALBERT-style),
    with ``tied`` its weight used outside them too."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    torch.manual_seed(0)
    shared, head = nn.Linear(24, 24).to(torch.bfloat16), nn.Linear(24, 4).to(torch.bfloat16)
    opt = bf16opt.AdamW([*shared.parameters(), *head.parameters()], lr=1e-2, precision="bf16-sr", seed=3,
                        backend="numba", offload=offload, update_in_backward=release,
                        update_in_backward_bucket=bucket)
    for step in range(3):
        x = torch.randn(4, 24, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        h = checkpoint(lambda t: torch.tanh(shared(t)), x.requires_grad_(), use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(shared(t)), h, use_reentrant=True)
        if tied:
            h = h + torch.nn.functional.linear(h, shared.weight)
        head(h).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return (nn.Sequential(shared, head), opt)


@pytest.mark.parametrize("bucket", [0, 1 << 20])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_layer_shared_by_reentrant_checkpoints_is_updated_once_from_its_whole_grad(bucket, offload):
    """Each reentrant segment's backward runs its own nested backward and the shared param's
    hook fires in each: updated there, it would be updated twice from partial grads. Hooks in
    a nested backward leave the param to step(), which updates it once, as a normal step."""
    expected = _shared_layer_run(False, bucket, offload)
    got = _shared_layer_run(True, bucket, offload)
    assert_same_run(*expected, *got)
    assert {float(state["step"]) for state in got[1].state.values()} == {3.0}


def test_a_param_updated_before_a_nested_backward_adds_to_its_grad_is_refused_by_name():
    """Used both inside and outside a reentrant segment, a param's hook fires first in the outer
    backward (each param alone: updated there), then its nested backward adds to the grad: the
    update cannot be taken back, so backward raises, naming the param and what to do."""
    with pytest.raises(RuntimeError, match=r"param 0 was updated in this backward before a reentrant"):
        _shared_layer_run(True, 0, None, tied=True)


@pytest.mark.parametrize("elements", [0, 60, 1 << 20])
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_buckets_of_any_size_give_the_normal_steps_bits(elements, backend):
    runs = []
    for release in (False, True):
        model, opt = make("Adam-amsgrad-L2", precision="bf16-sr", backend=backend, update_in_backward=release,
                          update_in_backward_bucket=elements)
        train(model, opt, batches())
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


def test_switching_modes_between_steps_gives_the_normal_steps_bits():
    runs = []
    for modes in ([False] * 6, [True, False, True, True, False, True]):
        model, opt = make("Adam-amsgrad-L2", precision="fp32-remainder", backend="numba")
        train(model, opt, batches(6), modes=modes)
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


def test_mixed_groups_one_in_backward_one_at_step():
    runs = []
    for release in (False, True):
        model = Net()
        opt = bf16opt.Lion([{"params": [model.w1, model.b1], "update_in_backward": release},
                            {"params": [model.w2, model.empty], "precision": "bf16-sr"}],
                           lr=1e-3, seed=7, backend="numba")
        train(model, opt, batches())
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


def test_the_state_dict_is_the_same_in_both_modes_but_the_mode_and_loads_into_either():
    saved = []
    for release in (False, True):
        model, opt = make(precision="bf16-kahan", backend="numba", update_in_backward=release)
        train(model, opt, batches(2))
        saved.append((copy.deepcopy(model.state_dict()), opt.state_dict()))
    assert_same_state_dict(saved[0][1], saved[1][1])
    # (saved, as DCP's flattened state dicts need every group key; a load keeps the live one)
    assert [opt_saved["param_groups"][0]["update_in_backward"] for _, opt_saved in saved] == [False, True]
    runs = []
    for release in (True, False):  # each resumes the other's run in its own mode
        model, opt = make(precision="bf16-kahan", backend="numba", update_in_backward=release)
        model.load_state_dict(saved[release][0])
        opt.load_state_dict(saved[release][1])
        assert opt.param_groups[0]["update_in_backward"] is release  # (the live optimizer's own)
        train(model, opt, batches(2, seed=5), scheduler=False)
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


@pytest.mark.filterwarnings("ignore:update_in_backward. a second backward:UserWarning")  # (by design here)
def test_backwards_without_a_step_update_each_time():
    model_a, opt_a = make("SGD-momentum", backend="numba", update_in_backward=True)
    model_b, opt_b = make("SGD-momentum", backend="numba")
    for x in batches(3):
        loss_of(model_a, x).backward()
        loss_of(model_b, x).backward()
        opt_b.step()
        opt_b.zero_grad()
    opt_a.step()
    assert_same_run(model_a, opt_a, model_b, opt_b)


# ---------------------------------------------------------------- grad accumulation


def accumulate_and_step(model, opt, data, micro, release_route):
    """``micro`` micro-batches per update; ``release_route``: the last backward of each update
    runs outside ``accumulating()`` (it updates), else all inside and step() updates."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for start in range(0, len(data), micro):
        for k, x in enumerate(data[start:start + micro]):
            last = k == micro - 1
            if last and release_route:
                loss_of(model, x).backward()
            else:
                with opt.accumulating():
                    loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("release_route", [True, False])
def test_accumulating_gives_the_normal_accumulated_steps_bits(release_route):
    data = batches(6)
    model_a, opt_a = make(precision="bf16-sr", backend="numba")
    accumulate_and_step(model_a, opt_a, data, 3, release_route=False)
    model_b, opt_b = make(precision="bf16-sr", backend="numba", update_in_backward=True)
    accumulate_and_step(model_b, opt_b, data, 3, release_route)
    assert_same_run(model_a, opt_a, model_b, opt_b)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"] == 1e-2 / 4


def test_inside_accumulating_the_hooks_update_nothing():
    model, opt = make(update_in_backward=True, backend="reference")
    before = snapshot(opt)
    with opt.accumulating():
        with opt.accumulating():  # (nests)
            loss_of(model, batches()[0]).backward()
        loss_of(model, batches()[1]).backward()
    assert_unchanged(opt, before)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("between", ["nothing", "step", "zero_grad", "accumulating"])
def test_backwards_that_update_with_no_step_between_warn_once(between):
    """Two updating backwards with no step() or zero_grad() between them are what a training
    library's gradient accumulation does (Trainer, accelerate): each makes its own update from
    part of the grads, which the user did not ask for.  Warned once per optimizer; a step,
    zero_grad or accumulating() between them is the documented loop, and warns nothing."""
    import warnings  # noqa: PLC0415

    model, opt = make(update_in_backward=True, backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            if between == "accumulating" and k < 2:
                with opt.accumulating():
                    loss_of(model, batches()[k]).backward()
            else:
                loss_of(model, batches()[k]).backward()
            if between in ("step", "zero_grad"):
                getattr(opt, between)()
    texts = [str(w.message) for w in caught if "update_in_backward: a second backward" in str(w.message)]
    assert len(texts) == (1 if between == "nothing" else 0), texts
    if texts:
        assert "accumulating()" in texts[0] and "step()" in texts[0]


# ---------------------------------------------------------------- refused by name, changing nothing


def test_a_closure_is_refused_before_it_runs():
    model, opt = make(update_in_backward=True, backend="reference")
    calls = []
    with pytest.raises(ValueError, match="closure.*update_in_backward"):
        opt.step(lambda: calls.append(1))
    assert calls == []


def test_grad_scaler_is_refused_at_its_first_step():
    model, opt = make(update_in_backward=True, backend="reference")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, batches()[0])).backward()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="GradScaler cannot be used with update_in_backward"):
        scaler.step(opt)
    assert_unchanged(opt, before)
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))


def test_sparse_grads_are_refused_in_backward_changing_nothing():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = bf16opt.SGD(emb.parameters(), lr=0.1, update_in_backward=True)
    before = snapshot(opt)
    with pytest.raises(TypeError, match="sparse"):
        emb(torch.tensor([1, 2])).sum().backward()
    assert_unchanged(opt, before)


def test_a_bad_setting_raises_before_any_param_of_the_backward_changes():
    model, opt = make(backend="reference")
    opt.param_groups[0]["params"] = [model.w1]
    opt.add_param_group({"params": [model.b1, model.w2]})
    for group in opt.param_groups:
        group["update_in_backward"] = True
    opt.zero_grad()
    opt.param_groups[1]["lr"] = -1.0  # group 0's params come first in backward... and must not move
    before = snapshot(opt)
    with pytest.raises(ValueError, match="learning rate"):
        loss_of(model, batches()[0]).backward()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("value, error", [("4M", TypeError), (-1, ValueError), (2.5, TypeError)])
def test_a_bad_bucket_size_set_between_steps_raises_from_backward_changing_nothing(value, error):
    model, opt = make(update_in_backward=True, backend="reference")
    train(model, opt, batches(1), scheduler=False)
    opt.param_groups[0]["update_in_backward_bucket"] = value
    before = snapshot(opt)
    with pytest.raises(error, match="update_in_backward_bucket"):
        loss_of(model, batches()[0]).backward()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_non_bool_mode_is_refused(value):
    model = Net()
    with pytest.raises(TypeError, match="update_in_backward must be a bool"):
        bf16opt.AdamW(model.parameters(), update_in_backward=value)
    assert all(hooks_on(p) == 0 for p in model.parameters())
    opt = bf16opt.AdamW([model.w1], update_in_backward=True)
    with pytest.raises(TypeError, match="update_in_backward must be a bool"):
        opt.add_param_group({"params": [model.b1], "update_in_backward": value})
    assert len(opt.param_groups) == 1 and hooks_on(model.b1) == 0 and hooks_on(model.w1) == 1


# ---------------------------------------------------------------- hooks come and go cleanly


def test_hooks_follow_the_mode_and_leave_with_the_optimizer():
    model, opt = make(update_in_backward=True, backend="reference")
    assert all(hooks_on(p) == 1 for p in model.parameters())
    opt.param_groups[0]["update_in_backward"] = False
    opt.zero_grad()
    assert all(hooks_on(p) == 0 for p in model.parameters())
    opt.param_groups[0]["update_in_backward"] = True
    opt.step()
    assert all(hooks_on(p) == 1 for p in model.parameters())
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None  # the hooks hold no reference to the optimizer
    assert all(hooks_on(p) == 0 for p in model.parameters())
    loss_of(model, batches()[0]).backward()  # (and backward works on)


def test_a_copy_hooks_its_own_params():
    model, opt = make(update_in_backward=True, backend="reference")
    twin = copy.deepcopy(opt)  # (new params, not the model's)
    assert all(hooks_on(p) == 1 for p in model.parameters())
    assert all(hooks_on(p) == 1 for p in twin.param_groups[0]["params"])


# ---------------------------------------------------------------- the CUDA kernels, on the CPU


def _param_alone(bucket, i):
    """Param ``i`` of ``bucket`` in a bucket of its own, as an update in backward launches it:
    its optimizer index, element offset and random stream kept."""
    from bf16opt.backends import Bucket  # noqa: PLC0415

    counts = None if bucket.counts is None else bucket.counts[i:i + 1].clone()
    return Bucket(bucket.config, [[column[i]] for column in bucket.tensors], indices=[bucket.indices[i]],
                  offsets=[bucket.offset(i)], stream_ids=[bucket.stream_id(i)], seed=bucket.seed,
                  step=bucket.step, counts=counts)


def _emulated_cases():
    emulation = pytest.importorskip("test_cuda_emulation", reason="needs the CUDA emulation tests")
    if emulation.emulator.compiler_problem() is not None:
        pytest.skip(f"CUDA emulation needs a host C++ compiler: {emulation.emulator.compiler_problem()}")
    cases = []
    for kind, configs in emulation.CONFIGS.items():
        # stochastic rounding, Kahan, the remainder and telemetry: what depends on a param's place
        for weights in ("param-stochastic", "kahan", "remainder"):
            picked = [case for case in configs if case[1].weights == weights]
            tracked = [case for case in picked if case[1].track]
            cases += (tracked or picked)[:1]
    return emulation, cases


def test_cuda_kernels_update_a_param_alone_as_in_its_bucket():
    """An update in backward launches a param alone; the emulated CUDA kernels give it the
    bits it gets in a bucket with others (and the reference's)."""
    from bf16opt.backends import cupy as cuda_backend  # noqa: PLC0415
    from bf16opt.backends import reference  # noqa: PLC0415

    emulation, cases = _emulated_cases()
    emulation.emulator.library()
    assert {case[1].weights for case in cases} >= {"param-stochastic", "kahan", "remainder"}
    for name, config in cases:
        rng = __import__("numpy").random.default_rng(39)
        together = emulation.make_bucket(config, [1, 22, 64, 129, 513], rng, 0.1, 0.4, True)
        expected = emulation.clone_bucket(together)
        alone = [_param_alone(emulation.clone_bucket(together), i) for i in range(len(together.params))]
        scalars = emulation.scalars_for(config, emulation.group_for(config, rng), together.step)
        reference.run(expected, scalars)
        cuda_backend.run(together, scalars, execute=emulation.emulator.execute, **emulation.SMALL_CHUNKS)
        emulation.assert_same_bits(expected, together, name)
        for i, bucket in enumerate(alone):
            cuda_backend.run(bucket, scalars, execute=emulation.emulator.execute, **emulation.SMALL_CHUNKS)
            emulation.assert_same_bits(_param_alone(expected, i), bucket, f"{name} param {i} alone")


# ---------------------------------------------------------------- per-update clipping


def clip_each_by_hand(params, max_norm):
    """clipping.py's rule, written out with torch ops."""
    for p in params:
        norm = torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32)
        p.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_per_update_clipping_gives_the_same_bits_in_both_modes_and_clips(offload):
    data = batches(3)
    model_a, opt_a = make("Adam-amsgrad-L2", precision="bf16-sr", backend="numba")
    norms = []
    for x in data:  # by hand, then a normal step without the option
        loss_of(model_a, x).backward()
        norms += [float(torch.linalg.vector_norm(p.grad, dtype=torch.float32)) for p in model_a.parameters()]
        clip_each_by_hand(model_a.parameters(), 0.5)
        opt_a.step()
        opt_a.zero_grad()
    assert max(norms) > 5  # (the clip really scaled)
    for release in (False, True):
        model_b, opt_b = make("Adam-amsgrad-L2", precision="bf16-sr", backend="numba", offload=offload,
                              update_in_backward=release, max_grad_norm_per_param=0.5)
        train(model_b, opt_b, data, scheduler=False)
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert same_bits(a.detach(), b.detach())
        state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert all(same_bits(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i])


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_clipping_step_leaves_the_clipped_grads_with_or_without_offload(offload):
    """A normal step with per-update clipping scales each grad in place, as clip_grad_norm_
    does; offloaded, it scales the host copy it reads and the device grad alike. So a second
    step on the same grads (no zero_grad) is the same in both."""
    x = batches(1)[0]
    model_a, opt_a = make("Adam-amsgrad-L2", precision="bf16-sr", backend="numba")
    loss_of(model_a, x).backward()
    clip_each_by_hand(model_a.parameters(), 0.5)
    expected = [p.grad.clone() for p in model_a.parameters()]
    model_b, opt_b = make("Adam-amsgrad-L2", precision="bf16-sr", backend="numba", offload=offload,
                          max_grad_norm_per_param=0.5)
    loss_of(model_b, x).backward()
    opt_b.step()
    assert all(same_bits(p.grad, g) for p, g in zip(model_b.parameters(), expected))
    opt_a.step()
    opt_a.step()
    opt_b.step()
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(model_a.parameters(), model_b.parameters()))


@pytest.mark.parametrize("value, error", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                          ("1", TypeError), (torch.tensor(1.0), TypeError)])
def test_a_bad_max_grad_norm_per_param_is_refused_changing_nothing(value, error):
    model, opt = make(backend="reference", max_grad_norm_per_param=1.0)
    loss_of(model, batches()[0]).backward()
    with pytest.raises(error, match="max_grad_norm_per_param"):
        bf16opt.AdamW(model.parameters(), max_grad_norm_per_param=value)
    opt.param_groups[0]["max_grad_norm_per_param"] = value
    before = snapshot(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(error, match="max_grad_norm_per_param"):
        opt.step()
    assert_unchanged(opt, before)
    assert all(same_bits(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_per_update_clipping_refuses_scaled_grads():
    model, opt = make(backend="reference", max_grad_norm_per_param=1.0)
    loss_of(model, batches()[0]).backward()
    before = snapshot(opt)
    with pytest.raises(ValueError, match="unscale_"):
        opt.step(grad_scale=torch.tensor(2.0 ** 16))
    assert_unchanged(opt, before)


# ---------------------------------------------------------------- offloaded: host updates in backward


def offloaded(opt, chunk=7):
    """The stand-in link: copies on worker threads, completed late and out of order."""
    from bf16opt.offload import use_copy_engine  # noqa: PLC0415
    from bf16opt.offload_copies import ThreadedCopyEngine  # noqa: PLC0415

    use_copy_engine(opt, ThreadedCopyEngine(latency=2e-4, jitter=1e-3, seed=3))
    opt._offloader.chunk_elements = chunk
    return opt


@pytest.mark.parametrize("opt_name, preset", [("AdamW", "bf16-sr"), ("Lion", "fp32-remainder"),
                                              ("SGD-momentum", "bf16-kahan"), ("Adam-amsgrad-L2", "fp32")])
def test_offloaded_updates_in_backward_give_the_normal_steps_bits(opt_name, preset):
    model_a, opt_a = make(opt_name, precision=preset, backend="numba")
    train(model_a, opt_a, batches())
    model_b, opt_b = make(opt_name, precision=preset, backend="numba", offload="cpu", update_in_backward=True)
    train(model_b, offloaded(opt_b), batches())
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert same_bits(a.detach(), b.detach())
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert [{k: v for k, v in g.items() if k not in ("offload", *MODE_KEYS)} for g in state_a["param_groups"]] == \
        [{k: v for k, v in g.items() if k not in ("offload", *MODE_KEYS)} for g in state_b["param_groups"]]
    assert all(same_bits(value, state_b["state"][i][key]) for i, s in state_a["state"].items()
               for key, value in s.items())


@pytest.mark.filterwarnings("ignore:update_in_backward. a second backward:UserWarning")  # (by design here)
def test_offloaded_accumulation_switches_and_backwards_without_a_step():
    data = batches(6)
    model_a, opt_a = make(precision="bf16-sr", backend="numba")
    accumulate_and_step(model_a, opt_a, data, 2, release_route=False)
    for x in data[:2]:
        loss_of(model_a, x).backward()
        opt_a.step()
        opt_a.zero_grad()
    model_b, opt_b = make(precision="bf16-sr", backend="numba", offload="cpu", update_in_backward=True)
    offloaded(opt_b)
    accumulate_and_step(model_b, opt_b, data, 2, release_route=True)
    opt_b.param_groups[0]["lr"] = opt_a.param_groups[0]["lr"]
    for x in data[:2]:  # two backwards in a row: the second waits for the first's host updates
        loss_of(model_b, x).backward()
    opt_b.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert same_bits(a.detach(), b.detach())
    assert all(p.grad is None for p in model_b.parameters())


def test_an_error_of_an_offloaded_update_is_raised_by_backward():
    model, opt = make(backend="numba", offload="cpu", update_in_backward=True)
    offloaded(opt)

    def failing(*arguments):
        raise RuntimeError("host update failed")
    opt._run_launches = failing
    with pytest.raises(RuntimeError, match="host update failed"):
        loss_of(model, batches()[0]).backward()
    del opt._run_launches
    opt.step()  # (reported once; the optimizer goes on)
    loss_of(model, batches()[1]).backward()
    opt.step()


@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("opt_name, preset, dtype", [("AdamW", "fp32", torch.bfloat16),
                                                     ("Lion", "bf16-states", torch.float16),
                                                     ("SGD-momentum", "fp32", torch.float16)])
def test_a_param_pruned_beside_a_master_copy_in_backward_gives_the_normal_steps_bits(opt_name, preset, dtype,
                                                                                     offload):
    """Pruned elements of a param with a float32 master copy, between updates in backward:
    the update starts from the pruned param (storage.join_copy) as the normal step's does, the
    master follows, and the pruned elements stay within one update of 0."""
    runs = []
    for release in (False, True):
        model, opt = make(opt_name, dtype, precision=preset, backend="numba", offload=offload,
                          update_in_backward=release)
        if offload and release:
            offloaded(opt)
        for k, x in enumerate(batches()):
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            if k == 2:  # (before the last step)
                with torch.no_grad():
                    model.w1[:, :3] = 0
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])
    model, opt = runs[1]
    state, where = opt.state[model.w1], (slice(None), slice(0, 3))
    if opt_name.startswith("SGD"):  # one update from 0: lr * the momentum buffer
        bound = opt.param_groups[0]["lr"] * state["momentum_buffer"][where].float().abs() * 1.01 + 1e-30
    else:  # Lion's lr (1e-3), a few of AdamW's (1e-2)
        bound = torch.full((12, 3), 0.05 if opt_name != "Lion" else 2e-3)
    assert bool((model.w1[where].detach().float().abs() <= bound).all())
    assert bool((state["master"][where].abs() <= bound).all())


def test_named_params_and_edits_between_updates_give_the_normal_steps_bits():
    """Named params (random streams named by name), then a preset, an lr and a flag changed
    between steps: each param's kept launch must notice and plan again."""
    runs = []
    for release in (False, True):
        model = Net()
        opt = bf16opt.Adam(model.named_parameters(), lr=1e-2, precision="bf16-sr", backend="numba",
                           seed=5, update_in_backward=release)
        for k, x in enumerate(batches(6)):
            if k == 2:
                opt.param_groups[0]["precision"] = "fp32-remainder"
            if k == 3:
                opt.param_groups[0]["lr"] = 3e-3
            if k == 4:
                opt.param_groups[0]["amsgrad"] = True
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


# ---------------------------------------------------------------- the timeline and the benchmark


def test_the_updates_in_backward_are_ranges_on_the_profiler_timeline():
    from bf16opt.release import PHASES  # noqa: PLC0415

    model, opt = make(backend="numba", offload="cpu", update_in_backward=True)
    offloaded(opt)
    loss_of(model, batches()[0]).backward()  # (compiled outside the profile)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(model, batches()[1]).backward()
        opt.step()
    names = {event.name for event in prof.events()}
    assert {PHASES["update"], PHASES["backward_wait"]} <= names


def test_release_model_benchmark_prints_every_row():
    """benchmarks/release_model.py on a tiny CPU model (its figures mean nothing here)."""
    import pathlib  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "release_model.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "2", "--dim", "64",
                             "--batch", "8", "--presets", "bf16", "--repeats", "1", "--warmup", "1",
                             "--threads", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for placement in ("state on device", "offload=cpu"):
        for mode in ("normal step", "update_in_backward"):
            assert any(line.startswith(f"bf16, {placement}, {mode}") for line in lines), result.stdout
    assert any("per-update clip" in line and "speculative snapshot" in line for line in lines), result.stdout


def test_an_offloaded_bucket_of_empty_params_alone_steps():
    """An update in backward launches an empty param alone (the offloaded rows' plan of a bucket
    without rows); so can a normal step of a group whose only param is empty."""
    empty = nn.Parameter(torch.zeros(0, dtype=torch.bfloat16))
    opt = bf16opt.AdamW([empty], offload="cpu", backend="numba")
    empty.grad = torch.zeros_like(empty)
    opt.step()
    assert int(opt.state[empty]["step"]) == 1


def test_update_in_backward_under_compiled_autograd_gives_the_normal_steps_bits():
    """Compiled autograd traces the hooks with Dynamo, which refuses the engine's end-of-backward
    callback unless fullgraph: then each bucket is updated at once, eagerly (Dynamo does not
    trace the kept launch), with the same bits, step after step."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    if not hasattr(compiled_autograd, "_enable"):
        pytest.skip("this torch has no torch._dynamo.compiled_autograd._enable")
    runs = []
    for release in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(torch.bfloat16)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16", backend="numba",
                            update_in_backward=release)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):  # (from the third, a kept launch)
            x = torch.randn(8, 16, generator=generator).to(torch.bfloat16)
            loss = (model(x).float() - x.float()).pow(2).mean()
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises: a backward that fails after some hooks ran."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


def test_zero_grad_after_a_failed_backward_waits_for_the_offloaded_updates(monkeypatch):
    """w2's update, handed to the background in a backward that then fails (torch runs no
    end-of-backward callback), has finished when zero_grad returns: the next forward reads
    w2's new value, not one being written."""
    import time  # noqa: PLC0415
    model, opt = make(backend="numba", offload="cpu", update_in_backward=True, update_in_backward_bucket=0)
    offloaded(opt)
    loss_of(model, batches()[0]).backward()
    opt.step()
    opt.zero_grad()
    run_launches = opt._run_launches

    def slow(*arguments):
        time.sleep(0.3)
        run_launches(*arguments)
    opt._run_launches = slow
    x = batches()[1]
    h = _FailingBackward.apply(torch.tanh(x @ model.w1.float().t() + model.b1.float()))
    before = model.w2.detach().clone()
    with pytest.raises(RuntimeError, match="backward failed"):
        (h @ model.w2.float().t()).pow(2).sum().backward()
    opt.zero_grad()
    seen = model.w2.detach().clone()
    assert opt.__dict__["_background_instance"]._queued == 0
    assert not same_bits(seen, before)  # (w2 was updated)
    time.sleep(0.4)
    assert same_bits(model.w2.detach(), seen)


@pytest.mark.parametrize("with_step", [True, False], ids=["after-step", "after-zero-grad-alone"])
def test_a_bad_setting_raises_before_a_backward_changes_anything_with_or_without_step(with_step):
    """Each backward checks every release group's settings at its first update, also in a loop
    of backward and zero_grad without step()."""
    model, opt = make(backend="reference", update_in_backward=True, update_in_backward_bucket=0)
    opt.param_groups[0]["params"] = [model.w2]  # (reached first in backward)
    opt.add_param_group({"params": [model.w1, model.b1]})
    loss_of(model, batches()[0]).backward()
    if with_step:
        opt.step()
    opt.zero_grad()
    opt.param_groups[1]["lr"] = -1.0
    before = snapshot(opt)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        loss_of(model, batches()[1]).backward()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("start, edit", [
    ({}, {"offload": "cpu"}),
    ({"update_in_backward_bucket": 0}, {"update_in_backward_bucket": 1 << 20})])
def test_state_replaced_by_a_precision_edit_is_freed(start, edit):
    """The launches kept between updates in backward must not hold the state a precision edit
    replaced (with offload switched on, or the buckets cut otherwise, at the same edit)."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision="fp32", update_in_backward=True, backend="numba",
                        **start)
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    old = [weakref.ref(t) for state in opt.state.values() for key, t in state.items() if key != "step"]
    opt.param_groups[0].update(edit, precision="bf16")
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    gc.collect()
    assert [ref for ref in old if ref() is not None] == []


# ---------------------------------------------------------------- a param of one optimizer only
def test_a_param_updated_in_backward_belongs_to_one_live_optimizer():
    """An update in backward frees the grad another optimizer of the same param would step
    from: a second optimizer over such params is refused, in either mode and either order, and
    the first trains on as before (a notebook cell run again while the old optimizer lives)."""
    model, first = make(update_in_backward=True)
    data = batches(3)
    twin, alone = make(update_in_backward=True)
    for kwargs in (dict(update_in_backward=True), dict()):
        with pytest.raises(ValueError, match="also a param of another live bf16opt optimizer"):
            bf16opt.AdamW(model.parameters(), **kwargs)
    with pytest.raises(ValueError, match="updates it in backward"):
        bf16opt.SGD([model.b1], lr=0.1)
    assert [p._post_accumulate_grad_hooks is not None for p in model.parameters()] == [True] * 4
    train(model, first, data)
    train(twin, alone, data)
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(model.parameters(), twin.parameters()))
    del first
    gc.collect()
    second = bf16opt.AdamW(model.parameters(), update_in_backward=True)  # (the old one is gone)
    assert second.param_groups[0]["update_in_backward"] is True


def test_a_group_joining_update_in_backward_is_refused_where_another_optimizer_has_its_params():
    """Two optimizers may share a param as torch.optim's do, while neither updates it in
    backward; switching a group to update in backward then is refused by zero_grad() and
    step() before they change anything, and add_param_group refuses such a group."""
    model, first = make()
    other = bf16opt.SGD([model.b1], lr=0.1)
    for x in batches(1):
        loss_of(model, x).backward()
    first.param_groups[0]["update_in_backward"] = True
    grads = [p.grad.clone() for p in model.parameters()]
    before = snapshot(first)
    for call in (first.zero_grad, first.step):
        with pytest.raises(ValueError, match="param 1 of group 0 is also a param of another"):
            call()
        assert_unchanged(first, before)
        assert all(same_bits(p.grad, g) for p, g in zip(model.parameters(), grads))
    first.param_groups[0]["update_in_backward"] = False
    first.step()  # (shared again without update in backward: fine)
    lone = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="param 1 of group 1 is also a param of another"):
        other.add_param_group(dict(params=[lone, model.w1], update_in_backward=True))
    assert len(other.param_groups) == 1 and lone._post_accumulate_grad_hooks is None
