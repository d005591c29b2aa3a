"""Semi-synchronous replica groups (DiLoCo, LocalSGD; torchllm/ft/semi_sync.py).

The refusals through ./run_train.sh; two groups in this process (one thread each, torchft's
all-reduce replaced by an in-process one) against a plain-PyTorch DiLoCo and plain parameter
averaging; what a heal copies; saves between syncs skipped. Slow: two groups through
scripts/ft_local.sh with DiLoCo end with equal weights. Streaming DiLoCo (fragments):
test_ft_streaming.py; the in-process groups: tests/builders/semi_sync.py.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import threading

import pytest
import torch

from builders.semi_sync import (Exchange, batches, end_steps, inner_step, semi_sync_groups,
                                small_model)
from cli import run_train
from conftest import REPO, tiny_args
from messages import refused

pytest.importorskip("torchft")

DILOCO = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2",
          "--fault_tolerance.semi_sync_method=diloco"]


# -- refusals (one line, exit 2) ---------------------------------------------------------------

def test_an_unknown_method_is_refused_naming_the_choices(tmp_path):
    ran = run_train(*tiny_args(tmp_path, "--fault_tolerance.enable",
                               "--fault_tolerance.semi_sync_method=dilocco"))
    refused(ran, "fault_tolerance.semi_sync_method", "dilocco", "diloco", "local_sgd")


def test_a_checkpoint_interval_between_syncs_is_refused_naming_both_keys(tmp_path):
    ran = run_train(*tiny_args(tmp_path, *DILOCO, "--fault_tolerance.sync_steps=5",
                               "--checkpoint.enable", "--checkpoint.interval=12"))
    line = refused(ran, "checkpoint.interval = 12", "fault_tolerance.sync_steps = 5")
    assert "checkpoint.interval = 10" in line, line  # what to use instead


def test_ft_local_refuses_an_interval_between_syncs_before_starting_a_group(tmp_path):
    logs = tmp_path / "logs"
    ran = subprocess.run(
        [str(REPO / "scripts" / "ft_local.sh"), "2",
         *tiny_args(tmp_path, "--fault_tolerance.semi_sync_method=diloco",
                    "--fault_tolerance.sync_steps=5", "--fault_tolerance.min_replica_size=2",
                    "--checkpoint.enable", "--checkpoint.interval=12")],
        cwd=REPO, env={**os.environ, "FT_LOG_DIR": str(logs)}, capture_output=True, text=True,
        timeout=120)
    refused(ran, "checkpoint.interval = 12", "fault_tolerance.sync_steps = 5")
    assert not logs.exists() or not list(logs.glob("replica_*.log"))


def test_semi_sync_without_replica_groups_is_refused(tmp_path):
    ran = run_train(*tiny_args(tmp_path, "--fault_tolerance.semi_sync_method=local_sgd"))
    refused(ran, "fault_tolerance.semi_sync_method", "fault_tolerance.enable")


def test_sync_steps_below_one_and_nesterov_without_momentum_are_refused(tmp_path):
    refused(run_train(*tiny_args(tmp_path, *DILOCO, "--fault_tolerance.sync_steps=0")),
            "fault_tolerance.sync_steps = 0")
    refused(run_train(*tiny_args(tmp_path, *DILOCO, "--fault_tolerance.outer_momentum=0")),
            "fault_tolerance.outer_nesterov", "fault_tolerance.outer_momentum = 0")


# -- two groups in this process against the algorithm in plain PyTorch --------------------------

def _run_groups(method: str, sync_steps: int, steps: int):
    """Two groups trained by the trainer's calls (begin_step, average, update, end_step)."""
    exchange, data = Exchange(), batches(steps)
    models = [small_model() for _ in range(2)]
    groups = [semi_sync_groups(m, method, r, exchange, sync_steps, steps) for r, m in enumerate(models)]
    errors = []

    def train(r):
        try:
            model, g = models[r], groups[r]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(1, steps + 1):
                g.heal.train_state.step = step
                g.begin_step()
                model(data[r][step - 1][0]).sum()  # (nothing crosses before the update)
                assert g.average({}, model)
                inner_step(model, opt, data[r][step - 1])
                g.end_step()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return models, groups, exchange, data


