"""Semi-synchronous replica groups (DiLoCo, LocalSGD; torchllm/ft/semi_sync.py).

The refusals through ./run_train.sh; two groups in this process (one thread each, torchft's
all-reduce replaced by an in-process one) against a plain-PyTorch DiLoCo and plain parameter
averaging; what a heal copies; saves between syncs skipped. Slow: two groups through
scripts/ft_local.sh with DiLoCo end with equal weights.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import threading

import pytest
import torch

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

class _Exchange:
    """What the live groups' torchft all-reduce does, between threads: the mean."""

    def __init__(self):
        self.barrier, self.slots, self.quorums = threading.Barrier(2, timeout=60), [None, None], 0


class _Manager:
    _quorum_id = 1

    def __init__(self, exchange: _Exchange, rank: int):
        self.exchange, self.rank = exchange, rank

    def allreduce(self, tensor, reduce_op=None):
        ex = self.exchange
        ex.slots[self.rank] = tensor
        ex.barrier.wait()
        mean = (ex.slots[0] + ex.slots[1]) / 2
        ex.barrier.wait()
        tensor.copy_(mean)
        return type("Work", (), {"wait": lambda self: None})()

    def should_commit(self):
        return True

    def start_quorum(self):
        self.exchange.quorums += 1

    def num_participants(self):
        return 2

    def participating_rank(self):
        return self.rank


