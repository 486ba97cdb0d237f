"""Mixed-precision integrations (docs/integrations_amp.md): GradScaler's protocol folded into
the kernels, float32 grads of bfloat16/float16 params, torch.compile.

* the kernels: the Numba chunk functions read float32 grads and multiply by
  ``inv_grad_scale`` exactly as the reference does (the CUDA kernels: test_cuda_emulation.py);
* float32 grads are read unrounded: a result that differs from feeding the bf16-rounded
  grad and equals the reference fed the float32 grad; memory_report counts their bytes;
* GradScaler: a step with an inf changes nothing (params, state, step counters, offload
  staging) and the scale halves; a normal run equals the reference stepped by hand with
  ``grad_scale`` (and, for power-of-two scales, ``unscale_`` then a plain step); the
  ``unscale_`` -> clip path with float32 grads of float16 params;
* torch.compile(opt.step) and a compiled training step give eager's bits;
* every example of docs/integrations_amp.md runs here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import bf16opt
from bf16opt.algorithms import ADAM, LION, SGD
from bf16opt.precision import PRESETS, plan_for
from buckets import ADAM_GROUPS, THIRD, adam_flags, make_bucket, run_both, sgd_flags, sgd_group
from snapshots import assert_unchanged, same_bits, snapshot

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations_amp.md"


def params_and_state(opt) -> list:
    """Every param and state tensor (clones), in a fixed order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [v.clone() for _, v in sorted(opt.state.get(p, {}).items())]
    return out


def assert_same(a: list, b: list, where: str = "") -> None:
    assert len(a) == len(b), where
    for k, (x, y) in enumerate(zip(a, b)):
        assert same_bits(x, y), f"{where}: tensor {k} differs"


