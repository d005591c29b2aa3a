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

import pytest

from builders.ft import assert_group_of_two_heals

pytest.importorskip("torchft")


@pytest.mark.slow
def test_a_killed_fsdp2_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer(tmp_path):
    assert_group_of_two_heals(tmp_path, ["--parallelism.dp_mode=fsdp"],
                              "FSDP2 replicate=1 shard=2", "FSDP2")
