"""Distributed training: FSDP2 (DTensor params), tensor-parallel placements, DCP checkpoints,
ZeroRedundancyOptimizer -- and the sharding-independent stochastic-rounding streams they rely on.

One spawned process group (2 CPU ranks, gloo) runs every multi-process check in sequence, to
keep the suite fast; each rank compares its shards with the same training run in one process
(built inside the rank), bit for bit.  The single-process tests below cover what needs no
process group: param names as stream ids, the format-1 state-dict rule.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bf16opt
from bf16opt.distributed import shard_of
from gloo_ranks import needs_cpu_fsdp2, needs_gloo, needs_two_rank_cpu_fsdp2, run_on_ranks

PRESETS = ("fp32", "bf16", "bf16-sr", "bf16-kahan", "fp32-remainder")


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make_model(seed: int = 0) -> nn.Module:
    # dim 0 of 5 and of 1: uneven shards on 2 ranks, rank 1 holds nothing of the last layer
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 1)).to(torch.bfloat16)


def train(model, opt, seed: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


# ------------------------------------------------------------------- the spawned checks
def _fsdp2_model(seed: int = 0, device: str = "cpu"):
    """make_model(seed) under FSDP2 on a mesh of every rank on ``device`` (named: fully_shard's
    default mesh is the accelerator's, which would move the params to CUDA where there is one)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = make_model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _same_shards(single_model, single_opt, sharded_model, sharded_opt) -> list:
    """What differs between this rank's shards and the one-process run (params, every state
    buffer: DTensors sharded like the param, step a plain tensor)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    wrong = []
    for (name, p), q in zip(single_model.named_parameters(), sharded_model.parameters()):
        if not torch.equal(bits(shard_of(p, q, name)), bits(q.to_local())):
            wrong.append(f"{name}: param")
        state, sharded = single_opt.state[p], sharded_opt.state[q]
        if set(state) != set(sharded):
            wrong.append(f"{name}: state keys {sorted(state)} vs {sorted(sharded)}")
            continue
        for key, value in state.items():
            other = sharded[key]
            if key == "step":
                ok = not isinstance(other, DTensor) and torch.equal(value, other)
            else:
                ok = isinstance(other, DTensor) and tuple(other.placements) == tuple(q.placements) and \
                    torch.equal(bits(shard_of(value, q, key)), bits(other.to_local()))
            if not ok:
                wrong.append(f"{name}: {key}")
    return wrong


def check_fsdp2_matches_one_process(rank: int) -> list:
    failures = []
    # every preset on the Numba kernels; the reference (their specification, equal to them
    # elsewhere in the suite) where shards matter most: the global element index of SR
    cases = [(bf16opt.AdamW, "numba", preset, None) for preset in PRESETS]
    cases += [(bf16opt.AdamW, "reference", "bf16-sr", None), (bf16opt.Lion, "numba", "bf16-sr", None),
              (bf16opt.SGD, "numba", "bf16-sr", None), (bf16opt.AdamW, "numba", "bf16-sr", "cpu")]
    for opt_class, backend, preset, offload in cases:
        kwargs = dict(lr=1e-2, precision=preset, backend=backend, seed=7, offload=offload)
        if opt_class is bf16opt.SGD:
            kwargs["momentum"] = 0.9
        single, sharded = make_model(), _fsdp2_model()
        opts = [opt_class(model.named_parameters(), **kwargs) for model in (single, sharded)]
        for model, opt in zip((single, sharded), opts):
            train(model, opt, 1, 3)
        failures += [f"{opt_class.__name__} {backend} {preset} offload={offload}: {what}"
                     for what in _same_shards(single, opts[0], sharded, opts[1])]
    return failures


def check_tensor_parallel_placements(rank: int) -> list:
    """A Shard(1) param (tensor parallel's row-wise split): round to nearest updates it like one
    process; stochastic rounding, whose streams number elements globally, refuses it; a grad
    placed otherwise than its param is refused before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

    failures = []
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    full, grad = torch.randn(4, 7).to(torch.bfloat16), torch.randn(4, 7).to(torch.bfloat16)
    single = nn.Parameter(full.clone())
    sharded = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(1)]))
    opts = [bf16opt.AdamW([p], lr=1e-2, precision="bf16", backend="numba") for p in (single, sharded)]
    for _ in range(2):
        single.grad = grad.clone()
        sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(1)])
        for opt in opts:
            opt.step()
    if not torch.equal(bits(shard_of(single, sharded, "w")), bits(sharded.to_local())):
        failures.append("Shard(1), bf16: differs from one process")
    sr = bf16opt.AdamW([sharded], lr=1e-2, precision="bf16-sr")
    before = bits(sharded.to_local()).clone()
    try:
        sr.step()
        failures.append("Shard(1), bf16-sr: no ValueError")
    except ValueError as error:
        if "not one contiguous range" not in str(error):
            failures.append(f"Shard(1), bf16-sr: {error}")
    sharded.grad = distribute_tensor(grad.clone(), mesh, [Replicate()])
    try:
        opts[1].step()
        failures.append("grad placed Replicate for a Shard(1) param: no TypeError")
    except TypeError as error:
        if "grad of param 0 is a DTensor placed" not in str(error):
            failures.append(f"grad placement: {error}")
    if not torch.equal(before, bits(sharded.to_local())) or sr.state:
        failures.append("a refused step changed the param or made state")
    from torch.distributed.tensor import DTensor, Partial  # noqa: PLC0415
    partial = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    try:
        bf16opt.AdamW([partial])
        failures.append("a Partial DTensor param: no TypeError")
    except TypeError as error:
        if "Partial placement" not in str(error):
            failures.append(f"Partial: {error}")
    return failures


