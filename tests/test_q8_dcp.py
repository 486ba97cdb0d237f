"""torch.distributed.checkpoint (DCP) of q8 moments: save, take more steps, load into a fresh
model and optimizer, take the same steps -- bit for bit.  Two CPU ranks (gloo) under FSDP2,
on the two shapes of tests/test_q8_distributed.py (a shard boundary on a block boundary and
one inside a block), and one process without a process group (docs/numerics.md,
"Distributed: q8")."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist
from torch import nn

import bf16opt
from bf16opt.distributed import shard_of
from bf16opt.q8_sharded import is_rank_table, whole_moment
from bf16opt.storage import Q8, q8_decode, q8_encode
from gloo_ranks import needs_gloo, run_on_ranks


# dim 0 cut in two: 12 rows of 256 (boundary 3072 = 12 blocks: aligned), 41 rows of 100
# (boundary 4100: inside block 16), one row (rank 1's shard is empty); all >= q8_min_numel,
# so every moment is q8
SHAPES = {"aligned": (24, 256), "cut": (82, 100), "empty": (1, 4096)}
PRESETS = ("fp32-remainder-q8", "bf16-sr-q8")


def _bits(t):
    t = t.detach()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _model(seed: int):
    torch.manual_seed(seed)
    params = {name: nn.Parameter(torch.randn(shape) * 0.1) for name, shape in SHAPES.items()}
    return nn.ParameterDict(params).to(torch.bfloat16)


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
                rows, world = param.to_local().shape[0], dist.get_world_size()
                start = dist.get_rank() * ((grad.shape[0] + world - 1) // world)
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
    restored_opt = bf16opt.AdamW(restored.named_parameters(), lr=1e-2, precision=preset, backend="numba",
                                 seed=5)
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
    """Sharded DCP checkpoints resume bit for bit, and every q8 moment is saved as a DTensor
    (a rank table: one row per shard), so DCP writes each rank's blocks."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    failures = []
    for preset in PRESETS:
        try:
            differences = _round_trip(preset, os.path.join(path, preset), _fsdp2_model)
            failures += [f"{preset}: {what}" for what in differences]
        except Exception as error:  # noqa: BLE001  (reported per preset)
            failures.append(f"{preset}: {type(error).__name__}: {error}")
    model = _fsdp2_model(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=PRESETS[0], backend="numba")
    _train(model, opt, 0, 1)
    for name, state in get_optimizer_state_dict(model, opt)["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            table = state[key]
            if not isinstance(table, DTensor) or table.dtype != Q8 or table.shape[0] != 2 \
                    or not torch.equal(table.to_local()[0, 1:1 + opt.state[model[name]][key].shape[0]],
                                       opt.state[model[name]][key]):
                failures.append(f"{name}: {key} is not saved as a rank table of this rank's blocks")
    return failures


def _check_other_sharding(rank: int, path: str) -> list:
    """A checkpoint loaded into the same params sharded on dim 1 (their tables have the same
    shape, so DCP reads them): a ValueError naming both shards, the optimizer unchanged."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,  # noqa: PLC0415
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    model = _fsdp2_model(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision="fp32-remainder-q8", backend="numba")
    _train(model, opt, 0, 1)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # (the one-row param stays on dim 0: on dim 1 its table has another shape, which DCP refuses)
    other = fully_shard(_model(0), mesh=mesh, shard_placement_fn=lambda param: Shard(int(param.shape[0] > 1)))
    other_opt = bf16opt.AdamW(other.named_parameters(), lr=1e-2, precision="fp32-remainder-q8",
                              backend="numba")
    state = {"optim": get_optimizer_state_dict(other, other_opt)}  # (makes the state: a zero-lr step)
    if tuple(state["optim"]["state"]["aligned"]["exp_avg"].shape) != (2, 13, 260):
        return ["Shard(1): the aligned param's table was meant to have the saved shape"]
    dcp.load(state, checkpoint_id=path)  # (writes the DTensor buffers in place, as for torch.optim)
    before = {name: {key: _local(value).clone() for key, value in other_opt.state[other[name]].items()}
              for name in SHAPES}
    try:
        set_optimizer_state_dict(other, other_opt, state["optim"])
        return ["Shard(1): no error"]
    except ValueError as error:
        if not all(words in str(error) for words in ("was saved for the shard", "this rank holds the shard")):
            return [f"Shard(1): {error}"]
    changed = [f"{name} {key}" for name in SHAPES for key, value in before[name].items()
               if not torch.equal(_bits(_local(other_opt.state[other[name]][key])), _bits(value))]
    failures = [f"Shard(1): the failed load changed {changed}"] if changed else []
    return failures + _gathered_into_other_sharding(other)


def _gathered_into_other_sharding(other) -> list:
    """Gathered tables (plain tensors) loaded by load_state_dict into ``other``'s sharding:
    each rank's slice of the decoded moment, quantized anew in its shard's blocks (and the
    codes as saved for the one-row param, sharded alike)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: PLC0415
                                                         get_optimizer_state_dict, set_optimizer_state_dict)

    nearest = bf16opt.Precision(master="bf16", exp_avg="q8", exp_avg_sq="q8", rounding="nearest",
                                q8_rounding="nearest")  # (no remainder: gloo has no int16 all-gather)
    model = _fsdp2_model(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=nearest, backend="numba")
    _train(model, opt, 0, 1)
    saved = opt.state_dict()
    gathered = {**saved, "state": {index: {key: value if key == "step" else value.full_tensor()
                                           for key, value in state.items()}
                                   for index, state in saved["state"].items()}}
    other_opt = bf16opt.AdamW(other.named_parameters(), lr=1e-2, precision=nearest, backend="numba")
    other_opt.load_state_dict(gathered)
    failures = []
    for index, name in enumerate(SHAPES):
        for key in ("exp_avg", "exp_avg_sq"):
            whole = whole_moment(gathered["state"][index][key], key, SHAPES[name], key)
            expected = q8_encode(shard_of(whole, other[name], name).reshape(-1), key == "exp_avg")
            if name == "empty":
                expected = opt.state[model[name]][key]
            if not torch.equal(other_opt.state[other[name]][key], expected):
                failures.append(f"a gathered table into another sharding: {name} {key}")
    # torch's full-state-dict loading hands each rank a row of the table, as a DTensor placed
    # like the live one: on another sharding that row is another shard's, and loading refuses
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, opt, options=options)
    fresh_opt = bf16opt.AdamW(other.named_parameters(), lr=1e-2, precision=nearest, backend="numba")
    try:
        set_optimizer_state_dict(other, fresh_opt, full if dist.get_rank() == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        failures.append("a full state dict into another sharding: no error")
    except ValueError as error:
        if "this rank holds the shard" not in str(error):
            failures.append(f"a full state dict into another sharding: {error}")
    return failures


def _check_full_state_dict(rank: int) -> list:
    """StateDictOptions(full_state_dict=True) gathers every rank's row; loaded back on the same
    sharding it resumes bit for bit; loaded into one process's plain params (rank 0) each
    moment is decoded from the shards and quantized anew to nearest in the param's blocks: the
    same codes where the shards cut no block."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: PLC0415
                                                         get_optimizer_state_dict, set_optimizer_state_dict)

    failures = []
    preset = "bf16-sr-q8"  # (gloo has no int16 all-gather for fp32-remainder-q8's remainder)
    model = _fsdp2_model(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=preset, backend="numba", seed=3)
    _train(model, opt, 0, 2)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, opt, options=options)
    blocks = {name: [None, None] for name in SHAPES}
    for name in SHAPES:
        dist.all_gather_object(blocks[name], opt.state[model[name]]["exp_avg"])
    restored = _fsdp2_model(1)
    restored.load_state_dict(model.state_dict())
    restored_opt = bf16opt.AdamW(restored.named_parameters(), lr=1e-2, precision=preset, backend="numba",
                                 seed=5)
    set_optimizer_state_dict(restored, restored_opt, full if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _train(model, opt, 2, 2)
    _train(restored, restored_opt, 2, 2)
    failures += [f"full state dict: {what}" for what in _differences(model, opt, restored, restored_opt)]
    if rank == 0:
        plain = _model(1)
        plain_opt = bf16opt.AdamW(plain.named_parameters(), lr=1e-2, precision=preset, backend="numba")
        set_optimizer_state_dict(plain, plain_opt, full)
        for name, shape in SHAPES.items():
            loaded = plain_opt.state[plain[name]]["exp_avg"]
            shards = [q8_decode(q, (q.shape[0] * 256,), True)[:n]
                      for q, n in zip(blocks[name], _shard_numels(shape))]
            if not torch.equal(loaded, q8_encode(torch.cat(shards), True)):
                failures.append(f"full state dict into one process: {name}: exp_avg is not the shards' "
                                f"moment quantized anew")
            if name == "aligned" and not torch.equal(loaded, torch.cat(blocks[name])):
                failures.append("full state dict into one process: aligned: exp_avg codes differ")
    return failures


def _shard_numels(shape: tuple) -> list:
    rows = -(-shape[0] // 2)
    return [min(rows, shape[0]) * shape[1], max(shape[0] - rows, 0) * shape[1]]


def _check_element_route(rank: int, path: str) -> None:
    """The documented way to another number of ranks, first half: the q8 run switched to
    fp32-remainder for a step, then a DCP checkpoint (and each rank's exp_avg, to compare)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

    model = _fsdp2_model(0)
    opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision="fp32-remainder-q8", backend="numba")
    _train(model, opt, 0, 2)
    opt.param_groups[0]["precision"] = "fp32-remainder"
    _train(model, opt, 2, 1)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "element"))
    torch.save({name: _local(opt.state[model[name]]["exp_avg"]) for name in SHAPES},
               os.path.join(path, f"exp_avg{rank}.pt"))


