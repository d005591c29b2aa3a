"""Fault tolerance (torchft replica groups; docs/fault_tolerance.md).

In-process: the refusals (one line each: the key, the value, what to do), the data split by
replica id, and a heal between two trainers' states. Slow: the acceptance run through
scripts/ft_local.sh, two groups of one CPU rank, one SIGKILLed and relaunched.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from conftest import tiny_args, wait_for
from torchllm.config import ConfigError, load_config
from builders.ft import assert_same_state, free_port, kill_and_relaunch, listening, steps_of

pytest.importorskip("torchft")


# -- refusals -------------------------------------------------------------------------------

def test_replica_id_outside_group_size_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                              "--fault_tolerance.replica_id=2"))
    msg = str(e.value)
    assert "fault_tolerance.replica_id = 2" in msg and "group_size = 2" in msg and "0 .. 1" in msg
    assert "\n" not in msg


def test_min_replica_size_above_group_size_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"fault_tolerance.min_replica_size = 3.*\(2\)"):
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                              "--fault_tolerance.min_replica_size=3"))


def test_pipeline_parallelism_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                              "--parallelism.pipeline_parallel_degree=2"))
    assert "pipeline_parallel_degree = 2" in str(e.value) and e.value.key == "fault_tolerance.enable"


def test_no_lighthouse_is_refused_naming_the_address_and_the_command(tmp_path, capsys):
    from torchllm.ft import check_fault_tolerance
    from torchllm.run.launch import main

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config(tiny_args(tmp_path, "--fault_tolerance.enable"))
    with pytest.raises(ConfigError) as e:
        check_fault_tolerance(cfg.fault_tolerance, cfg.job, cfg.training.device,
                              {"TORCHFT_LIGHTHOUSE": address})
    assert address in str(e.value) and "torchft_lighthouse --min_replicas 1" in str(e.value)
    # The launcher refuses before starting any process: exit 2, one line.
    os.environ["TORCHFT_LIGHTHOUSE"] = address
    threads = torch.get_num_threads()  # (the launcher runs torchrun with one, then its workers')
    try:
        code = main(["--standalone", "--nproc_per_node=1", "--",
                     *tiny_args(tmp_path, "--fault_tolerance.enable")])
    finally:
        del os.environ["TORCHFT_LIGHTHOUSE"]
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and address in err[0], err


def test_each_group_reads_its_own_part_of_the_data():
    from torchllm.ft.replicas import ReplicaGroups

    shard = ReplicaGroups.data_shard
    group = type("G", (), {"replica_id": 1, "group_size": 3})()
    # group 1 of 3, two dp ranks each: parts 2 and 3 of 6
    assert [shard(group, r, 2) for r in (0, 1)] == [(2, 6), (3, 6)]


# -- healing between two trainers' states (in-process) ---------------------------------------

def test_heal_makes_a_fresh_trainer_continue_exactly_like_the_live_one(tmp_path):
    from torchllm.ft import HealState
    from torchllm.ft.heal_codec import decode, encode
    from torchllm.train import Trainer

    args = ["--data.tokenizer=bytes", "--checkpoint.enable=false", "--validation.enable=false",
            "--eval.sample_freq=0", "--training.steps=6"]
    live = Trainer(load_config(tiny_args(tmp_path / "a", *args)))
    fresh = Trainer(load_config(tiny_args(tmp_path / "b", *args)))

    def heal_of(t):
        return HealState(t.state, lambda: restart(t))  # the trainer's one training state

    def restart(t):
        t.train_loader.close(t.batches)
        t.batches = iter(t.train_loader)

    try:
        for _ in range(3):
            live.train_state.step += 1
            live.train_step()
        # Encoded as the transport sends it between processes (data: tensors and JSON).
        heal_of(fresh).load_state_dict(decode(encode(heal_of(live).state_dict())))
        assert fresh.step == 3
        for _ in range(2):  # the same batches, weights and optimizer state: the same steps
            for t in (live, fresh):
                t.train_state.step += 1
                m = t.train_step()
                t.last = m
            assert fresh.last["loss"] == live.last["loss"]
            assert fresh.last["grad_norm"] == live.last["grad_norm"]
        for (name, a), b in zip(live.model.state_dict().items(), fresh.model.state_dict().values()):
            assert torch.equal(a, b), name
    finally:
        live.close()
        fresh.close()


# -- the acceptance run ---------------------------------------------------------------------

STEPS, KILL_AT = 40, 3
@pytest.mark.slow
def test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step(tmp_path):
    args = tiny_args(tmp_path, f"--training.steps={STEPS}", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0",
                     "--checkpoint.interval=1000", "--lr_scheduler.warmup_steps=2")
    logs, pause = tmp_path / "logs", []

    def bound_to_loopback(env):
        # ft_local.sh's lighthouse listens on fault_tolerance.bind (127.0.0.1) only.
        assert listening(int(env["TORCHFT_LIGHTHOUSE"].rsplit(":", 1)[1])) == ["0100007F"]

    def survivor_goes_on(before, killed):
        # The survivor's next step comes after the lighthouse drops the silent group (10 s).
        wait_for(lambda: max(steps_of(logs / "replica_0.log")) > before + 1, 90,
                 what="group 0's next step after the kill")
        pause.append(time.monotonic() - killed)

    # Relaunched beside the running group, into the same log folder (the lighthouse is reused;
    # the killed launch's lines stay); the survivor held back from 3 steps after the kill.
    run = kill_and_relaunch(tmp_path, args, KILL_AT, past=3, before_kill=bound_to_loopback,
                            after_relaunch=survivor_goes_on)
    outs, log0, log1, killed_log = run.outs, run.log0, run.log1, run.killed_log
    assert run.marker and KILL_AT in steps_of(killed_log), killed_log[-2000:]  # appended
    assert run.codes()[0] == "0", outs[0] + log0[-3000:]
    assert run.codes()[1] == "0", outs[1] + log1[-3000:]
    # The launch that started the lighthouse kept it up for the relaunch and exits with its code.
    assert run.procs[0].returncode == 0 and run.procs[1].returncode == 0, outs[0]
    assert "replica group 1's relaunch exited with code 0" in outs[0], outs[0]
    assert pause[0] < 90
    # Group 0: one launch, every step once, in order, no resume; it noted both changes.
    assert len(re.findall(r"step\s+1/", log0)) == 1 and "resumed from" not in log0
    assert sorted(steps_of(log0)) == list(range(1, STEPS + 1))
    # (a relaunch that joins before the lighthouse dropped the dead group keeps its place)
    assert ("replica group 1 left: 1 of 2 replica groups live" in log0
            and "replica group 1 joined: 2 of 2 replica groups live" in log0) \
        or "replica group 1 rejoined (relaunched): 2 of 2 replica groups live" in log0, log0
    # Group 1 healed from group 0 and from then on printed group 0's grad norms.
    healed = int(re.search(r"healed from a live peer: continues at step (\d+)", log1)[1])
    assert KILL_AT < healed <= STEPS
    g0, g1 = steps_of(log0), steps_of(log1)
    assert sorted(g1) == list(range(healed, STEPS + 1))
    assert [g1[s] for s in g1] == [g0[s] for s in g1]
    # Its summary counts the steps this launch trained (a step: 2 groups x batch 4 x seq 32,
    # the run's tokens per step, as tokens_seen counts them), not the count the heal brought.
    done = re.search(r"done: step \d+/\d+, (\d+) steps in [\d.]+s, ([\d,]+) tokens", log1)
    assert done and int(done[1]) == len(g1), log1[-2000:]
    assert int(done[2].replace(",", "")) == len(g1) * 2 * 4 * 32, done[0]
    # Both end with the same weights and optimizer state, tensor by tensor.
    assert_same_state(tmp_path)


# -- stopping below min_replica_size, and who saves (in-process, torchft's Manager stubbed) -----

class _Manager:
    def __init__(self, live: int, rank: int = 0):
        self.live, self.rank = live, rank

    def start_quorum(self):
        pass

    def num_participants(self):
        return self.live

    def participating_rank(self):
        return self.rank


def _replicas(live: int, committed: int, rank: int = 0):
    from torchllm.ft.replicas import ReplicaGroups

    r = object.__new__(ReplicaGroups)
    r.manager, r.min_replica_size, r.committed_here = _Manager(live, rank), 2, committed
    r.heal = type("H", (), {"healed_at": None, "train_state": type("T", (), {"step": 4})()})()
    r.quorums, r.members, r.group_rank, r.group_world = 1, [0], 0, 1
    # every peer agreed on the run (identity.py), no new quorum since the last look
    r.pg = type("P", (), {"refusal": None, "quorums": 1, "members": [0]})()
    r.transport = type("X", (), {"refusal": None, "sent_to": []})()  # no heal refused
    return r


def test_below_min_replica_size_stops_after_a_commit_and_waits_at_launch(monkeypatch):
    from torchllm.ft import ReplicasBelowMinimum
    from torchllm.ft import replicas as mod

    with pytest.raises(ReplicasBelowMinimum, match="min_replica_size = 2"):
        _replicas(live=1, committed=3).begin_step()
    _replicas(live=2, committed=3).begin_step()  # enough: nothing raised
    waits = []
    monkeypatch.setattr(mod, "STARTUP_WAIT_S", 2.0)
    monkeypatch.setattr(mod.time, "sleep", lambda s: waits.append(s) or time_travel(s))
    clock = [0.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])

    def time_travel(s):
        clock[0] += s

    with pytest.raises(ReplicasBelowMinimum):  # at launch: waits for the others, then stops
        _replicas(live=1, committed=0).begin_step()
    assert len(waits) >= 2


def test_only_the_lowest_live_group_saves_but_every_group_saves_the_last_step():
    from torchllm.ft.replicas import GroupCheckpointer

    saved = []
    inner = type("C", (), {"save": lambda self, step, **kw: saved.append((step, kw["last"]))})()
    GroupCheckpointer(inner, _replicas(2, 1, rank=1)).save(5)
    GroupCheckpointer(inner, _replicas(2, 1, rank=1)).save(9, last=True)
    GroupCheckpointer(inner, _replicas(2, 1, rank=0)).save(5)
    assert saved == [(9, True), (5, False)]


def test_too_few_groups_saves_the_last_completed_step_and_ends_cleanly(tmp_path):
    from torchllm.checkpoint import complete_steps
    from torchllm.ft import ReplicasBelowMinimum
    from torchllm.ft.replicas import SingleGroup
    from torchllm.train import Trainer

    class GroupLeft(SingleGroup):
        def begin_step(self):
            if trainer.step == 3:  # the quorum of step 3 has too few groups
                raise ReplicasBelowMinimum("1 live replica group(s), fewer than 2")
            return True

    trainer = Trainer(load_config(tiny_args(tmp_path, "--data.tokenizer=bytes",
                                            "--checkpoint.enable", "--checkpoint.interval=100",
                                            "--validation.enable=false", "--eval.sample_freq=0",
                                            "--training.steps=6")))
    trainer.replicas = GroupLeft()
    losses = trainer.train()  # returns: the process exits 0
    assert len(losses) == 2 and trainer.step == 2
    assert complete_steps(tmp_path / "default" / "checkpoint") == [2]
