"""memory_report equals the storage table of the README and the live tensors' nbytes."""

from __future__ import annotations

import pytest
import torch

import bf16opt

# (preset, param dtype) -> optimizer bytes per param for (master, exp_avg, exp_avg_sq):
# the README's presets table, plus what the precision rules give fp32 and fp16 params.
TABLE = {
    ("fp32", torch.bfloat16): (4, 4, 4),
    ("bf16-states", torch.bfloat16): (4, 2, 2),
    ("bf16-master", torch.bfloat16): (0, 4, 4),
    ("bf16", torch.bfloat16): (0, 2, 2),
    ("fp32", torch.float16): (4, 4, 4),
    ("bf16-states", torch.float16): (4, 2, 2),
    ("bf16-master", torch.float16): (0, 4, 4),
    ("bf16", torch.float16): (0, 2, 2),
    ("fp32", torch.float32): (0, 4, 4),
    ("bf16-states", torch.float32): (0, 2, 2),
    ("bf16-master", torch.float32): (0, 4, 4),
    ("bf16", torch.float32): (0, 2, 2),
}


def stepped(opt_class, preset, dtype, **kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3)).to(dtype)
    opt = opt_class(model.parameters(), precision=preset, **kwargs)
    model(torch.randn(5, 13, dtype=dtype)).float().sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("preset,dtype", sorted(TABLE, key=str))
def test_adam_memory_report_matches_storage_table(preset, dtype):
    model, opt = stepped(bf16opt.AdamW, preset, dtype)
    report = bf16opt.memory_report(opt)
    per_param = report.bytes_per_param
    master, exp_avg, exp_avg_sq = TABLE[preset, dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    assert report.num_params == sum(p.numel() for p in model.parameters())
    assert per_param["params"] == size and per_param["grads"] == size
    assert (per_param["master"], per_param["exp_avg"], per_param["exp_avg_sq"]) == (master, exp_avg, exp_avg_sq)
    assert per_param["max_exp_avg_sq"] == 0 and per_param["compensation"] == 0


@pytest.mark.parametrize("preset,dtype", sorted(TABLE, key=str))
def test_lion_and_amsgrad_buffers_are_counted(preset, dtype):
    master, exp_avg, exp_avg_sq = TABLE[preset, dtype]
    _, lion = stepped(bf16opt.Lion, preset, dtype)
    per_param = bf16opt.memory_report(lion).bytes_per_param
    assert (per_param["master"], per_param["exp_avg"], per_param["exp_avg_sq"]) == (master, exp_avg, 0)
    _, adam = stepped(bf16opt.Adam, preset, dtype, amsgrad=True)
    assert bf16opt.memory_report(adam).bytes_per_param["max_exp_avg_sq"] == exp_avg_sq


@pytest.mark.parametrize("preset", ["fp32", "bf16", "bf16-master", "bf16-states"])
def test_total_is_the_sum_of_live_tensors(preset):
    model, opt = stepped(bf16opt.AdamW, preset, torch.bfloat16, amsgrad=True)
    live = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    live += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    report = bf16opt.memory_report(opt)
    assert report.total == sum(t.numel() * t.element_size() for t in live)
    assert report.optimizer_bytes == report.total - report.bytes["params"] - report.bytes["grads"]
    text = str(report)
    for component in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "Total"):
        assert component in text


def test_report_before_first_step_counts_only_params():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    report = bf16opt.memory_report(bf16opt.AdamW(model.parameters(), precision="fp32"))
    assert report.total == 2 * 20 and report.optimizer_bytes == 0
