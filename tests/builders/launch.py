"""Shared test builders (tests/builders/launch.py): imported by the test modules that use them."""

from __future__ import annotations

import json
import os
import re
import subprocess

from parallel_worker import qk_norm_weights
import pytest

from torchllm.train import Trainer

from conftest import REPO, TORCHRUN, tiny_args, tiny_config


STEPS = 7  # warm-up 2 + 5 steps at the peak rate: a wrong scale or reduction shows from step 1


GLOBAL_BATCH = 8


def common_args(steps: int) -> tuple[str, ...]:
    return (
        f"--training.steps={steps}", "--training.seq_len=16", "--lr_scheduler.warmup_steps=2",
        "--optimizer.lr=3e-3", "--training.max_norm=0.5", "--job.deterministic",
        "--job.run_name=parallel", f"--training.global_batch_size={GLOBAL_BATCH}",
    )


COMMON = common_args(STEPS)  # (test_pipeline's and test_lora's layouts, launch's defaults)


# This module's layouts (and test_context_parallel's, test_expert_parallel's): warm-up 2 + 3
# steps is enough for the argument above (a wrong scale shows in step 1's gradient norm, a wrong
# reduction in step 2's loss) and leaves bf16's curve a clear descent; 2 blocks, not the debug
# flavor's 4, still shard, gather and prefetch across blocks at ~60% of the per-step cost.
PARITY_STEPS = 5


PARITY = (*common_args(PARITY_STEPS), "--model.n_layers=2")


SMALL = {"steps": PARITY_STEPS, "common": PARITY}  # run_reference's and launch's keywords


# The load-balancing loss is a per-micro-batch statistic (like every token-choice MoE's), so a
# different split of the batch optimizes a slightly different objective: parity runs without it.
# MoE at lr 3e-4: top-k routing is discontinuous, and at 1e-3 a 1e-6 relative perturbation of the
# weights (what TP's summation order gives) flips routes and moves step 3's loss by 2e-4 (one
# process, measured on an AMD EPYC host); at 3e-4 the same perturbation moves it by < 5e-7.
QWEN3_MOE = ("--model.name=qwen3_moe", "--model.moe_aux_loss_coef=0", "--optimizer.lr=3e-4")


def run_reference(tmp_path, *extra, steps: int = STEPS, common: tuple = COMMON):
    trainer = Trainer(tiny_config(
        tmp_path, *common, f"--training.local_batch_size={GLOBAL_BATCH}", *extra))
    metrics = [trainer.train_step() for _ in range(steps)]
    trainer.close()  # frees the run folder for the ranks' runs
    out = {k: [m[k] for m in metrics] for k in ("loss", "grad_norm")}
    out["qk_norm"] = qk_norm_weights(trainer.model)
    return out


def launch(tmp_path, nproc: int, runs: dict, count_sync=(), record_dtypes=(),
           record_qk_norm=(), train=(), steps: int = STEPS, common: tuple = COMMON,
           **extra_spec) -> dict:
    """One torchrun launch of tests/parallel_worker.py running every run in `runs` for `steps`
    recorded steps; `train`: runs trained whole (Trainer.train()) instead."""
    spec = {
        **extra_spec,  # (parallel_worker's other keys: "ep_layer")
        "runs": {name: tiny_args(tmp_path, *common, *args) for name, args in runs.items()},
        "steps": steps,
        "count_sync": list(count_sync),
        "record_dtypes": list(record_dtypes),
        "record_qk_norm": list(record_qk_norm),
        "train": list(train),
    }
    spec_path, out_path = tmp_path / f"spec{nproc}.json", tmp_path / f"out{nproc}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*TORCHRUN, "--standalone",
         f"--nproc_per_node={nproc}", str(REPO / "tests" / "parallel_worker.py"),
         str(spec_path), str(out_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, launch_failure(proc)
    return json.loads(out_path.read_text())


def launch_failure(proc: subprocess.CompletedProcess) -> str:
    """What a failed torchrun launch printed, for the assertion message: each rank's first
    error (one rank's crash makes the others fail at their next collective, with long
    tracebacks that would push it out of a plain tail), then torchrun's own lines."""
    lines = (proc.stdout + proc.stderr).splitlines()
    first: dict[str, int] = {}
    for i, line in enumerate(lines):
        rank = re.match(r"\[rank(\d+)\]:", line)
        if rank and re.search(r"Traceback|terminate called|Error|Fatal|Abort", line):
            first.setdefault(rank[1], i)
    heads = [f"--- rank {r}'s first error ---\n" + "\n".join(lines[i : i + 30])
             for r, i in sorted(first.items())]
    own = "\n".join(line for line in lines if not line.startswith("[rank"))
    return "\n".join(heads)[-12000:] + "\n--- the launcher ---\n" + own[-3000:]


def assert_matches(got: dict, ref: dict, loose: bool) -> None:
    rel = 2e-2 if loose else 1e-4
    assert got["loss"] == pytest.approx(ref["loss"], rel=rel), (got["loss"], ref["loss"])
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rel * 10), (
        got["grad_norm"], ref["grad_norm"])
