"""Streaming DiLoCo (fault_tolerance.num_fragments; torchllm/ft/fragments.py, ft/semi_sync.py):
fragments as contiguous runs of blocks synced in turn and the refusal through ./run_train.sh; a
relaunch healed at an interval start counts nothing in the fragments its source had not synced
(two groups in this process against streaming DiLoCo in plain PyTorch). Slow: two groups with
two fragments through scripts/ft_local.sh end equal, each sync sending one fragment.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import threading

import pytest
import torch

from builders.semi_sync import Exchange, batches, inner_step, semi_sync_groups
from cli import run_train
from conftest import REPO, tiny_args
from messages import refused

pytest.importorskip("torchft")

DILOCO = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2",
          "--fault_tolerance.semi_sync_method=diloco"]


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
            inner_step(local[r], inner[r], data[r][step - 1])
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

    exchange, data = Exchange(), batches(HEAL_STEPS)
    models = [_Blocks(), _Blocks()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    groups = [semi_sync_groups(m, "diloco", r, exchange, 2, HEAL_STEPS, fragments=2)
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
                inner_step(model, opts[r], data[r][step - 1])
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
    relaunch = groups[1] = semi_sync_groups(models[1], "diloco", 1, exchange, 2, HEAL_STEPS, fragments=2)

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