@needs_gloo
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (the one-process load at the end)
def test_fsdp2_q8_dcp_round_trip_continues_bit_for_bit():
    """Two ranks: sharded DCP and full state dicts resume bit for bit, another sharding raises;
    then one process (another world size) cannot load the two ranks' q8 checkpoint (DCP
    refuses the tables' shape), but loads their checkpoint taken after a step with an element
    preset, and goes back to q8."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,  # noqa: PLC0415
                                                         get_state_dict, set_state_dict)

    with tempfile.TemporaryDirectory() as path:
        results = run_on_ranks({"round trip": functools.partial(_check_fsdp2, path=path),
                                "other sharding": functools.partial(_check_other_sharding,
                                                                    path=os.path.join(path, "dim0")),
                                "full state dict": _check_full_state_dict,
                                "element route": functools.partial(_check_element_route, path=path)})
        expected = {"round trip": [], "other sharding": [], "full state dict": [], "element route": None}
        assert results == {0: expected, 1: expected}
        model = _model(1)
        opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision="fp32-remainder-q8", backend="numba")
        state = {"optim": get_optimizer_state_dict(model, opt)}
        with pytest.raises(dcp.CheckpointException, match=r"Size mismatch between saved torch.Size\(\[2, "):
            dcp.load(state, checkpoint_id=os.path.join(path, "dim0"))
        # ...second half: one process loads the element checkpoint and goes back to q8
        opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision="fp32-remainder", backend="numba")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "element"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        shards = [torch.load(os.path.join(path, f"exp_avg{rank}.pt")) for rank in range(2)]
        for name in SHAPES:
            whole = torch.cat([shard[name] for shard in shards])
            assert torch.equal(opt.state[model[name]]["exp_avg"], whole)
        opt.param_groups[0]["precision"] = "fp32-remainder-q8"
        _train(model, opt, 3, 1)
        assert all(opt.state[model[name]]["exp_avg"].dtype == Q8 for name in SHAPES)


# ------------------------------------------------------------------- one process
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("preset", PRESETS)
def test_q8_dcp_round_trip_without_a_process_group(preset, tmp_path):
    assert not (dist.is_available() and dist.is_initialized())
    assert _round_trip(preset, str(tmp_path / "ckpt"), _model) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_q8_dcp_checkpoint_loads_only_into_q8_moments(tmp_path):
    """DCP loads into the live optimizer's own tensors: a q8 checkpoint and an optimizer with
    element moments (either way round) differ in shape, and DCP refuses; the documented way is
    to load with the saved preset and change the precision after."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: PLC0415

    for saved, live in (("fp32-remainder-q8", "fp32-remainder"), ("fp32-remainder", "fp32-remainder-q8")):
        model = _model(0)
        opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=saved, backend="numba")
        _train(model, opt, 0, 1)
        path = str(tmp_path / saved)
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        fresh = _model(1)  # (no grads: get_optimizer_state_dict makes its state)
        other = bf16opt.AdamW(fresh.named_parameters(), lr=1e-2, precision=live, backend="numba")
        with pytest.raises(dcp.CheckpointException, match="Size mismatch"):
            dcp.load({"optim": get_optimizer_state_dict(fresh, other)}, checkpoint_id=path)


