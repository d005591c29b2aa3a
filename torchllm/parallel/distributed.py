"""What the training loop needs across ranks: gradient-sync control, dp reductions, clipping."""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch import nn
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
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter of this micro-step unless `enabled`.

    With accumulation only the last micro-step's backward needs to communicate: DDP keeps
    accumulating local grads (its `no_sync`) and FSDP2 keeps unsharded grads until then. Wrap
    forward and backward: DDP reads the flag in its forward pre-hook, FSDP2 in backward.
    """
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None or enabled:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


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
NCCL_HINT = (
    "check the network settings NCCL uses: NCCL_P2P_DISABLE=1 (GPUs without NVLink/P2P "
    "between them), NCCL_IB_DISABLE=1 (no InfiniBand: use TCP sockets), NCCL_SOCKET_IFNAME=<iface> "
    "(the interface the nodes reach each other on, e.g. eth0; see `ip addr`), and NCCL_DEBUG=INFO "
    "for NCCL's own log; `python -m torchllm.tools.env_check` prints what this node has"
)


class FirstCollectiveError(RuntimeError):
    """The first collective of a run timed out or failed: usually the network, not the code."""


def first_collective(device: torch.device, timeout_s: float, group=None) -> None:
    """All-reduce one number over `group` (default: the world) as the run's first collective.

    A misconfigured network shows up here as a hang or an NCCL error; this turns both into a
    FirstCollectiveError after `timeout_s` seconds that names the settings to check
    (NCCL_HINT). The caller owns the timeout (e.g. a config value); it is not read here.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    where = f"rank {dist.get_rank()} of {dist.get_world_size()}, backend {dist.get_backend(group)}"
    try:
        t = torch.ones(1, device=device)
        work = dist.all_reduce(t, group=group, async_op=True)
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise FirstCollectiveError(
                    f"the first all-reduce ({where}) did not complete in {timeout_s:g} s: a rank "
                    f"is missing or the ranks cannot reach each other; {NCCL_HINT}")
            time.sleep(0.01)
        work.wait()
        total = t.item()
    except FirstCollectiveError:
        raise
    except Exception as e:  # NCCL/gloo errors: "unhandled system error", connection refused...
        raise FirstCollectiveError(f"the first all-reduce ({where}) failed: {e}; {NCCL_HINT}"
                                   ) from e
    if total != size:
        raise FirstCollectiveError(
            f"the first all-reduce ({where}) summed {size} ones to {total:g}: the transport "
            f"corrupts data; {NCCL_HINT}")
