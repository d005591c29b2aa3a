"""Shared test builders (tests/builders/checkpoint.py): imported by the test modules that use them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch

from torchllm.checkpoint import open_checkpoint

from conftest import REPO, TORCHRUN, tb_scalars, tiny_args, tiny_config


COMMON = ("--checkpoint.enable", "--checkpoint.interval=100", "--training.local_batch_size=2",
          "--job.deterministic", "--metrics.log_freq=1")


FSDP2 = ("--parallelism.data_parallel_shard_degree=2",)


def torchrun(*argv: str, script: str | None = None, timeout: int = 600) -> str:
    target = [str(REPO / "tests" / script)] if script else ["-m", "torchllm.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2",
         *target, *argv], env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def torchrun_jobs(path: Path, jobs: list[dict]) -> str:
    """Several train / load jobs on 2 gloo ranks (tests/checkpoint_worker.py --jobs), forked as
    torchrun's workers by builders.launch.fork_ranks; returns the ranks' console."""
    from builders.launch import fork_ranks

    path.write_text(json.dumps(jobs))
    proc = fork_ranks(REPO / "tests" / "checkpoint_worker.py", 2, "--jobs", str(path),
                      logs=path.with_name(path.stem + "_logs"))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout


def tb_losses(tmp_path, run: str) -> list[tuple[int, float]]:
    return list(tb_scalars(tmp_path / "tb" / run).items())


def assert_same_tensors(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key].to(value.dtype), value), key


def saved_state(step_dir) -> dict:
    return {**{f"model.{k}": v for k, v in open_checkpoint(step_dir).tensors("model.").items()},
            **{f"optimizer.{k}": v
               for k, v in open_checkpoint(step_dir).tensors("optimizer.").items()}}


def trained_once(tmp_path_factory, *args: str) -> Path:
    """The dump folder of a finished run of tiny_config(folder, *args): a module-scoped
    fixture trains it once, and each test works on a copy (copy_run)."""
    from torchllm.train import Trainer

    root = tmp_path_factory.mktemp("trained")
    Trainer(tiny_config(root, *args)).train()
    return root


def copy_run(trained: Path, dest: Path) -> Path:
    """A copy of a trained dump folder at `dest` (made if absent) for one test to change."""
    shutil.copytree(trained, dest, dirs_exist_ok=True)
    return dest