# ---------------------------------------------------------------- the kernels
KERNEL_CASES = {  # (algorithm, preset, param dtype, grad dtype, flags, group)
    "adam-bf16-fp32grad": (ADAM, "bf16", torch.bfloat16, torch.float32,
                           adam_flags(ADAM_GROUPS["decoupled"], False), ADAM_GROUPS["decoupled"]),
    # all-bf16 AdamW takes the paired two-elements-per-word loop: the scale folded there too
    "adamw-bf16-paired": (ADAM, "bf16", torch.bfloat16, torch.bfloat16,
                          adam_flags(ADAM_GROUPS["decoupled"], False), ADAM_GROUPS["decoupled"]),
    "amsgrad-fp16-master-fp32grad": (ADAM, "fp32", torch.float16, torch.float32,
                                     adam_flags(ADAM_GROUPS["l2"], True), ADAM_GROUPS["l2"]),
    "lion-bf16sr-fp32grad": (LION, "bf16-sr", torch.bfloat16, torch.float32, {},
                             dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
    "sgd-kahan-fp32grad": (SGD, "bf16-kahan", torch.bfloat16, torch.float32,
                           sgd_flags(sgd_group(momentum=0.9), first=True), sgd_group(momentum=0.9)),
    "sgd-remainder-fp32grad": (SGD, "fp32-remainder", torch.bfloat16, torch.float32,
                               sgd_flags(sgd_group(weight_decay=0.1)), sgd_group(weight_decay=0.1)),
    "adam-fp32": (ADAM, "fp32", torch.float32, torch.float32,
                  adam_flags(ADAM_GROUPS["none"], False), ADAM_GROUPS["none"]),
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_numba_reads_float32_grads_and_folds_the_grad_scale(name):
    """Numba == reference bit for bit with float32 grads and ``inv_grad_scale`` 1/3 (odd
    sizes, strided tensors, NaN/inf/subnormal grads; maximize on alternate steps)."""
    algorithm, preset, param, grad, flags, group = KERNEL_CASES[name]
    bucket = make_bucket(algorithm, plan_for(PRESETS[preset], param), [(7,), (5, 13), (1000,), (64,)],
                         seed=11, flags=flags, layouts=[True, False, True, True], grad=grad)
    assert bucket.config.grad == grad and all(g.dtype == grad for g in bucket["grad"])
    run_both(bucket, group, steps=2, where=name, alternate_maximize=True, inv_grad_scale=THIRD)


# ---------------------------------------------------------------- float32 grads
# float32 grads of 16-bit params (p.grad_dtype); older torches keep the grads 16-bit, silently
needs_grad_dtype = pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"),
                                      reason="float32 grads of 16-bit params need torch >= 2.10 (grad_dtype)")


def bf16_model(grad_dtype=None, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)
    for p in model.parameters():
        p.grad_dtype = grad_dtype  # float32: backward produces and accumulates float32 .grad
    return model


def accumulate(model, micro_batches: int = 3, seed: int = 1) -> None:
    """Gradient accumulation over micro-batches (sums in the grads' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(micro_batches):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        model(x).float().pow(2).mean().backward()


@needs_grad_dtype
@pytest.mark.parametrize("backend, offload", [("reference", None), ("numba", None), ("numba", "cpu")])
def test_float32_grads_are_read_unrounded(backend, offload):
    """float32-accumulated grads of bf16 params update the float32 master differently from
    the same grads rounded to bf16, and exactly as the reference fed the float32 grads."""
    results = {}
    for name, kind in (("adamw", bf16opt.AdamW), ("sgd", bf16opt.SGD)):
        model = bf16_model(torch.float32)
        opt = kind(model.parameters(), lr=1e-2, precision="fp32", backend=backend, offload=offload)
        ref_model = bf16_model(torch.float32)
        ref = kind(ref_model.parameters(), lr=1e-2, precision="fp32", backend="reference")
        rounded_model = bf16_model()
        rounded = kind(rounded_model.parameters(), lr=1e-2, precision="fp32", backend="reference")
        for step in range(2):
            accumulate(model, seed=step)
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            for r, q, p in zip(ref_model.parameters(), rounded_model.parameters(), model.parameters()):
                r.grad = p.grad.clone()
                q.grad = p.grad.to(torch.bfloat16)
            for o in (opt, ref, rounded):
                o.step()
                o.zero_grad()
            assert_same(params_and_state(opt), params_and_state(ref), f"{name} step {step}")
        results[name] = not all(same_bits(a, b) for a, b in
                                zip(params_and_state(opt), params_and_state(rounded)))
    assert results == {"adamw": True, "sgd": True}  # the float32 grads made a difference


@needs_grad_dtype
def test_memory_report_counts_float32_grads():
    model = bf16_model(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    opt = bf16opt.AdamW(model.parameters(), precision="bf16", offload="cpu")
    accumulate(model, micro_batches=1)
    opt.step()
    report = bf16opt.memory_report(opt)
    assert report.bytes["grads"] == 4 * n and report.dtypes["grads"] == {"fp32"}
    assert report.bytes["params"] == 2 * n
    assert report.staging["grad_staging"] == 4 * n  # staged in float32 too, never rounded


@needs_grad_dtype
def test_float32_grads_of_float32_params_only_match():
    """Other mismatched grad dtypes stay refused (bf16 grads of an fp32 param, fp32 grads of a
    float64 param)."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad_dtype = None
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt = bf16opt.AdamW([p])
    with pytest.raises(ValueError, match="or float32 for a bfloat16/float16 param"):
        opt.step()
    assert not opt.state


# ---------------------------------------------------------------- GradScaler
def fp16_run(backend="numba", offload=None, grad_dtype=None, init_scale=2.0 ** 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).half()
    for p in model.parameters():
        p.grad_dtype = grad_dtype
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="fp32", backend=backend, offload=offload)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return model, opt, scaler


def scaled_backward(model, scaler, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 16, generator=gen).half()
    scaler.scale(model(x).float().pow(2).mean()).backward()


