"""Several optimizers driven as one, so the trainer, LR schedule and metrics see one object."""

from __future__ import annotations

import collections.abc

import torch


class StateView(collections.abc.Mapping):
    """Read-only union of the children's `state` (a ChainMap would insert missing keys into
    the first child's defaultdict on lookup)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def __getitem__(self, param):
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __iter__(self):
        return (p for o in self.optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


class OptimizerList(torch.optim.Optimizer):
    """Steps and zeroes every child optimizer; exposes their param groups and state.

    `param_groups` lists the children's current group dicts, so an LR scheduler built on this object
    scales every group of every child (each from its own initial lr), and `state` is a live view
    of all children's states (metrics count its bytes). Checkpoints go through `optimizers`:
    torch.distributed.checkpoint's optimizer state dict takes the list and keys it by parameter
    names, exactly as for a single optimizer.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})  # the step-hook machinery (float8 registers a post hook)
        self.optimizers = list(optimizers)

    # Optimizer.__init__ builds its own groups and state (kept aside, unused); afterwards both
    # read through to the children, whose group dicts `load_state_dict` replaces.
    @property
    def param_groups(self) -> list[dict]:
        if "optimizers" not in self.__dict__:
            return self.__dict__["_base_groups"]
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.__dict__["_base_groups"] = groups

    @property
    def state(self):
        if "optimizers" not in self.__dict__:
            return self.__dict__["_base_state"]
        return StateView(self.optimizers)

    @state.setter
    def state(self, state) -> None:
        self.__dict__["_base_state"] = state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OptimizerList.step takes no closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer, sd in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(sd)
