"""The cross-group gradient mean inside the group's own gradient reduction (overlapped with
backward), as TorchTitan does with torchft.

Inside a replica group, FSDP2 reduce-scatters each block's gradients as soon as backward is
done with that block, and DDP all-reduces each bucket as soon as its gradients are ready. The
mean over the live groups is hooked into the same places, so it runs block by block (bucket by
bucket) while backward still works on the blocks before, instead of over every gradient once
backward has finished:

    FSDP2 / HSDP   FSDPModule.set_all_reduce_hook on every FSDP2 unit: the unit's reduced
                   gradient shard (after the group's reduce-scatter, and its all-reduce under
                   HSDP), before FSDP2 divides it and hands it to the sharded parameters
    DDP            a comm hook per bucket: the group's mean (what DDP's default reduction
                   computes: divide by the group's size, sum), then the groups' mean

Both cross with ft/reduce.py's explicit SUM and count (`mean_over_groups`), as the
after-backward path does, so the numbers are the same. The buckets of DDP must be the same in
every group: a relaunched group's DDP would otherwise start from its initial buckets while its
peers had rebuilt theirs after their first step (apply_ddp's `static_buckets`, as torchft's own
DDP does). The hooks act only inside a step (between the quorum and the commit vote): a
backward elsewhere (a benchmark's probe) reduces within the group only.

Where neither wrapper holds a parameter (a group of one rank; DDP with a compressing comm hook
of its own) its gradient keeps the after-backward path (ReplicaGroups.average).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchllm.ft.reduce import mean_over_groups


class OverlappedMean:
    """The hooks of one model; `active` says whether the step's reduction crosses groups now,
    `covered` holds the parameters whose gradients the hooks average (id()s)."""

    def __init__(self, manager):
        self.manager = manager
        self.active = False
        self.covered: set[int] = set()
        self.kind = ""  # "FSDP2" / "DDP" / "" (nothing hooked)
        self.calls = 0  # cross-group reductions run inside the group's reduction (tests)

    def mean(self, tensor: torch.Tensor) -> None:
        if self.active:
            self.calls += 1
            mean_over_groups(self.manager, [tensor])

    def install(self, model: nn.Module, dims, ddp_comm_hook: str = "none") -> str:
        """Hook into the model's FSDP2 units or its DDP (`dims`: the group's ParallelDims),
        before its first forward; returns what was hooked ("" if nothing: every gradient then
        crosses after backward)."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if units:
            for unit in units:
                unit.set_all_reduce_hook(self.mean)
                # (every parameter under a unit: the root unit holds what no block holds)
                for p in unit.parameters():
                    self.covered.add(id(p))
            self.kind = "FSDP2"
        elif dims is not None and dims.ddp_enabled and ddp_comm_hook == "none":
            # (DDP's replicate registers the hook at its lazy init, the first forward)
            group = dims.mesh["dp_replicate"].get_group()
            model.register_comm_hook((group, self.mean), ddp_mean_hook)
            self.covered.update(id(p) for p in model.parameters())
            self.kind = "DDP"
        return self.kind

    def after_backward(self, model: nn.Module) -> list[torch.Tensor]:
        """The gradients the hooks did not average (the after-backward path's)."""
        return [p.grad for p in model.parameters()
                if p.grad is not None and id(p) not in self.covered]


def ddp_mean_hook(state: tuple[dist.ProcessGroup, Callable], bucket):
    """DDP comm hook: the bucket's mean over the group's ranks (as DDP computes it without a
    hook: divided by the group's size, then summed), then over the live replica groups."""
    group, mean = state
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    dist.all_reduce(buf, group=group)
    mean(buf)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut

