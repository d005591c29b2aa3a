"""Cluster ergonomics without a cluster: the first-collective guard, env_check, dry_run."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def _first_collective_rank(rank: int, store_path: str, late_s: float, timeout_s: float, q):
    from torchllm.parallel import FirstCollectiveError, first_collective

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        if rank == 1:
            time.sleep(late_s)  # a rank that is not there yet (a hung node, a wrong interface)
        try:
            first_collective(torch.device("cpu"), timeout_s=timeout_s)
            q.put((rank, "ok"))
        except FirstCollectiveError as e:
            q.put((rank, str(e)))
        # The late rank's all-reduce meets rank 0's pending one; then both agree to finish.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, late_s: float, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_first_collective_rank,
                         args=(r, str(tmp_path / "store"), late_s, timeout_s, q))
             for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_first_collective_passes_when_every_rank_joins(tmp_path):
    assert run_two_ranks(tmp_path, late_s=0, timeout_s=30) == {0: "ok", 1: "ok"}


def test_first_collective_timeout_names_the_nccl_settings(tmp_path):
    out = run_two_ranks(tmp_path, late_s=4, timeout_s=1)
    message = out[0]
    assert "did not complete in 1 s" in message and "rank 0 of 2" in message
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "env_check"):
        assert var in message
    assert out[1] == "ok"  # the late rank met rank 0's pending all-reduce


def test_first_collective_is_a_no_op_without_a_process_group():
    from torchllm.parallel import first_collective

    assert not dist.is_initialized()
    first_collective(torch.device("cpu"), timeout_s=0.1)
