"""What crosses between replica groups each step, through torchft's public API only.

torchft's `Manager.allreduce(tensor, reduce_op=...)` changed meaning between versions: before
torchft's "fix allreduce reduction scaling" (October 2025) its default was SUM and a SUM was
divided by the number of participants (an average); since then the default is AVG, and SUM
sums. So nothing here relies on the default or on what torchft divides by: every tensor crosses
with an explicit `SUM` and one extra element, 1.0, appended; after the reduce that element holds
what torchft turned the 1.0s into (the number of live groups, or 1 where SUM averaged), and
dividing by it gives the mean over the live groups in either version (`mean_over_groups`). A MAX
is never scaled, in any version.

Besides the gradients, each step averages the model's state that changes outside them
(`step_buffers`): the MoE layers' token loads (`expert_load`, the input of the aux-loss-free
routing bias update, models/moe.update_expert_bias: every group then moves its biases the same
way) and every persistent floating-point buffer (`expert_bias`; whatever a checkpoint saves
beside the parameters and an update rule may write). Without it each group's routing biases
follow its own tokens from the first step.
"""

from __future__ import annotations

import importlib.metadata
import weakref

import torch
import torch.distributed as dist

from torchllm.log import logger

TESTED_TORCHFT = "0.2.0"  # the version the tests run (pyproject's `ft` extra pins it)
_PERSISTENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> state names


def torchft_version() -> str:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def warn_untested_torchft() -> str | None:
    """One warning line when the installed torchft is not the tested one; returns it."""
    version = torchft_version()
    if version == TESTED_TORCHFT:
        return None
    line = (f"fault tolerance: torchft {version} is installed; torchllm is tested with torchft "
            f"{TESTED_TORCHFT} (pip install torchft=={TESTED_TORCHFT}): it uses only torchft's "
            "public Manager and ProcessGroup calls, but their behaviour may differ")
    logger.warning(line)
    return line


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def mean_over_groups(manager, tensors: list[torch.Tensor], weight: float = 1.0) -> bool:
    """Replace each tensor by its mean over the live groups, in place (one reduce per dtype
    and device; floating-point tensors only). `weight` 0.0: this group is not counted (it
    sends zeros and receives the others' mean: a group that healed into a sync, semi_sync.py);
    False when no group was counted (the tensors are then left zero)."""
    return _over_groups(manager, tensors, total=False, weight=weight)


def sum_over_groups(manager, tensors: list[torch.Tensor]) -> None:
    """Replace each tensor by its sum over the live groups, in place (exact where torchft's
    SUM sums, as in 0.2.0; the mean times the live groups where it averaged)."""
    _over_groups(manager, tensors, total=True)


def _over_groups(manager, tensors: list[torch.Tensor], total: bool, weight: float = 1.0) -> bool:
    tensors = [_local(t) for t in tensors]
    for key in dict.fromkeys((t.dtype, t.device) for t in tensors):
        same = [t for t in tensors if (t.dtype, t.device) == key]
        one = torch.full((1,), weight, dtype=key[0], device=key[1])
        flat = torch.cat([*(t.reshape(-1) for t in same), one])
        manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        # flat[-1]: the live groups where SUM summed, 1 where it averaged (module doc); the
        # counted ones only (weight 1.0), in either
        if total:
            flat = flat[:-1] * (manager.num_participants() / flat[-1])
        elif weight == 0.0 and flat[-1].item() == 0:  # no group counted (only an uncounted
            return False                              # one asks: no host sync otherwise)
        else:
            flat = flat[:-1] / flat[-1]
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return True


def max_over_groups(manager, tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone()
    manager.allreduce(out, reduce_op=dist.ReduceOp.MAX).wait()
    return out


def step_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers every group must hold equal (module doc): the MoE token loads and the
    persistent floating-point buffers. Constant tables (the RoPE cache) are not persistent."""
    persistent = _PERSISTENT.get(model)
    if persistent is None:  # (a model's buffers are registered once: the names looked up once)
        persistent = _PERSISTENT[model] = set(model.state_dict(keep_vars=True))
    out = []
    for name, buf in model.named_buffers():
        if not torch.is_floating_point(buf):
            continue
        if name in persistent or name.rsplit(".", 1)[-1] == "expert_load":
            out.append(buf)
    return out


def reset_step_loads(model: torch.nn.Module) -> None:
    """A step that did not commit runs again on new batches: its token loads are dropped."""
    for name, buf in model.named_buffers():
        if name.rsplit(".", 1)[-1] == "expert_load":
            buf.zero_()