def check_precision_change(rank: int) -> list:
    """A group's precision edited between steps converts DTensor state on the shards (here into
    fp32-remainder, which rewrites the param) exactly as it does in one process."""
    single, sharded = make_model(), _fsdp2_model()
    opts = [bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision="bf16-sr", seed=2)
            for model in (single, sharded)]
    for model, opt in zip((single, sharded), opts):
        train(model, opt, 1, 2)
        opt.param_groups[0]["precision"] = "fp32-remainder"
        train(model, opt, 2, 2)
    return [f"bf16-sr -> fp32-remainder: {what}" for what in _same_shards(single, opts[0], sharded, opts[1])]


def check_dcp_round_trip(rank: int, path: str) -> list:
    """get_state_dict -> dcp.save, more steps; a fresh model and optimizer: get_state_dict ->
    dcp.load -> set_state_dict, the same steps: bit-identical continuation."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    failures = []
    for preset in ("bf16-sr", "fp32-remainder"):
        model = _fsdp2_model()
        opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=preset, seed=3)
        train(model, opt, 1, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        states = list(optim_sd["state"].values())
        if not all(isinstance(v, DTensor) for s in states for k, v in s.items() if k != "step"):
            failures.append(f"{preset}: DCP's optimizer state dict holds non-DTensor buffers")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, preset))
        train(model, opt, 2, 2)
        restored = _fsdp2_model(seed=1)  # other initial weights: everything must come from the checkpoint
        restored_opt = bf16opt.AdamW(restored.named_parameters(), lr=1e-2, precision=preset, seed=3)
        model_sd, optim_sd = get_state_dict(restored, restored_opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=os.path.join(path, preset))
        set_state_dict(restored, restored_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        train(restored, restored_opt, 2, 2)
        for p, q in zip(model.parameters(), restored.parameters()):
            same = torch.equal(bits(p.to_local()), bits(q.to_local()))
            for key, value in opt.state[p].items():
                other = restored_opt.state[q][key]
                same &= torch.equal(bits(value if key == "step" else value.to_local()),
                                    bits(other if key == "step" else other.to_local()))
            if not same:
                failures.append(f"{preset}: DCP round trip does not continue bit for bit")
                break
    return failures


def check_zero_redundancy(rank: int) -> list:
    """ZeroRedundancyOptimizer(optimizer_class=bf16opt.AdamW): each rank updates its partition
    with bf16opt and broadcasts it; the model equals the one-process run on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415

    single, replicated = make_model(), make_model()
    opts = [bf16opt.AdamW(single.parameters(), lr=1e-2, precision="bf16"),
            ZeroRedundancyOptimizer(replicated.parameters(), optimizer_class=bf16opt.AdamW, lr=1e-2,
                                    precision="bf16")]
    for model, opt in zip((single, replicated), opts):
        train(model, opt, 1, 3)
    same = all(torch.equal(bits(p), bits(q)) for p, q in zip(single.parameters(), replicated.parameters()))
    return [] if same else ["ZeroRedundancyOptimizer: differs from one process"]


