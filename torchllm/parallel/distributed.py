"""What the training loop needs across ranks: gradient-sync control, dp reductions, clipping."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchllm.parallel.dims import ParallelDims


@contextlib.contextmanager
def rank_zero_first(parallel_dims: ParallelDims):
    """Rank 0 runs the body first (e.g. to build a shared cache file), then the others do."""
    distributed = parallel_dims.mesh is not None
    if distributed and dist.get_rank() != 0:
        dist.barrier()
    yield
    if distributed and dist.get_rank() == 0:
        dist.barrier()


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool, pcfg=None):
    """Skip the gradient all-reduce of this micro-step unless `enabled` (the last micro-step).

    DDP keeps accumulating whole local gradients until the last micro-step (its `no_sync`):
    a DDP rank holds whole gradients anyway, so skipping costs no memory. FSDP2 is different:
    skipping its reduce-scatter keeps every rank's unsharded fp32 gradients of the whole model
    until the last micro-step. So FSDP2 reduce-scatters every micro-step by default (each
    backward's gradients are reduced and added to the sharded ones, 1/shard of them per rank);
    `parallelism.fsdp_reduce_every_microstep = false` (`pcfg`) skips it as DDP does: one
    reduce-scatter per step, for communication-bound runs that have the memory. Wrap forward
    and backward: DDP reads the flag in its forward pre-hook, FSDP2 in backward.
    """
    setter = getattr(model, "set_requires_gradient_sync", None)
    every_step = isinstance(model, FSDPModule) and reduce_every_microstep(pcfg)
    if setter is None or enabled or every_step:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def reduce_every_microstep(pcfg) -> bool:
    """parallelism.fsdp_reduce_every_microstep (its default, true, without a config)."""
    return getattr(pcfg, "fsdp_reduce_every_microstep", True)


def dp_sum(value: torch.Tensor, parallel_dims: ParallelDims) -> torch.Tensor:
    """A device tensor summed over the data-parallel ranks (a new tensor; no host sync)."""
    if parallel_dims.mesh is None or not parallel_dims.dp_enabled:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, group=parallel_dims.dp_group)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one (a MAX all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.full((1,), int(flag), device=device)  # a fill, not a blocking host-to-device copy
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def set_comm_timeout(parallel_dims: ParallelDims, seconds: float) -> None:
    """Give every process group of the run (the default one, each mesh dim's, the flattened
    dp one) a new collective timeout, on every backend (NCCL, gloo). A no-op for one process.

    TorchTitan's pattern: a long timeout while rank 0 alone builds caches or compiles, then a
    shorter one once every rank has finished a step. The ranks meet at a barrier first, so no
    collective still in flight from before is measured against the new timeout.
    """
    if parallel_dims.mesh is None:
        return
    dist.barrier()
    parallel_dims.set_timeout(seconds)


def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, foreach: bool | None = None,
    pp_group=None,
) -> torch.Tensor:
    """Clip the total gradient norm; correct when parameters are sharded DTensors.

    The norm of a sharded DTensor gradient is a partial value on each rank; `full_tensor()`
    reduces it over the mesh so every rank clips by the same, global norm. Plain tensors (DDP,
    single device) are already whole and go through unchanged. Under pipeline parallelism each
    rank holds other stages' parameters: the norms are combined over `pp_group` too.
    """
    params = [p for p in parameters if p.grad is not None]
    # DTensors on different meshes (expert parallelism's experts beside FSDP2's other weights)
    # cannot meet in one op: take each mesh's norm, reduce it, then combine the plain numbers.
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, group=pp_group)
            total = total ** (1.0 / norm_type)
    if max_norm > 0 and math.isfinite(max_norm):
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


# What users of cloud nodes needed when the first collective hung or failed (docs/gpu.md).
