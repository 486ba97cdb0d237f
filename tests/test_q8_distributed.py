"""q8 moments of FSDP2 params (two CPU ranks, gloo): each rank quantizes its shard in blocks
that start at the shard's first element.  Where every shard boundary is a multiple of 256
elements the blocks are the unsharded param's and the run equals one process bit for bit; where
a boundary cuts a block, each rank's part of that block is a block of its own (with its own
scale): the run equals one process updating each shard as a param of its own
(docs/numerics.md, "Distributed: q8")."""

from __future__ import annotations

import functools

import torch
from torch import nn

import bf16opt
from bf16opt.storage import Q8, Q8_BLOCK
from gloo_ranks import needs_gloo, run_on_ranks


# dim 0 cut in two: 12 rows of 256 (boundary 3072 = 12 blocks: aligned), 41 rows of 100
# (boundary 4100: inside block 16)
SHAPES = {"aligned": (24, 256), "cut": (82, 100)}


def _bits(t):
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _model():
    torch.manual_seed(0)
    return nn.ParameterDict({name: nn.Parameter(torch.randn(shape) * 0.1) for name, shape in SHAPES.items()}) \
        .to(torch.bfloat16)


def _grads(step: int) -> dict:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: (torch.randn(shape, generator=generator) * 0.01).to(torch.bfloat16)
            for name, shape in SHAPES.items()}


def _check(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world,))
    single, sharded = _model(), fully_shard(_model(), mesh=mesh)
    kwargs = dict(lr=1e-2, precision="fp32-remainder-q8", backend="numba")
    opt_single = bf16opt.AdamW(single.parameters(), **kwargs)
    opt_sharded = bf16opt.AdamW(sharded.parameters(), **kwargs)
    # each rank's shards as params of their own, in one process
    own = {name: nn.Parameter(q.to_local().detach().clone()) for name, q in sharded.items()}
    # (a shard below q8_min_numel is still q8: the threshold counts the whole param's elements)
    whole_size = bf16opt.Precision(**{**bf16opt.PRESETS["fp32-remainder-q8"].to_dict(), "q8_min_numel": 0})
    opt_own = bf16opt.AdamW(own.values(), **{**kwargs, "precision": whole_size})
    for step in range(3):
        grads = _grads(step)
        for name in SHAPES:
            single[name].grad = grads[name]
            q = sharded[name]
            rows = q.to_local().shape[0]
            first = rank * ((SHAPES[name][0] + world - 1) // world)
            local_grad = grads[name][first:first + rows]
            q.grad = torch.distributed.tensor.DTensor.from_local(local_grad, mesh, q.placements, run_check=False,
                                                                 shape=q.shape, stride=q.stride())
            own[name].grad = local_grad.clone()
        for opt in (opt_single, opt_sharded, opt_own):
            opt.step()
    failures = []
    for name in SHAPES:
        q = sharded[name]
        local = q.to_local()
        rows = local.shape[0]
        first_row = rank * ((SHAPES[name][0] + world - 1) // world)
        offset = first_row * SHAPES[name][1]
        state = opt_sharded.state[q]
        if not torch.equal(_bits(local), _bits(own[name])):
            failures.append(f"{name}: param differs from its shard updated as a param of its own")
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype != Q8 or not torch.equal(state[key], opt_own.state[own[name]][key]):
                failures.append(f"{name}: {key} differs from its shard's own")
        if name == "aligned":
            assert offset % Q8_BLOCK == 0
            whole = single[name][first_row:first_row + rows]
            if not torch.equal(_bits(local), _bits(whole)):
                failures.append("aligned: param differs from the unsharded run")
            for key in ("exp_avg", "exp_avg_sq"):
                blocks = opt_single.state[single[name]][key][offset // Q8_BLOCK:][:state[key].shape[0]]
                if not torch.equal(state[key], blocks):
                    failures.append(f"aligned: {key} differs from the unsharded run's blocks")
        elif offset % Q8_BLOCK == 0 and rank == 1:
            failures.append("cut: the boundary was meant to cut a block")
    # a rank's state dict saves its own q8 tensors and loads back bit-identically
    saved = opt_sharded.state_dict()
    failures += _loaded_moments_differ(saved, sharded, kwargs, opt_sharded, "state dict round trip")
    # (a q8 moment is saved as its rank's row of a rank table, test_q8_dcp.py; a state dict
    # holding the rank's plain q8 tensors, as bf16opt saved them before, loads too)
    param_of = dict(zip(saved["param_groups"][0]["params"], sharded.parameters()))
    plain = {**saved, "state": {index: {**state, **{key: opt_sharded.state[param_of[index]][key]
                                                    for key in ("exp_avg", "exp_avg_sq")}}
                                for index, state in saved["state"].items()}}
    failures += _loaded_moments_differ(plain, sharded, kwargs, opt_sharded, "plain q8 tensors in a state dict")
    return failures


def _loaded_moments_differ(state_dict: dict, model, kwargs: dict, expected, what: str) -> list:
    """``state_dict`` loaded by a fresh optimizer of ``model``'s params: the q8 moments that
    differ from ``expected``'s."""
    loaded = bf16opt.AdamW(model.parameters(), **kwargs)
    loaded.load_state_dict(state_dict)
    return [f"{what}: {key}" for q in model.parameters() for key in ("exp_avg", "exp_avg_sq")
            if not torch.equal(loaded.state[q][key], expected.state[q][key])]


@needs_gloo
def test_fsdp2_q8_blocks_are_blocks_of_each_shard():
    assert run_on_ranks({"shards": functools.partial(_check, world=2)}) == {0: {"shards": []}, 1: {"shards": []}}
