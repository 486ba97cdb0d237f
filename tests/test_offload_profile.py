"""The offload pipeline on the profiler timeline (bf16opt/offload.py's ``PHASES``,
bf16opt/offload_copies.py's ``phase``), and benchmarks/offload_model.py.

A profiled offloaded step must record every named range, change no bit, and call NVTX only for
CUDA params (checked here with a recording stand-in for ``torch.cuda.nvtx``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bf16opt
from bf16opt.offload import PHASES, use_copy_engine
from bf16opt.offload_copies import ThreadedCopyEngine, phase

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def all_threads_config():
    """A profiler config that records every thread (the copy engine's workers too), where torch
    has one."""
    try:
        from torch._C._profiler import _ExperimentalConfig  # noqa: PLC0415
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(3)]).to(torch.bfloat16)


def iteration(net, opt, x, edit=False):
    net(x).float().pow(2).mean().backward()
    if edit:  # a param changed on its device: its mirror is read back (mirror_read)
        with torch.no_grad():
            net[0].weight.mul_(0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)


def offloaded(net, chunk=256):
    opt = bf16opt.AdamW(net.parameters(), lr=1e-2, precision="bf16", offload="cpu")
    engine = ThreadedCopyEngine(bandwidth=1e9, jitter=1e-4)
    use_copy_engine(opt, engine)
    opt._offloader.chunk_elements = chunk
    return opt, engine


THREADS_REASON = "this torch's profiler records no other thread (profile_all_threads: torch >= 2.7)"


@pytest.mark.skipif(all_threads_config() is None, reason=THREADS_REASON)
def test_a_profiled_offloaded_step_records_every_phase_and_changes_no_bit():
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    nets = [model(), model()]
    opts = [offloaded(net) for net in nets]
    reference = model()
    ref_opt = bf16opt.AdamW(reference.parameters(), lr=1e-2, precision="bf16")
    for net, (opt, _) in zip(nets + [reference], opts + [(ref_opt, None)]):
        iteration(net, opt, x)
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], experimental_config=all_threads_config()) as prof:
        iteration(nets[0], opts[0][0], x, edit=True)
    iteration(nets[1], opts[1][0], x, edit=True)
    iteration(reference, ref_opt, x, edit=True)
    names = {event.name for event in prof.events()}
    missing = set(PHASES.values()) - names
    assert not missing, sorted(missing)
    assert {"bf16opt.copy.d2h", "bf16opt.copy.h2d"} <= names, sorted(n for n in names if "bf16opt" in n)
    turns = sum(event.name == PHASES["chunk"] for event in prof.events())
    assert 1 <= turns <= 3 * (32 * 32 // 256)  # the driving thread's turns: at most one per chunk
    for net in nets[1:] + [reference]:
        for a, b in zip(nets[0].parameters(), net.parameters()):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for opt, engine in opts:
        engine.close()


def test_no_profiler_no_range_and_nvtx_only_for_cuda_params(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    assert phase("a") is phase("b")  # one shared do-nothing object when nothing records
    with phase("outer", True):
        with phase("inner", True):
            pass
    assert calls == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]
    calls.clear()
    net = model()
    opt, engine = offloaded(net)
    iteration(net, opt, torch.randn(8, 32, dtype=torch.bfloat16))
    engine.close()
    assert calls == []  # CPU params: no NVTX


def test_a_phase_closes_its_range_when_the_body_raises():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(KeyError):
            with phase("bf16opt.test.raises"):
                raise KeyError("x")
    assert any(event.name == "bf16opt.test.raises" for event in prof.events())


@pytest.mark.skipif(all_threads_config() is None, reason=THREADS_REASON)
def test_offload_model_benchmark_help_and_a_tiny_run(tmp_path):
    """benchmarks/offload_model.py: --help, then a tiny CPU run printing every row, the
    pipeline's breakdown and the thread sweep, and writing a trace with the named ranges
    (figures mean nothing here)."""
    script = str(BENCHMARKS / "offload_model.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--trace" in shown.stdout and "--presets" in shown.stdout, shown.stderr
    trace = tmp_path / "trace.json"
    result = subprocess.run([sys.executable, script, "--device", "cpu", "--layers", "2", "--dim", "64",
                             "--presets", "bf16,fp32", "--repeats", "1", "--warmup", "1", "--profile-steps", "1",
                             "--chunk", "2048", "--threads", "1", "--thread-sweep",
                             "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for preset in ("bf16", "fp32"):
        assert any(line.startswith(f"{preset}, offload=cpu") for line in lines), result.stdout
        assert any(line.startswith(f"{preset}, state on the device") for line in lines), result.stdout
        assert any(line.split()[:1] == [preset] and "|" in line for line in lines), result.stdout
    assert any(line.startswith("forward+backward alone") for line in lines), result.stdout
    sweep = lines.index(next(line for line in lines if line.startswith("host threads, bf16")))
    assert len(lines) >= sweep + 3 and lines[sweep + 2].split()[0].isdigit(), result.stdout
    text = trace.read_text(encoding="utf-8")
    assert PHASES["host_update"] in text and PHASES["chunk"] in text
