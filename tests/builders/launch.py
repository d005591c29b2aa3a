"""Shared test builders (tests/builders/launch.py): imported by the test modules that use them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import torch.multiprocessing as mp

from parallel_worker import qk_norm_weights
import pytest

from torchllm.train import Trainer

from conftest import REPO, preloaded_forkserver, tiny_args, tiny_config


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
    """One launch of `nproc` gloo ranks running tests/parallel_worker.py's main on every run in
    `runs` for `steps` recorded steps; `train`: runs trained whole (Trainer.train()) instead.
    The ranks are forked by fork_ranks (their consoles: launch<nproc>_logs/rank<N>.log)."""
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
    proc = fork_ranks(REPO / "tests" / "parallel_worker.py", nproc, str(spec_path),
                      str(out_path), logs=tmp_path / f"launch{nproc}_logs")
    assert proc.returncode == 0, launch_failure(proc)
    return json.loads(out_path.read_text())


def fork_ranks(script, nproc: int, *args: str, logs, timeout: float = 600
               ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS` for the tests' own worker
    scripts (parallel_worker.py, a test module's worker): each rank runs SCRIPT as __main__ in a
    process forked from the preloaded fork server (conftest.preloaded_forkserver: ~0.1 s a rank
    instead of a torchrun and N interpreters importing torch, ~4 CPU-s each), with the variables
    torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), OMP_NUM_THREADS=1
    and this process's environment. For tests whose subject is what the ranks compute; the
    launcher itself (signals, a killed rank, the rendezvous) is tested with real torchrun workers
    (test_launch_path, test_launcher, test_checkpoint_dist, the docs' NGPU=2 lines).
    Returns what torchrun's would: the exit code (the first failing rank's) and every rank's
    console (logs/rank<N>.log) with torchrun's "[rank<N>]:" prefix."""
    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    ranks = mp.start_processes(_rank, args=(str(script), list(args), env, str(logs)),
                               nprocs=nproc, join=False, start_method=preloaded_forkserver())
    deadline, code, error = time.monotonic() + timeout, 0, ""
    try:
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{Path(script).name} on {nproc} ranks ran past {timeout} s")
    except Exception as e:  # a rank raised or died (join stops the others), or the time ran out
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
        code, error = getattr(e, "exit_code", None) or 1, f"{type(e).__name__}: {e}"
    out = "".join(f"[rank{r}]: {line}\n" for r in range(nproc) if (logs / f"rank{r}.log").is_file()
                  for line in (logs / f"rank{r}.log").read_text(errors="replace").splitlines())
    return subprocess.CompletedProcess([str(script), *args], code, out, error)


def _rank(rank: int, script: str, args: list[str], env: dict, logs: str) -> None:
    """One rank of fork_ranks (forked from the fork server): torchrun's per-worker variables,
    its console in logs/rank<rank>.log, SCRIPT run as __main__ (it ends the process itself with
    exit_process, or returns)."""
    import multiprocessing
    import runpy
    import sys

    import torch

    log = os.open(f"{logs}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      ROLE_RANK=str(rank))
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 (the server's torch read its own at import)
    # The platform's default start method, as in a fresh process (a forked rank inherits
    # "forkserver": its data-loader workers would start a server that re-runs SCRIPT).
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` has it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
