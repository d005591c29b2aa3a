"""Run by torchrun from tests/unit/parallel/test_expert_parallel.py: one MoE layer with its experts
sharded over all ranks (expert parallelism), each rank feeding its own slice of a shared input.

    torchrun --nproc_per_node=N tests/expert_parallel_worker.py OUT.pt

Rank 0 writes, per case, the gathered outputs, input gradients, the router gradient (summed
over ranks: each rank's is the partial of its tokens) and the experts' full gradients, for the
test to compare with the same layer run on the whole input in one process (layer_case).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchllm.models.moe import MoE
from torchllm.parallel.expert_parallel import apply_ep
from torchllm.run.process_exit import exit_process

TOKENS_PER_RANK = 12
CASES = ("balanced", "skewed")  # skewed: every token routed to the first rank's experts


def layer_case(case: str, world: int):
    """The layer (seeded), the whole input and the output weights of the loss, for one case."""
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=24, n_experts=4 * world // 2, top_k=2)
    moe.init_weights(out_scale=1.0)
    if case == "skewed":  # large logits for the experts 0 and 1 (rank 0's) only
        with torch.no_grad():
            moe.gate.weight[:2] = moe.gate.weight[:2].abs() * 50
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * TOKENS_PER_RANK, 16, generator=g)
    if case == "skewed":
        x = x.abs()
    weights = torch.randn(world * TOKENS_PER_RANK, 16, generator=g)
    return moe, x, weights


def run(case: str, mesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    moe, x, weights = layer_case(case, world)
    apply_ep(moe, mesh)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x_local = x[rows].clone().requires_grad_(True)
    out = moe(x_local[None])[0]  # [batch, seq, dim] like a block's input
    (out * weights[rows]).sum().backward()
    gate_grad = moe.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    result = {"out": gather(out.detach()), "x_grad": gather(x_local.grad),
              "gate.weight": gate_grad, "counts": moe.tokens_per_expert.clone()}
    for name, p in moe.experts.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        result[f"experts.{name}"] = p.grad.full_tensor()
        result[f"local_shape.{name}"] = list(p.to_local().shape)
    return result


def gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    results = {case: run(case, mesh) for case in CASES}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # not sys.exit: see torchllm.run.process_exit
