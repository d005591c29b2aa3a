"""What a relaunched replica group receives from a live peer to train in step with it.

The peer's state at the start of the step both are about to run: the run's one training state
(torchllm/checkpoint/training_state.py: the list a checkpoint saves too), every piece but the
rank-local ones (RNG states; the data loader sends what it says a peer may take, its position
without its rank). Tensors travel as local tensors (an FSDP2 group's rank sends its own shard to
the same rank of the receiving group, whose layout is the same), and go back into the receiver's
own tensors. The data position is the peer's count of batches read: each group reads its own
part of the data (its replica id), so the receiver continues its own part at the same count. It
travels as data (torchllm/ft/transport.py: raw tensors and JSON, to and from groups with the
run's shared secret only, after their identity records agreed that they are of one run and
config, identity.py); load_state_dict checks the peer's pieces' names and its weights' and
optimizer states' names, shapes and dtypes against this group's own before changing anything.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchllm.checkpoint.training_state import MODEL, OPTIMIZER
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


def _refused(problem: str) -> ConfigError:
    return ConfigError(f"fault tolerance: a heal from a live peer refused: {problem}",
                       "fault_tolerance.enable")


class HealState:
    """The state_dict()/load_state_dict() pair torchft's Manager sends and applies: the pieces
    of `state` (a TrainingState) a peer may take. `restart_data`: the loop's, a new iterator at
    the loader's just restored position."""

    def __init__(self, state, restart_data):
        self.state, self.pieces = state, state.sent()
        for piece in self.pieces.values():  # a piece no peer could take: refused at launch
            getattr(piece.peer, "check", lambda: None)()
        self.train_state = state.get("train_state")  # the step counter
        self.restart_data = restart_data
        self.healed_at: int | None = None  # the step of the last heal (for the console note)

    def state_dict(self) -> dict:
        return {name: _sent(piece) for name, piece in self.pieces.items()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if set(sd) != set(self.pieces):
            raise _refused(f"the peer sends the pieces {', '.join(sorted(sd))}, this group has "
                           f"{', '.join(self.pieces)}; replica groups must run the same "
                           "config")
        for name, piece in self.pieces.items():  # every check before anything changes
            if problem := _misfit(piece, sd[name]):
                raise _refused(problem)
        for name, piece in self.pieces.items():
            _apply(piece, sd[name])
        self.restart_data()
        self.healed_at = self.train_state.step


def _sent(piece):
    """What a heal sends of `piece`: local tensors for the model and optimizers, an object's
    state_dict() (or its `peer` form) as data."""
    if piece.peer is not None:
        return piece.peer.state_dict()
    if piece.kind == MODEL:
        return _local(piece.obj.state_dict())
    if piece.kind == OPTIMIZER:
        return [_local(o.state_dict()) for o in _optimizers(piece.obj)]
    return piece.obj.state_dict()


def _misfit(piece, theirs) -> str | None:
    """How the peer's form of `piece` does not fit this group's, or None."""
    if piece.peer is not None:
        return None  # (its own load_state_dict checks)
    if piece.kind == MODEL:
        if not isinstance(theirs, dict):
            return f"the peer's {piece.name} is not a state_dict"
        problem = _other_model(piece.obj.state_dict(), theirs)
        return problem and f"{problem}; replica groups must run the same model config (model.*)"
    if piece.kind == OPTIMIZER:
        mine = _optimizers(piece.obj)
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            return f"the peer's {piece.name} is not {len(mine)} optimizer state(s)"
        return next((p for o, s in zip(mine, theirs) if (p := _other_optimizer(o, s))), None)
    return None


def _apply(piece, theirs) -> None:
    """`theirs` (checked by _misfit) into this group's `piece`."""
    if piece.peer is not None:
        piece.peer.load_state_dict(theirs)
    elif piece.kind == MODEL:
        for name, tensor in piece.obj.state_dict().items():
            _local(tensor).copy_(theirs[name])
    elif piece.kind == OPTIMIZER:
        for opt, state in zip(_optimizers(piece.obj), theirs):
            opt.load_state_dict(state)
            _shard_like_params(opt)
    else:
        piece.obj.load_state_dict(theirs)


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