def offload_records(opt) -> list:
    """The offload pipeline's bookkeeping and staging buffers (clones)."""
    records = getattr(opt, "_offloader_instance", None)
    if records is None:
        return []
    return [(r.grad_ref() if r.grad_ref else None, r.grad_stamp, r.grad_print, r.mirror_stamp,
             r.mirror_print, r.grad.clone(), r.mirror.clone()) for r in records._records.values()]


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_grad_scaler_step_with_inf_changes_nothing(offload):
    """fp16 params and grads: GradScaler.step hands the optimizer its scale and found_inf;
    with an inf the step changes nothing (params, state, step counters, offload staging) and
    the scale halves; the next step goes on as in a run without offload."""
    model, opt, scaler = fp16_run(offload=offload)
    plain_model, plain, plain_scaler = fp16_run(backend="reference")
    for step in range(3):
        for m, s in ((model, scaler), (plain_model, plain_scaler)):
            scaled_backward(m, s, step)
            if step == 1:
                m.weight.grad[0, 0] = float("inf")
        before, staged = snapshot(opt), offload_records(opt)
        scale = scaler.get_scale()
        for o, s in ((opt, scaler), (plain, plain_scaler)):
            s.step(o)
            s.update()
            o.zero_grad()
        if step == 1:
            assert_unchanged(opt, before)
            assert all(float(st["step"]) == 1 for st in opt.state.values())
            now = offload_records(opt)
            assert len(now) == len(staged) and all(
                a[:5] == b[:5] and same_bits(a[5], b[5]) and same_bits(a[6], b[6]) for a, b in zip(now, staged))
            assert scaler.get_scale() == scale / 2
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # GradScaler cleaned up
        assert_same(params_and_state(opt), params_and_state(plain), f"step {step}")
    assert all(float(st["step"]) == 2 for st in opt.state.values())


def test_a_grad_scaler_step_that_raised_can_be_retried():
    """GradScaler hands the scale over as attributes and removes them only after a step that
    returned: a step refusing a bad lr must not leave them, or the retry unscales twice."""
    model, opt, scaler = fp16_run()
    plain_model, plain, plain_scaler = fp16_run()
    for m, s in ((model, scaler), (plain_model, plain_scaler)):
        scaled_backward(m, s, 0)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="learning rate"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.param_groups[0]["lr"] = 1e-2
    for o, s in ((opt, scaler), (plain, plain_scaler)):
        s.step(o)
    assert_same(params_and_state(opt), params_and_state(plain))


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_grad_scaler_folds_the_unscale_into_the_kernels(offload):
    """A GradScaler run (scale 1000: its float32 reciprocal is inexact) equals the reference
    stepped by hand with ``grad_scale=``; the grads stay scaled (no unscaled copy)."""
    model, opt, scaler = fp16_run(offload=offload, init_scale=1000.0)
    ref_model, ref, _ = fp16_run(backend="reference")
    for step in range(2):
        scaled_backward(model, scaler, step)
        for r, p in zip(ref_model.parameters(), model.parameters()):
            r.grad = p.grad.clone()
        grads = [p.grad.clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        assert all(same_bits(g, p.grad) for g, p in zip(grads, model.parameters()))
        ref.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(0.0))
        assert_same(params_and_state(opt), params_and_state(ref), f"step {step}")
        opt.zero_grad()
        ref.zero_grad()


def test_folded_unscale_equals_unscale_then_step_for_power_of_two_scales():
    """bf16 params and grads, GradScaler's default power-of-two scales: folding the unscale
    into the kernels gives the bits of ``scaler.unscale_(opt)`` followed by a plain step."""
    runs = []
    for unscale_first in (False, True):
        model = bf16_model()
        opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16", backend="numba")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            scaler.scale(model(torch.randn(8, 16, generator=gen).bfloat16()).float().pow(2).mean()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(params_and_state(opt))
    assert_same(*runs)


