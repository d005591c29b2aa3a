"""MoE checkpoints: resume is bit-exact (one process), and a checkpoint saved with expert
parallelism loads without it and vice versa (2 gloo ranks): the loaded weights and optimizer
state equal the saved ones exactly, and the resumed losses follow the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from torchllm.train import Trainer

from conftest import tiny_args, tiny_config
from builders.checkpoint import (
    COMMON,
    assert_same_tensors,
    saved_state,
    tb_losses,
    torchrun_jobs,
)

pytestmark = pytest.mark.slow

# 2 blocks (the debug flavor has 4): a checkpoint's experts, not its depth, are the subject.
MOE = ("--model.name=qwen3_moe", "--model.n_layers=2",
       "--parallelism.data_parallel_shard_degree=2")
EP = {1: "--parallelism.expert_parallel_degree=1", 2: "--parallelism.expert_parallel_degree=2"}


def test_moe_resume_is_bit_exact(tmp_path):
    """One process, aux loss on: 2 steps, stop, resume for 2 more = 4 uninterrupted steps."""
    args = (*COMMON, "--model.name=qwen3_moe", "--model.n_layers=2", "--training.steps=4")
    straight = Trainer(tiny_config(tmp_path, *args, "--job.run_name=straight")).train()
    split = Trainer(tiny_config(tmp_path, *args, "--job.run_name=split",
                                "--training.stop_after_steps=2")).train()
    split += Trainer(tiny_config(tmp_path, *args, "--job.run_name=split")).train()
    assert len(straight) == 4 and split == straight


def test_ep_checkpoint_reshards_both_ways(tmp_path):
    """Save at step 2 with EP=2, load with EP=1, and the other way round (same dp degree, so
    the data position is restored too): every expert weight and its Adam moments arrive
    unchanged, and steps 3-4 give the losses of an uninterrupted EP=2 run. Two launches: the
    uninterrupted run and both saves, then (fresh processes) both loads and resumes."""
    args = tiny_args(tmp_path, *COMMON, *MOE, "--training.steps=4")
    ways = {"r21": (2, 1), "r12": (1, 2)}
    save = [{"train": [*args, EP[2], "--job.run_name=straight"]}]
    save += [{"train": [*args, EP[saved], f"--job.run_name={run}",
                        "--training.stop_after_steps=2"]} for run, (saved, _) in ways.items()]
    resume = [{"load": [*args, EP[loaded], f"--job.run_name={run}"],
               "out": str(tmp_path / f"{run}.pt")} for run, (_, loaded) in ways.items()]
    resume += [{"train": [*args, EP[loaded], f"--job.run_name={run}"]}
               for run, (_, loaded) in ways.items()]
    for name, jobs in (("save", save), ("resume", resume)):
        torchrun_jobs(tmp_path / f"{name}.json", jobs)
    straight = tb_losses(tmp_path, "straight")
    for run in ways:
        expected = saved_state(tmp_path / run / "checkpoint" / "step-2")
        assert any(".experts.w1" in k for k in expected)
        assert_same_tensors(torch.load(tmp_path / f"{run}.pt"), expected)
        resumed = tb_losses(tmp_path, run)
        assert [s for s, _ in resumed] == list(range(1, 5))
        # EP and FSDP2 sum gradients in other orders: equal up to float32 rounding.
        assert [v for _, v in resumed] == pytest.approx([v for _, v in straight], rel=1e-5)
