"""What a resume keeps from the checkpoint and what it takes from the new config.

Every step folder holds the `config.toml` it was written under. At resume, keys whose value
differs are listed in one warning with what wins: the optimizer's hyperparameters (the keys
its OptimizerSpec.hparams names: peak LR, betas, eps, weight decay for AdamW) come back with the
optimizer state unless `checkpoint.optimizer_hparams_from = "config"`; every other key takes the
new value (the LR schedule's shape and length included: it is a function of the step, rebuilt
from the config).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.checkpoint.layout import complete_steps, not_resumable, step_dir
from torchllm.checkpoint.step import MarkerError, read_marker
from torchllm.config import flat_toml
from torchllm.optim.registry import resume_hparams
from torchllm.storage import Location

# Keys that say how this launch runs, not what the run is.
LAUNCH_ONLY = {"checkpoint.load_step", "training.stop_after_steps",
               "training.time_limit_minutes", "job.print_config", "job.config_file"}


def config_changes(saved_toml: str, current_toml: str, hparams_from: str) -> list[str]:
    """'key: old -> new (what wins)' for each key that differs (missing values are 'unset')."""
    old, new = flat_toml(saved_toml), flat_toml(current_toml)
    # The optimizer's keys that live in its param groups, hence in the checkpoint (its spec's).
    hparams = resume_hparams(*{str(c.get("optimizer.name", "adamw")) for c in (old, new)})
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in LAUNCH_ONLY or old.get(key) == new.get(key):
            continue
        if key in hparams and hparams_from == "checkpoint":
            wins = "the checkpoint's value is kept; checkpoint.optimizer_hparams_from = " \
                   "'config' applies the new one"
        else:
            wins = "the new value applies"
        changes.append(f"{key}: {old.get(key, 'unset')!r} -> {new.get(key, 'unset')!r} ({wins})")
    return changes


def recorded_precision(folder: Location, load_step: int, device: torch.device) -> str | None:
    """The precision ("bf16" or "fp32") recorded in the marker of the checkpoint a resume from
    the checkpoint folder `folder` tries first (`load_step`, checkpoint.load_step; or the newest
    with a readable marker), as rank 0 reads it: every rank gets the same answer. None: no
    checkpoint, or one saved before precision was recorded."""
    found = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        steps = [s for s in complete_steps(folder) if load_step in (-1, s)]
        for step in reversed(steps):
            try:
                record = read_marker(step_dir(folder, step))
            except MarkerError:
                continue  # never loaded: the loader falls back past it
            if step and not_resumable(record) and load_step == -1:
                continue  # passed over by the resume (weights only, or saved while skipping)
            if record.get("precision") in ("bf16", "fp32"):
                found[0] = record["precision"]
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0, device=device if device.type == "cuda" else None)
    return found[0]


def hparams_snapshot(optimizer) -> list[dict]:
    """The configured hyperparameters of every param group (everything but the params)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_hparams(optimizer, lr_scheduler, snapshot: list[dict]) -> None:
    """After loading: put the configured hyperparameters back and re-derive the current LR
    from the (new) peak LR and the schedule at the restored step."""
    groups = optimizer.param_groups
    if len(groups) != len(snapshot):
        raise ValueError(f"{len(groups)} param groups after loading, {len(snapshot)} configured")
    for group, hp in zip(groups, snapshot):
        group.update(hp)
    if lr_scheduler is not None:
        lr_scheduler.base_lrs = [g["initial_lr"] for g in groups]
        current_lr(optimizer, lr_scheduler)


def current_lr(optimizer, lr_scheduler) -> None:
    """After loading: the LR of the next step from this config's schedule (its length and
    shape may have changed: training.steps) at the restored step, not the one the checkpoint's
    schedule had set for it."""
    groups = optimizer.param_groups
    done = lr_scheduler.last_epoch
    for group, base, factor in zip(groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
        group["lr"] = base * factor(done)
    lr_scheduler._last_lr = [g["lr"] for g in groups]
