"""A replica group of two DDP ranks SIGKILLed and relaunched heals (issue 65 #7; #4).

Through scripts/ft_local.sh, as a user runs it: two groups of NGPU=2 CPU ranks each (DDP inside
a group, `parallelism.dp_mode=ddp`; the cross-group mean inside DDP's comm hook, bucket by
bucket: ft/overlap.py), group 1's whole process group SIGKILLed, then relaunched beside the
survivor. The buckets are small (1 MiB: the debug model's gradients fill many), so the
relaunched group's buckets must be its peer's from its first step on (fixed buckets,
ParallelPlan.static_ddp_buckets): each bucket's cross-group all-reduce pairs with the peer's.
The relaunch heals, trains in step (the same grad norms; buckets of another layout pair the
wrong all-reduces: gloo aborts the survivor), and both groups end with the same weights and
optimizer state, tensor by tensor. Four trainer processes on a loaded 2-core machine: the
survivor is throttled until the relaunch healed (builders/ft.py:Throttle), the waits are
generous. ~1-4 min.

The buckets themselves, in-process: four gloo ranks as two groups of two DDP ranks, one group
a step ahead (its buckets would have been rebuilt after that step) and the other fresh (a
relaunch, healed to its weights): the buckets the comm hook receives, in order and size, are
the same in both groups and in the survivor's first step, and the weights stay equal.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from builders.ft import assert_group_of_two_heals
from conftest import build_model, spawn_gloo


@pytest.mark.slow
def test_a_killed_ddp_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer(tmp_path):
    pytest.importorskip("torchft")  # (the buckets' test below runs without it)
    assert_group_of_two_heals(tmp_path, ["--parallelism.dp_mode=ddp",
                                         "--parallelism.ddp_bucket_cap_mb=1"],
                              "DDP 2 (comm hook none)", "DDP")


class PairedGroups:
    """torchft 0.2.0's Manager.allreduce (SUM sums) over the mesh's cross-group dim, which first
    checks that both groups reduce a tensor of the same size (a bucket of another layout would
    pair with the wrong bucket: gloo then fails or hangs; here every rank raises at once)."""

    def __init__(self, group):
        self.group = group

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        n = torch.tensor([tensor.numel(), -tensor.numel()])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        if n[0] != -n[1]:
            raise RuntimeError(f"the groups reduce buckets of {n[0]} and {-n[1]} elements")
        dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return type("Done", (), {"wait": lambda self: tensor})()

    def num_participants(self):
        return 2


def buckets_worker(rank: int, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchllm.ft.overlap import OverlappedMean
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer
    from torchllm.parallel.data_parallel import apply_ddp

    class Recorded(OverlappedMean):  # the size of each bucket the comm hook hands over
        sizes: list[int] = []

        def mean(self, tensor):
            self.sizes.append(tensor.numel())
            super().mean(tensor)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("groups", "group"))
    across, survivor = mesh["groups"].get_group(), mesh["groups"].get_local_rank() == 0
    # ~0.85 MiB of gradients per block: 1 MiB buckets, several of them
    args = LlamaArgs(dim=128, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=16,
                     rope_theta=10000.0)
    model = build_model(Transformer, args)
    apply_ddp(model, mesh["group"], bucket_cap_mb=1, static_buckets=True)  # (as under ft)
    hooks = Recorded(PairedGroups(across))
    dims = SimpleNamespace(ddp_enabled=True, mesh={"dp_replicate": mesh["group"]})
    assert hooks.install(model, dims) == "DDP"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))

    def step(active: bool) -> list[int]:
        hooks.sizes, hooks.active = [], active
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                          tokens[:, 1:].flatten()).backward()
        hooks.active = False
        opt.step()
        opt.zero_grad()
        return hooks.sizes

    first = step(False) if survivor else []  # the survivor's first step, alone
    for p in model.parameters():  # the relaunch heals: the survivor's weights, rank by rank
        dist.broadcast(p.data, group=across, group_src=0)
    both = step(True)  # the relaunch's first step, the survivor's second: the groups' mean
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    theirs = [torch.zeros_like(weights), torch.zeros_like(weights)]
    dist.all_gather(theirs, weights, group=across)
    (tmp_path / f"buckets{rank}.json").write_text(json.dumps({
        "survivor": survivor, "first": first, "both": both,
        "weights_equal": torch.equal(theirs[0], theirs[1])}))


@pytest.mark.slow
def test_a_relaunched_ddp_groups_buckets_are_its_peers_from_its_first_step(tmp_path):
    spawn_gloo(buckets_worker, tmp_path, world=4)
    runs = [json.loads((tmp_path / f"buckets{rank}.json").read_text()) for rank in range(4)]
    survivors = [r for r in runs if r["survivor"]]
    assert len(survivors) == 2 and all(len(r["both"]) >= 3 for r in runs), runs  # several
    for r in runs:  # the relaunch's buckets are the survivor's, which never changed
        assert r["both"] == runs[0]["both"] and r["weights_equal"], r
    for r in survivors:
        assert r["first"] == r["both"], r
