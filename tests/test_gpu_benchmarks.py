"""The GPU benchmarks' logic, checked without a GPU: benchmarks/gpu_step.py's options, its clear
refusal without CUDA, its --dry-run (the same code on the CPU with no-op launches) and the
files it writes; benchmarks/gpu_run.sh parses.  (Figures at this size mean nothing.)"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
GPU_STEP = BENCHMARKS / "gpu_step.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_STEP), *args], capture_output=True, text=True, timeout=600)


def gpu_step_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_step  # noqa: PLC0415
    finally:
        sys.path.remove(str(BENCHMARKS))
    return gpu_step


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_step_module().parse(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--log2-params", "--shapes", "--rows", "--repeats", "--warmup", "--no-track", "--out",
                   "--dry-run"):
        assert option in out
    assert "GPT-2 small" in out and "torch.optim.AdamW(fused=True)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_fails_clearly():
    done = run("--log2-params", "10")
    assert done.returncode == 2 and done.stdout == ""
    assert "needs a CUDA device" in done.stderr and "--dry-run" in done.stderr


@pytest.mark.parametrize("args, message", [
    (("--shapes", "one,huge"), "--shapes: unknown ['huge']"),
    (("--log2-params", "40"), "--log2-params must be in [6, 32]"),
    (("--repeats", "0"), "--repeats must be >= 1"),
])
def test_bad_options_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_step_module().parse(["--dry-run", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_gpt2_small_shapes():
    gpu_step = gpu_step_module()
    shapes = gpu_step.gpt2_small_shapes()
    assert len(shapes) == 148 and sum(math.prod(s) for s in shapes) == 124_439_808
    assert gpu_step.shapes_for("one-gpt2", 27) == [(124_439_808,)]
    assert gpu_step.shapes_for("64", 27) == [(1 << 21,)] * 64


def test_dry_run_writes_every_row_and_its_ratios(tmp_path):
    done = run("--dry-run", "--log2-params", "10", "--shapes", "one,64,gpt2,one-gpt2", "--rows",
               "Lion,SGD", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "gpu_step.json").read_text(encoding="utf-8"))
    assert figures["dry_run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_step.json", "gpu_step.md"]
    results = {(r["row"], r["shape"]): r for r in figures["results"]}
    rows = ["Lion bf16-sr", "SGD momentum bf16-kahan"]
    assert set(results) == {(row, shape) for row in rows for shape in ("one", "64", "gpt2", "one-gpt2")}
    for (row, shape), r in results.items():
        assert r["tensors"] == {"one": 1, "64": 64, "gpt2": 148, "one-gpt2": 1}[shape]
        assert r["limit_ms"] > 0 and r["bf16opt_ms"] > 0 and r["tracked_ms"] > 0
        assert r["of_limit"] == pytest.approx(r["limit_ms"] / r["bf16opt_ms"])
        assert r["tracked_vs_untracked"] == pytest.approx(r["tracked_ms"] / r["bf16opt_ms"])
        if row.startswith("Lion"):  # torch has no Lion
            assert r["torch_fused_ms"] is None and r["vs_torch"] is None
        else:
            assert r["vs_torch"] == pytest.approx(r["bf16opt_ms"] / r["torch_fused_ms"])
            assert r["torch_same_storage"] is False  # bf16-kahan keeps a buffer torch has not
        one = {"64": "one", "gpt2": "one-gpt2"}.get(shape)
        if one:
            assert r["vs_one_tensor"] == pytest.approx(r["bf16opt_ms"] / results[(row, one)]["bf16opt_ms"])
            assert r["params"] == results[(row, one)]["params"]
        else:
            assert r["vs_one_tensor"] is None
    table = (tmp_path / "gpu_step.md").read_text(encoding="utf-8")
    assert table.count("\n| ") == 1 + len(results) and "x torch" in table and "dry-run" in table


def test_limit_arrays_follow_the_state():
    """The limit kernel moves what the step moves: grad, param and each per-element state
    buffer, in their dtypes (an int16 remainder, fp32 moments), over all params' elements."""
    gpu_step = gpu_step_module()
    params = [torch.zeros(16, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)]
    state = {"step": torch.tensor(1.0), "remainder": torch.zeros(16, dtype=torch.int16),
             "exp_avg": torch.zeros(16), "exp_avg_sq": torch.zeros(16)}
    arrays = gpu_step.limit_arrays(params, state)
    assert [a.dtype for a in arrays] == [torch.bfloat16, torch.bfloat16, torch.int16,
                                         torch.float32, torch.float32]
    assert {a.numel() for a in arrays} == {24}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_run_script_parses():
    done = subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_run.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