def _groups(model, method: str, rank: int, exchange: _Exchange, sync_steps: int, steps: int,
            fragments: int = 1):
    from torchllm.ft.semi_sync import OuterStep, SemiSyncGroups

    g = object.__new__(SemiSyncGroups)
    g.replica_id = rank
    g.manager, g.min_replica_size, g.committed_here = _Manager(exchange, rank), 1, 0
    g.heal = type("H", (), {"healed_at": None, "train_state": type("T", (), {"step": 0})()})()
    g.quorums, g.members, g.group_rank, g.group_world, g.group_size = 1, [0, 1], 0, 1, 2
    g.pg = type("P", (), {"refusal": None, "quorums": 1, "members": [0, 1]})()
    g.transport = type("X", (), {"refusal": None, "sent_to": []})()
    g.ftcfg = type("F", (), {"semi_sync_method": method})()
    g.sync_steps, g.last_step, g.quorum_taken = sync_steps, steps, False
    g.bytes_sent, g.syncs, g.pending, g.joining, g.marker = 0, 0, 0, 0, None
    g.num_fragments, g.uncounted, g.save_every = fragments, set(), 0
    g.state = OuterStep(model, method, lr=0.7, momentum=0.9, nesterov=True,
                        num_fragments=fragments)
    return g


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(steps: int):
    torch.manual_seed(1)
    return [[(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(steps)] for _ in range(2)]


def _inner_step(model, opt, batch):
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run_groups(method: str, sync_steps: int, steps: int):
    """Two groups trained by the trainer's calls (begin_step, average, update, end_step)."""
    exchange, data = _Exchange(), _batches(steps)
    models = [_model() for _ in range(2)]
    groups = [_groups(m, method, r, exchange, sync_steps, steps) for r, m in enumerate(models)]
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
                _inner_step(model, opt, data[r][step - 1])
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
    glob = _model()
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
                _inner_step(local[r], inner[r], data[r][s - 1])
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

    exchange, data = _Exchange(), _batches(2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    live = _groups(model, "diloco", 0, exchange, sync_steps=2, steps=4)
    for step in (1, 2):
        _inner_step(model, opt, data[0][step - 1])
    alone, healed_model = copy.deepcopy(model), copy.deepcopy(model)  # (what the heal copies)
    alone_state = _groups(alone, "diloco", 0, _Exchange(), 2, 4).state
    alone_state.anchor = [a.clone() for a in live.state.anchor]
    assert alone_state.sync(lambda tensors: True)  # one live group: the mean is its change
    healed = _groups(healed_model, "diloco", 1, exchange, sync_steps=2, steps=4)
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


def _end_steps(groups, exchange):
    errors = []

    def run(g):
        try:
            g.end_step()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_retried_sync_of_groups_that_all_healed_into_it_averages_their_copies():
    """Both groups of the quorum healed into the sync (their sources died during it): no group
    is counted, so they average their copies as live groups would, not 0/0 (NaN)."""
    exchange, data = _Exchange(), _batches(2)
    models = [_model() for _ in range(2)]
    for r, model in enumerate(models):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in (1, 2):
            _inner_step(model, opt, data[r][step - 1])
    plain = [copy.deepcopy(m) for m in models]  # the same two changes, synced as live groups
    healed = [_groups(m, "diloco", r, exchange, sync_steps=2, steps=4)
              for r, m in enumerate(models)]
    for g in healed:
        g.state.anchor = [p.detach().clone() for p in _model().parameters()]
        g.heal.train_state.step, g.joining = 2, 2
    live_exchange = _Exchange()
    live = [_groups(m, "diloco", r, live_exchange, sync_steps=2, steps=4)
            for r, m in enumerate(plain)]
    for g in live:
        g.state.anchor = [p.detach().clone() for p in _model().parameters()]
        g.heal.train_state.step = 2
    _end_steps(healed, exchange)
    _end_steps(live, live_exchange)
    for (name, a), b, want in zip(models[0].named_parameters(), models[1].parameters(),
                                  plain[0].parameters()):
        assert torch.equal(a, want) and torch.equal(b, want), name


# -- streaming DiLoCo: a relaunch healed at an interval start -----------------------------------

class _Blocks(torch.nn.Module):
    """Two blocks (`layers.0.`, `layers.1.`): with two fragments, one each."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


# sync_steps 2, two fragments: fragment 0 syncs after the odd steps, 1 after the even ones,
# both after the last (6). Group 1 dies after step 2; its relaunch heals from group 0 at the
# quorum of step 3, when fragment 0 has changed at group 0 since its last sync (step 1).
HEAL_STEPS, HEAL_AT = 6, 3
HEAL_SYNCS = {1: (0,), 2: (1,), 3: (0,), 4: (1,), 5: (0,), 6: (0, 1)}


def _streaming_reference(data):
    """Streaming DiLoCo in plain PyTorch: `glob` holds each fragment's weights at its last
    sync; a sync moves a fragment by the outer optimizer (Nesterov SGD) on the mean of the
    counted groups' changes (glob - local) and every group takes it. The relaunch copies group
    0's weights and inner optimizer at step 3; fragment 0's next sync (step 3) counts group 0's
    change only, every later one both. Returns each step's weights, per group, after its sync."""
    glob = _Blocks()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    local = [copy.deepcopy(glob) for _ in range(2)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in local]
    after = {}
    for step in range(1, HEAL_STEPS + 1):
        if step == HEAL_AT:
            local[1].load_state_dict(local[0].state_dict())
            inner[1].load_state_dict(copy.deepcopy(inner[0].state_dict()))
        for r in range(2):
            _inner_step(local[r], inner[r], data[r][step - 1])
        for f in HEAL_SYNCS[step]:
            counted = [0] if (step, f) == (HEAL_AT, 0) else [0, 1]
            frag = [n for n, _ in glob.named_parameters() if n.startswith(f"layers.{f}.")]
            with torch.no_grad():
                for name, q in glob.named_parameters():
                    if name in frag:
                        changes = [q - local[r].get_parameter(name) for r in counted]
                        q.grad = sum(changes) / len(changes)
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m in local:
                    for name in frag:
                        m.get_parameter(name).copy_(glob.get_parameter(name))
        after[step] = [[p.detach().clone() for p in m.parameters()] for m in local]
    return after


def test_a_relaunch_healed_at_an_interval_start_counts_nothing_in_the_fragments_its_source_had_not_synced():
    """Streaming DiLoCo (2 fragments): the relaunch heals at step 3's quorum (weights, inner and
    outer state, the step; healed_at bumped as the heal does) from group 0, whose fragment 0
    last synced at step 1. That fragment's next sync (step 3) counts for nothing from the
    relaunch (group 0's step-2 change came with the heal and counts in group 0's share), fragment
    1's does count; from the next interval on, every fragment counts again."""
    from torchllm.ft.heal_codec import decode, encode

    exchange, data = _Exchange(), _batches(HEAL_STEPS)
    models = [_Blocks(), _Blocks()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    groups = [_groups(m, "diloco", r, exchange, 2, HEAL_STEPS, fragments=2)
              for r, m in enumerate(models)]
    after, uncounted, errors = {0: {}, 1: {}}, [], []

    def train(r, until):  # the trainer's calls (torchllm/train.py)
        try:
            g, model = groups[r], models[r]
            while g.heal.train_state.step < until:
                g.heal.train_state.step += 1
                g.begin_step()
                step = g.heal.train_state.step
                if r == 1 and step == HEAL_AT:
                    uncounted.append(set(g.uncounted))
                assert g.average({}, model)
                _inner_step(model, opts[r], data[r][step - 1])
                g.end_step()
                after[r][step] = [p.detach().clone() for p in model.parameters()]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            exchange.barrier.abort()

    def both(until):
        threads = [threading.Thread(target=train, args=(r, until)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    both(HEAL_AT - 1)
    # Group 1 relaunched (fresh weights, step 0): its first quorum heals it from group 0.
    sent = [copy.deepcopy(models[0].state_dict()), copy.deepcopy(opts[0].state_dict()),
            decode(encode(groups[0].state.state_dict()))]
    models[1] = _Blocks(seed=5)
    opts[1] = torch.optim.AdamW(models[1].parameters(), lr=1e-2)
    relaunch = groups[1] = _groups(models[1], "diloco", 1, exchange, 2, HEAL_STEPS, fragments=2)

    def heal():  # (once: later quorums find it in step)
        relaunch.manager.start_quorum = quorum
        quorum()
        models[1].load_state_dict(sent[0])
        opts[1].load_state_dict(sent[1])
        relaunch.state.load_state_dict(sent[2])
        relaunch._load_pending({"pending_sync": 0})  # group 0 runs no sync again
        relaunch.heal.train_state.step = HEAL_AT  # (the source's: in the quorum of step 3)
        relaunch.heal.healed_at = relaunch.heal.train_state.step  # as HealState's load does

    quorum, relaunch.manager.start_quorum = relaunch.manager.start_quorum, heal
    both(HEAL_STEPS)
    assert not errors, errors
    want = _streaming_reference(data)
    names = [n for n, _ in models[0].named_parameters()]
    for step in range(HEAL_AT, HEAL_STEPS + 1):
        for r in range(2):
            for name, got, ref in zip(names, after[r][step], want[step][r]):
                assert torch.equal(got, ref), (step, r, name, (got - ref).abs().max())
    assert uncounted == [{0}]  # (after step 3's heal) and none once it synced:
    assert relaunch.uncounted == set() and relaunch.syncs == groups[0].syncs - 2
    for a, b in zip(models[0].parameters(), models[1].parameters()):  # step 6: a full sync
        assert torch.equal(a, b)


# -- what a heal copies, saves between syncs ------------------------------------------------------

def test_a_heal_copies_the_last_sync_and_the_outer_momentum_as_data():
    from torchllm.config import ConfigError
    from torchllm.ft.heal_codec import decode, encode
    from torchllm.ft.semi_sync import OuterStep

    models, groups, _, _ = _run_groups("diloco", sync_steps=2, steps=4)
    live = groups[0].state
    fresh_model = _model()
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
    groups = _groups(_model(), "diloco", 0, _Exchange(), sync_steps=5, steps=12)
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


def test_fragments_are_contiguous_blocks_synced_in_turn(tmp_path):
    from torchllm.ft.fragments import due, fragment_of

    names = ["tok_embeddings.weight", *(f"layers.{i}.attention.wq.weight" for i in range(4)),
             "norm.weight", "output.weight"]
    assert fragment_of(names, 1) == [0] * 7
    assert fragment_of(names, 2) == [0, 0, 0, 1, 1, 1, 1]
    # H = 10, 2 fragments: the first after 5 steps of each interval, the second after 10
    assert [s for s in range(1, 21) if due(s, 10, 2, full=False)] == [5, 10, 15, 20]
    assert due(5, 10, 2, False) == [0] and due(10, 10, 2, False) == [1]
    assert due(7, 10, 2, full=True) == [0, 1]
    assert [s for s in range(1, 11) if due(s, 5, 1, False)] == [5, 10]  # one: every H steps
    refused(run_train(*tiny_args(tmp_path, *DILOCO, "--fault_tolerance.sync_steps=5",
                                 "--fault_tolerance.num_fragments=2")),
            "fault_tolerance.num_fragments = 2", "fault_tolerance.sync_steps = 5")


FRAGMENT_STEPS, FRAGMENT_SYNC = 12, 4  # fragment 0 after steps 2, 6, 10; 1 after 4, 8; both at 12


@pytest.mark.slow
def test_two_groups_with_two_fragments_through_ft_local_end_equal_sending_half(tmp_path):
    """Streaming DiLoCo: two fragments, each synced at its own step; both groups end with the
    same weights and outer momentum, and a sync sends a fragment, not the whole model."""
    from builders.ft import free_port
    from torchllm.checkpoint import open_checkpoint

    logs = tmp_path / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs), "TORCHLLM_FORK_WORKERS": "1"}
    args = tiny_args(tmp_path, f"--training.steps={FRAGMENT_STEPS}", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0", "--checkpoint.enable",
                     "--checkpoint.interval=1000", "--fault_tolerance.semi_sync_method=diloco",
                     f"--fault_tolerance.sync_steps={FRAGMENT_SYNC}",
                     "--fault_tolerance.num_fragments=2")
    ran = subprocess.run([str(REPO / "scripts" / "ft_local.sh"), "2", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    texts = [(logs / f"replica_{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert ran.returncode == 0, ran.stdout[-3000:] + texts[0][-3000:] + texts[1][-3000:]
    a = open_checkpoint(tmp_path / "debug_model-replica0").tensors("")
    b = open_checkpoint(tmp_path / "debug_model-replica1").tensors("")
    shared = [k for k in a if k.startswith(("model.", "outer_optimizer."))]
    assert any(k.startswith("outer_optimizer.") for k in shared)
    for key in shared:
        assert torch.equal(a[key], b[key]), key
    # The bytes: fragment 0 (embeddings, first half of the blocks) 4 times, fragment 1 3 times,
    # against the whole model's bytes at each of one fragment's 3 syncs.
    def fragment(name):  # debug: 4 blocks; the embeddings first, the norm and output last
        block = re.search(r"layers\.(\d+)\.", name)
        return int(block[1]) // 2 if block else 0 if name.startswith("tok_embeddings") else 1

    weights = [k[len("model."):] for k in a if k.startswith("model.")]
    frag = [sum(a["model." + n].numel() * 4 for n in weights if fragment(n) == i)
            for i in (0, 1)]
    whole = sum(frag)
    assert 0.25 * whole < frag[0] < 0.75 * whole
    for text in texts:
        m = re.search(r"fault tolerance: (\d+) syncs \(diloco, every 4 steps, 2 fragments\), "
                      r"(\d+) bytes sent", text)
        assert m and int(m[1]) == 7, text[-2000:]
        assert int(m[2]) == 4 * frag[0] + 3 * frag[1], (m[2], frag)
        assert int(m[2]) / 7 < 0.75 * whole  # ~1/2 of one fragment's 3 syncs x whole

