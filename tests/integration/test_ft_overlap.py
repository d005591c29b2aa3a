"""The cross-group gradient mean inside FSDP2's / DDP's reduction (issue 65 #4; ft/overlap.py).

Four gloo ranks as two replica groups of two ranks (ranks 0-1 and 2-3, a 2 x 2 mesh: the group
dim shards (FSDP2) or replicates (DDP) inside a group, the other dim joins the groups, as
torchft's process group does), each group its own batch. One copy of the model averages across
groups in its reduction hooks (the overlapped path), another one after backward
(ReplicaGroups.average's path, today's): the gradients, and the weights after an update, must
be the same; and the hooks must really have run (the group's own gradients differ between the
groups before the mean).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import build_model, spawn_gloo, tiny_args


class GroupsManager:
    """torchft 0.2.0's Manager.allreduce (SUM sums) over the mesh's cross-group dim."""

    def __init__(self, group):
        self.group = group

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return type("Done", (), {"wait": lambda self: tensor})()

    def num_participants(self):
        return 2


def worker(rank: int, tmp_path, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchllm.ft.overlap import OverlappedMean
    from torchllm.ft.reduce import mean_over_groups
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer
    from torchllm.parallel.data_parallel import apply_ddp, apply_fsdp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("groups", "group"))
    manager = GroupsManager(mesh["groups"].get_group())
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16,
                     rope_theta=10000.0)
    overlapped = build_model(Transformer, args)
    after = copy.deepcopy(overlapped)
    for model in (overlapped, after):
        if layout == "fsdp":
            apply_fsdp(model, mesh["group"], param_dtype=torch.float32,
                       reduce_dtype=torch.float32)
        else:
            apply_ddp(model, mesh["group"], bucket_cap_mb=1, static_buckets=True)

    # what install reads of the group's ParallelDims (DDP replicates over the group's dim)
    dims = SimpleNamespace(ddp_enabled=layout == "ddp", mesh={"dp_replicate": mesh["group"]})
    hooks = OverlappedMean(manager)
    assert hooks.install(overlapped, dims) == {"fsdp": "FSDP2", "ddp": "DDP"}[layout]
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, model in (("overlapped", overlapped), ("after", after)):
        hooks.active = name == "overlapped"  # (as ReplicaGroups: inside a step only)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        hooks.active = False
        if name == "after":  # today's path: the group's reduction, then every gradient
            own = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                   for p in model.parameters()]
            mean_over_groups(manager, hooks.after_backward(model))  # (nothing hooked here)
        out[name] = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                     for p in model.parameters()]
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        out[name + "_weights"] = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                                  for p in model.parameters()]
    # the group's own gradients, gathered over the groups: they differ (each its own batch)
    theirs = [torch.zeros_like(g) for g in own]
    for g, t in zip(own, theirs):
        gathered = [torch.zeros_like(g), torch.zeros_like(g)]
        dist.all_gather(gathered, g, group=mesh["groups"].get_group())
        t.copy_(gathered[1 - mesh["groups"].get_local_rank()])
    result = {
        "calls": hooks.calls,
        "groups_differ": all(not torch.equal(g, t) for g, t in zip(own, theirs)),
        "grad_diff": max((a - b).abs().max().item()
                         for a, b in zip(out["overlapped"], out["after"])),
        "grad_scale": max(b.abs().max().item() for b in out["after"]),
        "oracle_diff": max((a - (g + t) / 2).abs().max().item()
                           for a, g, t in zip(out["overlapped"], own, theirs)),
        "weight_diff": max((a - b).abs().max().item()
                           for a, b in zip(out["overlapped_weights"], out["after_weights"])),
    }
    (tmp_path / f"{layout}{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_the_mean_across_groups_inside_the_groups_reduction_equals_the_after_backward_one(
        tmp_path, layout):
    spawn_gloo(worker, tmp_path, layout, world=4)
    for rank in range(4):
        r = json.loads((tmp_path / f"{layout}{rank}.json").read_text())
        assert r["calls"] >= 1 and r["groups_differ"], r  # the hooks ran, on different grads
        # the same sums in the same order: ~1 ulp at most (division by 2 and 4 is exact)
        assert r["grad_diff"] <= 1e-6 * r["grad_scale"], r
        assert r["oracle_diff"] <= 1e-6 * r["grad_scale"], r  # the mean of both groups'
        assert r["weight_diff"] <= 1e-6, r


@pytest.mark.slow
def test_the_benchmark_reports_fault_tolerances_per_step_cost_at_the_tiniest_shape(tmp_path):
    """benchmarks/bench_fault_tolerance.py --cost-only: 2 groups through ft_local.sh (overlap on,
    off) and the same 2 launches without torchft, 3 steps each, 1 rank a group (the cheapest:
    there the overlapped path has no group reduction to hook into; the docs' table has 2)."""
    from cli import run_script

    out = tmp_path / "cost.json"
    ran = run_script("benchmarks/bench_fault_tolerance.py", "--cost-only", "--cost-steps=3",
                     "--ranks=1", f"--json={out}", "--timeout=500", "--training.seq_len=32",
                     "--training.local_batch_size=2", "--data.tokenizer=bytes",
                     "--lr_scheduler.warmup_steps=1", timeout=600)
    assert ran.returncode == 0, ran.out[-3000:]
    result = json.loads(out.read_text())
    assert "cores" in result["machine"] and result["machine"] in ran.stdout  # detected now
    cost = result["step_cost"]
    for name in ("without_torchft_ms", "overlapped_ms", "after_backward_ms"):
        assert cost[name] > 0, cost
    for name in ("overlapped", "after_backward"):  # each against the run without torchft
        assert cost[f"{name}_cost_ms"] == round(cost[f"{name}_ms"]
                                                 - cost["without_torchft_ms"], 1), cost
        assert f"{cost[f'{name}_cost_ms']:+} ms" in ran.stdout
    assert "| without torchft (2 launches side by side) |" in ran.stdout


@pytest.mark.slow
def test_groups_that_average_in_different_places_refuse_each_other_naming_the_key(tmp_path):
    """An overlapped group all-reduces per FSDP2 unit, the other once after backward: their
    all-reduces would not line up, so the identity check refuses the pair first."""
    from messages import assert_names
    from torchllm.config import load_config
    from torchllm.ft.identity import group_record, refusal
    from torchllm.train import Trainer

    records = []
    for overlap in ("true", "false"):
        t = Trainer(load_config(tiny_args(
            tmp_path / overlap, "--data.tokenizer=bytes", "--validation.enable=false",
            "--eval.sample_freq=0", "--checkpoint.enable=false", "--training.steps=3",
            f"--fault_tolerance.overlap={overlap}")))
        try:
            records.append(group_record(t.context, "run"))
        finally:
            t.close()
    assert_names(refusal(records[1], records[0], "http://lh:1"), "fault_tolerance.overlap",
                 "True", "False")
