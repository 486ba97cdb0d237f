"""memory_report equals the storage table of the README and the live tensors' nbytes, for every preset."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import bf16opt

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BUFFERS = ("master", "exp_avg", "exp_avg_sq", "compensation", "remainder")

# (preset, param dtype) -> optimizer bytes per param for BUFFERS: the README's presets table
# for bf16 params, plus what the precision rules give fp32 and fp16 params (an fp32 param is
# its own master, so "remainder" and "kahan" add nothing; fp16 params get an fp32 master copy
# under "fp32-remainder", and a Kahan buffer for their fp16 master under "bf16-kahan").
TABLE = {
    ("fp32", torch.bfloat16): (4, 4, 4, 0, 0),
    ("fp32", torch.float16): (4, 4, 4, 0, 0),
    ("fp32", torch.float32): (0, 4, 4, 0, 0),
    ("fp32-remainder", torch.bfloat16): (0, 4, 4, 0, 2),
    ("fp32-remainder", torch.float16): (4, 4, 4, 0, 0),
    ("fp32-remainder", torch.float32): (0, 4, 4, 0, 0),
    ("fp32-remainder-bf16-states", torch.bfloat16): (0, 2, 2, 0, 2),
    ("fp32-remainder-bf16-states", torch.float16): (4, 2, 2, 0, 0),
    ("fp32-remainder-bf16-states", torch.float32): (0, 2, 2, 0, 0),
    ("bf16-states", torch.bfloat16): (4, 2, 2, 0, 0),
    ("bf16-states", torch.float16): (4, 2, 2, 0, 0),
    ("bf16-states", torch.float32): (0, 2, 2, 0, 0),
    ("bf16-master", torch.bfloat16): (0, 4, 4, 0, 0),
    ("bf16-master", torch.float16): (0, 4, 4, 0, 0),
    ("bf16-master", torch.float32): (0, 4, 4, 0, 0),
    ("bf16", torch.bfloat16): (0, 2, 2, 0, 0),
    ("bf16", torch.float16): (0, 2, 2, 0, 0),
    ("bf16", torch.float32): (0, 2, 2, 0, 0),
    ("bf16-kahan", torch.bfloat16): (0, 2, 2, 2, 0),
    ("bf16-kahan", torch.float16): (0, 2, 2, 2, 0),
    ("bf16-kahan", torch.float32): (0, 2, 2, 0, 0),
    ("bf16-sr", torch.bfloat16): (0, 2, 2, 0, 0),
    ("bf16-sr", torch.float16): (0, 2, 2, 0, 0),
    ("bf16-sr", torch.float32): (0, 2, 2, 0, 0),
    # the q8 presets on this table's small params (under q8_min_numel): their small_moments
    ("fp32-remainder-q8", torch.bfloat16): (0, 4, 4, 0, 2),
    ("fp32-remainder-q8", torch.float16): (4, 4, 4, 0, 0),
    ("fp32-remainder-q8", torch.float32): (0, 4, 4, 0, 0),
    ("bf16-sr-q8", torch.bfloat16): (0, 2, 2, 0, 0),
    ("bf16-sr-q8", torch.float16): (0, 2, 2, 0, 0),
    ("bf16-sr-q8", torch.float32): (0, 2, 2, 0, 0),
}
# q8 moments of large params: 256 code bytes and a 4-byte scale per block of 256 elements
Q8_BYTES = 260 / 256
Q8_PRESETS = ("fp32-remainder-q8", "bf16-sr-q8")
# The README's "optimizer B/param (Adam)" column (bf16 params, without amsgrad).
README_ADAM_BYTES = {"fp32": 12, "fp32-remainder": 10, "fp32-remainder-bf16-states": 6, "bf16-states": 8,
                     "bf16-master": 8, "bf16": 4, "bf16-kahan": 6, "bf16-sr": 4,
                     "fp32-remainder-q8": 4.03, "bf16-sr-q8": 2.03}  # (q8: for params of 4096+ elements)
# optimizer, amsgrad: Lion has no exp_avg_sq, amsgrad adds one exp_avg_sq-sized buffer; SGD's
# momentum buffer is stored like exp_avg
CONFIGS = [("AdamW", False), ("AdamW", True), ("Lion", False), ("SGD", False)]
CASES = [(preset, dtype) for preset in bf16opt.PRESETS for dtype in DTYPES]


def case_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def stepped(opt_class, preset, dtype, wide: bool = False, **kwargs):
    """One step of a small model.  On the reference backend: what a step allocates is the
    optimizer's, the same for every backend (test_lifecycle's state machines compare the
    reference's optimizer and numba's, state included), and numba would compile a kernel per
    case for nothing."""
    if wide:  # params of 4096+ elements, whole blocks of 256: q8 moments
        model = torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False), torch.nn.Linear(32, 256, bias=False))
        model = model.to(dtype)
        x = torch.randn(5, 256, dtype=dtype)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3)).to(dtype)
        x = torch.randn(5, 13, dtype=dtype)
    opt = opt_class(model.parameters(), precision=preset, backend="reference", **kwargs)
    model(x).float().sum().backward()
    opt.step()
    return model, opt


def expected_buffers(preset, dtype, opt_name, amsgrad) -> dict:
    """Bytes per param of each optimizer buffer (and amsgrad's max_exp_avg_sq) from TABLE."""
    expected = dict(zip(BUFFERS, TABLE[preset, dtype]))
    exp_avg_sq = expected.pop("exp_avg_sq")
    if opt_name == "SGD":
        expected["momentum_buffer"] = expected.pop("exp_avg")
    elif opt_name != "Lion":
        expected["exp_avg_sq"] = exp_avg_sq
        expected["max_exp_avg_sq"] = exp_avg_sq if amsgrad else 0
    return expected


def kwargs_of(opt_name, amsgrad) -> dict:
    return {"Lion": {}, "SGD": dict(momentum=0.9)}.get(opt_name, dict(amsgrad=amsgrad))


def test_table_covers_every_preset_and_agrees_with_the_readme():
    """TABLE and README_ADAM_BYTES list every preset; the README's table says the same numbers."""
    assert set(TABLE) == {(preset, dtype) for preset in bf16opt.PRESETS for dtype in DTYPES}
    rows = re.findall(r'^\| `"([\w-]+)"`.*\| ([\d.]+) \|$', (ROOT / "README.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert {preset: float(nbytes) for preset, nbytes in rows} == README_ADAM_BYTES
    for preset, nbytes in README_ADAM_BYTES.items():
        if preset not in Q8_PRESETS:
            assert sum(TABLE[preset, torch.bfloat16]) == nbytes, preset


@pytest.mark.parametrize("opt_name,amsgrad", CONFIGS)
@pytest.mark.parametrize("preset,dtype", CASES, ids=case_id)
def test_memory_report_matches_storage_table(preset, dtype, opt_name, amsgrad):
    """Every buffer's bytes per param, and nothing else but an 8-byte (float64) `step` per tensor."""
    kwargs = kwargs_of(opt_name, amsgrad)
    model, opt = stepped(getattr(bf16opt, opt_name), preset, dtype, **kwargs)
    report = bf16opt.memory_report(opt)
    per_param = report.bytes_per_param
    size = torch.tensor([], dtype=dtype).element_size()
    assert report.num_params == sum(p.numel() for p in model.parameters())
    assert per_param["params"] == size and per_param["grads"] == size
    expected = expected_buffers(preset, dtype, opt_name, amsgrad)
    assert {name: per_param[name] for name in expected} == expected
    # the report lists exactly the algorithm's buffers (and torch's step scalars)
    assert set(report.bytes) - {"params", "grads", "step"} == set(expected)
    others = {name: nbytes for name, nbytes in report.bytes.items()
              if name not in expected and name not in ("params", "grads") and nbytes}
    assert others == {"step": 8 * len(list(model.parameters()))}  # float64 step counters


@pytest.mark.parametrize("opt_name,amsgrad", CONFIGS)
@pytest.mark.parametrize("preset", list(bf16opt.PRESETS))
def test_bf16_optimizer_bytes_match_the_readme_table(preset, opt_name, amsgrad):
    """Optimizer bytes per bf16 param: the README's Adam column, minus exp_avg_sq for Lion and
    SGD, plus one exp_avg_sq for amsgrad (per-tensor `step` scalars aside)."""
    kwargs = kwargs_of(opt_name, amsgrad)
    q8 = preset in Q8_PRESETS  # (its README figure is for params of 4096+ elements: a wide model)
    model, opt = stepped(getattr(bf16opt, opt_name), preset, torch.bfloat16, wide=q8, **kwargs)
    report = bf16opt.memory_report(opt)
    exp_avg_sq = Q8_BYTES if q8 else bf16opt.PRESETS[preset].exp_avg_sq.itemsize
    expected = (2 * Q8_BYTES + (2 if preset == "fp32-remainder-q8" else 0)) if q8 else README_ADAM_BYTES[preset]
    assert round(expected, 2) == README_ADAM_BYTES[preset]
    expected = expected - (exp_avg_sq if opt_name in ("Lion", "SGD") else 0)
    expected += exp_avg_sq if amsgrad else 0
    steps = 8 * len(list(model.parameters()))  # float64 step counters
    assert (report.optimizer_bytes - steps) / report.num_params == expected


@pytest.mark.parametrize("opt_name,amsgrad", CONFIGS)
@pytest.mark.parametrize("preset,dtype", CASES, ids=case_id)
def test_total_is_the_sum_of_live_tensors(preset, dtype, opt_name, amsgrad):
    kwargs = kwargs_of(opt_name, amsgrad)
    model, opt = stepped(getattr(bf16opt, opt_name), preset, dtype, **kwargs)
    live = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    live += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    report = bf16opt.memory_report(opt)
    assert report.total == sum(t.numel() * t.element_size() for t in live)
    assert report.optimizer_bytes == report.total - report.bytes["params"] - report.bytes["grads"]
    text = str(report)
    for component in ("params", "grads", "master", *expected_buffers(preset, dtype, opt_name, amsgrad),
                      "Total"):
        assert component in text


def test_sgd_without_momentum_keeps_no_buffer():
    """As torch.optim.SGD: no momentum, no momentum buffer (only the master policy's buffer)."""
    model, opt = stepped(bf16opt.SGD, "fp32", torch.bfloat16)
    report = bf16opt.memory_report(opt)
    assert report.bytes["momentum_buffer"] == 0
    assert report.bytes_per_param["master"] == 4
    assert all("momentum_buffer" not in state for state in opt.state.values())


def test_report_before_first_step_counts_only_params():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    report = bf16opt.memory_report(bf16opt.AdamW(model.parameters(), precision="fp32"))
    assert report.total == 2 * 20 and report.optimizer_bytes == 0
