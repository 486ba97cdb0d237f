"""Update in backward under FSDP2 (two CPU ranks, gloo).

FSDP2's sharded params take no part in autograd: their grads are written by its reduce-scatter,
which then runs the params' post-accumulate-grad hooks itself (pytorch PR 129450; tested with
torch 2.13) with the reduced ``Shard(0)`` grad.  So ``update_in_backward=True`` updates each shard in backward and frees its
grad, with the normal step's bits.  Each rank trains on its own batches here, so a hook that saw
a rank's partial (unreduced) grad would give other bits than the normal step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import bf16opt
from gloo_ranks import needs_cpu_fsdp2, needs_gloo, run_on_ranks
from test_distributed import _fsdp2_model, bits, make_model


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _root_only_model():
    """make_model's layers in one fully_shard unit, the root: its reduce-scatter runs at the
    end of backward, from FSDP2's own end-of-backward callback."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    return fully_shard(make_model(), mesh=_mesh())


def _mixed_precision_model():
    """make_model in float32, computed in bfloat16 and reduced in float32 (FSDP2's usual
    MixedPrecisionPolicy): the hooks see the float32 sharded grad."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model().float()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=_mesh(), mp_policy=policy)
    return fully_shard(model, mesh=_mesh(), mp_policy=policy)


CASES = [  # (model, optimizer, backend, preset, offload, extra keywords)
    (_fsdp2_model, bf16opt.AdamW, "numba", "bf16-sr", None, {}),
    (_fsdp2_model, bf16opt.AdamW, "numba", "fp32-remainder", None, {}),
    (_fsdp2_model, bf16opt.AdamW, "reference", "bf16-states", None, {}),
    (_fsdp2_model, bf16opt.SGD, "numba", "bf16-kahan", None, {"momentum": 0.9}),
    (_fsdp2_model, bf16opt.AdamW, "numba", "bf16-sr", "cpu", {}),
    (_root_only_model, bf16opt.AdamW, "numba", "bf16-sr", "cpu", {}),
    (_mixed_precision_model, bf16opt.AdamW, "numba", "fp32", None, {}),
]


class Twice(nn.Module):
    """One fully_shard unit used twice in a forward: its grads come from two uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def _twice_model():
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = _mesh()
    model = Twice().to(torch.bfloat16)
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batches(rank: int, count: int) -> list:
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randn(16, 8, generator=generator).to(torch.bfloat16) for _ in range(count)]


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _differences(normal_model, normal_opt, release_model, release_opt) -> list:
    """What differs between the two runs' shards: params and every state buffer."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    wrong = []
    for (name, p), q in zip(normal_model.named_parameters(), release_model.parameters()):
        if not torch.equal(bits(p.to_local()), bits(q.to_local())):
            wrong.append(f"{name}: param")
        state, other = normal_opt.state[p], release_opt.state[q]
        if set(state) != set(other):
            wrong.append(f"{name}: state keys {sorted(state)} vs {sorted(other)}")
            continue
        for key, value in state.items():
            if isinstance(value, DTensor):
                same = isinstance(other[key], DTensor) and other[key].placements == value.placements and \
                    torch.equal(bits(value.to_local()), bits(other[key].to_local()))
            else:
                same = torch.equal(value, other[key])
            if not same:
                wrong.append(f"{name}: {key}")
    return wrong


def _fingerprint(opt, q) -> list:
    """The bits of a shard and of its state, as lists (to compare before and after)."""
    values = [q.to_local()] + [value.to_local() if hasattr(value, "to_local") else value
                               for value in opt.state.get(q, {}).values()]
    return [bits(value).tolist() for value in values]


def check_steps_match_the_normal_step(rank: int) -> list:
    """Per case, 3 steps: the hooks fire in backward with the reduced DTensor grad (the one
    ``step()`` reads in the normal run), backward returns with every shard updated and no grad
    left, and params and state equal the normal step's bit for bit."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    failures = []
    for make, opt_class, backend, preset, offload, extra in CASES:
        what = f"{make.__name__} {opt_class.__name__} {backend} {preset} offload={offload}"
        kwargs = dict(lr=1e-2, precision=preset, backend=backend, seed=7, offload=offload, **extra)
        normal, release = make(), make()
        seen = {}  # param -> the grad its hook saw (registered before the optimizer's, so it runs first)
        for q in release.parameters():
            q.register_post_accumulate_grad_hook(lambda t: seen.__setitem__(t, t.grad))
        normal_opt = opt_class(normal.named_parameters(), **kwargs)
        release_opt = opt_class(release.named_parameters(), update_in_backward=True, **kwargs)
        for x in _batches(rank, 3):
            normal_opt.zero_grad()
            _loss(normal, x).backward()
            release_opt.zero_grad()
            seen.clear()
            before = [_fingerprint(release_opt, q) for q in release.parameters()]
            _loss(release, x).backward()
            for (name, p), q, old in zip(normal.named_parameters(), release.parameters(), before):
                grad = seen.get(q)
                if not isinstance(grad, DTensor) or grad.placements != q.placements:
                    placed = getattr(grad, "placements", "")
                    failures.append(f"{what}: {name}'s hook saw {type(grad).__name__} {placed}")
                elif not torch.equal(bits(grad.to_local()), bits(p.grad.to_local())):
                    failures.append(f"{what}: {name}'s hook saw another grad than the normal step reads")
                if q.grad is not None:
                    failures.append(f"{what}: {name} still holds its grad after backward")
                if q.to_local().numel() and _fingerprint(release_opt, q) == old:
                    failures.append(f"{what}: {name} was not updated in backward")
            normal_opt.step()
            release_opt.step()
        failures += [f"{what}: {d}" for d in _differences(normal, normal_opt, release, release_opt)]
    return failures


