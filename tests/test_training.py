"""bf16opt inside real training loops: GradScaler, clipping, closures, per-group precision."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bf16opt
from snapshots import assert_unchanged, snapshot


def regression_problem(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    return model, x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["fp32", "bf16"])
def test_gradscaler_autocast_and_clipping(param_dtype, preset):
    model, x, y = regression_problem(param_dtype)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision=preset)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y.float())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_gradscaler_skips_the_step_on_inf_gradients():
    model, x, y = regression_problem()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16")
    scaler = torch.amp.GradScaler("cpu")
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = snapshot(opt)
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert_unchanged(opt, before)
    assert scaler.get_scale() < 2.0 ** 16


@pytest.mark.parametrize("opt_class", [bf16opt.Adam, bf16opt.AdamW, bf16opt.Lion])
def test_closure_is_evaluated_and_its_loss_returned(opt_class):
    model, x, y = regression_problem()
    opt = opt_class(model.parameters(), lr=1e-3)
    calls = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append(loss.item())
        return loss

    returned = opt.step(closure)
    assert calls and returned.item() == calls[0]


def test_precision_per_param_group():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    embedding, linear, norm = model
    opt = bf16opt.AdamW([
        {"params": linear.parameters()},
        {"params": list(embedding.parameters()) + list(norm.parameters()), "precision": "fp32"},
    ], precision="bf16")
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    opt.step()
    assert "master" not in opt.state[linear.weight]
    assert opt.state[linear.weight]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[embedding.weight]["master"].dtype == torch.float32
    assert opt.state[norm.weight]["exp_avg_sq"].dtype == torch.float32


def test_optimizer_deepcopies():
    model, x, y = regression_problem(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision="bf16-states")
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    clone = copy.deepcopy(opt)
    assert clone.param_groups[0]["precision"] == opt.param_groups[0]["precision"]
    assert len(clone.state) == len(opt.state)


# DDP, FSDP2, DCP and ZeroRedundancyOptimizer: tests/test_distributed.py (one spawned process group)
