"""An optimizer from outside torchllm (tests/toy_optimizer: SGD with momentum written by hand)
is one module plus one `register` line: through `job.custom_import` the launcher's check knows
it, the Trainer trains with it and resumes exactly (its momentum buffers in the checkpoint), and
a resume keeps exactly the hyperparameters its OptimizerSpec declares. torch.optim.SGD is the
independent oracle of its updates (docs/howto_optimizer.md)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from conftest import REPO, tiny_args, tiny_config
from messages import assert_names
from torchllm.config import ConfigError
from torchllm.run.launch import check_config
from torchllm.train import Trainer

TOY = ["--job.custom_import=toy_optimizer", "--optimizer.name=toy_sgd", "--optimizer.lr=0.3",
       "--optimizer.beta1=0.9", "--optimizer.weight_decay=0.01"]
CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=100",
        "--training.steps=4"]


@pytest.fixture
def toy_importable(monkeypatch):
    """tests/ importable, and the toy optimizer registered (when a config imports it) on a copy
    of the registry, forgotten afterwards: later tests see only the built-in optimizers."""
    from torchllm.optim import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "toy_optimizer"]:
        del sys.modules[name]


def test_toy_sgd_updates_equal_torch_sgd(toy_importable):
    from toy_optimizer import ToySGD

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = ToySGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01)
    oracle = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ours]
        for params, opt in ((ours, mine), (theirs, oracle)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert ours[0].ne(theirs[0].detach() * 0).any()  # they moved


def test_unknown_optimizer_is_refused_by_the_launchers_check(tmp_path, toy_importable):
    with pytest.raises(ConfigError, match=r"optimizer.name = 'toy_sgd' is not registered.*"
                                          r"'adamw'.*job.custom_import"):
        check_config(tiny_args(tmp_path, "--optimizer.name=toy_sgd"), 1)
    check_config(tiny_args(tmp_path, *TOY), 1)  # registered by the module the config imports


@pytest.mark.slow
def test_toy_optimizer_trains_and_resumes_exactly_through_the_trainer(tmp_path, toy_importable,
                                                                       caplog):
    from toy_optimizer import ToySGD

    straight = Trainer(tiny_config(tmp_path / "a", *CKPT, *TOY))
    assert isinstance(straight.optimizer, ToySGD)
    losses = straight.train()
    assert losses[-1] < losses[0]
    Trainer(tiny_config(tmp_path / "b", *CKPT, *TOY, "--training.stop_after_steps=2")).train()
    # Resumed with two changed optimizer keys: beta1 (toy_sgd's momentum, in its param groups:
    # the checkpoint's is kept) and eps (toy_sgd reads no eps: the new value applies).
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = Trainer(tiny_config(tmp_path / "b", *CKPT, *TOY, "--optimizer.beta1=0.5",
                                      "--optimizer.eps=1e-6"))
    said = next(r.getMessage() for r in caplog.records if "optimizer.beta1" in r.getMessage())
    beta1 = said[said.index("optimizer.beta1"):said.index("optimizer.eps")]  # keys sorted
    eps = said[said.index("optimizer.eps"):]
    # Both values of each; the kept one names the key that would apply the new value.
    assert_names(beta1, "0.9", "0.5", "checkpoint.optimizer_hparams_from")
    assert_names(eps, "1e-08", "1e-06")
    assert "checkpoint.optimizer_hparams_from" not in eps
    assert resumed.step == 2 and resumed.optimizer.param_groups[0]["momentum"] == 0.9
    assert resumed.train() == losses[2:]
    for (name, a), b in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
