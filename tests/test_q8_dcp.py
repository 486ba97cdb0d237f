"""torch.distributed.checkpoint (DCP) of q8 moments: save, take more steps, load into a fresh
model and optimizer, take the same steps -- bit for bit.  Two CPU ranks (gloo) under FSDP2,
on the two shapes of tests/test_q8_distributed.py (a shard boundary on a block boundary and
one inside a block), and one process without a process group (docs/numerics.md,
"Distributed: q8")."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import bf16opt
from bf16opt.storage import Q8

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this torch build")

# dim 0 cut in two: 12 rows of 256 (boundary 3072 = 12 blocks: aligned), 41 rows of 100
# (boundary 4100: inside block 16); both >= q8_min_numel, so both moments are q8
SHAPES = {"aligned": (24, 256), "cut": (82, 100)}
PRESETS = ("fp32-remainder-q8", "bf16-sr-q8")


def _bits(t):
    t = t.detach()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _model(seed: int):
    torch.manual_seed(seed)
    return nn.ParameterDict({name: nn.Parameter(torch.randn(shape) * 0.1) for name, shape in SHAPES.items()}) \
        .to(torch.bfloat16)


def _grads(step: int) -> dict:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: (torch.randn(shape, generator=generator) * 0.01).to(torch.bfloat16)
            for name, shape in SHAPES.items()}


def _train(model, opt, first: int, steps: int) -> None:
    """Steps ``first`` .. ``first + steps - 1`` with fixed grads (each rank its rows of them)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    for step in range(first, first + steps):
        for name, grad in _grads(step).items():
            param = model[name]
            if isinstance(param, DTensor):
                rows = param.to_local().shape[0]
                start = dist.get_rank() * ((grad.shape[0] + dist.get_world_size() - 1) // dist.get_world_size())
                param.grad = DTensor.from_local(grad[start:start + rows], param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())
            else:
                param.grad = grad
        opt.step()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _differences(model, opt, restored, restored_opt) -> list:
    """What of params and state differs between two runs (bit for bit)."""
    wrong = []
    for name in SHAPES:
        p, q = model[name], restored[name]
        if not torch.equal(_bits(_local(p)), _bits(_local(q))):
            wrong.append(f"{name}: param")
        state, other = opt.state[p], restored_opt.state[q]
        if set(state) != set(other):
            wrong.append(f"{name}: state keys {sorted(state)} vs {sorted(other)}")
            continue
        for key, value in state.items():
            if key in ("exp_avg", "exp_avg_sq") and value.dtype != Q8:
                wrong.append(f"{name}: {key} is not q8")
            if not torch.equal(_bits(_local(value)), _bits(_local(other[key]))):
                wrong.append(f"{name}: {key}")
    return wrong


def _round_trip(preset: str, path: str, build) -> list:
    """DCP save after two steps, two more steps; a fresh run (other initial weights) loads the
    checkpoint and takes the same two steps: what differs."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

    model = build(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=preset, backend="numba", seed=3)
    _train(model, opt, 0, 2)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train(model, opt, 2, 2)
    restored = build(1)
    restored_opt = bf16opt.AdamW(restored.named_parameters(), lr=1e-2, precision=preset, backend="numba", seed=5)
    model_sd, optim_sd = get_state_dict(restored, restored_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(restored, restored_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(restored, restored_opt, 2, 2)
    return _differences(model, opt, restored, restored_opt)


# ------------------------------------------------------------------- two ranks
def _fsdp2_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    return fully_shard(_model(seed), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def _check_fsdp2(rank: int, path: str) -> list:
    failures = []
    for preset in PRESETS:
        try:
            failures += [f"{preset}: {what}" for what in _round_trip(preset, os.path.join(path, preset), _fsdp2_model)]
        except Exception as error:  # noqa: BLE001  (reported per preset)
            failures.append(f"{preset}: {type(error).__name__}: {error}")
    return failures


def _worker(rank: int, world: int, port: int, path: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = _check_fsdp2(rank, path)
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_fsdp2_q8_dcp_round_trip_continues_bit_for_bit(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    results = mp.Manager().dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as path:
        mp.spawn(_worker, args=(2, port, path, results), nprocs=2, join=True)
    assert dict(results) == {0: [], 1: []}


# ------------------------------------------------------------------- one process
@pytest.mark.parametrize("preset", PRESETS)
def test_q8_dcp_round_trip_without_a_process_group(preset, tmp_path):
    assert not (dist.is_available() and dist.is_initialized())
    assert _round_trip(preset, str(tmp_path / "ckpt"), _model) == []
