"""Monitoring over 2 real processes (gloo): dp reductions, norms of sharded DTensors, and one
TensorBoard folder per rank."""

import json

import pytest
import torch
import torch.distributed as dist

from conftest import spawn_gloo, tiny_config


def worker(rank: int, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from torchllm.metrics import norms
    from torchllm.metrics.norms import l2_norm, l2_norms, track_update
    from torchllm.metrics.reduce import loss_stats, to_host
    from torchllm.config.paths import tensorboard_folder
    from torchllm.metrics.writers import build_writers

    # Rank 0: 3 tokens, summed loss 6 (mean 2); rank 1: 5 tokens, summed loss 20 (mean 4).
    loss_sum, n_tokens = [(6.0, 3), (20.0, 5)][rank]
    stats = to_host(loss_stats(torch.tensor(loss_sum), n_tokens, with_max=True))

    torch.manual_seed(0)  # the same full tensor on both ranks, then sharded by rows
    full = torch.randn(8, 5)
    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    norm = l2_norm([sharded])
    # Several sharded tensors and a replicated one (its shares are not summed over the mesh):
    # one all-reduce for them all.
    calls = []
    real_all_reduce = norms.dist.all_reduce
    norms.dist.all_reduce = lambda t, **kw: calls.append(t.numel()) or real_all_reduce(t, **kw)
    together = l2_norms({"a": [sharded, distribute_tensor(2 * full, mesh, [Shard(1)])],
                         "r": [distribute_tensor(full, mesh, [Replicate()])]})
    norms.dist.all_reduce = real_all_reduce
    # A Partial DTensor (pending sum; not a parameter layout): the norm of the ranks' sum.
    partial = l2_norms({"p": [DTensor.from_local(full * (rank + 1), mesh, [Partial()])]})
    out = {}
    with track_update({"w": [sharded]}, out):
        sharded.data.mul_(1.5)  # an update of exactly 0.5·W

    cfg = tiny_config(tmp_path, "--metrics.rank_0_only=false")
    (writer,) = build_writers(cfg.metrics, tensorboard_folder(cfg.job, cfg.metrics, "run"),
                              "run", tmp_path / "run", dist.get_rank())
    writer.write(1, {"loss/avg": stats["loss"]})
    writer.close()
    result = {**stats, "norm": norm, "full_norm": full.norm().item(), **out,
              "together": together, "all_reduces": calls, "partial": partial}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_reductions_norms_and_per_rank_folders_over_two_ranks(tmp_path):
    spawn_gloo(worker, tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["loss"] == pytest.approx(26 / 8)  # sum of losses / sum of tokens
        assert r["loss_max"] == pytest.approx(4.0)
        assert r["tokens"] == 8
        assert r["norm"] == pytest.approx(r["full_norm"], rel=1e-6)  # the global, not a shard
        assert r["together"]["a"] == pytest.approx(5 ** 0.5 * r["full_norm"], rel=1e-6)
        assert r["together"]["r"] == pytest.approx(r["full_norm"], rel=1e-6)
        assert r["all_reduces"] == [2]  # both sharded tensors' shares in one all-reduce
        assert r["partial"]["p"] == pytest.approx(3 * r["full_norm"], rel=1e-6)  # 1x + 2x
        assert r["update_ratio/w"] == pytest.approx(0.5, rel=1e-6)
        assert r["param_norm/w"] == pytest.approx(1.5 * r["full_norm"], rel=1e-6)
    for rank in (0, 1):
        assert list((tmp_path / "tb" / "run" / f"rank_{rank}").glob("events.out.tfevents.*"))
