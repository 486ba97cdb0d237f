"""Checks run on two CPU ranks: a gloo process group of spawned processes, the scaffolding the
distributed test files share (test_distributed.py, test_q8_distributed.py, test_q8_dcp.py,
test_release_distributed.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this torch build")


# FSDP2 on CPU params: torch 2.6 stops in its all-gather (no record_event on CPU streams); 2.7
# sums the reduce-scattered grads of two gloo ranks (right on 2.11 and 2.13)
_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2])
needs_cpu_fsdp2 = pytest.mark.skipif(_TORCH < (2, 7), reason="FSDP2 on CPU params needs torch >= 2.7")
needs_two_rank_cpu_fsdp2 = pytest.mark.skipif(
    _TORCH < (2, 11), reason="FSDP2's reduce-scatter of CPU grads over gloo ranks needs torch >= 2.11")


def run_on_ranks(checks: dict, world: int = 2) -> dict:
    """``{rank: {name: checks[name](rank)}}``, the checks run in order on every rank of one gloo
    process group of ``world`` spawned processes.  A check is a module-level function of the
    rank (or a ``functools.partial`` of one: the processes unpickle it).  The ranks see no CUDA
    device: the checks compare with backend='numba' on CPU tensors, and fully_shard's default
    mesh would otherwise be the accelerator's."""
    results = mp.Manager().dict()
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.spawn(_worker, args=(world, _free_port(), checks, results), nprocs=world, join=True)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    return dict(results)


def _worker(rank: int, world: int, port: int, checks: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = {name: check(rank) for name, check in checks.items()}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