def check_memory_report_is_this_ranks(rank: int) -> list:
    """memory_report under FSDP2 counts each DTensor's local shard: this rank's bytes."""
    model = _fsdp2_model()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16", backend="numba")
    train(model, opt, rank, 1)
    report = bf16opt.memory_report(opt)
    shards = [p.to_local() for p in model.parameters()]
    state = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for k, v in s.items()
             if k != "step"]
    expected = (sum(t.numel() for t in shards), sum(t.numel() * t.element_size() for t in shards),
                sum(t.numel() * t.element_size() for t in state))
    got = (report.num_params, report.bytes["params"], report.bytes["exp_avg"] + report.bytes["exp_avg_sq"])
    return [] if got == expected else [f"memory_report {got}, this rank holds {expected}"]


def check_ddp(rank: int) -> list:
    """DDP (plain params, grads averaged across ranks): every rank equals one process that sees
    the average gradient, with stochastic rounding too (DDP's params are the model's own)."""
    single, replicated = make_model(), make_model()
    ddp = nn.parallel.DistributedDataParallel(replicated)
    opts = [bf16opt.AdamW(model.parameters(), lr=1e-2, precision="bf16-sr", seed=9)
            for model in (single, replicated)]
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        batches = [torch.randn(8, 8, generator=generator).to(torch.bfloat16) for _ in range(2)]
        for opt in opts:
            opt.zero_grad()
        ddp(batches[rank]).float().pow(2).mean().backward()  # DDP: each rank its batch, grads averaged
        for batch in batches:  # one process: the same average, summed in the same order
            (single(batch).float().pow(2).mean() / 2).backward()
        for p, q in zip(single.parameters(), replicated.parameters()):
            p.grad.copy_(q.grad)  # (bf16 sums may round in another order: the update is what is compared)
        for opt in opts:
            opt.step()
    same = all(torch.equal(bits(p), bits(q)) for p, q in zip(single.parameters(), replicated.parameters()))
    flat = torch.cat([bits(p).reshape(-1).to(torch.int64) for p in replicated.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return ([] if same else ["DDP: differs from one process"]) + \
        ([] if torch.equal(gathered[0], gathered[1]) else ["DDP: ranks out of sync"])


def check_full_state_dict(rank: int) -> list:
    """StateDictOptions(full_state_dict=True): whole tensors out (rank 0), each rank's slice back in.
    (Not with fp32-remainder: torch gathers the int16 remainder with an all-gather, which gloo,
    like NCCL, has no int16 for -- docs/integrations_dist.md.)"""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,  # noqa: PLC0415
                                                         set_optimizer_state_dict)

    failures = []
    for preset in ("bf16-sr", "fp32"):
        model = _fsdp2_model()
        opt = bf16opt.AdamW(model.named_parameters(), lr=1e-2, precision=preset, seed=3)
        train(model, opt, 1, 2)
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
        shapes = {key: tuple(value.shape) for key, value in full["state"]["0.weight"].items()} if rank == 0 else {}
        if rank == 0 and shapes.get("exp_avg") != (5, 8):
            failures.append(f"{preset}: full state dict holds {shapes}")
        restored = _fsdp2_model(seed=1)
        restored.load_state_dict(model.state_dict())
        restored_opt = bf16opt.AdamW(restored.named_parameters(), lr=1e-2, precision=preset, seed=3)
        set_optimizer_state_dict(restored, restored_opt, full if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        train(model, opt, 2, 1)
        train(restored, restored_opt, 2, 1)
        if not all(torch.equal(bits(p.to_local()), bits(q.to_local()))
                   for p, q in zip(model.parameters(), restored.parameters())):
            failures.append(f"{preset}: a full state dict does not continue bit for bit")
    return failures


def check_integration_examples(rank: int, path: str) -> list:
    """Every python block of docs/integrations_dist.md, run as written on this rank."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "integrations_dist.md"),
                encoding="utf-8").read()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    failures = [] if len(blocks) == 5 else \
        [f"docs/integrations_dist.md has {len(blocks)} python blocks, expected 5"]
    for number, block in enumerate(blocks):
        try:
            exec(compile(block, f"integrations_dist.md block {number}", "exec"),  # noqa: S102
                 {"rank": rank, "path": os.path.join(path, f"docs{number}"), "__name__": "example"})
        except Exception as error:  # noqa: BLE001  (reported with its block)
            failures.append(f"block {number}: {type(error).__name__}: {error}")
    return failures


@needs_gloo
@needs_two_rank_cpu_fsdp2
def test_fsdp2_tensor_parallel_dcp_zero_and_ddp_on_two_ranks():
    """FSDP2 (uneven shards, an empty shard) equals one process bit for bit for every preset,
    Lion and SGD with stochastic rounding, offload='cpu'; Shard(1) placements; DCP save/load
    and full state dicts continue bit for bit; ZeroRedundancyOptimizer and DDP equal one
    process; memory_report is this rank's; docs/integrations_dist.md's examples run."""
    with tempfile.TemporaryDirectory() as path:
        checks = {"fsdp2": check_fsdp2_matches_one_process,
                  "tensor_parallel": check_tensor_parallel_placements,
                  "precision_change": check_precision_change,
                  "dcp": functools.partial(check_dcp_round_trip, path=path),
                  "zero": check_zero_redundancy,
                  "ddp": check_ddp,
                  "memory_report": check_memory_report_is_this_ranks,
                  "full_state_dict": check_full_state_dict,
                  "docs": functools.partial(check_integration_examples, path=path)}
        results = run_on_ranks(checks)
    expected = {name: [] for name in checks}
    assert results == {0: expected, 1: expected}


# ------------------------------------------------------------------- one process
def _named_run(order: list, backend: str, offload=None, rename: dict = None, steps: int = 3) -> dict:
    """name -> param bits after ``steps`` steps of bf16-sr AdamW over named params given in ``order``."""
    model = make_model()
    named = dict(model.named_parameters())
    pairs = [((rename or {}).get(name, name), named[name]) for name in order]
    opt = bf16opt.AdamW(pairs, lr=1e-2, precision="bf16-sr", backend=backend, seed=11, offload=offload)
    train(model, opt, 1, steps)
    return {name: bits(p).clone() for name, p in named.items()}


@pytest.mark.parametrize("backend, offload", [("reference", None), ("numba", None), ("numba", "cpu")])
def test_named_params_in_any_order_round_alike(backend, offload):
    """Stochastic rounding names a named param's streams by its name: building the optimizer
    with the same named params in another order changes no bit; renaming one changes its bits."""
    names = [name for name, _ in make_model().named_parameters()]
    first = _named_run(names, backend, offload)
    assert all(torch.equal(first[n], v) for n, v in _named_run(names[::-1], backend, offload).items())
    renamed = _named_run(names, backend, offload, rename={"0.weight": "encoder.weight"})
    assert not torch.equal(first["0.weight"], renamed["0.weight"])
    # (the other params see other inputs from step 2 on, so only the renamed one is compared)


def test_format_1_state_dicts_keep_position_streams():
    """A state dict saved by format 1 (which named every stream by position) loads into a named
    optimizer with sr_streams='position' in its groups: it continues as the old run would (with
    this version's bits: it warns that an older bf16opt drew others), and the entry survives the
    next save and load.  A format-3 state dict loads with name streams, without a warning."""
    def optimizer(named: bool):
        model = make_model()
        params = model.named_parameters() if named else model.parameters()
        return model, bf16opt.AdamW(params, lr=1e-2, precision="bf16-sr", seed=5)

    old_model, old_opt = optimizer(named=False)  # what format 1 computed for any optimizer
    train(old_model, old_opt, 1, 2)
    saved = copy.deepcopy(old_opt.state_dict())
    saved["bf16opt"]["format"] = 1
    saved["param_groups"][0]["param_names"] = [name for name, _ in old_model.named_parameters()]
    model, opt = optimizer(named=True)
    model.load_state_dict(old_model.state_dict())
    with pytest.warns(UserWarning, match="state-dict format 1"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["sr_streams"] == "position"
    resaved = copy.deepcopy(opt.state_dict())
    assert resaved["bf16opt"]["format"] == 3 and resaved["param_groups"][0]["sr_streams"] == "position"
    train(old_model, old_opt, 2, 2)
    train(model, opt, 2, 2)
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(old_model.parameters(), model.parameters()))

    again_model, again = optimizer(named=True)
    again_model.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a format-3 state dict: nothing to warn about
        again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert again.param_groups[0]["sr_streams"] == "position"
    fresh_model, fresh = optimizer(named=True)
    current = copy.deepcopy(fresh.state_dict())
    again.load_state_dict(current)  # a format-3 state dict of a named optimizer: name streams
    assert "sr_streams" not in again.param_groups[0]


# ------------------------------------------------------------------- one process, FSDP2 on a device
def _cuda_problem() -> str | None:
    """Why the CUDA case cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL (FSDP2 on CUDA needs it)"
    from bf16opt.backends import cupy as cupy_backend  # noqa: PLC0415

    try:
        cupy_backend.check_available(torch.device("cuda"))
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture
def one_process_group(request):
    """A process group of this process alone (gloo for CPU tensors, NCCL for CUDA ones)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    backend = "cpu:gloo,cuda:nccl" if request.param == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


ONE_PROCESS_CASES = [(bf16opt.AdamW, preset) for preset in PRESETS] + [(bf16opt.Lion, "bf16-sr"),
                                                                       (bf16opt.SGD, "bf16-sr")]


@needs_gloo
@pytest.mark.parametrize("one_process_group", [
    pytest.param("cpu", marks=needs_cpu_fsdp2), pytest.param("cuda", marks=pytest.mark.skipif(_cuda_problem() is not None,
                                                         reason=str(_cuda_problem())))],
    indirect=True)
def test_one_process_fully_shard_equals_the_unsharded_run(one_process_group):
    """fully_shard on a one-rank mesh of the device (CUDA: backend='cupy', the CPU: 'numba')
    updates params and state exactly as the same optimizer on the plain model, for every preset,
    Lion and SGD with stochastic rounding: the shard's DTensor params, the global element
    index of the random streams and the state placed like the param change no bit.  Both get
    the sharded model's gradients (the update is compared, not two backward passes)."""
    device = one_process_group
    backend = "cupy" if device == "cuda" else "numba"
    failures = []
    for opt_class, preset in ONE_PROCESS_CASES:
        kwargs = dict(lr=1e-2, precision=preset, backend=backend, seed=7)
        if opt_class is bf16opt.SGD:
            kwargs["momentum"] = 0.9
        single, sharded = make_model().to(device), _fsdp2_model(device=device)
        assert all(p.device.type == device for p in [*single.parameters(), *sharded.parameters()])
        opts = [opt_class(model.named_parameters(), **kwargs) for model in (single, sharded)]
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 8, generator=generator).to(device, torch.bfloat16)
            for opt in opts:
                opt.zero_grad()
            sharded(x).float().pow(2).mean().backward()
            for p, q in zip(single.parameters(), sharded.parameters()):
                p.grad = q.grad.full_tensor().clone()
            for opt in opts:
                opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        failures += [f"{opt_class.__name__} {preset}: {what}"
                     for what in _same_shards(single, opts[0], sharded, opts[1])]
    assert failures == []
