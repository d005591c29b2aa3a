"""Recipes on 2 gloo ranks: schedules, chunked loss, Muon and reduce/compression dtypes compose
with FSDP2/DDP and give the single-process losses.

As a test module it launches 2 gloo ranks (builders.launch.fork_ranks); as a script it is
their worker (as it is under torchrun too):

    torchrun --nproc_per_node=2 tests/integration/test_recipes_parallel.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys

import pytest

from builders.launch import fork_ranks, launch_failure
from messages import assert_names

STEPS = 6
COMMON = (
    f"--training.steps={STEPS}", "--training.seq_len=16", "--lr_scheduler.warmup_steps=2",
    "--optimizer.lr=3e-3", "--job.deterministic", "--job.run_name=recipes",
    "--training.global_batch_size=8",
)
# Ramp 4 -> 8 sequences over 128 tokens, 8-token sequences in the first half.
SCHEDULES = ("--training.batch_size_ramp_tokens=128", "--training.batch_size_ramp_lr_scaling",
             "--training.seq_len_schedule=8:0.5,16:1.0", "--training.chunked_loss",
             "--training.loss_chunk_tokens=24")
FSDP = ("--training.local_batch_size=2",)  # 2 x 2 ranks = one pass of 4 sequences
DDP = ("--parallelism.dp_mode=ddp", "--training.local_batch_size=2")
RUNS = {  # name: (2-rank args, reference args, relative tolerance)
    "fsdp_schedules_chunked": ([*SCHEDULES, *FSDP], SCHEDULES, 1e-4),
    "fsdp_bf16_reduce": ([*SCHEDULES, *FSDP, "--parallelism.fsdp_reduce_dtype=bf16"],
                         SCHEDULES, 2e-2),
    "ddp_fp16_hook_schedules": ([*SCHEDULES, *DDP, "--parallelism.ddp_comm_hook=fp16"],
                                SCHEDULES, 2e-2),
    # Muon's Newton-Schulz iteration amplifies last-bit differences of the all-reduced gradient
    # (measured rel 2e-4 over 10 steps, on the old base too): a looser band, still far below
    # what a wrong update (e.g. a missing orthogonalization) moves the loss.
    "ddp_muon": ([*DDP, "--optimizer.name=muon"], ("--optimizer.name=muon",), 1e-3),
    "fsdp_muon": ([*FSDP, "--optimizer.name=muon"], None, None),  # refused, with the reason
}


def run_steps(trainer) -> list[float]:
    losses = []
    for step in range(1, STEPS + 1):
        trainer.train_state.step = step
        losses.append(trainer.train_step()["loss"])
    trainer.close()  # frees the run folder for the next run
    return losses


def worker(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from torchllm.config import ConfigError, load_config
    from torchllm.parallel import destroy_distributed
    from torchllm.train import Trainer

    results = {}
    for name, args in json.loads(open(spec_path).read()).items():
        try:
            results[name] = {"loss": run_steps(Trainer(load_config(args)))}
        except ConfigError as e:
            results[name] = {"error": str(e)}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    destroy_distributed()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from torchllm.train import Trainer

    from conftest import tiny_args, tiny_config

    tmp = tmp_path_factory.mktemp("recipes")
    reference = {name: run_steps(Trainer(tiny_config(tmp, *COMMON, "--training.local_batch_size=4",
                                                     *ref)))
                 for name, (_, ref, _) in RUNS.items() if ref is not None}
    spec = {name: tiny_args(tmp, *COMMON, *args) for name, (args, _, _) in RUNS.items()}
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = fork_ranks(__file__, 2, str(spec_path), str(out_path), logs=tmp / "launch_logs")
    assert proc.returncode == 0, launch_failure(proc)
    return reference, json.loads(out_path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (_, ref, _) in RUNS.items() if ref is not None])
def test_two_ranks_match_single_process(name, results):
    reference, got = results
    rel = RUNS[name][2]
    assert got[name]["loss"] == pytest.approx(reference[name], rel=rel), (got[name], reference[name])


@pytest.mark.slow
def test_muon_with_fsdp2_is_refused_with_what_works(results):
    _, got = results
    assert_names(got["fsdp_muon"]["error"], "optimizer.name = 'muon'", "FSDP2")
    assert "dp_mode = 'ddp'" in got["fsdp_muon"]["error"]


if __name__ == "__main__":
    worker(*sys.argv[1:])
    from torchllm.run.process_exit import exit_process

    exit_process(0)  # not sys.exit: see torchllm.run.process_exit