@needs_grad_dtype
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_unscale_then_clip_with_float32_grads_of_fp16_params(offload):
    """fp16 params with float32 grads: ``scaler.unscale_`` (torch refuses fp16 grads) then
    clipping, then ``scaler.step``: the step uses the clipped grads (grad_scale None)."""
    model, opt, scaler = fp16_run(offload=offload, grad_dtype=torch.float32)
    ref_model, ref, _ = fp16_run(backend="reference", grad_dtype=torch.float32)
    for step in range(2):
        scaled_backward(model, scaler, step)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        for r, p in zip(ref_model.parameters(), model.parameters()):
            assert p.grad.dtype == torch.float32
            r.grad = p.grad.clone()
        scaler.step(opt)
        scaler.update()
        ref.step()
        assert_same(params_and_state(opt), params_and_state(ref), f"step {step}")
        opt.zero_grad()
        ref.zero_grad()
    # what torch itself refuses: unscale_ of fp16 grads (the folded path needs no unscale_)
    model, opt, scaler = fp16_run()
    scaled_backward(model, scaler, 0)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_grad_scaler_step_of_an_optimizer_without_grads_this_iteration(offload):
    """A second optimizer whose params got no grad (a frozen head): GradScaler hands it
    found_inf = sum([]), the int 0, as torch's fused AdamW takes it; the step changes nothing
    and GradScaler clears its attributes, so later steps work."""
    head, body = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt_head = bf16opt.AdamW(head.parameters(), lr=1e-2, offload=offload)
    opt_body = torch.optim.SGD(body.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in head.parameters()]
    scaler.scale(body(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt_body)
    scaler.step(opt_head)
    scaler.update()
    assert all(torch.equal(p.detach(), b) for p, b in zip(head.parameters(), before))
    assert not hasattr(opt_head, "found_inf") and not hasattr(opt_head, "grad_scale")
    head(torch.ones(2, 4)).sum().backward()
    opt_head.step()
    assert not any(torch.equal(p.detach(), b) for p, b in zip(head.parameters(), before))


def test_step_keywords_skip_and_scale():
    """``step(found_inf=...)`` non-zero (NaN too) skips; ``grad_scale`` folds as GradScaler's does."""
    model = bf16_model()
    opt = bf16opt.SGD(model.parameters(), lr=0.1, momentum=0.9, precision="fp32")
    accumulate(model, micro_batches=1)
    opt.step()
    for flag in (1.0, float("nan")):
        before = snapshot(opt)
        opt.step(found_inf=torch.tensor(flag), grad_scale=torch.tensor(4.0))
        assert_unchanged(opt, before)
    twin_model = bf16_model()
    twin = bf16opt.SGD(twin_model.parameters(), lr=0.1, momentum=0.9, precision="fp32")
    for p, q in zip(model.parameters(), twin_model.parameters()):
        q.grad = p.grad.clone()
    twin.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        q.grad = (p.grad.float() * 4).to(p.dtype)  # exact: a power of two
    opt.step()
    twin.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    assert_same(params_and_state(opt), params_and_state(twin))


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend, precision", [("numba", "bf16"), ("reference", "fp32")])
def test_compiled_step_equals_eager(backend, precision):
    """``torch.compile(opt.step)``, called 4 times (a graph break around the step; it used
    to crash on the second call), gives eager's bits."""
    runs = []
    for compiled in (False, True):
        import torch._dynamo
        torch._dynamo.reset()
        model = bf16_model()
        opt = bf16opt.AdamW(model.parameters(), precision=precision, backend=backend)
        step = torch.compile(opt.step) if compiled else opt.step
        for k in range(4):
            accumulate(model, micro_batches=1, seed=k)
            step()
            opt.zero_grad()
        runs.append(params_and_state(opt))
    assert_same(*runs)


def test_compiled_train_step_calls_step():
    """A compiled training step (forward, backward and ``opt.step()`` in one function)
    gives eager's bits.  (backend="eager": Dynamo's graph capture with eager kernels, so the
    forward/backward bits are eager's too and the comparison is exact.)"""
    runs = []
    for compiled in (False, True):
        import torch._dynamo
        torch._dynamo.reset()
        model = bf16_model()
        opt = bf16opt.AdamW(model.parameters(), precision="bf16-sr", backend="numba", seed=5)

        def train_step(x):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        run = torch.compile(train_step, backend="eager") if compiled else train_step
        gen = torch.Generator().manual_seed(0)
        losses = [run(torch.randn(8, 16, generator=gen).bfloat16()).detach() for _ in range(3)]
        runs.append(params_and_state(opt) + losses)
    assert_same(*runs)


# ---------------------------------------------------------------- the document's examples
def doc_examples() -> list:
    text = DOC.read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_doc_has_examples():
    assert len(doc_examples()) == 3  # GradScaler, float32 grads, torch.compile


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=needs_grad_dtype), 2])  # (1: float32 grads)
def test_doc_example_runs(index):
    import torch._dynamo
    torch._dynamo.reset()
    # as a script: torch.compile imports the module a function's globals name
    exec(compile(doc_examples()[index], f"{DOC.name} example {index}", "exec"), {"__name__": "__main__"})
