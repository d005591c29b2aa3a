"""comm.init_timeout_seconds / comm.train_timeout_seconds on 2 real gloo ranks (issue 21, item 4):
every process group of the mesh gets the init timeout, then the train timeout, which really
fails a collective that a rank is late for."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchllm.parallel import ParallelDims, set_comm_timeout

from conftest import preloaded_forkserver


def timeouts(dims: ParallelDims) -> list[float]:
    """The collective timeout (seconds) of the default group and of each mesh group."""
    groups = [dist.group.WORLD, dims.dp_group, dims.dp_shard_cp_mesh.get_group(),
              *(dims.mesh.get_group(d) for d in range(dims.mesh.ndim))]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in groups]


def worker(rank: int, tmp_path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
    dims.build_mesh(torch.device("cpu"), timeout_s=77)
    result = {"init": timeouts(dims)}
    set_comm_timeout(dims, 2)
    result["train"] = timeouts(dims)
    t = torch.ones(1)
    if rank == 1:
        time.sleep(6)  # late for the all-reduce by more than the 2 s train timeout
    else:
        start = time.perf_counter()
        try:
            dist.all_reduce(t)
            result["late_rank"] = "waited"
        except Exception as e:  # gloo: "Timed out waiting ... for recv"
            result["late_rank"] = f"failed: {type(e).__name__}"
        result["seconds"] = time.perf_counter() - start
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the group is broken on purpose: no teardown


@pytest.mark.slow
def test_init_then_train_timeout_on_every_group(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(tmp_path, port), nprocs=2, join=True,
                       start_method=preloaded_forkserver())
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        n = 3 + 5  # world, dp, dp_shard x cp, and the mesh's 5 dims (pp dp_replicate dp_shard cp tp)
        assert r["init"] == [77.0] * n
        assert r["train"] == [2.0] * n
    assert results[0]["late_rank"].startswith("failed"), results[0]
    assert results[0]["seconds"] < 5.5, results[0]


def test_trainer_switches_to_the_train_timeout_after_its_first_step(tmp_path, monkeypatch):
    from torchllm import train
    from torchllm.train import Trainer

    from conftest import tiny_config

    calls = []
    monkeypatch.setattr(train, "set_comm_timeout", lambda dims, s: calls.append(s))
    trainer = Trainer(tiny_config(tmp_path, "--comm.train_timeout_seconds=42",
                                  "--training.steps=2"))
    trainer.train()
    assert calls == [42]
