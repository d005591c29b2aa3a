"""A replica group of two ranks (FSDP2) SIGKILLed and relaunched heals (issue 65 #7; #4).

Through scripts/ft_local.sh, as a user runs it: two groups of NGPU=2 CPU ranks each (FSDP2
inside a group, the cross-group mean inside its reduction: ft/overlap.py), group 1's whole
process group SIGKILLed, then relaunched beside the survivor. The relaunch heals (each rank from
the same rank of the live group: FSDP2 shards line up), trains in step (the same grad norms),
and both groups end with the same weights and optimizer state, tensor by tensor. Four trainer
processes on a loaded 2-core machine: the survivor is throttled until the relaunch healed
(builders/ft.py:Throttle), the waits are generous. ~2-4 min.
"""

from __future__ import annotations

import re

import pytest

from builders.ft import assert_same_state, kill_and_relaunch, steps_of
from conftest import tiny_args

pytest.importorskip("torchft")

STEPS, KILL_AT = 20, 2


@pytest.mark.slow
def test_a_killed_fsdp2_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer(tmp_path):
    args = tiny_args(tmp_path, f"--training.steps={STEPS}", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0",
                     "--training.local_batch_size=2", "--checkpoint.interval=1000",
                     "--lr_scheduler.warmup_steps=2", "--parallelism.dp_mode=fsdp")
    # (held back from the kill on: its steps take ~0.5 s, a relaunch's start-up ~30 s)
    run = kill_and_relaunch(tmp_path, args, KILL_AT, env={"NGPU": "2"}, wait_s=420,
                            timeout_s=900)
    log0, log1 = run.log0, run.log1
    assert run.marker and KILL_AT in steps_of(run.killed_log), run.killed_log[-2000:]
    assert run.codes() == ["0", "0"], run.outs[0] + log0[-3000:] + run.outs[1] + log1[-3000:]
    # Two ranks per group, FSDP2 inside, the groups' mean inside FSDP2's reduction.
    for log in (log0, log1):
        assert "FSDP2 replicate=1 shard=2" in log, log[-3000:]
        assert "inside FSDP2's reduction" in log, log[-3000:]
    assert sorted(steps_of(log0)) == list(range(1, STEPS + 1))
    healed = int(re.search(r"healed from a live peer: continues at step (\d+)", log1)[1])
    assert KILL_AT < healed <= STEPS
    g0, g1 = steps_of(log0), steps_of(log1)
    assert sorted(g1) == list(range(healed, STEPS + 1))
    assert [g1[s] for s in g1] == [g0[s] for s in g1]  # in step: the same grad norms
    # Both end with the same weights and optimizer state (every group saves the last step).
    assert_same_state(tmp_path)
