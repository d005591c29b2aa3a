"""What a relaunched replica group receives from a live peer to train in step with it.

The peer's state at the start of the step both are about to run: weights, optimizer state, LR
schedule, data position, counters (step, tokens seen) and the loss guard's and callbacks' state.
Tensors travel as local tensors (an FSDP2 group's rank sends its own shard to the same rank of
the receiving group, whose layout is the same), and go back into the receiver's own tensors.
The data position is the peer's count of batches read: each group reads its own part of the data
(its replica id), so the receiver continues its own part at the same count. It travels as data
(torchllm/ft/transport.py: raw tensors and JSON, to and from groups with the run's shared secret
only, after their identity records agreed that they are of one run and config, identity.py);
load_state_dict checks the peer's weights' names, shapes and dtypes against this group's own.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchllm.config.job_config import ConfigError


def _local(value):
    """`value` with every DTensor replaced by its local shard (nested dicts/lists kept)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "optimizers", [optimizer]))  # an OptimizerList's children


def rank_free_position(loader) -> bool:
    """Whether the loader's position is a count of batches, the same meaning in every group
    (window sources and their mixtures); a stream's position is its own group's offset."""
    from torchllm.data.windows import IndexedBatches

    dataset = loader.dataset
    return isinstance(dataset, IndexedBatches) and "streams" not in dataset.state_dict()


class HealState:
    """The state_dict()/load_state_dict() pair torchft's Manager sends and applies."""

    def __init__(self, model, optimizer, lr_scheduler, loader, train_state, others: dict,
                 restart_data):
        if not rank_free_position(loader):
            raise ConfigError(
                "fault_tolerance.enable with a streamed data source is not supported: a "
                "stream's position is its own group's, and a relaunched group could not take "
                "it from a peer; use window sources (local files, shards:, embedded, mixtures "
                "of them)", "fault_tolerance.enable")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.loader, self.train_state, self.others = loader, train_state, others
        self.restart_data = restart_data  # the trainer's: a new iterator at the loaded position
        self.healed_at: int | None = None  # the step of the last heal (for the console note)

    def state_dict(self) -> dict:
        data = dict(self.loader.state_dict())
        data.pop("dp_rank")  # the sender's; the receiver keeps its own part of the data
        return {
            "model": _local(self.model.state_dict()),
            "optimizer": [_local(o.state_dict()) for o in _optimizers(self.optimizer)],
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": data,
            "train_state": self.train_state.state_dict(),
            "others": {k: o.state_dict() for k, o in self.others.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        own = self.model.state_dict()
        if problem := _other_model(own, sd["model"]):
            raise ConfigError(f"fault tolerance: a heal from a live peer refused: {problem}; "
                              "replica groups must run the same model config (model.*)",
                              "fault_tolerance.enable")
        for opt, state in zip(_optimizers(self.optimizer), sd["optimizer"]):
            if problem := _other_optimizer(opt, state):
                raise ConfigError(f"fault tolerance: a heal from a live peer refused: {problem}",
                                  "fault_tolerance.enable")
        for name, tensor in own.items():
            _local(tensor).copy_(sd["model"][name])
        for opt, state in zip(_optimizers(self.optimizer), sd["optimizer"]):
            opt.load_state_dict(state)
            _shard_like_params(opt)
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        self.loader.load_state_dict({**sd["data"], "dp_rank": self.loader.dp_rank})
        self.train_state.load_state_dict(sd["train_state"])
        for key, obj in self.others.items():
            obj.load_state_dict(sd["others"][key])
        self.restart_data()
        self.healed_at = self.train_state.step


def _other_model(own: dict, theirs: dict) -> str | None:
    """How the peer's weights differ from this group's (names, then shapes), or None."""
    if set(own) != set(theirs):
        return (f"the peer's model has other weights than this group's "
                f"({', '.join(sorted(set(own) ^ set(theirs))[:4])})")
    for name, tensor in own.items():
        if not isinstance(theirs[name], torch.Tensor):
            return f"weight {name} is a {type(theirs[name]).__name__} in the peer's state"
        mine, peer = tuple(_local(tensor).shape), tuple(theirs[name].shape)
        if mine != peer:
            return f"weight {name} is {list(peer)} in the peer's model, {list(mine)} here"
        if tensor.dtype != theirs[name].dtype:
            return f"weight {name} is {theirs[name].dtype} in the peer's model, {tensor.dtype} here"
    return None


def _other_optimizer(optimizer, theirs) -> str | None:
    """How the peer's optimizer state does not fit this group's parameters (their index, the
    shape of each per-parameter tensor), or None."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = theirs.get("state") if isinstance(theirs, dict) else None
    if not isinstance(state, dict):
        return "the peer's optimizer state is not a state_dict"
    for index, entry in state.items():
        if not (type(index) is int and 0 <= index < len(params) and isinstance(entry, dict)):
            return f"optimizer state for parameter {index!r}, this group has {len(params)}"
        shape = tuple(_local(params[index]).shape)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                return (f"optimizer state {key} of parameter {index} is {list(value.shape)} in "
                        f"the peer's, {list(shape)} here")
    return None


def _shard_like_params(optimizer) -> None:
    """After loading local tensors: a DTensor parameter's state tensors become DTensors again
    (same mesh and placements as the parameter; scalars such as Adam's step stay plain)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) \
                        and v.shape == p.to_local().shape and v.dim() > 0:
                    state[k] = DTensor.from_local(v, p.device_mesh, p.placements,
                                                  run_check=False)