def _reference(method: str, sync_steps: int, steps: int, data):
    """The same algorithm in plain PyTorch: each group AdamW from the global weights for an
    interval, then the global weights move by the outer optimizer (Nesterov SGD) on the mean of
    (global - group), or become the groups' mean (LocalSGD)."""
    glob = small_model()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    local = [copy.deepcopy(glob) for _ in range(2)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in local]
    step = 0
    while step < steps:
        interval = range(step + 1, min(step + sync_steps, steps) + 1)
        for r in range(2):
            with torch.no_grad():
                for p, q in zip(local[r].parameters(), glob.parameters()):
                    p.copy_(q)
            for s in interval:
                inner_step(local[r], inner[r], data[r][s - 1])
        with torch.no_grad():
            for q, a, b in zip(glob.parameters(), local[0].parameters(), local[1].parameters()):
                if method == "local_sgd":
                    q.copy_((a + b) / 2)
                else:
                    q.grad = ((q - a) + (q - b)) / 2
        if method == "diloco":
            outer.step()
            outer.zero_grad(set_to_none=True)
        step = interval[-1]
    return glob


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_two_groups_equal_the_algorithm_in_plain_pytorch(method):
    steps, sync_steps = 7, 2  # syncs after steps 2, 4, 6 and the last, 7
    models, groups, exchange, data = _run_groups(method, sync_steps, steps)
    ref = _reference(method, sync_steps, steps, data)
    for (name, a), b, want in zip(models[0].named_parameters(), models[1].parameters(),
                                  ref.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a, want), (name, (a - want).abs().max())
    n_params = sum(p.numel() for p in ref.parameters())
    assert [g.syncs for g in groups] == [4, 4]
    assert groups[0].bytes_sent == 4 * n_params * 4  # the parameters' size (fp32) per sync
    assert exchange.quorums == 2 * 4  # a quorum at the start of each interval, per group


