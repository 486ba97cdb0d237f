"""Step hooks and the profiler's step scope, as torch.optim has them.

bf16opt wraps ``step`` itself (``MixedPrecisionOptimizer.profile_hook_step``): torch's
wrapper enters its ``record_function`` scope through torch's operator dispatch, which costs
more than the rest of a small step's bookkeeping; bf16opt enters the same scope through its
C++ binding.  Everything must be torch's: global and per-optimizer pre- and post-hooks, in
torch's order, a pre-hook's replacement arguments, torch's error for a bad pre-hook result,
and the scope ``Optimizer.step#<class>.step`` in a profile and in an execution trace.  Each test runs the same thing on
torch.optim.AdamW and bf16opt.AdamW and compares.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import bf16opt


def make(cls):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    if cls is bf16opt.AdamW:
        opt = cls(model.parameters(), lr=0.1, precision="fp32", backend="numba")
    else:
        opt = cls(model.parameters(), lr=0.1)
    return model, opt


def loss_of(model):
    return model(torch.ones(2, 4)).square().sum()


@pytest.mark.parametrize("profiled", [False, True], ids=["no profiler", "profiler running"])
def test_hooks_run_in_torchs_order_with_torchs_arguments(profiled):
    logs = {}
    for cls in (torch.optim.AdamW, bf16opt.AdamW):
        model, opt = make(cls)
        log = logs[cls] = []

        def closure(model=model, log=log):
            log.append("closure")
            model.zero_grad()
            loss = loss_of(model)
            loss.backward()
            return loss

        def logging(name, log=log):  # a hook that logs its call and returns None
            return lambda o, args, kwargs: log.append((name, len(args), list(kwargs)))

        handles = [
            register_optimizer_step_pre_hook(logging("global pre")),
            register_optimizer_step_post_hook(logging("global post")),
            opt.register_step_pre_hook(logging("pre")),
            # a pre-hook may replace the arguments: here it passes the closure
            opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": closure})),
            opt.register_step_post_hook(logging("post")),
        ]
        try:
            if profiled:
                with torch.profiler.profile():
                    loss = opt.step()
            else:
                loss = opt.step()
        finally:
            for handle in handles:
                handle.remove()
        log.append(("loss", round(loss.item(), 4)))
        log.append(("stepped", opt.state[model.weight]["step"].item()))
    assert logs[bf16opt.AdamW] == logs[torch.optim.AdamW]
    assert logs[bf16opt.AdamW][:5] == [("global pre", 1, []), ("pre", 1, []), "closure", ("post", 1, ["closure"]),
                                       ("global post", 1, ["closure"])]


@pytest.mark.parametrize("profiled", [False, True], ids=["no profiler", "profiler running"])
def test_a_bad_pre_hook_result_raises_torchs_error_before_the_step(profiled):
    for cls in (torch.optim.AdamW, bf16opt.AdamW):
        model, opt = make(cls)
        loss_of(model).backward()
        before = model.weight.detach().clone()
        opt.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
        with pytest.raises(RuntimeError, match=r"must return None or a tuple of \(new_args, new_kwargs\), "
                                               r"but got not a pair"):
            if profiled:
                with torch.profiler.profile():
                    opt.step()
            else:
                opt.step()
        assert torch.equal(model.weight, before)
        assert opt.state == {} or not opt.state[model.weight]


def test_a_profile_shows_the_step_scope_as_torchs_does():
    scopes = {}
    for cls in (torch.optim.AdamW, bf16opt.AdamW):
        model, opt = make(cls)
        loss_of(model).backward()
        with torch.profiler.profile() as prof:
            opt.step()
        name = f"Optimizer.step#{cls.__name__}.step"
        scopes[cls] = [(event.scope, event.device_type) for event in prof.events() if event.name == name]
    assert scopes[bf16opt.AdamW] == scopes[torch.optim.AdamW]
    assert len(scopes[torch.optim.AdamW]) == 1


def test_an_execution_trace_without_a_profiler_shows_the_step():
    """An observer of torch's record-function events that runs without a profiler (an
    execution-trace observer) sees the step's scope as it sees torch.optim's."""
    from torch.profiler import ExecutionTraceObserver

    seen = {}
    for cls in (torch.optim.AdamW, bf16opt.AdamW):
        model, opt = make(cls)
        loss_of(model).backward()
        path = Path(tempfile.mkdtemp()) / "trace.json"
        observer = ExecutionTraceObserver().register_callback(str(path))
        observer.start()
        try:
            assert not torch.autograd._profiler_enabled()
            opt.step()
        finally:
            observer.stop()
            observer.unregister_callback()
        names = [node.get("name") for node in json.loads(path.read_text(encoding="utf-8")).get("nodes", [])]
        seen[cls] = names.count(f"Optimizer.step#{cls.__name__}.step")
    assert seen[bf16opt.AdamW] == seen[torch.optim.AdamW] == 1


def test_a_compiled_training_step_traces_the_wrapper_without_warnings():
    """torch.compile traces the step's wrapper as it traces torch.optim's (the step itself runs
    eagerly): no warning about the scope's C++ binding, which Dynamo cannot trace."""
    model, opt = make(bf16opt.AdamW)
    before = model.weight.detach().clone()

    @torch.compile(backend="eager")
    def train_step():
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step()
    assert not [str(w.message) for w in caught if "record_function" in str(w.message)]
    assert not torch.equal(model.weight, before)