# ------------------------------------------------------------------- the table's layout
def _documented_row(moment: torch.Tensor, whole: tuple, offset: tuple, padded_blocks: int) -> torch.Tensor:
    """One rank's row of a rank table, written from docs/numerics.md's description: a header
    of little-endian int64 words, the shard's q8 blocks, zero rows up to ``padded_blocks``."""
    codes = q8_encode(moment.reshape(-1).contiguous(), True)
    words = [int.from_bytes(b"bf16q8t1", "little"), len(whole), codes.shape[0],
             *whole, *moment.shape, *offset]
    row = torch.zeros((padded_blocks + 1, 260), dtype=torch.uint8)
    row[0, :8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    row[1:1 + codes.shape[0]] = codes
    return row


def _gathered(moment: torch.Tensor, cuts: list) -> torch.Tensor:
    """A gathered table of ``moment`` cut on dim 0 at ``cuts``."""
    edges = [0, *cuts, moment.shape[0]]
    pieces = [(moment[a:b], (a, 0)) for a, b in zip(edges, edges[1:])]
    padded = max(-(-piece.numel() // 256) for piece, _ in pieces)
    whole = tuple(moment.shape)
    return torch.stack([_documented_row(piece, whole, offset, padded) for piece, offset in pieces])


@settings(max_examples=20)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), data=st.data())
def test_a_gathered_rank_table_decodes_into_each_shards_moment(rows, cols, data):
    """whole_moment(table) is every shard's q8 moment decoded and placed at its offset."""
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=3)))
    moment = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 1000 + cols))
    table = _gathered(moment, cuts)
    assert is_rank_table(table)
    edges = [0, *cuts, rows]
    expected = torch.cat([q8_decode(q8_encode(moment[a:b].reshape(-1), True), (b - a, cols), True)
                          for a, b in zip(edges, edges[1:])])
    assert torch.equal(whole_moment(table, "exp_avg", (rows, cols), "exp_avg"), expected)