def test_a_group_healed_into_a_retried_sync_joins_it_counting_for_nothing():
    """Group 1 healed from group 0 while group 0 waited to run its sync (after step 2) again:
    it holds group 0's weights and last sync, does not train step 2 (begin_step says so) and
    joins the sync with no change of its own. Both end where group 0 alone would (the live
    groups' mean: its own change), not at the mean of two copies of it."""
    from torchllm.config import ConfigError

    exchange, data = Exchange(), batches(2)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    live = semi_sync_groups(model, "diloco", 0, exchange, sync_steps=2, steps=4)
    for step in (1, 2):
        inner_step(model, opt, data[0][step - 1])
    alone, healed_model = copy.deepcopy(model), copy.deepcopy(model)  # (what the heal copies)
    alone_state = semi_sync_groups(alone, "diloco", 0, Exchange(), 2, 4).state
    alone_state.anchor = [a.clone() for a in live.state.anchor]
    assert alone_state.sync(lambda tensors: True)  # one live group: the mean is its change
    healed = semi_sync_groups(healed_model, "diloco", 1, exchange, sync_steps=2, steps=4)
    healed.state.load_state_dict(live.state.state_dict())
    healed.manager.start_quorum = lambda: healed._load_pending({"pending_sync": 2})
    live.heal.train_state.step = healed.heal.train_state.step = 2
    trains = []

    def run(g, begin):
        try:
            if begin:
                trains.append(g.begin_step())
            g.end_step()
        except BaseException as e:  # noqa: BLE001 - reported below
            trains.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(live, False)),
               threading.Thread(target=run, args=(healed, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert trains == [False]  # the healed group does not train step 2 again
    for (name, want), a, b in zip(alone.named_parameters(), model.parameters(),
                                  healed_model.parameters()):
        assert torch.equal(a, want), (name, (a - want).abs().max())
        assert torch.equal(b, want), name
    assert healed.joining == 0 and healed.syncs == 1  # the next sync counts it again
    with pytest.raises(ConfigError, match="pending_sync is 'soon'"):
        healed._load_pending({"pending_sync": "soon"})


def test_a_retried_sync_of_groups_that_all_healed_into_it_averages_their_copies():
    """Both groups of the quorum healed into the sync (their sources died during it): no group
    is counted, so they average their copies as live groups would, not 0/0 (NaN)."""
    exchange, data = Exchange(), batches(2)
    models = [small_model() for _ in range(2)]
    for r, model in enumerate(models):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in (1, 2):
            inner_step(model, opt, data[r][step - 1])
    plain = [copy.deepcopy(m) for m in models]  # the same two changes, synced as live groups
    healed = [semi_sync_groups(m, "diloco", r, exchange, sync_steps=2, steps=4)
              for r, m in enumerate(models)]
    for g in healed:
        g.state.anchor = [p.detach().clone() for p in small_model().parameters()]
        g.heal.train_state.step, g.joining = 2, 2
    live_exchange = Exchange()
    live = [semi_sync_groups(m, "diloco", r, live_exchange, sync_steps=2, steps=4)
            for r, m in enumerate(plain)]
    for g in live:
        g.state.anchor = [p.detach().clone() for p in small_model().parameters()]
        g.heal.train_state.step = 2
    end_steps(healed, exchange)
    end_steps(live, live_exchange)
    for (name, a), b, want in zip(models[0].named_parameters(), models[1].parameters(),
                                  plain[0].parameters()):
        assert torch.equal(a, want) and torch.equal(b, want), name


def test_a_heal_copies_the_last_sync_and_the_outer_momentum_as_data():
    from torchllm.config import ConfigError
    from torchllm.ft.heal_codec import decode, encode
    from torchllm.ft.semi_sync import OuterStep

    models, groups, _, _ = _run_groups("diloco", sync_steps=2, steps=4)
    live = groups[0].state
    fresh_model = small_model()
    fresh = OuterStep(fresh_model, "diloco")
    fresh.load_state_dict(decode(encode(live.state_dict())))
    for a, b in zip(fresh.anchor, live.anchor):
        assert torch.equal(a, b)
    assert len(live.momentum()) == len(fresh.momentum()) == 4
    for a, b in zip(fresh.momentum(), live.momentum()):
        assert torch.equal(a, b)
    wide = OuterStep(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                         torch.nn.Linear(32, 4)), "diloco")
    with pytest.raises(ConfigError, match=r"anchor of parameter 0 is \[16, 8\].*\[32, 8\]"):
        wide.load_state_dict(live.state_dict())


def test_saves_between_syncs_are_skipped_unless_kept_for_inspection():
    from torchllm.ft.semi_sync import SyncPointCheckpointer

    saved = []
    inner = type("C", (), {"save": lambda self, step, **kw: saved.append(step)})()
    groups = semi_sync_groups(small_model(), "diloco", 0, Exchange(), sync_steps=5, steps=12)
    ckpt = SyncPointCheckpointer(inner, groups)
    for step in (3, 5, 10, 11, 12):
        ckpt.save(step, last=step == 12)
    ckpt.save(7, unhealthy="the guard stopped the run")
    assert saved == [5, 10, 12, 7]


# -- two groups through scripts/ft_local.sh -------------------------------------------------------

LOSS = re.compile(r"step\s+(\d+)/\d+ \| loss (\S+)")


@pytest.mark.slow
def test_two_diloco_groups_through_ft_local_end_with_equal_weights(tmp_path):
    from builders.ft import free_port
    from torchllm.checkpoint import open_checkpoint

    logs = tmp_path / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs), "TORCHLLM_FORK_WORKERS": "1"}
    args = tiny_args(tmp_path, "--training.steps=12", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0", "--checkpoint.enable",
                     "--checkpoint.interval=5", "--fault_tolerance.semi_sync_method=diloco",
                     "--fault_tolerance.sync_steps=5")
    ran = subprocess.run([str(REPO / "scripts" / "ft_local.sh"), "2", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    logs_text = [(logs / f"replica_{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert ran.returncode == 0, ran.stdout[-3000:] + logs_text[0][-3000:] + logs_text[1][-3000:]
    losses = [{int(m[1]): m[2] for m in LOSS.finditer(t)} for t in logs_text]
    assert sorted(losses[0]) == sorted(losses[1]) == list(range(1, 13))
    assert losses[0][2] != losses[1][2]  # each group prints its own loss: it trains alone
    for text in logs_text:  # syncs after steps 5, 10 and the last, 12
        assert re.search(r"fault tolerance: 3 syncs \(diloco, every 5 steps\)", text), text[-2000:]
        # the quorum line says what a step trains on: no batch is averaged between syncs
        assert "every 5 steps the 2 groups' parameter changes are averaged (diloco)" in text, \
            text[-2000:]
        assert "effective global batch" not in text
    a = open_checkpoint(tmp_path / "debug_model-replica0").tensors("")
    b = open_checkpoint(tmp_path / "debug_model-replica1").tensors("")
    assert a.keys() == b.keys() and any(k.startswith("outer_optimizer.") for k in a)
    shared = [k for k in a if k.startswith(("model.", "outer_optimizer."))]
    for key in shared:  # the weights and the outer momentum: one after the last sync
        assert torch.equal(a[key], b[key]), key
    # (each group's own inner optimizer: its moments are of its own data)
    assert not torch.equal(a["optimizer.state.output.weight.exp_avg"],
                           b["optimizer.state.output.weight.exp_avg"])