def check_accumulation(rank: int) -> list:
    """Two micro-batches per step, both ways: ``opt.accumulating()`` (FSDP2 reduce-scatters each
    backward and sums the sharded grads; the hooks do nothing until the last) and FSDP2's own
    ``set_requires_gradient_sync(False)`` (no reduce-scatter, so no hook, until the last)."""
    failures = []
    kwargs = dict(lr=1e-2, precision="bf16-sr", seed=3)
    for route in ("accumulating", "no gradient sync"):
        normal, release = _fsdp2_model(), _fsdp2_model()
        normal_opt = bf16opt.AdamW(normal.named_parameters(), **kwargs)
        release_opt = bf16opt.AdamW(release.named_parameters(), update_in_backward=True, **kwargs)
        batches = _batches(rank, 4)
        for first, last in zip(batches[::2], batches[1::2]):
            for model, opt in ((normal, normal_opt), (release, release_opt)):
                opt.zero_grad()
                if route == "accumulating":
                    with opt.accumulating():
                        _loss(model, first).backward()
                else:
                    model.set_requires_gradient_sync(False)
                    _loss(model, first).backward()
                    model.set_requires_gradient_sync(True)
                _loss(model, last).backward()
                opt.step()
        if any(q.grad is not None for q in release.parameters()):
            failures.append(f"{route}: grads left after the last backward")
        failures += [f"{route}: {d}" for d in _differences(normal, normal_opt, release, release_opt)]
    return failures


def check_a_unit_used_twice(rank: int) -> list:
    """A fully_shard unit called twice in one forward: its hooks still fire once per backward,
    with the grad of both uses."""
    calls = []
    normal, release = _twice_model(), _twice_model()
    for q in release.parameters():
        q.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    kwargs = dict(lr=1e-2, precision="bf16-sr", seed=5)
    normal_opt = bf16opt.AdamW(normal.named_parameters(), **kwargs)
    release_opt = bf16opt.AdamW(release.named_parameters(), update_in_backward=True, **kwargs)
    for x in _batches(rank, 2):
        for model, opt in ((normal, normal_opt), (release, release_opt)):
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
    expected_calls = 2 * len(list(release.parameters()))  # once per param and backward
    failures = [] if len(calls) == expected_calls else [f"{len(calls)} hook calls in 2 backwards"]
    if any(q.grad is not None for q in release.parameters()):
        failures.append("grads left after backward")
    return failures + _differences(normal, normal_opt, release, release_opt)


def _hook_counts(model) -> list:
    return [len(getattr(q, "_post_accumulate_grad_hooks", None) or ()) for q in model.parameters()]


