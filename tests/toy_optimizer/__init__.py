"""An optimizer from outside torchllm: one module, registered by one line (below).

The tests import it through the config (`job.custom_import = "toy_optimizer"`, with tests/ on
PYTHONPATH): docs/howto_optimizer.md walks through the same steps. It is plain SGD with
(heavy-ball) momentum and L2 weight decay, written by hand; torch.optim.SGD is the oracle its
updates are compared against. Its momentum is `optimizer.beta1` (the decay of the gradient's
running sum, as Adam's beta1 is), so it needs no config key of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from torchllm.optim import OptimizerSpec, register


class ToySGD(torch.optim.Optimizer):
    """p -= lr * buf, buf = momentum * buf + (grad + weight_decay * p) (buf = that sum on the
    first step): torch.optim.SGD with dampening 0, nesterov off."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d_p.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(d_p)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])


def toy_sgd(model: nn.Module, ocfg, device: torch.device) -> ToySGD:
    params = [p for p in model.parameters() if p.requires_grad]
    return ToySGD(params, lr=ocfg.lr, momentum=ocfg.beta1, weight_decay=ocfg.weight_decay)


SPEC = OptimizerSpec(
    name="toy_sgd", build=toy_sgd,
    keys=("lr", "beta1", "weight_decay"),  # the [optimizer] keys toy_sgd reads
    hparams=("lr", "beta1", "weight_decay"),  # in its param groups: a resume keeps them
)

register(SPEC)
