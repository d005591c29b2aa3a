"""Mutants of replica groups through torchft's public API only (issue 65 #2-#4):
torchllm/ft/reduce.py, the quorum's members (identity.py, replicas.py) and
fault_tolerance.process_group (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_public.py::"
MEANS = (T + "test_means_and_sums_over_groups_are_the_same_in_either_torchft_allreduce[0.2.0]",
         T + "test_means_and_sums_over_groups_are_the_same_in_either_torchft_allreduce[before 0.2]")
BIASES = T + "test_moe_routing_biases_stay_equal_across_groups_for_20_steps"
TRAINERS = (T + "test_gradients_are_averaged_and_tokens_summed_in_either_torchft_allreduce[0.2.0]",
            T + "test_gradients_are_averaged_and_tokens_summed_in_either_torchft_allreduce"
            "[before 0.2]")

MUTANTS = [
    Mutant.at(
        "ft_buffers_not_averaged",
        "only the gradients cross between replica groups: each group's MoE routing biases follow "
        "its own tokens from the first step",
        "torchllm.ft.replicas:ReplicaGroups.average",
        "        mean_over_groups(self.manager, grads + step_buffers(model))\n",
        "        mean_over_groups(self.manager, grads)\n",
        (BIASES,),
    ),
    Mutant.at(
        "ft_expert_load_not_averaged",
        "the routing biases are averaged but not the token loads their update reads: each "
        "group's last update differs",
        "torchllm.ft.reduce:step_buffers",
        '        if name in persistent or name.rsplit(".", 1)[-1] == "expert_load":\n',
        "        if name in persistent:\n",
        (BIASES, T + "test_the_buffers_kept_equal_across_groups_are_the_moe_loads_and_biases"),
    ),
    Mutant.at(
        "ft_allreduce_default_op",
        "the cross-group allreduce relies on torchft's default op (SUM that averaged before "
        "torchft's change, AVG after)",
        "torchllm.ft.reduce:_over_groups",
        "        manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()\n",
        "        manager.allreduce(flat).wait()\n",
        MEANS,
    ),
    Mutant.at(
        "ft_mean_trusts_torchft_to_divide",
        "the gradients are taken as torchft returns a SUM: summed over the groups with torchft "
        "0.2.0 (an update twice as large with two groups)",
        "torchllm.ft.reduce:_over_groups",
        "            flat = flat[:-1] / flat[-1]\n", "            flat = flat[:-1]\n",
        MEANS + TRAINERS,
    ),
    Mutant.at(
        "ft_sum_trusts_torchft_not_to_divide",
        "the token counts are taken as torchft returns a SUM: averaged, not summed, with a "
        "torchft whose SUM averages",
        "torchllm.ft.reduce:_over_groups",
        "            flat = flat[:-1] * (manager.num_participants() / flat[-1])\n",
        "            flat = flat[:-1]\n",
        MEANS + TRAINERS,
    ),
    Mutant.at(
        "ft_members_from_torchft_private",
        "the quorum's members are read from torchft's private `_global_ranks` (absent from "
        "torchft's main branch): the console says 0 of 2 groups live",
        "torchllm.ft.replicas:ReplicaGroups._note_quorum",
        "        order = list(self.pg.members)",
        "        order = [(g - self.group_rank) // self.group_world\n"
        "                 for g in getattr(self.pg, '_global_ranks', None) or []]",
        TRAINERS,
    ),
    Mutant.at(
        "ft_members_not_recorded",
        "the identity records are compared but not kept as the quorum's members",
        "torchllm.ft.identity:checked_group",
        '            self.members = [r.get("replica") if r else None for r in records]\n', "",
        (T + "test_the_quorums_members_come_from_the_groups_identity_records",),
    ),
    Mutant.at(
        "ft_torchft_version_not_checked",
        "a torchft other than the tested one starts without a word",
        "torchllm.ft.replicas:ReplicaGroups.__init__",
        "        warn_untested_torchft()", "        pass",
        (T + "test_another_torchft_version_is_warned_about_in_one_line",),
    ),
    Mutant.at(
        "ft_process_group_always_gloo",
        "fault_tolerance.process_group = 'nccl' still builds a gloo group across replica groups",
        "torchllm.ft.identity:checked_group",
        '    base = torchft.ProcessGroupNCCL if backend == "nccl" else torchft.ProcessGroupGloo\n',
        "    base = torchft.ProcessGroupGloo\n",
        (T + "test_the_cross_group_process_group_is_the_configured_backend",),
    ),
    Mutant.at(
        "ft_nccl_with_cpu_training_accepted",
        "fault_tolerance.process_group = 'nccl' with training.device = 'cpu' passes the config "
        "check on a GPU machine (NCCL then fails on CPU tensors mid-run)",
        "torchllm.config.sections_ft:fault_tolerance_errors",
        '    if ft.process_group == "nccl" and device == "cpu":\n',
        "    if False:\n",
        (T + "test_nccl_with_training_on_cpu_is_refused_at_config_load_on_a_gpu_machine",),
    ),
    Mutant.at(
        "ft_nccl_without_gpu_accepted",
        "fault_tolerance.process_group = 'nccl' on a machine without a GPU is not refused "
        "before the run starts",
        "torchllm.ft.lighthouse:check_backend",
        '    if ftcfg.process_group == "nccl" and not torch.cuda.is_available():\n',
        "    if False:\n",
        (T + "test_nccl_across_groups_without_a_gpu_is_refused_before_the_lighthouse",),
    ),
]