def check_per_update_clipping_is_refused(rank: int) -> list:
    """``max_grad_norm_per_param`` would clip by a shard's norm: refused when the group is made
    (in backward another group's params could already be updated), leaving no hooks; a backward
    then changes nothing."""
    model = _fsdp2_model()
    params = list(model.named_parameters())
    hooks = _hook_counts(model)
    failures = []
    attempts = [lambda: bf16opt.AdamW(params, lr=1e-2, update_in_backward=True, max_grad_norm_per_param=1.0),
                lambda: bf16opt.AdamW([{"params": params[:1]},
                                       {"params": params[1:], "max_grad_norm_per_param": 1.0}],
                                      lr=1e-2, update_in_backward=True)]
    for attempt in attempts:
        try:
            attempt()
            failures.append("no ValueError at construction")
        except ValueError as error:
            if "shard's norm is not the param's" not in str(error):
                failures.append(f"ValueError: {error}")
    opt = bf16opt.AdamW(params[:1], lr=1e-2, update_in_backward=True)
    added = _hook_counts(model)
    try:
        opt.add_param_group({"params": [q for _, q in params[1:]], "max_grad_norm_per_param": 1.0})
        failures.append("no ValueError from add_param_group")
    except ValueError:
        pass
    if len(opt.param_groups) != 1 or _hook_counts(model) != added or added == hooks:
        failures.append(f"hooks {hooks} -> {added} -> {_hook_counts(model)}, {len(opt.param_groups)} groups")
    return failures + _clipping_set_later_is_refused(rank)


def _clipping_set_later_is_refused(rank: int) -> list:
    """Set on a normal step's group after construction: step() refuses, changing nothing."""
    model = _fsdp2_model()
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2)
    opt.param_groups[0]["max_grad_norm_per_param"] = 1.0
    _loss(model, _batches(rank, 1)[0]).backward()
    before = [bits(q.to_local()).clone() for q in model.parameters()]
    return _refused(opt.step, "step()", "shard's norm is not the param's", opt, model, before,
                    lambda q: q.to_local())


def _refused(call, what: str, text: str, opt, model, before: list, shard) -> list:
    """Failures unless ``call()`` raises a ValueError containing ``text`` and leaves the
    state empty and every param's ``shard(param)`` bits as ``before``."""
    try:
        call()
        failures = [f"no ValueError from {what}"]
    except ValueError as error:
        failures = [] if text in str(error) else [f"ValueError: {error}"]
    if opt.state or not all(torch.equal(old, bits(shard(q))) for old, q in zip(before, model.parameters())):
        failures.append(f"{what} changed a param or the state")
    return failures


def check_ddp_is_refused(rank: int) -> list:
    """DistributedDataParallel averages the grads after the hooks have run: the first hook's
    backward raises, naming the group, before any param or state changes."""
    torch.manual_seed(0)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-2, backend="numba", update_in_backward=True)
    before = [bits(p.detach()) for p in model.parameters()]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    return _refused(lambda: ddp(x).float().pow(2).mean().backward(), "backward",
                    "param group 0 holds plain params", opt, model, before, lambda q: q.detach())


@needs_gloo
@needs_cpu_fsdp2
def test_fsdp2_updates_in_backward_with_the_normal_steps_bits():
    """FSDP2 runs the hooks after its reduce-scatter: each shard is updated in backward from the
    reduced grad and its grad freed, with the normal step's bits (AdamW with stochastic rounding,
    remainder, bf16 states on the reference, SGD momentum with Kahan, offload='cpu' also with the
    root as the only unit, float32 params under a mixed-precision policy), with either way of
    accumulating grads and with a unit used twice; per-update clipping is refused, and so is
    DistributedDataParallel (its all-reduce runs after the hooks)."""
    checks = {"steps": check_steps_match_the_normal_step, "accumulation": check_accumulation,
              "unit used twice": check_a_unit_used_twice,
              "per-update clipping": check_per_update_clipping_is_refused, "DDP": check_ddp_is_refused}
    expected = {name: [] for name in checks}
    assert run_on_ranks(checks) == {0: expected, 1: expected}
