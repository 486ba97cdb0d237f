"""Snapshots of an optimizer's params, state and groups, to show a failed call changed nothing."""

import torch


def snapshot(opt):
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def same_bits(a, b):
    """The same dtype and the same bits of the values (a negative view's values, not its memory)."""
    a, b = a.resolve_neg(), b.resolve_neg()
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_unchanged(opt, before):
    params, state, groups = before
    now = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert all(same_bits(a, b) for a, b in zip(now, params))
    assert set(state) == {id(p) for p in opt.state}
    for p, s in opt.state.items():
        assert set(s) == set(state[id(p)])
        for k, v in s.items():
            assert same_bits(v, state[id(p)][k]), k
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