def test_a_gathered_rank_table_must_tile_the_param():
    moment = torch.randn(20, 100)
    table = _gathered(moment, [10])
    with pytest.raises(ValueError, match="not every shard was gathered"):
        whole_moment(table[:1], "exp_avg", (20, 100), "exp_avg")
    with pytest.raises(ValueError, match="overlap"):
        whole_moment(torch.stack([table[0], table[0]]), "exp_avg", (20, 100), "exp_avg")
    with pytest.raises(ValueError, match="param of shape"):
        whole_moment(table, "exp_avg", (20, 101), "exp_avg")
    broken = table.clone()
    broken[1, 0, 16:24] = torch.tensor([99], dtype=torch.int64).view(torch.uint8)  # 99 blocks
    with pytest.raises(ValueError, match="no valid header"):
        whole_moment(broken, "exp_avg", (20, 100), "exp_avg")
    assert not is_rank_table(q8_encode(moment.reshape(-1), True))  # a q8 moment is no table


def test_a_gathered_rank_table_loads_into_a_plain_param_quantized_anew():
    """A full state dict of a sharded run loads into one process: each moment decoded from its
    shards and quantized to nearest in the param's own blocks; a failed load changes nothing."""
    param = nn.Parameter(torch.randn(30, 200).to(torch.bfloat16))
    opt = bf16opt.AdamW([param], lr=1e-2, precision="fp32-remainder-q8", backend="reference")
    param.grad = torch.randn(30, 200).to(torch.bfloat16)
    opt.step()
    saved = opt.state_dict()
    other = q8_decode(saved["state"][0]["exp_avg"], (30, 200), True) * 3  # (not the live moment)
    saved["state"][0]["exp_avg"] = _gathered(other, [15])
    before = opt.state[param]["exp_avg"].clone()
    bad = {**saved, "state": {0: {**saved["state"][0], "exp_avg": saved["state"][0]["exp_avg"][:1]}}}
    with pytest.raises(ValueError, match="not every shard was gathered"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state[param]["exp_avg"], before)
    opt.load_state_dict(saved)
    shards = whole_moment(saved["state"][0]["exp_avg"], "exp_avg", (30, 200), "exp_avg")
    assert torch.equal(opt.state[param]["exp_avg"], q8_encode(shards.reshape(-1), True))
