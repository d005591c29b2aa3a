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

import os
import re
import signal
import subprocess

import pytest
import torch

from builders.ft import RELAUNCHED, Throttle, free_port, steps_of
from conftest import REPO, tiny_args, wait_for

pytest.importorskip("torchft")

STEPS, KILL_AT = 20, 2


@pytest.mark.slow
def test_a_killed_fsdp2_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer(tmp_path):
    logs = tmp_path / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}", "NGPU": "2",
           "FT_LOG_DIR": str(logs), "TORCHLLM_FORK_WORKERS": "1",
           "FT_HEARTBEAT_TIMEOUT_MS": "10000"}
    env.pop("FT_JOIN_TIMEOUT_MS", None)
    args = tiny_args(tmp_path, f"--training.steps={STEPS}", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0",
                     "--training.local_batch_size=2", "--checkpoint.interval=1000",
                     "--lr_scheduler.warmup_steps=2", "--parallelism.dp_mode=fsdp")
    script = [str(REPO / "scripts" / "ft_local.sh"), "2", *args]
    procs = [subprocess.Popen(script, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)]
    throttle = None
    try:
        wait_for(lambda: KILL_AT in steps_of(logs / "replica_1.log"), 420,
                 what=f"group 1 at step {KILL_AT}")
        os.killpg(int((logs / "replica_1.pid").read_text()), signal.SIGKILL)  # both its ranks
        before = max(steps_of(logs / "replica_0.log"))
        procs.append(subprocess.Popen(script, cwd=REPO, env={**env, "FT_REPLICAS": "1"},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        # (held back from the kill on: its steps take ~0.5 s, a relaunch's start-up ~30 s)
        throttle = Throttle(int((logs / "replica_0.pid").read_text()), logs / "replica_0.log",
                            logs / "replica_1.log", before)
        throttle.start()
        outs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs[::-1]][::-1]
    finally:
        if throttle is not None:
            throttle.done.set()
            throttle.join()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log0 = (logs / "replica_0.log").read_text()
    killed_log, marker, log1 = (logs / "replica_1.log").read_text().partition(RELAUNCHED)
    assert marker and KILL_AT in steps_of(killed_log), killed_log[-2000:]
    assert (logs / "replica_0.code").read_text().strip() == "0", outs[0] + log0[-3000:]
    assert (logs / "replica_1.code").read_text().strip() == "0", outs[1] + log1[-3000:]
    # Two ranks per group, FSDP2 inside, the groups' mean inside FSDP2's reduction.
    for log in (log0, log1):
        assert "FSDP2 replicate=1 shard=2" in log, log[-3000:]
        assert "inside FSDP2's reduction" in log, log[-3000:]
    assert sorted(steps_of(logs / "replica_0.log")) == list(range(1, STEPS + 1))
    healed = int(re.search(r"healed from a live peer: continues at step (\d+)", log1)[1])
    assert KILL_AT < healed <= STEPS
    g0, g1 = steps_of(logs / "replica_0.log"), steps_of(log1)
    assert sorted(g1) == list(range(healed, STEPS + 1))
    assert [g1[s] for s in g1] == [g0[s] for s in g1]  # in step: the same grad norms
    # Both end with the same weights and optimizer state (every group saves the last step).
    from torchllm.checkpoint import open_checkpoint

    a = open_checkpoint(tmp_path / "debug_model-replica0").tensors("")
    b = open_checkpoint(tmp_path / "debug_model-replica1").tensors("")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
