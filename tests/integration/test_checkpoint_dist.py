"""Checkpoints across processes: bit-exact resume with 2-rank FSDP2, and resharding
(FSDP2 on 2 ranks -> 1 rank, 1 rank -> FSDP2 on 2 ranks, DDP -> FSDP2) with identical weights and
optimizer state after the load; a load failure on one rank only makes both ranks fall back to
the same step. Each run is a real torchrun launch on gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from torchllm.checkpoint import complete_steps
from torchllm.checkpoint import open_checkpoint
from torchllm.train import Trainer

from conftest import REPO, TORCHRUN, tb_scalars, tiny_args, tiny_config
from messages import assert_names
from builders.checkpoint import COMMON, FSDP2, assert_same_tensors, saved_state, tb_losses, torchrun, torchrun_jobs  # noqa: F401

pytestmark = pytest.mark.slow

DDP = ("--parallelism.data_parallel_shard_degree=1",
       "--parallelism.data_parallel_replicate_degree=2")


STEPS3 = ("--training.steps=3",)
LOAD = ("--checkpoint.exclude_from_loading=dataloader", "--checkpoint.allow_global_batch_change")


def bit_exact_args(tmp) -> list[str]:
    return tiny_args(tmp, *COMMON, *FSDP2, "--training.steps=6", "--data.num_workers=2")


def fault_args(tmp) -> list[str]:
    return tiny_args(tmp, *COMMON, *FSDP2, "--training.steps=4", "--checkpoint.interval=2",
                     "--job.run_name=fault")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """The runs the tests below start from, in ONE torchrun launch (each launch costs seconds
    of start-up per rank): a 1-rank run first (in this process), then on 2 ranks the straight
    run and the split run's first half (bit-exact resume), FSDP2 and DDP runs and the loads of
    the 1-rank and the DDP run into FSDP2 (resharding), a 2-step FSDP2 run (another dp degree)
    and a 4-step one saving every 2 steps (rank-local load failure). Each test its own runs."""
    tmp = tmp_path_factory.mktemp("ckpt_dist")
    Trainer(tiny_config(tmp, *COMMON, *STEPS3, "--job.run_name=single")).train()
    torchrun_jobs(tmp / "jobs.json", [
        {"train": [*bit_exact_args(tmp), "--job.run_name=straight"]},
        {"train": [*bit_exact_args(tmp), "--job.run_name=split", "--training.stop_after_steps=3"]},
        {"train": tiny_args(tmp, *COMMON, *FSDP2, *STEPS3, "--job.run_name=fsdp2")},
        {"train": tiny_args(tmp, *COMMON, *DDP, *STEPS3, "--job.run_name=ddp")},
        {"train": tiny_args(tmp, *COMMON, *FSDP2, "--training.steps=2", "--job.run_name=dp")},
        {"train": fault_args(tmp)},
        # 1 rank -> FSDP2 on 2 ranks; DDP -> FSDP2 (the same dp degree: the data position is
        # restored).
        {"load": tiny_args(tmp, *COMMON, *FSDP2, *STEPS3, "--job.run_name=single", *LOAD),
         "out": str(tmp / "loaded_2ranks.pt")},
        {"load": tiny_args(tmp, *COMMON, *FSDP2, *STEPS3, "--job.run_name=ddp"),
         "out": str(tmp / "ddp_to_fsdp2.pt")},
    ])
    return tmp


def test_fsdp2_resume_is_bit_exact_with_two_workers(launched):
    tmp_path = launched
    # The straight run and the split run's first half: the shared launch; the resume: a new one.
    assert complete_steps(tmp_path / "split" / "checkpoint") == [3]
    torchrun(*bit_exact_args(tmp_path), "--job.run_name=split", "--training.stop_after_steps=3")
    straight, split = tb_losses(tmp_path, "straight"), tb_losses(tmp_path, "split")
    assert [s for s, _ in straight] == list(range(1, 7))
    assert split == straight  # every step's loss, bit for bit (float32 events)
    assert_same_tensors(saved_state(tmp_path / "split" / "checkpoint" / "step-6"),
                        saved_state(tmp_path / "straight" / "checkpoint" / "step-6"))


def test_resharding_keeps_weights_and_optimizer_state(launched):
    tmp_path = launched
    # FSDP2 on 2 ranks -> 1 rank (the data order belongs to 2 dp ranks: not restored).
    one = Trainer(tiny_config(tmp_path, *COMMON, *STEPS3, "--job.run_name=fsdp2", *LOAD))
    assert one.step == 3
    flat = {f"model.{k}": v for k, v in one.model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for fqn, state in get_optimizer_state_dict(one.model, one.optimizer)["state"].items():
        flat.update({f"optimizer.state.{fqn}.{k}": v for k, v in state.items()})
    assert_same_tensors(flat, saved_state(tmp_path / "fsdp2" / "checkpoint" / "step-3"))
    one.close()  # gives back the process-wide switches job.deterministic set
    # 1 rank -> FSDP2 on 2 ranks; DDP -> FSDP2 (the loads in the shared launch).
    for out, run in (("loaded_2ranks.pt", "single"), ("ddp_to_fsdp2.pt", "ddp")):
        assert_same_tensors(torch.load(tmp_path / out),
                            saved_state(tmp_path / run / "checkpoint" / "step-3"))


def test_resuming_with_another_dp_degree_continues_the_data_order(launched, caplog):
    # "dp": 2 steps of FSDP2 on 2 ranks (the shared launch); here one rank, the same global
    # batch: the data position is mapped onto one rank (exactness: test_journey_round6).
    with caplog.at_level("INFO", logger="torchllm"):
        trainer = Trainer(tiny_config(launched, *COMMON, "--training.steps=2",
                                      "--job.run_name=dp", "--training.global_batch_size=4"))
    trainer.close()  # gives back the process-wide switches job.deterministic set
    assert trainer.train_state.step == 2
    assert "data order continued on another layout" in caplog.text


def test_rank_local_load_failure_makes_every_rank_fall_back_together(launched):
    """Rank 1 alone cannot apply step 4: both ranks resume from step 2, and the warning says
    which rank failed and why (before: rank 0 at step 4, rank 1 at step 2, then a hang)."""
    assert complete_steps(launched / "fault" / "checkpoint") == [2, 4]
    out = launched / "steps.json"
    log = torchrun(str(out), *fault_args(launched), script="checkpoint_fault_worker.py",
                   timeout=300)
    assert json.loads(out.read_text()) == [2, 2]
    # The step, the rank that failed, and its error.
    assert_names(log, "step-4", "rank 1", "OSError: simulated rank-local failure")


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with this RANK (a child of the launcher process, found by
    its environment)."""
    children = [int(pid) for pid in
                Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()]
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def test_sigterm_on_one_rank_stops_both_at_the_same_step(tmp_path):
    """Preemption reaches one rank of two: both agree to stop after the same step, save it
    together and exit 0 (a rank stopping alone would leave the other waiting in a collective)."""
    args = tiny_args(tmp_path, *COMMON, *FSDP2, "--training.steps=100000", "--job.run_name=sig")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2",
         "-m", "torchllm.train", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines: list[str] = []  # read in a thread: a hung rank must not block the test on a read
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("step     3/" in line for line in list(lines)):  # both ranks training
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            time.sleep(0.2)
        os.kill(worker_pid(proc.pid, rank=1), signal.SIGTERM)
        code = proc.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks disagreed and hang: fail, not hang
    out = "".join(lines)
    assert code == 0, out[-6000:]
    assert "another rank is stopping" in out, out[-6000:]  # rank 0 logs; rank 1 got the signal
    stopped_at = int(out.split("stopping at step ")[1].split(":")[0])
    assert complete_steps(tmp_path / "sig" / "checkpoint") == [stopped_at]
    assert tb_losses(tmp_path, "sig")[-1][0] == stopped_at
